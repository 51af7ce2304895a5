"""Shared test helpers: per-dtype tolerances (the one place they are kept) and comparisons."""

from __future__ import annotations

import copy
import time

import torch
from conftest import DEVICE

from fused_preact.ops.backends import BACKENDS
from fused_preact.ops.dtypes import TRAITS
from fused_preact.ops.validate import EAGER_FLOOR, EAGER_RATIO, ErrorPool, rule_violations

#: The backends that replace eager BN → ReLU → Conv with their own kernels or recomputation and serve
#: this session's device (read from their declared capabilities; a registered backend is enrolled
#: too): every op, module and model test against eager runs each of them.
FUSED_BACKENDS = tuple(n for n, b in BACKENDS.items()
                       if b.fused and not b.not_supported_reasons(torch.empty(1, device=DEVICE).expand(1, 8, 1, 1)))

#: Max-norm relative tolerance per compute dtype (``fused_preact.ops.dtypes``' ``test_tol``):
#: ``max|got − ref| ≤ tol · max(|ref|, floor)``. fp32 against a float64 reference; fp16/bf16 against
#: the float64 reference of the same (rounded) inputs, so the tolerance covers the 16-bit activations
#: and outputs.
TOL = {d: t.test_tol for d, t in TRAITS.items()}


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


#: The eager-relative rule (:mod:`fused_preact.ops.validate`, which ``backend="auto"`` applies too): a
#: fused error may be up to EAGER_RATIO times eager's own error against the same float64 reference, plus
#: EAGER_FLOOR[dtype] (machine epsilon of a 16-bit dtype: where eager's own error is tiny, e.g. running
#: statistics computed in fp32 and rounded once, the fused path may round once more). ErrorPool pools them.
__all__ = ["FUSED_BACKENDS", "TOL", "rel_err", "assert_close", "EAGER_RATIO", "EAGER_FLOOR", "ErrorPool", "assert_within_eager",
           "randn", "HostEvent", "pooled_training_errors"]


def assert_within_eager(fused: ErrorPool, eager: ErrorPool, dtype: torch.dtype, what: str = "") -> None:
    """The eager-relative rule: for every tensor name, ``fused.rel ≤ EAGER_RATIO · eager.rel + EAGER_FLOOR[dtype]``.

    Both pools hold errors against the same float64 reference (outputs, input gradients, parameter
    gradients, running statistics). A 16-bit result cannot be held to a fixed tolerance: eager
    PyTorch's own 16-bit error ranges from 1e-4 to 1 depending on the tensor (BatchNorm's backward
    cancels, ReLU decisions flip); what matters is that fusing does not make it worse.
    Raises AssertionError listing every tensor that breaks the rule.
    """
    assert set(fused.num) == set(eager.num), (sorted(fused.num), sorted(eager.num))
    bad = rule_violations(fused.rels(), eager.rels(), EAGER_FLOOR[dtype], EAGER_RATIO)
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


def pooled_training_errors(builds: dict, x_shape, dy_shape, dtype: torch.dtype, draws: int = 2,
                           x_shift: float = 0.2) -> dict:
    """Errors of the 16-bit ``builds["eager"]`` and ``builds["fused"]`` (modules in ``dtype``) against
    ``builds["float64"]``, pooled over ``draws`` training steps on fresh copies: channels_last input
    ``N(x_shift, 1)`` of ``x_shape`` and output gradient ``N(0, 1)`` of ``dy_shape``; output, input
    gradient, every parameter gradient (floored at 1% of the largest reference gradient's norm) and
    floating buffer. Returns ``{"eager": ErrorPool, "fused": ErrorPool}`` for :func:`assert_within_eager`."""
    pools = {"eager": ErrorPool(), "fused": ErrorPool()}
    for draw in range(draws):
        gen = torch.Generator().manual_seed(draw)
        x = torch.randn(*x_shape, dtype=torch.float64, generator=gen) + x_shift
        dy = torch.randn(*dy_shape, dtype=torch.float64, generator=gen)
        res = {}
        for name, original in builds.items():
            m = copy.deepcopy(original).train()
            dt = torch.float64 if name == "float64" else dtype
            xi = x.to(DEVICE, dt).contiguous(memory_format=torch.channels_last).requires_grad_()
            y = m(xi)
            y.backward(dy.to(DEVICE, dt))
            res[name] = {"output": y, "input grad": xi.grad, **{f"grad {n}": p.grad for n, p in m.named_parameters()},
                         **{f"buffer {n}": b for n, b in m.named_buffers() if b.is_floating_point()}}
        ref = res["float64"]
        scale = 1e-2 * max(v.norm().item() for k, v in ref.items() if k.startswith("grad "))
        for name, pool in pools.items():
            for k, v in res[name].items():
                pool.add(k, v, ref[k], scale if k.startswith("grad ") else 0.0)
    return pools
