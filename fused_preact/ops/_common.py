"""Helpers shared by the op files: Triton import, layout conversion, dot dtypes, output shapes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton", "tl", "as_nhwc", "wants_channels_last", "conv_out_size", "dot_dtype", "interpreting"]


def interpreting() -> bool:
    """True when the Triton kernels run under Triton's CPU interpreter."""
    from fused_preact.dispatch import triton_mode

    return triton_mode() == "interpreter"


def as_nhwc(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) tensor → contiguous (N, H, W, C) tensor; free for channels_last input, a copy otherwise."""
    return x.permute(0, 2, 3, 1).contiguous()


def wants_channels_last(x: torch.Tensor) -> bool:
    """Whether an op's output should be channels_last: exactly when ``x`` is channels_last and not NCHW-contiguous.

    The real and fake implementations both use this rule, so their output strides agree.
    """
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output extent of a convolution along one axis (``torch.nn.Conv2d``'s formula)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype):
    """Operand dtype for ``tl.dot``: the input dtype, except bf16 under the interpreter.

    Triton's interpreter (seen with triton 3.9) returns wrong ``tl.dot`` results for bf16
    operands, so there bf16 tiles are upcast to fp32 before the dot; compiled GPU kernels use bf16.
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _DOT[dtype]


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for fp32 operands: TF32 exactly when cuDNN convolutions may use it."""
    if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 and not interpreting():
        return "tf32"
    return "ieee"
