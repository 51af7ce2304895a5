"""``torch.library.opcheck`` on the custom ops of the compile path: schema, fake (meta) impls, autograd
registration, AOT dispatch (``fused_preact.ops.library``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from torch.library import opcheck

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.modules import _spec, _tensors, bn_mode
from fused_preact.ops.library import encode_key
from fused_preact.ops.spec import OP_FIELDS

OPS = torch.ops.fused_preact


def _op_args(module, units, proj, residual, channels_last: bool, train: bool):
    """(x, tensors, floats, key) of ``chain_forward`` for ``module``'s chain, as the compile path builds them."""
    torch.manual_seed(0)
    module.train(train)
    x = torch.randn(2, units[0][0].num_features, 7, 5, device=DEVICE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    spec = _spec(units, proj, "add", residual)
    modes = tuple(dataclasses.replace(bn_mode(bn), update=False) for bn, _ in units)
    t = _tensors(units, proj, None, modes)
    floats = [float(v) for u in t.units for v in (u.momentum or 0.0, u.eps)]
    tensors = [v if v is not None else x.new_empty(0) for v in t.flatten(OP_FIELDS)]
    return x, tensors, floats, "triton|" + encode_key(spec, modes, x.dtype, None)


def _block(train):
    b = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    return b, b._units(), b.shortcut, "none"


def _unit(train):
    m = FusedBNReLUConv2d(4, 6, 3, padding=1, bias=True, backend="triton").to(DEVICE)
    return m, [(m.bn, m.conv)], None, "none"


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("build", [_block, _unit], ids=["block", "unit"])
def test_chain_forward(build, train, channels_last):
    module, units, proj, residual = build(train)
    opcheck(OPS.chain_forward.default, _op_args(module, units, proj, residual, channels_last, train))


def test_chain_backward():
    module, units, proj, residual = _block(True)
    x, tensors, floats, key = _op_args(module, units, proj, residual, True, True)
    outs = OPS.chain_forward(x, tensors, floats, key)
    dy = torch.randn_like(outs[0])
    args = (dy, None, x.detach(), [o.detach() for o in outs[3:]], outs[2].detach(), [t.detach() for t in tensors], key)
    opcheck(OPS.chain_backward.default, args)
