"""Launchers of the ``recompute`` backend's own kernels (:mod:`.kernels`) and of the fold it borrows
from the wgrad kernel: tiles and grids decided here, tensors passed by name.

Inside :func:`fused_preact.ops.triton.launch.recording` they append :class:`~fused_preact.ops.triton.launch.Launch`
records instead of launching, as the Triton backend's launchers do.
"""

from __future__ import annotations

from typing import Optional

import torch

from fused_preact.ops._common import interpreting, nhwc_strides, triton
from fused_preact.ops.recompute import kernels as RK
from fused_preact.ops.spec import ConvGeom
from fused_preact.ops.triton import launch as TL
from fused_preact.ops.triton.configs import INTERP_SUM_ROWS, GemmConfig, p2

__all__ = ["tiles", "sum_rows", "preact", "mask_sums", "fold"]

#: Programs the backward reduction aims at on a GPU (a few waves of a 100+-SM device); each program
#: reduces ``sum_rows`` rows, so the fold reads ``cdiv(M, sum_rows)`` partial rows per channel.
_TARGET_PROGRAMS = 1024
#: The fold-only wgrad launch's signature is fixed (1×1 geometry, fp32 operand pointers, these tiles),
#: so every fold of a process shares one compilation per channel-count specialization.
_FOLD_CFG = GemmConfig(16, 16, 16, 4, 1)


def tiles(M: int, C: int, channels_inner: bool = True) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) of the elementwise kernels: on a GPU 64×64, or 64×32 when channels are not
    the innermost dimension (NCHW: the tensors' offsets are not shared along a row, and 64×64 tiles of
    the backward reduction spill in the static report); under the interpreter as few programs as the
    interpreter's fp32 sums allow (it runs programs one after another)."""
    if interpreting():
        return p2(M, 16, INTERP_SUM_ROWS), p2(C, 16, 256)
    return 64, 64 if channels_inner else 32


def sum_rows(M: int, C: int, channels_inner: bool = True) -> int:
    """Rows one program of :func:`mask_sums` reduces: a multiple of BLOCK_M, so that about
    ``_TARGET_PROGRAMS`` programs cover the (M, C) tensor (at most 64 chunks each)."""
    bm, bc = tiles(M, C, channels_inner)
    if interpreting():
        return bm
    per = triton.cdiv(M * triton.cdiv(C, bc), _TARGET_PROGRAMS)
    return max(bm, min(64 * bm, triton.cdiv(per, bm) * bm))


def preact(*, x: torch.Tensor, pack: torch.Tensor, a: torch.Tensor, idx64: bool) -> None:
    """``a = relu(x·scale + shift)`` (scale, shift: rows 3 and 4 of ``pack`` (5, C) fp32) for logical
    (N, C, H, W) ``x`` and ``a`` of the same shape, any strides; stored in a's dtype."""
    N, C, H, W = x.shape
    M = N * H * W
    bm, bc = tiles(M, C, x.stride(1) == 1)
    grid = (triton.cdiv(M, bm), triton.cdiv(C, bc))
    args = (x, *nhwc_strides(x), pack, a, *nhwc_strides(a), M, H, W, C)
    kw = dict(IDX64=idx64, BLOCK_M=bm, BLOCK_C=bc, num_warps=4)
    TL._launcher("preact", RK._preact_kernel, grid)(*args, **kw)


def mask_sums(*, da: torch.Tensor, x: torch.Tensor, pack: torch.Tensor, out: torch.Tensor, out_strides,
              psum: torch.Tensor, rows: int, write_dx: bool, res: Optional[torch.Tensor] = None,
              idx64: bool = False) -> int:
    """BatchNorm's backward reduction on the conv input gradient ``da`` (logical (N, C, H, W), any
    strides) of the unit whose BN input is ``x``: ``dz = da·[x·scale + shift > 0]`` (or, with
    ``write_dx``, ``dx = scale·dz`` + ``res``) into ``out`` through its (n, h, w, c) ``out_strides``
    (``out`` may alias ``da``), and per program of ``rows`` rows Σdz, Σdz·x̂ into ``psum``
    (programs, 2, C) fp32; ``rows`` must be :func:`sum_rows` of the same layout. Returns the number of
    partial rows written."""
    N, C, H, W = x.shape
    M = N * H * W
    bm, bc = tiles(M, C, x.stride(1) == 1)
    parts = triton.cdiv(M, rows)
    grid = (parts, triton.cdiv(C, bc))
    rs = nhwc_strides(res) if res is not None else (0, 0, 0, 0)
    args = (da, *nhwc_strides(da), x, *nhwc_strides(x), pack, out, *out_strides, res, *rs, psum, M, rows, H, W, C)
    kw = dict(WRITE_DX=write_dx, HAS_RES=res is not None, IDX64=idx64, BLOCK_M=bm, BLOCK_C=bc, num_warps=4)
    TL._launcher("mask_sums", RK._mask_sums_kernel, grid)(*args, **kw)
    return parts


def fold(*, psum: torch.Tensor, num_parts: int, C: int, pack: torch.Tensor, sum_mode: TL.SumMode, coef: torch.Tensor,
         dbeta: Optional[torch.Tensor], dgamma: Optional[torch.Tensor], inv_count: float) -> None:
    """Fold the ``num_parts`` partial rows of ``psum`` in order (deterministic) into dβ = Σdz and
    dγ = Σdz·x̂ (when given) and ``coef``: with ``sum_mode`` 1 the dx coefficients (Σdz, Σdz·x̂)·inv_count,
    with 2 the gradients of externally given statistics. This is the fold of
    :func:`fused_preact.ops.triton.launch.wgrad` launched without its weight gradient (``dw=None``)."""
    geom = ConvGeom(C, C, (1, 1))
    TL.wgrad(geom=geom, in_shape=(1, C, 1, 1), out_shape=(1, C, 1, 1), in_strides=(0, 0, 0, 0), cfg=_FOLD_CFG,
             split=1, dy=psum, dy_strides=(0, 0, 0, 0), x=psum, pack=pack, dw=None, dw_strides=(0, 0, 0, 0),
             cdtype=torch.float32, idx64=False, sum_mode=sum_mode, psum=psum, num_parts=num_parts, dbeta=dbeta,
             dgamma=dgamma, coef=coef, inv_count=inv_count)
