"""Fused ops: per-channel batch statistics and BN→ReLU→Conv2d (Triton kernels + custom ops)."""

from fused_preact.ops.stats import batch_stats, batch_stats_reference
from fused_preact.ops.bn_relu_conv import (
    BNStats,
    bn_relu_conv2d,
    bn_relu_conv2d_reference,
    bn_relu_conv2d_with_stats,
    bn_relu_conv2d_with_stats_out,
    bn_statistics,
    check_inputs,
    check_training_batch,
)

__all__ = [
    "BNStats",
    "batch_stats",
    "batch_stats_reference",
    "bn_relu_conv2d",
    "bn_relu_conv2d_reference",
    "bn_relu_conv2d_with_stats",
    "bn_relu_conv2d_with_stats_out",
    "bn_statistics",
    "check_inputs",
    "check_training_batch",
]
