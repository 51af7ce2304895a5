"""Shared test helpers: per-dtype tolerances (the one place they are kept) and comparisons."""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch

from conftest import DEVICE

#: Max-norm relative tolerance per compute dtype: ``max|got − ref| ≤ tol · max(|ref|, floor)``.
#: fp32 against a float64 reference; fp16/bf16 against the float64 reference of the same
#: (rounded) inputs, so the tolerance covers the 16-bit activations and outputs.
TOL = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
    torch.float64: 1e-10,
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got − ref| / max|ref| (denominator floored at 1e-6), in float64."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if ref.numel() == 0:
        return 0.0
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Assert ``rel_err(got, ref) ≤ TOL[dtype]`` with a readable message."""
    err = rel_err(got, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e} ({dtype})"


#: The eager-relative rule for 16-bit runs (:func:`assert_within_eager`): a fused error may be up to
#: EAGER_RATIO times eager's own error against the same float64 reference, plus EAGER_FLOOR[dtype].
EAGER_RATIO = 2.0
#: machine epsilon of the dtype, i.e. two units of roundoff (fp16 9.8e-4, bf16 7.8e-3): where eager's own error
#: is tiny (e.g. running statistics, computed in fp32 and rounded once) the fused path may round once more.
EAGER_FLOOR = {dt: torch.finfo(dt).eps for dt in (torch.float16, torch.bfloat16)}


class ErrorPool:
    """Relative L2 errors of named tensors against their references, pooled over several draws.

    ``rel(name) = sqrt(Σ ||got − ref||²) / sqrt(Σ max(||ref||, scale)²)`` over the draws added under
    ``name`` (float64 arithmetic; ``scale`` floors the denominator of a tensor whose reference is ~0,
    e.g. the gradient of a conv bias that feeds a training-mode BatchNorm).

    Why pooled L2 and not one draw's max-norm: in 16-bit training a pre-activation within rounding
    distance of zero lands on the other side of the ReLU in either build, at random places; in a
    small test model one such flip moves a gradient's max-norm error by 10-100× (measured for eager
    PyTorch itself between inputs 1% apart). Summing squared errors over several draws averages the
    flips, so the comparison of two builds measures their rounding, not which draw had a flip.
    """

    def __init__(self) -> None:
        self.num: dict[str, float] = defaultdict(float)
        self.den: dict[str, float] = defaultdict(float)

    def add(self, name: str, got: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> None:
        """Add one draw of tensor ``name``: ``got`` (any dtype/device) against ``ref`` (same shape)."""
        got = got.detach().double().cpu()
        ref = ref.detach().double().cpu()
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        self.num[name] += (got - ref).square().sum().item()
        self.den[name] += max(ref.norm().item(), scale) ** 2

    def rel(self, name: str) -> float:
        """The pooled relative L2 error of ``name`` (0 for an empty or all-zero reference and no error)."""
        num, den = self.num[name], self.den[name]
        return 0.0 if num == 0 else math.sqrt(num / den) if den > 0 else math.inf


def assert_within_eager(fused: ErrorPool, eager: ErrorPool, dtype: torch.dtype, what: str = "") -> None:
    """The eager-relative rule: for every tensor name, ``fused.rel ≤ EAGER_RATIO · eager.rel + EAGER_FLOOR[dtype]``.

    Both pools hold errors against the same float64 reference (outputs, input gradients, parameter
    gradients, running statistics). A 16-bit result cannot be held to a fixed tolerance: eager
    PyTorch's own 16-bit error ranges from 1e-4 to 1 depending on the tensor (BatchNorm's backward
    cancels, ReLU decisions flip); what matters is that fusing does not make it worse.
    Raises AssertionError listing every tensor that breaks the rule.
    """
    assert set(fused.num) == set(eager.num), (sorted(fused.num), sorted(eager.num))
    floor = EAGER_FLOOR[dtype]
    bad = [f"{n}: fused {fused.rel(n):.2e} > {EAGER_RATIO:g} × eager {eager.rel(n):.2e} + {floor:.1e}"
           for n in fused.num if fused.rel(n) > EAGER_RATIO * eager.rel(n) + floor]
    assert not bad, f"{what} ({dtype}): fused 16-bit errors beyond the eager-relative rule:\n" + "\n".join(bad)


def randn(*shape, dtype=torch.float32, device=DEVICE, mean=0.0, std=1.0, channels_last=False, generator=None):
    """Fresh normal data (never zeros); channels_last applies to 4-D shapes."""
    t = torch.randn(*shape, dtype=torch.float64, generator=generator) * std + mean
    t = t.to(device=device, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t


class HostEvent:
    """A stand-in for ``torch.cuda.Event`` on the host clock (tests of the timing glue without CUDA):
    ``elapsed_time`` in ms, at least 1e-6 so that a ratio of two times is always defined."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return max((other.t - self.t) * 1e3, 1e-6)
