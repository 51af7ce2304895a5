"""Synchronized BN for the fused modules: 2 processes on gloo (CPU) against one process on the whole batch.

Each rank runs a fused block on its slice of one global batch (slices of unequal size), after
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` — torch's own converter, to show it keeps the model
fused and synchronized. Rank 0 compares with float64 eager BN → ReLU → Conv on the concatenated batch:
outputs, input grads, parameter grads (summed over ranks), BN grads and running stats.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from conftest import DEVICE
from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import PreActBlock
from fused_preact.modules import convert_sync_batchnorm
from helpers import rel_err

SPLITS = (5, 2)  # images per rank: unequal on purpose


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(kind: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    if kind.startswith("unit"):
        fused = FusedBNReLUConv2d(8, 12, 3, padding=1, stride=2, backend="reference" if kind == "unit_reference" else "auto")
        eager = nn.Sequential(OrderedDict(bn=copy.deepcopy(fused.bn), relu=nn.ReLU(), conv=copy.deepcopy(fused.conv)))
    else:
        fused = FusedPreActBlock(8, 16, stride=2)
        eager = PreActBlock(8, 16, stride=2)
    for m in fused.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.5)
    eager.load_state_dict(fused.state_dict())
    return fused, eager.double()


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    n = sum(SPLITS)
    xs = [torch.randn(n, 8, 7, 6, generator=g) * 2 + 1 for _ in range(steps)]
    return xs


def _worker(rank: int, world: int, port: int, kind: str, out_path: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fused, _ = _build(kind)
        fused = convert_sync_batchnorm(fused).to(DEVICE)
        lo = sum(SPLITS[:rank])
        res = []
        for x in _data(steps):
            xl = x[lo:lo + SPLITS[rank]].to(DEVICE).requires_grad_()
            fused.zero_grad()
            y = fused(xl)
            g = torch.cos(torch.arange(y[0].numel(), dtype=y.dtype, device=y.device)).view_as(y[0])
            (y * g).sum().backward()
            grads = {k: p.grad.detach().clone() for k, p in fused.named_parameters()}
            for t in grads.values():
                dist.all_reduce(t)
            res.append(dict(y=y.detach().cpu(), dx=xl.grad.cpu(), grads={k: v.cpu() for k, v in grads.items()},
                            state={k: v.cpu().clone() for k, v in fused.state_dict().items()},
                            types=sorted({type(m).__name__ for m in fused.modules()}),
                            backends=getattr(fused, "last_backend", None)))
        torch.save(res, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["unit", "block", "unit_reference"])
def test_sync_bn_two_processes_equals_one_big_batch(kind, tmp_path):
    steps = 2
    port = _free_port()
    mp.spawn(_worker, args=(2, port, kind, str(tmp_path / "res"), steps), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"res.{r}") for r in range(2)]
    _, eager = _build(kind)
    eager.train()
    for step, x in enumerate(_data(steps)):
        xd = x.double().requires_grad_()
        eager.zero_grad()
        y = eager(xd)
        g = torch.cos(torch.arange(y[0].numel(), dtype=y.dtype)).view_as(y[0])
        (y * g).sum().backward()
        r0, r1 = ranks[0][step], ranks[1][step]
        assert "SyncBatchNorm" in r0["types"] and "BatchNorm2d" not in r0["types"]
        assert any(t.startswith("Fused") for t in r0["types"]), "torch's converter must keep the fused modules"
        fused_ok = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        assert r0["backends"] == ("reference" if kind == "unit_reference" or not fused_ok else "triton")
        assert rel_err(torch.cat([r0["y"], r1["y"]]), y) < 1e-4
        assert rel_err(torch.cat([r0["dx"], r1["dx"]]), xd.grad) < 1e-4
        for name, p in eager.named_parameters():
            key = name
            assert rel_err(r0["grads"][key], p.grad) < 1e-4, key
            assert torch.equal(r0["grads"][key], r1["grads"][key])
        for name, b in eager.state_dict().items():
            key = name
            if b.is_floating_point():
                assert rel_err(r0["state"][key], b) < 1e-5, key
                assert torch.equal(r0["state"][key], r1["state"][key]), key
            else:
                assert int(r0["state"][key]) == int(b) == step + 1, key


def test_sync_bn_without_process_group_is_plain_bn():
    """A SyncBatchNorm child outside torch.distributed behaves as BatchNorm2d (nn.SyncBatchNorm's rule)."""
    fused, eager = _build("unit")
    fused = convert_sync_batchnorm(fused).to(DEVICE)
    assert isinstance(fused, FusedBNReLUConv2d) and isinstance(fused.bn, nn.SyncBatchNorm)
    x = _data(1)[0]
    y = fused(x.to(DEVICE))
    assert rel_err(y.cpu(), eager(x.double())) < 1e-4
    assert rel_err(fused.bn.running_var.cpu(), eager.bn.running_var) < 1e-5
