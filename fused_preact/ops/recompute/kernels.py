"""Elementwise Triton kernels of the ``recompute`` backend (the convolutions are cuDNN's).

    _preact_kernel      a = relu(x·scale + shift) into a transient buffer, the convolution's input
    _mask_sums_kernel   BatchNorm's backward reduction on the convolution's input gradient da:
                        dz = da·[x·scale + shift > 0] (stored, or dx = scale·dz in eval mode) and, per
                        program, the column sums Σdz, Σdz·x̂ (folded by the wgrad kernel's fold programs,
                        then the dx pass of :mod:`fused_preact.ops.triton.kernels_bn` finishes dx)

The transform is the fused kernels' own (:func:`~fused_preact.ops.triton.pack._preact`: one
fused multiply-add, PyTorch's NaN rules for ReLU) and the mask is ``threshold_backward``'s, so the
recompute backend rounds exactly where the fused path rounds. Tensors are addressed through their
(n, h, w, c) strides: NCHW and channels_last alike. ``pack`` is a BatchNorm's (5, C) fp32 rows (mean,
var, invstd, scale, shift) written by the finalize kernel.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.pack import _preact, _scale_shift


@triton.jit(do_not_specialize=("M", "H", "W"))
def _preact_kernel(
    x_ptr, sxn, sxh, sxw, sxc,
    pack_ptr,
    a_ptr, san, sah, saw, sac,
    M, H, W, C, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``a[m, c] = relu(x[m, c]·scale[c] + shift[c])`` stored in a's dtype, for the M = N·H·W rows of
    x and a (each through its (n, h, w, c) strides). Grid: (cdiv(M, BLOCK_M), cdiv(C, BLOCK_C))."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < M)[:, None] & cmask[None, :]
    wi = rows % W
    hi = (rows // W) % H
    nb = rows // (H * W)
    if IDX64:
        nb = nb.to(tl.int64)
    xt = tl.load(x_ptr + (nb * sxn + hi * sxh + wi * sxw)[:, None] + cols[None, :] * sxc, mask=mask, other=0.0)
    sc, sh = _scale_shift(pack_ptr, cols, cmask, C)
    a = _preact(xt, sc, sh, mask)
    tl.store(a_ptr + (nb * san + hi * sah + wi * saw)[:, None] + cols[None, :] * sac,
             a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=("M", "ROWS", "H", "W"))
def _mask_sums_kernel(
    da_ptr, sdn, sdh, sdw, sdc,
    x_ptr, sxn, sxh, sxw, sxc,
    pack_ptr,
    out_ptr, son, soh, sow, soc,
    res_ptr, srn, srh, srw, src,
    psum_ptr,
    M, ROWS, H, W, C,
    WRITE_DX: tl.constexpr, HAS_RES: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """BatchNorm's backward reduction over rows [pid_m·ROWS, (pid_m + 1)·ROWS) of the M = N·H·W rows,
    channels [pid_c·BLOCK_C, …), in chunks of BLOCK_M rows.

    ``dz = da·[x·scale + shift > 0]`` (``threshold_backward``: a NaN pre-activation passes its
    gradient). Stores ``dz`` in out's dtype into ``out`` — or, with WRITE_DX (running or externally
    given statistics), ``dx = (dz·invstd)·γ`` (+ ``res``, the gradient reaching x through an identity
    shortcut, with HAS_RES). ``out`` may be ``da`` itself (each element is read before it is written by
    the same program). Row ``pid_m`` of ``psum`` (programs, 2, C) fp32 gets Σdz and Σdz·x̂ of the
    stored (rounded) dz, ``x̂ = (x − mean)·invstd``. Grid: (cdiv(M, ROWS), cdiv(C, BLOCK_C)); ROWS is a
    multiple of BLOCK_M.
    """
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mu = tl.load(pack_ptr + cols, mask=cmask, other=0.0)
    istd = tl.load(pack_ptr + 2 * C + cols, mask=cmask, other=0.0)
    sc, sh = _scale_shift(pack_ptr, cols, cmask, C)
    s_dz = tl.zeros([BLOCK_C], dtype=tl.float32)
    s_dzx = tl.zeros([BLOCK_C], dtype=tl.float32)
    start = pid_m * ROWS
    end = tl.minimum(start + ROWS, M)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cmask[None, :]
        wi = rows % W
        hi = (rows // W) % H
        nb = rows // (H * W)
        if IDX64:
            nb = nb.to(tl.int64)
        da = tl.load(da_ptr + (nb * sdn + hi * sdh + wi * sdw)[:, None] + cols[None, :] * sdc,
                     mask=mask, other=0.0).to(tl.float32)
        xt = tl.load(x_ptr + (nb * sxn + hi * sxh + wi * sxw)[:, None] + cols[None, :] * sxc,
                     mask=mask, other=0.0).to(tl.float32)
        z = tl.fma(xt, sc[None, :], sh[None, :])
        dz = tl.where(mask & ~(z <= 0.0), da, 0.0)
        optr = out_ptr + (nb * son + hi * soh + wi * sow)[:, None] + cols[None, :] * soc
        if WRITE_DX:  # (dz·invstd)·γ, γ last (as eager: a γ near fp32's range does not overflow invstd·γ)
            gam = tl.load(pack_ptr + 8 * C + cols, mask=cmask, other=0.0)
            dx = (dz * istd[None, :]) * gam[None, :]
            if HAS_RES:
                dx += tl.load(res_ptr + (nb * srn + hi * srh + wi * srw)[:, None] + cols[None, :] * src,
                              mask=mask, other=0.0).to(tl.float32)
            tl.store(optr, dx.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            dzr = dz.to(out_ptr.dtype.element_ty)
            tl.store(optr, dzr, mask=mask)
            dz = dzr.to(tl.float32)  # the sums see exactly what the dx pass will read
        xhat = tl.where(mask, (xt - mu[None, :]) * istd[None, :], 0.0)
        s_dz += tl.sum(dz, axis=0)
        s_dzx += tl.sum(dz * xhat, axis=0)
    prow = psum_ptr + pid_m.to(tl.int64) * (2 * C) + cols
    tl.store(prow, s_dz, mask=cmask)
    tl.store(prow + C, s_dzx, mask=cmask)
