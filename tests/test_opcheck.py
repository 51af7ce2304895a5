"""``torch.library.opcheck`` on the custom ops: schema, fake (meta) impls, autograd registration, AOT dispatch."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fused_preact  # noqa: F401  (registers the ops)
from conftest import DEVICE

OPS = torch.ops.fused_preact


def _args(channels_last: bool, batch_stats: bool, bias: bool):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 7, 5, device=DEVICE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w = torch.randn(8, 3, 3, 3, device=DEVICE, requires_grad=True)
    b = torch.randn(8, device=DEVICE, requires_grad=True) if bias else None
    mean = torch.randn(6, device=DEVICE)
    invstd = torch.rand(6, device=DEVICE) + 0.5
    gamma = torch.rand(6, device=DEVICE, requires_grad=True)
    beta = torch.randn(6, device=DEVICE, requires_grad=True)
    return x, w, b, mean, invstd, gamma, beta, [2, 1], [1, 2], [1, 2], 2, batch_stats, "triton"


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("batch_stats", [True, False], ids=["train", "eval"])
def test_bn_relu_conv2d(channels_last, batch_stats):
    opcheck(OPS.bn_relu_conv2d.default, _args(channels_last, batch_stats, bias=batch_stats))


def test_bn_relu_conv2d_backward():
    x, w, b, mean, invstd, gamma, beta, *conv, batch_stats, backend = _args(True, True, True)
    y = OPS.bn_relu_conv2d(x, w, b, mean, invstd, gamma, beta, *conv, batch_stats, backend)
    dy = torch.randn_like(y)
    args = (dy, x.detach(), w.detach(), mean, invstd, gamma.detach(), beta.detach(), *conv, batch_stats, True, backend)
    opcheck(OPS.bn_relu_conv2d_backward.default, args)


def test_batch_stats():
    opcheck(OPS.batch_stats.default, (torch.randn(3, 5, 4, 6, device=DEVICE),))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_bn_relu_conv2d_stats(channels_last, residual):
    x, w, b, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats, backend = _args(
        channels_last, True, bias=residual
    )
    y = OPS.bn_relu_conv2d(x, w, b, mean, invstd, gamma, beta, stride, padding, dilation, groups, True, backend)
    r = torch.randn(y.shape, device=DEVICE, requires_grad=True) if residual else None
    opcheck(OPS.bn_relu_conv2d_stats.default,
            (x, w, b, mean, invstd, gamma, beta, r, stride, padding, dilation, groups, batch_stats, backend))
