"""The dtypes a chain computes in, and everything each one decides: one table, :data:`TRAITS`.

The tile rules (``triton/configs.py``: the 16-bit or the fp32 tile family), the launchers (the
kernels' ``PRO16`` transform and ``DOT_DTYPE`` operand), the static report and the benchmarks (the
short names), the eager-relative validation rule (its floor) and the tests (their tolerances) read
it. A dtype outside the table has no traits: :func:`traits` raises rather than picking a path.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["DtypeTraits", "TRAITS", "traits", "by_name", "NAMES"]


@dataclasses.dataclass(frozen=True)
class DtypeTraits:
    """What one compute dtype decides.

    Attributes:
        dtype: the torch dtype. name: its short name (``"bf16"``), as ``TILE_OVERRIDES``, the static
            report and the benchmarks' ``--dtypes`` spell it.
        fused: the fused kernels compute in it (float64 runs the plain PyTorch reference only).
        mma16: 16-bit MMA operands: the kernels' packed 16-bit pre-activation transform
            (``launch.Pro16``) and the 16-bit tile family of the tile rules. False: fp32 operands
            (TF32 where cuDNN may use it), the fp32 transform and the fp32 tile family.
        dot: the ``tl.dot`` operand dtype's name in ``triton.language`` (compiled kernels).
        test_tol: the tests' max-norm relative tolerance against a float64 reference of the same inputs.
        eager_floor: the additive floor of the eager-relative rule (``validate.EAGER_FLOOR``): machine
            epsilon of a 16-bit dtype; for fp32 1e-5 (about 80 units of roundoff: reductions over
            10⁵–10⁶ values in another order than eager's).
    """

    dtype: torch.dtype
    name: str
    fused: bool
    mma16: bool
    dot: str
    test_tol: float
    eager_floor: float


#: Every dtype a chain may compute in, by torch dtype.
TRAITS: dict[torch.dtype, DtypeTraits] = {t.dtype: t for t in (
    DtypeTraits(torch.bfloat16, "bf16", fused=True, mma16=True, dot="bfloat16", test_tol=4e-2,
                eager_floor=torch.finfo(torch.bfloat16).eps),
    DtypeTraits(torch.float16, "fp16", fused=True, mma16=True, dot="float16", test_tol=1e-2,
                eager_floor=torch.finfo(torch.float16).eps),
    DtypeTraits(torch.float32, "fp32", fused=True, mma16=False, dot="float32", test_tol=1e-4,
                eager_floor=1e-5),
    DtypeTraits(torch.float64, "fp64", fused=False, mma16=False, dot="float64", test_tol=1e-10,
                eager_floor=1e-12),
)}

#: Short name → traits.
NAMES: dict[str, DtypeTraits] = {t.name: t for t in TRAITS.values()}


def traits(dtype: torch.dtype) -> DtypeTraits:
    """The :class:`DtypeTraits` of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not in :data:`TRAITS` (no path is guessed for it).
    """
    t = TRAITS.get(dtype)
    if t is None:
        raise TypeError(f"fused_preact: no compute path for {dtype} (known: {', '.join(NAMES)})")
    return t


def by_name(name: str) -> DtypeTraits:
    """The traits of a short name (``"bf16"``) or of a torch dtype's name (``"bfloat16"``,
    ``"torch.bfloat16"``).

    Raises:
        ValueError: an unknown name.
    """
    if name in NAMES:
        return NAMES[name]
    for t in TRAITS.values():
        if name in (str(t.dtype), str(t.dtype).replace("torch.", "")):
            return t
    raise ValueError(f"unknown dtype {name!r}; expected one of {list(NAMES)}")
