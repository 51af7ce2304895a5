"""What a fused unit keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
from fused_preact.models import PreActBlock, PreActBottleneck


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


def _bottlenecks(stride: int):
    torch.manual_seed(0)
    fused = {b: FusedPreActBottleneck(32, 16, stride=stride, backend=b).to(DEVICE) for b in ("triton", "recompute")}
    eager = PreActBottleneck(32, 16, stride=stride).to(DEVICE)
    eager.load_state_dict(fused["triton"].state_dict())
    return fused, eager


@pytest.mark.parametrize("stride", [1, 2], ids=["identity", "projection"])
def test_recompute_bottleneck_saves_like_the_fused_path(stride):
    """The recompute backend keeps what the fused kernels keep — the units' inputs and per-channel
    vectors, never the BN or ReLU outputs: ≤ 1.15× the fused path's saved bytes, ≤ 0.6× eager's."""
    fused, eager = _bottlenecks(stride)
    x = torch.randn(4, 32, 16, 16, device=DEVICE, requires_grad=True)
    got = {b: saved_bytes(m, x) for b, m in fused.items()}
    eager_b = saved_bytes(eager, x)
    assert got["recompute"] <= 1.15 * got["triton"], (got, eager_b)
    assert got["recompute"] <= 0.6 * eager_b, (got, eager_b)


def test_recompute_unit_saves_its_input_only():
    torch.manual_seed(0)
    m = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="recompute").to(DEVICE)
    x = torch.randn(8, 16, 32, 32, device=DEVICE, requires_grad=True)
    act = x.numel() * x.element_size()
    assert act <= saved_bytes(m, x) < 1.1 * act


def _relayout_hooks():
    """Saved-tensors hooks that hand every tensor back NCHW-contiguous, as
    ``save_on_cpu(pin_memory=True)`` does (it packs into ``torch.empty(size)``)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda v: v.detach().contiguous(), lambda v: v)


@pytest.mark.parametrize("kind", ["unit-channels_last", "block-sliced"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_saved_input_handed_back_in_another_layout(kind, train):
    """A saved-tensors hook may return the saved input in another layout (the same values); the
    backward must not read it with the forward's strides (it read garbage: a relative error of 1 to
    inf). Such a backward differentiates the reference ops instead: eager's gradients."""
    torch.manual_seed(0)
    if kind == "unit-channels_last":
        fused = FusedBNReLUConv2d(4, 6, 3, padding=1, backend="triton").to(DEVICE)
        eager = nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
        base = torch.randn(2, 4, 5, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
        make = lambda: base.clone().requires_grad_()  # noqa: E731
    else:
        fused = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
        eager = PreActBlock(4, 8, stride=2).to(DEVICE)
        eager.load_state_dict(fused.state_dict())
        base = torch.randn(2, 4, 7, 9, device=DEVICE)
        make = lambda: base.clone()[:, :, 1:, 1:7].requires_grad_()  # noqa: E731 (a strided view)
    grads = []
    for m in (fused, eager):
        m.train(train)
        x = make()
        with _relayout_hooks():
            y = m(x)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        grads.append([x.grad] + [p.grad.clone() for p in m.parameters()])
        m.zero_grad()
    assert fused.last_backend == "triton"
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
