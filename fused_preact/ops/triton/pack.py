"""The pack: the per-channel fp32 rows of one BatchNorm that every kernel of a unit reads, and the
fp32 pre-activation transform that reads it.

A pack is a (PACK_ROWS, C) fp32 region of the plan's ``aux`` buffer, written by the finalize kernel
(:mod:`.kernels_bn`) from the batch, running or given statistics: mean, var, invstd, scale = invstd·γ,
shift = β − mean·scale, then three rows of the fprop kernel's scratch, then γ (1 without affine
parameters). The transform is ``a = relu(x·scale + shift)`` in one fused multiply-add, with PyTorch's
NaN semantics (``relu(NaN) = NaN``, ``relu(-inf) = 0``); 16-bit inputs take :mod:`.prologue16`'s packed
form of it.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton

__all__ = ["PACK_MEAN", "PACK_VAR", "PACK_INVSTD", "PACK_SCALE", "PACK_SHIFT", "PACK_ROWS16", "PACK_GAMMA",
           "PACK_ROWS"]

# Rows of a pack: per-channel fp32 vectors of one BatchNorm, written by the finalize kernel (rows 0-4
# and PACK_GAMMA: γ, 1 without affine parameters).
PACK_MEAN, PACK_VAR, PACK_INVSTD, PACK_SCALE, PACK_SHIFT = 0, 1, 2, 3, 4
#: Rows PACK_ROWS16.. (three rows of C fp32 words) are the fprop kernel's scratch: the 16-bit prologue
#: vectors it derives from rows 0-4 (``kernels_fprop._write_pack16``), or for an fp32 input under fp16
#: operands the scaled fp32 scale and shift (``kernels_fprop._write_scaled32``).
PACK_ROWS16 = tl.constexpr(5)
PACK_GAMMA = 8
PACK_ROWS = 9


@triton.jit
def _relu_nan(z):
    """``relu`` keeping NaN (``tl.maximum(z, 0)`` would return 0 for NaN)."""
    return tl.where(z < 0.0, 0.0, z)


@triton.jit
def _load_row(ptrs, mask):
    """``tl.load(ptrs)`` where ``mask`` is None, else masked with 0 for the masked-off entries."""
    if mask is None:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _scale_shift(pack_ptr, chans, cmask, C):
    """The pack's scale and shift rows at channels ``chans`` (0 where ``cmask`` is False; ``cmask`` None:
    every channel exists). Masked loads of contiguous channels (not clamped indices), so the compiler
    can prove contiguity: vector loads."""
    sc = _load_row(pack_ptr + 3 * C + chans, cmask)
    sh = _load_row(pack_ptr + 4 * C + chans, cmask)
    return sc, sh


@triton.jit
def _preact(xt, sc, sh, mask):
    """``relu(x·scale + shift)`` of a loaded x tile in fp32 (one fused multiply-add: a single rounding,
    as eager's ``x·alpha + beta`` batch norm), zero where ``mask`` is False (padding, tails): the padded
    taps of the conv input are zeros of the pre-activation."""
    a = _relu_nan(tl.fma(xt.to(tl.float32), sc[None, :], sh[None, :]))
    return tl.where(mask, a, 0.0)
