"""The eager-relative rule: how close a backend's results must be to a float64 reference, measured
against eager PyTorch's own distance from it.

A 16-bit (or TF32) result cannot be held to a fixed tolerance: eager PyTorch's own error against
float64 ranges from 1e-4 to 1 depending on the tensor (BatchNorm's backward cancels, ReLU decisions
flip near zero). What a fused backend must not do is make it worse. For every compared tensor,

    rel(backend) ≤ EAGER_RATIO · rel(eager) + floor(dtype)

where ``rel`` is the relative L2 error against the float64 reference (:func:`rel_l2`, pooled over
draws by :class:`ErrorPool`), ``EAGER_RATIO`` = 2 and the floor is two units of roundoff of the
compute dtype (:func:`eager_floor`): where eager's own error is tiny (running statistics are computed
in fp32 and rounded once) a backend may round once more. The test suite and ``backend="auto"``'s
validation (:mod:`fused_preact.ops.auto`) apply the same rule.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, Optional

import torch

from fused_preact.ops.dtypes import TRAITS

__all__ = ["EAGER_RATIO", "EAGER_FLOOR", "eager_floor", "rel_l2", "ErrorPool", "rule_violations"]

#: A backend's error may be up to this multiple of eager's own error against the same reference.
EAGER_RATIO = 2.0
#: Additive floor per compute dtype (:attr:`DtypeTraits.eager_floor <fused_preact.ops.dtypes.DtypeTraits>`):
#: machine epsilon (two units of roundoff) for the 16-bit dtypes (fp16 9.8e-4, bf16 7.8e-3); for fp32
#: 1e-5. A defect (a flipped mask, a wrong statistic, a perturbed gradient) shows at 1e-3 or more.
EAGER_FLOOR = {d: t.eager_floor for d, t in TRAITS.items()}
#: TF32 keeps fp16's 10 mantissa bits: the floor of fp32 convolutions that may use it.
_TF32_FLOOR = 2.0 ** -10


def eager_floor(dtype: torch.dtype, tf32: bool = False) -> float:
    """The rule's additive floor for compute dtype ``dtype`` (:data:`EAGER_FLOOR`); fp32 with TF32
    convolutions allowed (``tf32``) gets TF32's machine epsilon 2⁻¹⁰."""
    if dtype == torch.float32 and tf32:
        return _TF32_FLOOR
    return EAGER_FLOOR[dtype]


def rel_l2(got: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """``‖got − ref‖₂ / max(‖ref‖₂, scale)`` in float64 (on ``ref``'s device); 0 for an empty tensor or
    an exact match, inf when the denominator is 0 and the error is not. Non-finite entries give NaN or
    inf (never a pass of the rule)."""
    if ref.numel() == 0:
        return 0.0
    diff = (got.detach().to(device=ref.device, dtype=torch.float64) - ref.detach().double()).norm().item()
    if diff == 0.0:
        return 0.0
    den = max(ref.detach().double().norm().item(), scale)
    return diff / den if den > 0 else math.inf


class ErrorPool:
    """Relative L2 errors of named tensors against their references, pooled over several draws.

    ``rel(name) = sqrt(Σ ‖got − ref‖²) / sqrt(Σ max(‖ref‖, scale)²)`` over the draws added under
    ``name`` (float64 arithmetic; ``scale`` floors the denominator of a tensor whose reference is ~0,
    e.g. the gradient of a conv bias that feeds a training-mode BatchNorm).

    Why pooled L2 and not one draw's max-norm: in 16-bit training a pre-activation within rounding
    distance of zero lands on the other side of the ReLU in either build, at random places; one such
    flip moves a gradient's max-norm error by 10-100× (measured for eager PyTorch itself between
    inputs 1% apart). Summing squared errors over draws averages the flips, so the comparison of two
    builds measures their rounding, not which draw had a flip.
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

    def rels(self) -> dict[str, float]:
        """Every name's pooled error."""
        return {n: self.rel(n) for n in self.num}


def rule_violations(backend: Mapping[str, float], eager: Mapping[str, float], floor: float,
                    ratio: Optional[float] = None) -> list[str]:
    """The tensors whose error breaks the rule ``backend ≤ ratio · eager + floor`` (``ratio`` default
    :data:`EAGER_RATIO`), one line each; a NaN error always breaks it. Both mappings hold errors against
    the same float64 reference by tensor name.

    Raises:
        KeyError: a name of ``backend`` missing from ``eager``.
    """
    ratio = EAGER_RATIO if ratio is None else ratio
    bad = []
    for name, err in backend.items():
        ref = eager[name]
        if not err <= ratio * ref + floor:  # written so that NaN fails
            bad.append(f"{name}: {err:.2e} > {ratio:g} × eager {ref:.2e} + {floor:.1e}")
    return bad
