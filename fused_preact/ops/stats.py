"""Per-channel batch statistics (mean, biased variance) of an activation, in fp32.

Order: launcher → reference → functional (kernels: :mod:`fused_preact.ops.triton.kernels_bn`). Inside a fused
chain the statistics come from the producing convolution's epilogue; this standalone pass serves the
BatchNorm whose input no fused conv produced, and synchronized BN's local statistics.
"""

from __future__ import annotations

import torch

from fused_preact.ops._common import nhwc_strides, triton
from fused_preact.ops.index_range import needs_idx64, range_reasons
from fused_preact.ops.spec import BATCH, BNMode
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.pack import PACK_ROWS

__all__ = ["batch_stats", "batch_stats_reference"]


# -------------------------------------------------------------------------------------- launcher
def _batch_stats_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, C, H, W = x.shape
    M = N * H * W
    rows = max(16, min(256, triton.next_power_of_2(M)))
    parts = triton.cdiv(M, rows)
    rows_bn = PACK_ROWS * C
    part, pack = torch.empty(parts * 2 * C + rows_bn, device=x.device, dtype=torch.float32).split([parts * 2 * C, rows_bn])
    launch.stats_partial(x=x, x_strides=nhwc_strides(x), part=part, shape=x.shape, rows=rows, idx64=needs_idx64(x))
    launch.finalize(pack=pack, C=C, mode=BNMode(BATCH, False), part=part, num_parts=parts, count=M, rows=rows)
    return pack[:C], pack[C:2 * C]


# ------------------------------------------------------------------------------------- reference
def batch_stats_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch per-channel mean and biased variance of ``x`` (N, C, H, W), in fp32 (fp64 for fp64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    var, mean = torch.var_mean(x.to(acc), dim=(0, 2, 3), correction=0)
    return mean, var


# ------------------------------------------------------------------------------------ functional
def batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel batch mean and biased variance, computed by the Triton kernels.

    Args:
        x: (N, C, H, W) float32/float16/bfloat16, any memory format (read through its strides), on
            CUDA or, with Triton's interpreter active, on CPU. Must have N·H·W ≥ 1.

    Raises:
        ValueError: x outside the kernels' index range (:func:`fused_preact.ops.index_range.range_reasons`:
            N·H·W near 2³¹, or one image spanning 2³¹ elements).

    Returns:
        ``(mean, var)``: two (C,) float32 tensors; ``var`` is biased (divides by N·H·W), as
        ``nn.BatchNorm2d`` normalizes with. Not differentiable (``x`` is read detached).

    Source: the batch statistics of ``torch.nn.functional.batch_norm`` in training mode; Chan, Golub &
    LeVeque's pairwise update for the per-tile combination.
    """
    reasons = range_reasons([tuple(x.shape)], x.stride())
    if reasons:
        raise ValueError("batch_stats: " + "; ".join(reasons))
    return _batch_stats_triton(x.detach())
