"""Per-channel batch statistics (mean, biased variance) of an NCHW/NHWC activation, in fp32.

Order: Triton kernels → launcher → reference → custom op → functional.

Each Triton program reduces a (BLOCK_M × BLOCK_C) tile of the NHWC matrix ``x[M = N·H·W, C]`` to a
partial (count, mean, M2) with a corrected two-pass reduction in registers; a second kernel folds the
partials with the k-way form of Chan et al.'s rule (``M2 = Σ M2_i + Σ n_i·(mean_i − mean)²``, the
pairwise ``M2a + M2b + δ²·na·nb/n`` applied to all tiles at once; Chan, Golub & LeVeque 1979),
which stays accurate for inputs whose mean is large relative to their spread, unlike
``E[x²] − E[x]²``. The fold runs in a fixed order, so results are bitwise reproducible (no atomics).
"""

from __future__ import annotations

import torch

from fused_preact.ops._common import as_nhwc, triton, tl

__all__ = ["batch_stats", "batch_stats_reference"]


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _stats_partial_kernel(
    x_ptr, part_mean_ptr, part_m2_ptr, M, C,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < M)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    count = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
    # Corrected two-pass (Chan, Golub & LeVeque 1983): the second pass's Σd repairs the first mean.
    mean0 = tl.sum(x, axis=0) / count
    d = tl.where(mask, x - mean0[None, :], 0.0)
    s1 = tl.sum(d, axis=0)
    mean = mean0 + s1 / count
    m2 = tl.maximum(tl.sum(d * d, axis=0) - s1 * s1 / count, 0.0)
    out = pid_m.to(tl.int64) * C + cols
    tl.store(part_mean_ptr + out, mean, mask=cols < C)
    tl.store(part_m2_ptr + out, m2, mask=cols < C)


@triton.jit
def _stats_combine_kernel(
    part_mean_ptr, part_m2_ptr, mean_ptr, var_ptr, M, C, NUM_PARTS,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_c = tl.program_id(0)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    # k-way form of Chan's rule, shifted by the first tile's mean so that large means cancel
    # exactly: mean = ref + Σ n_i·(mean_i − ref)/M, M2 = Σ M2_i + Σ n_i·(mean_i − mean)².
    ref = tl.load(part_mean_ptr + cols, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, NUM_PARTS, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        pmask = (parts < NUM_PARTS)[:, None] & cmask[None, :]
        nb = tl.minimum(M - parts * BLOCK_M, BLOCK_M).to(tl.float32)
        mb = tl.load(part_mean_ptr + parts.to(tl.int64)[:, None] * C + cols[None, :], mask=pmask, other=0.0)
        acc += tl.sum(tl.where(pmask, nb[:, None] * (mb - ref[None, :]), 0.0), axis=0)
    mean = ref + acc / M
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, NUM_PARTS, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        pmask = (parts < NUM_PARTS)[:, None] & cmask[None, :]
        nb = tl.minimum(M - parts * BLOCK_M, BLOCK_M).to(tl.float32)
        offs = parts.to(tl.int64)[:, None] * C + cols[None, :]
        mb = tl.load(part_mean_ptr + offs, mask=pmask, other=0.0)
        m2b = tl.load(part_m2_ptr + offs, mask=pmask, other=0.0)
        delta = mb - mean[None, :]
        m2 += tl.sum(tl.where(pmask, m2b + nb[:, None] * delta * delta, 0.0), axis=0)
    tl.store(mean_ptr + cols, mean, mask=cmask)
    tl.store(var_ptr + cols, m2 / M, mask=cmask)


# -------------------------------------------------------------------------------------- launcher
def _stats_blocks(M: int, C: int) -> tuple[int, int]:
    block_c = max(16, min(64, triton.next_power_of_2(C)))
    # ≤ 256-row tiles keep each tile's fp32 sums short (the interpreter's sums are sequential, a
    # GPU's are trees); the k-way fold combines the tiles accurately.
    block_m = max(16, min(256, triton.next_power_of_2(M)))
    return block_m, block_c


def _batch_stats_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, C, H, W = x.shape
    M = N * H * W
    xm = as_nhwc(x)
    block_m, block_c = _stats_blocks(M, C)
    parts = triton.cdiv(M, block_m)
    part_mean = torch.empty(parts, C, device=x.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    _stats_partial_kernel[(parts, triton.cdiv(C, block_c))](
        xm, part_mean, part_m2, M, C, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=8
    )
    return combine_partials(part_mean, part_m2, M, block_m)


def combine_partials(part_mean: torch.Tensor, part_m2: torch.Tensor, M: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-tile statistics into per-channel mean and biased variance (Chan's rule, fp32).

    Args:
        part_mean, part_m2: (num_tiles, C) fp32; row i holds the mean and M2 (Σ(x − mean_i)²) of
            rows ``[i·block_m, min((i+1)·block_m, M))`` of the (M, C) activation.
        M: total rows (N·H·W); block_m: rows per tile (the last tile may be shorter).

    Returns:
        ``(mean, var)``: (C,) float32 each; var is biased (M2/M).
    """
    parts, C = part_mean.shape
    block_c = _stats_blocks(M, C)[1]
    mean = torch.empty(C, device=part_mean.device, dtype=torch.float32)
    var = torch.empty_like(mean)
    _stats_combine_kernel[(triton.cdiv(C, block_c),)](
        part_mean, part_m2, mean, var, M, C, parts, BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_P=64
    )
    return mean, var


# ------------------------------------------------------------------------------------- reference
def batch_stats_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch per-channel mean and biased variance of ``x`` (N, C, H, W), in fp32 (fp64 for fp64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    var, mean = torch.var_mean(x.to(acc), dim=(0, 2, 3), correction=0)
    return mean, var


# ------------------------------------------------------------------------------------- custom op
@torch.library.custom_op("fused_preact::batch_stats", mutates_args=(), device_types=("cpu", "cuda"))
def _batch_stats_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch_stats_triton(x)


@_batch_stats_op.register_fake
def _(x):
    C = x.shape[1]
    return x.new_empty(C, dtype=torch.float32), x.new_empty(C, dtype=torch.float32)


# ------------------------------------------------------------------------------------ functional
def batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel batch mean and biased variance, computed by the Triton kernels.

    Args:
        x: (N, C, H, W) float32/float16/bfloat16, NCHW or channels_last (NCHW is copied to NHWC
            first), on CUDA or, with Triton's interpreter active, on CPU. Must have N·H·W ≥ 1.

    Returns:
        ``(mean, var)``: two (C,) float32 tensors; ``var`` is biased (divides by N·H·W), as
        ``nn.BatchNorm2d`` uses to normalize. Not differentiable (``x`` is detached): the fused
        conv op's backward carries the statistics' gradient terms.

    Source: the batch statistics of ``torch.nn.functional.batch_norm`` in training mode.
    """
    return _batch_stats_op(x.detach())
