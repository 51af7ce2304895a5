"""NaN and ±Inf in the input: the fused path returns exactly eager PyTorch's NaN/Inf pattern.

Eager semantics: ``relu(NaN) = NaN``, ``relu(+inf) = inf``, ``relu(-inf) = 0``; ReLU's backward is
``threshold_backward`` (``out <= 0 → 0``), which passes the gradient at a NaN activation; in training a
NaN or Inf makes its channel's batch statistics non-finite. Every kernel that applies the transform
(fprop prologue, wgrad prologue, dgrad mask) is exercised: output, input gradient, weight, γ and β
gradients and the running statistics are compared position by position.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import FUSED_BACKENDS

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import PreActBlock
from fused_preact.ops import bn_relu_conv2d


def _pattern(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = t.detach().cpu()
    return t.isnan(), t == float("inf"), t == float("-inf")


def _assert_same_pattern(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    for kind, a, b in zip(("NaN", "+inf", "-inf"), _pattern(got), _pattern(ref)):
        assert torch.equal(a, b), f"{what}: {kind} at {int(a.sum())} fused vs {int(b.sum())} eager positions"


def _run(fused, eager, x):
    outs = []
    for m in (fused, eager):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(torch.ones_like(y))
        outs.append((y, xi.grad, {n: p.grad for n, p in m.named_parameters()}, dict(m.named_buffers())))
    return outs


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["unit", "block"])
def test_nonfinite_input_pattern_matches_eager(kind, train, value, backend):
    torch.manual_seed(0)
    if kind == "unit":
        fused = FusedBNReLUConv2d(8, 8, 3, padding=1, backend=backend).to(DEVICE)
        eager = torch.nn.Sequential(torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1,
                                                                                           bias=False)).to(DEVICE)
    else:
        fused = FusedPreActBlock(8, 8, backend=backend).to(DEVICE)
        eager = PreActBlock(8, 8).to(DEVICE)
    for b in fused.buffers():
        if b.is_floating_point():
            b.uniform_(0.5, 1.5)  # running_var > 0 and running_mean away from 0 in eval
    for p in fused.parameters():
        p.data.normal_(0.5, 0.5)
    eager.load_state_dict(fused.state_dict() if kind == "block" else
                          {k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in fused.state_dict().items()})
    fused.train(train)
    eager.train(train)
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    x[0, 3, 2, 2] = value
    (yf, dxf, gf, bf), (ye, dxe, ge, be) = _run(fused, eager, x)
    _assert_same_pattern(yf, ye, "output")
    _assert_same_pattern(dxf, dxe, "input gradient")
    for (name, a), b in zip(gf.items(), ge.values()):
        _assert_same_pattern(a, b, f"grad {name}")
    for (name, a), b in zip(bf.items(), be.values()):
        _assert_same_pattern(a, b, f"buffer {name}")
    if train or value != float("-inf"):  # eval: relu(-inf·scale + shift) = 0, the only finite case
        assert not torch.isfinite(ye).all()  # the patterns compared are not all-finite: the test can fail


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_nan_output_gradient_at_padded_taps(request, backend):
    """A NaN in the output gradient at a corner pixel. Eager's weight gradient is NaN at every tap of
    that output channel: its implicit GEMM multiplies the NaN by the zero padding. The Triton wgrad
    kernel masks a padded row out of both operands, so the taps where that pixel reads padding stay
    finite there. A known difference (strict xfail: a fix makes this test fail until the mark goes)."""
    if backend == "triton":
        request.applymarker(pytest.mark.xfail(strict=True, reason="Triton wgrad skips padded rows of dy"))
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 4, device=DEVICE).contiguous(memory_format=torch.channels_last)
    w = torch.randn(3, 2, 3, 3, device=DEVICE)
    gamma, beta = torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE)
    grads = []
    for fused in (True, False):
        wi = w.clone().requires_grad_()
        if fused:
            y = bn_relu_conv2d(x, wi, None, None, None, gamma, beta, True, padding=1, backend=backend)
        else:
            a = torch.relu(torch.nn.functional.batch_norm(x, None, None, gamma, beta, True))
            y = torch.nn.functional.conv2d(a, wi, padding=1)
        dy = torch.zeros_like(y)
        dy[0, 0, 0, 0] = float("nan")
        grads.append(torch.autograd.grad(y, wi, dy)[0])
    assert grads[1][0].isnan().all()  # eager: the whole output channel's weight gradient
    _assert_same_pattern(grads[0], grads[1], "weight gradient")
