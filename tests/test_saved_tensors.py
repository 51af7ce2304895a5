"""What a fused unit keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``."""

from __future__ import annotations

import torch
import torch.nn as nn

from conftest import DEVICE
from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import PreActBlock


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during ``module(x)`` (a tensor saved twice counts once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    return sum(storages.values())


def test_fused_unit_saves_about_half_of_eager():
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="triton").to(DEVICE)
    eager = nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
    x = torch.randn(8, 16, 32, 32, device=DEVICE, requires_grad=True)
    act = x.numel() * x.element_size()
    fused_b, eager_b = saved_bytes(fused, x), saved_bytes(eager, x)
    # Fused: x + weight + (C,) vectors. Eager: x, the ReLU output (also the conv input), weight, vectors.
    assert act <= fused_b < 1.1 * act
    assert eager_b >= 2 * act
    assert 0.45 < fused_b / eager_b < 0.55, (fused_b, eager_b)


def test_fused_block_saves_less_than_eager():
    torch.manual_seed(0)
    fused = FusedPreActBlock(16, 32, stride=2, backend="triton").to(DEVICE)
    eager = PreActBlock(16, 32, stride=2).to(DEVICE)
    eager.load_state_dict(fused.state_dict())
    x = torch.randn(4, 16, 32, 32, device=DEVICE, requires_grad=True)
    fused_b, eager_b = saved_bytes(fused, x), saved_bytes(eager, x)
    assert fused_b / eager_b < 0.6, (fused_b, eager_b)
