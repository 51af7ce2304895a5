"""Per-channel batch statistics (mean, biased variance) of an activation, in fp32.

Order: launcher → reference → functional (kernels: :mod:`fused_preact.ops._bn_kernels`). Inside a fused
chain the statistics come from the producing convolution's epilogue; this standalone pass serves the
BatchNorm whose input no fused conv produced, and synchronized BN's local statistics.
"""

from __future__ import annotations

import torch

from fused_preact.ops import _bn_kernels as BK
from fused_preact.ops._common import interpreting, nhwc_strides, triton

__all__ = ["batch_stats", "batch_stats_reference"]


# -------------------------------------------------------------------------------------- launcher
def _batch_stats_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, C, H, W = x.shape
    M = N * H * W
    rows = max(16, min(256, triton.next_power_of_2(M)))
    parts = triton.cdiv(M, rows)
    block_c = max(16, min(256 if interpreting() else 64, triton.next_power_of_2(C)))
    part, pack = torch.empty(parts * 2 * C + 5 * C, device=x.device, dtype=torch.float32).split([parts * 2 * C, 5 * C])
    big = sum((s - 1) * st for s, st in zip((N, H, W, C), nhwc_strides(x))) >= 2**31 - 1
    BK._stats_partial_kernel[(parts, triton.cdiv(C, block_c))](
        x, *nhwc_strides(x), part, M, H=H, W=W, C=C, IDX64=big, BLOCK_M=rows, BLOCK_C=block_c)
    BK._finalize_kernel[(triton.cdiv(C, block_c),)](
        part, parts, M, rows, 1.0, pack, None, None, None, None, None, 0.0, 0.0,
        C=C, MODE=0, HAS_AFFINE=False, UPDATE_RUNNING=False, CUMULATIVE=False, INC_NBT=False,
        BLOCK_C=block_c, BLOCK_P=max(16, min(1024, triton.next_power_of_2(parts))) if interpreting() else 32)
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

    Returns:
        ``(mean, var)``: two (C,) float32 tensors; ``var`` is biased (divides by N·H·W), as
        ``nn.BatchNorm2d`` normalizes with. Not differentiable (``x`` is read detached).

    Source: the batch statistics of ``torch.nn.functional.batch_norm`` in training mode; Chan, Golub &
    LeVeque's pairwise update for the per-tile combination.
    """
    return _batch_stats_triton(x.detach())
