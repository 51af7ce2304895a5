"""Functional BatchNorm → ReLU → Conv2d: ``y = conv2d(relu(batch_norm(x)), W, b)`` in one fused unit.

Order: reference → functional. The unit is a one-conv chain (:mod:`fused_preact.ops.spec`); the
dataflow follows docs/design.md: statistics, then the fprop kernel's prologue turns each x tile into
``a = max(x·scale + shift, 0)`` before the MMA; backward recomputes the ReLU mask and BN's sums in
the dgrad epilogue, dx in one elementwise pass, and ``a`` again in the wgrad prologue. Saved for
backward: x, W and (C,) vectors only — never the BN or ReLU output.

Semantics copied from ``torch.nn.functional.batch_norm`` (running stats, momentum, unbiased running
variance, eval mode) followed by ``torch.nn.functional.relu`` and ``torch.nn.functional.conv2d``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fused_preact.ops._common import IntOr2
from fused_preact.ops.backends import PlanCache, eager_fallback
from fused_preact.ops.run import run_chain
from fused_preact.ops.spec import (
    BATCH,
    RUNNING,
    BNMode,
    ChainSpec,
    ChainTensors,
    ConvGeom,
    UnitTensors,
    check_running_buffers,
    functorch_reasons,
    trace_reasons,
)

__all__ = ["bn_relu_conv2d", "bn_relu_conv2d_reference"]

_PLANS = PlanCache()


def bn_relu_conv2d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
    running_mean: Optional[torch.Tensor] = None, running_var: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None, bn_bias: Optional[torch.Tensor] = None, training: bool = False,
    momentum: float = 0.1, eps: float = 1e-5, stride: IntOr2 = 1, padding: IntOr2 = 0, dilation: IntOr2 = 1,
    groups: int = 1,
) -> torch.Tensor:
    """Plain PyTorch ``F.conv2d(F.relu(F.batch_norm(x, ...)), weight, bias, ...)``: the source of truth.

    Arguments and semantics are exactly those of ``torch.nn.functional.batch_norm`` followed by
    ``torch.nn.functional.conv2d``; any device and float dtype.
    """
    a = F.relu(F.batch_norm(x, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps))
    return F.conv2d(a, weight, bias, stride, padding, dilation, groups)


def bn_relu_conv2d(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
    running_mean: Optional[torch.Tensor] = None, running_var: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None, bn_bias: Optional[torch.Tensor] = None, training: bool = False,
    momentum: float = 0.1, eps: float = 1e-5, stride: IntOr2 = 1, padding: IntOr2 = 0, dilation: IntOr2 = 1,
    groups: int = 1, backend: str = "auto",
) -> torch.Tensor:
    """Fused ``conv2d(relu(batch_norm(x)))`` with the arguments of ``F.batch_norm`` and ``F.conv2d``.

    Args:
        x: (N, C, H, W) float32/float16/bfloat16 (float64 on the reference path), NCHW or
            channels_last; the output follows x's memory format.
        weight: (K, C/groups, R, S) conv weight; bias: (K,) or None.
        running_mean, running_var, bn_weight, bn_bias, training, momentum, eps: as ``F.batch_norm``
            (running buffers are updated in place in training; ``momentum`` is the average factor).
        stride, padding, dilation, groups: as ``F.conv2d`` (ints, pairs or one-element lists;
            ``padding="valid"``/``"same"`` too, ``"same"`` where it pads both sides alike).
        backend: ``"auto"`` (measured and validated per signature on CUDA, :mod:`fused_preact.ops.auto`;
            elsewhere the first of ``fused_preact.ops.backends.PRIORITY`` that can serve x), ``"triton"``,
            ``"cuda"`` (CUDA extension, opt-in), ``"recompute"`` (cuDNN convolutions, BN+ReLU recomputed)
            or ``"reference"`` (plain PyTorch). Under a ``torch.func`` transform (vmap, grad, …),
            ``torch.jit.trace`` or symbolic sizes outside ``torch.compile`` (``torch.export`` with a
            dynamic dimension) the plain PyTorch ops run (:func:`~fused_preact.ops.spec.functorch_reasons`,
            :func:`~fused_preact.ops.spec.trace_reasons`); a forced fused backend raises there.

    Returns:
        (N, K, P, Q) tensor of the compute dtype (x's, or the autocast dtype under autocast).

    Raises:
        RuntimeError: a forced backend cannot serve x (the message says why; a fused one under a
            ``torch.func`` transform); eval mode without ``running_mean``/``running_var``; PyTorch's
            input errors, bad geometry included (``F.conv2d``'s messages: non-positive stride or
            groups, negative padding, dilation < 1, a padding/stride/dilation of 3 or more values).
        ValueError: training with one value per channel, with only one of the running buffers, or with
            ``eps <= 0``; unknown backend name; a padding string other than "valid"/"same".
        TypeError: ``training`` not a bool, ``momentum`` not a number (``F.batch_norm`` takes no
            ``None`` there).
    """
    # F.batch_norm's own argument checks, in its order and with its messages.
    if not isinstance(training, bool):
        cls = type(training)  # named as CPython's tp_name: a C type outside builtins with its module
        heap = cls.__flags__ & (1 << 9)  # Py_TPFLAGS_HEAPTYPE: a class defined in Python
        name = cls.__name__ if heap or cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
        raise TypeError(f"batch_norm(): argument 'training' (position 6) must be bool, not {name}")
    if not isinstance(momentum, (int, float)):
        raise TypeError(f"batch_norm(): argument 'momentum' (position 7) must be float, not {type(momentum).__name__}")
    check_running_buffers(training, running_mean, running_var)
    transform = functorch_reasons() + trace_reasons(x)
    if transform:
        eager_fallback(backend, transform[0])
        return bn_relu_conv2d_reference(x, weight, bias, running_mean, running_var, bn_weight, bn_bias, training,
                                        momentum, eps, stride, padding, dilation, groups)
    if (bn_weight is None) != (bn_bias is None):  # F.batch_norm's defaults for the missing half: γ = 1, β = 0
        C = x.shape[1]
        bn_weight = bn_weight if bn_weight is not None else torch.ones(C, device=x.device, dtype=bn_bias.dtype)
        bn_bias = bn_bias if bn_bias is not None else torch.zeros(C, device=x.device, dtype=bn_weight.dtype)
    spec = ChainSpec((ConvGeom.from_args(weight, bias, stride, padding, dilation, groups),))
    mode = BNMode(BATCH if training else RUNNING, bn_weight is not None, training and running_mean is not None, False)
    t = ChainTensors([UnitTensors(weight, bias, bn_weight, bn_bias, running_mean, running_var, None, momentum, eps)])
    result, _ = run_chain(backend, _PLANS, spec, x, t, (mode,))
    return result.out
