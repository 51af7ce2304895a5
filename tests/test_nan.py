"""NaN and ±Inf in the input: the fused path returns exactly eager PyTorch's NaN/Inf pattern.

Eager semantics: ``relu(NaN) = NaN``, ``relu(+inf) = inf``, ``relu(-inf) = 0``; ReLU's backward is
``threshold_backward`` (``out <= 0 → 0``), which passes the gradient at a NaN activation; in training a
NaN or Inf makes its channel's batch statistics non-finite. Every kernel that applies the transform
(fprop prologue, wgrad prologue, dgrad mask) is exercised: output, input gradient, weight, γ and β
gradients and the running statistics are compared position by position.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE
from helpers import FUSED_BACKENDS, rel_err

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


def test_eager_nan_pattern_at_padded_taps_depends_on_the_algorithm():
    """Why the next test's reference is not eager PyTorch: a non-finite dy whose tap reads the zero
    padding makes that tap's weight gradient NaN (``0·NaN``) in some of eager's algorithms and not in
    others. On the CPU, the same problem gives NaN at every tap with a batch of 1 (im2col, which
    multiplies the padding's zeros) and only at the taps that read the image with a batch of 2 (oneDNN,
    which skips the padding). If ATen ever makes the two agree, this test fails and the library's rule
    can follow eager again."""
    if DEVICE != "cpu":
        pytest.skip("documents the CPU algorithms")
    torch.manual_seed(0)
    a = torch.relu(torch.randn(2, 2, 4, 4))
    w = torch.randn(3, 2, 3, 3, requires_grad=True)
    nan_taps = []
    for n in (1, 2):
        y = torch.nn.functional.conv2d(a[:n], w, padding=1)
        dy = torch.zeros_like(y)
        dy[0, 0, 0, 0] = float("nan")
        nan_taps.append(int(torch.autograd.grad(y, w, dy)[0][0].isnan().sum()))
    assert nan_taps == [18, 8]  # all 2·3·3 taps of output channel 0; only the 2·2·2 that read the image


def _wgrad_without_padding(a: torch.Tensor, dy: torch.Tensor, w_shape, stride, padding, dilation, groups):
    """``dW[k, c, r, s] = Σ dy[n, k, p, q] · a[n, c, ih, iw]`` over the positions whose tap reads inside
    the image (float64): the padding contributes nothing, not ``0·dy``."""
    N, C = a.shape[:2]
    K, Cg, kh, kw = w_shape
    geo = dict(dilation=dilation, padding=padding, stride=stride)
    cols = torch.nn.functional.unfold(a, (kh, kw), **geo)  # N, C·kh·kw, L
    inside = torch.nn.functional.unfold(torch.ones_like(a[:, :1]), (kh, kw), **geo) > 0.5  # N, kh·kw, L
    L = cols.shape[-1]
    cols = cols.view(N, groups, 1, Cg, kh * kw, L)
    prod = dy.reshape(N, groups, K // groups, 1, 1, L) * cols  # N, G, Kg, Cg, kh·kw, L
    prod = torch.where(inside.view(N, 1, 1, 1, kh * kw, L), prod, torch.zeros((), dtype=prod.dtype))
    return prod.sum((0, -1)).reshape(K, Cg, kh, kw)


#: (C, K, H, W, kernel, stride, padding, dilation, groups) of the output-gradient cases: padded taps
#: of every shape — one or several rows or columns of padding, strided and dilated taps, a kernel larger
#: than the image (some taps read only padding), grouped channels.
_DY_GEOMS = {
    "3x3": (2, 3, 5, 5, 3, 1, 1, 1, 1),
    "3x3-s2": (2, 3, 6, 5, 3, 2, 1, 1, 1),
    "3x3-d2p2": (2, 3, 5, 6, 3, 1, 2, 2, 1),
    "1x3": (2, 3, 4, 5, (1, 3), 1, (0, 1), 1, 1),
    "5x5-on-3x3": (2, 2, 3, 3, 5, 1, 2, 1, 1),
    "3x3-g2": (4, 4, 5, 5, 3, 1, 1, 1, 2),
}


@pytest.mark.parametrize("tiles", ["default", "small-splitK"])
@pytest.mark.parametrize("geom", list(_DY_GEOMS))
def test_nonfinite_output_gradient_pattern(geom, tiles, monkeypatch):
    """NaN and ±inf in the output gradient, at corners, edges and the interior. The weight gradient's
    NaN/±inf pattern is that of padding that contributes nothing (a dy whose tap reads the padding adds
    no term; see the test above for why eager's cannot be the reference), position by position; the
    input, γ and β gradients' patterns are eager's. ``small-splitK``: wgrad tiles of several row blocks
    and output-channel pieces, rows split three ways, so a padded row can fall into any block, piece
    or split. The Triton backend only: the recompute backend's wgrad is ATen's."""
    import fused_preact.ops.bn_relu_conv as op_mod
    import fused_preact.ops.triton.layout as triton_layout
    from fused_preact.ops.triton.configs import GemmConfig

    if tiles != "default":
        small = GemmConfig(64, 16, 16)  # wgrad: 64 output channels in 16-wide pieces, 16-row blocks
        monkeypatch.setattr(triton_layout, "wgrad_config", lambda *args, **kwargs: small)
        monkeypatch.setattr(triton_layout, "wgrad_split", lambda m_total, tiles, block_k, device: 3)
        monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none
    C, K, H, W, ks, stride, padding, dilation, groups = _DY_GEOMS[geom]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, C, H, W, generator=gen, dtype=torch.float64)
    kh, kw = (ks, ks) if isinstance(ks, int) else ks
    w = torch.randn(K, C // groups, kh, kw, generator=gen, dtype=torch.float64)
    gamma = torch.rand(C, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(C, generator=gen, dtype=torch.float64)
    geo = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    dy = torch.randn(torch.nn.functional.conv2d(x, w, **geo).shape, generator=gen, dtype=torch.float64)
    N, _, P, Q = dy.shape
    for j, (n, k, p, q) in enumerate([(0, 0, 0, 0), (1, K - 1, P - 1, Q - 1), (0, 1, 0, Q - 1)]):
        dy[n, k, p, q] = (float("nan"), float("inf"), float("-inf"))[j]
    grads = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, gamma, beta)]
        if fused:
            xf, wf, gf, bf = (t.float().to(DEVICE) for t in leaves)
            y = bn_relu_conv2d(xf.contiguous(memory_format=torch.channels_last), wf, None, None, None, gf, bf,
                               True, **geo, backend="triton")
            grads.append(torch.autograd.grad(y, leaves, dy.float().to(DEVICE)))
        else:
            a = torch.relu(torch.nn.functional.batch_norm(leaves[0], None, None, leaves[2], leaves[3], True))
            y = torch.nn.functional.conv2d(a, leaves[1], **geo)
            grads.append(torch.autograd.grad(y, leaves, dy))
            dw_ref = _wgrad_without_padding(a.detach(), dy, w.shape, stride, padding, dilation, groups)
    assert dw_ref.isnan().any() and torch.isfinite(dw_ref).any()  # a pattern, not all-or-nothing
    for name, got, ref in zip(("input", "weight", "γ", "β"), grads[0], (grads[1][0], dw_ref, *grads[1][2:])):
        _assert_same_pattern(got, ref, f"{name} gradient")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dead", ["one", "all", "one-beside-tiny-scales"])
def test_fp16_channel_with_minus_inf_shift_is_dead(dead, train):
    """fp16 (model.half()): a BatchNorm channel with β = −inf transforms to relu(−inf) = 0 everywhere,
    as eager's: its scale still bounds fp16's exponent, which would otherwise scale its finite scale
    up to inf (inf − inf = NaN) — from 0 (a non-finite shift counted as 0: that channel's weight
    gradient NaN, with every channel dead the whole output), or from the other channels' tiny scales
    (γ/σ ≈ 3e-6, which the forward's one exponent per call brings into fp16's range). Eager fp16's
    NaN/±inf pattern."""
    if dead == "one-beside-tiny-scales" and not train:
        pytest.skip("σ = 1000 overflows an fp16 running_var (eager too)")
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="triton")
    tiny = dead == "one-beside-tiny-scales"
    with torch.no_grad():
        fused.bn.weight.uniform_(0.5, 1.0)
        fused.bn.bias.uniform_(-1.0, 1.0)
        if tiny:
            fused.bn.weight.fill_(0.003)
            fused.bn.bias.zero_()
            fused.bn.weight[3] = 1.0
        fused.bn.bias[3 if dead != "all" else slice(None)] = float("-inf")
    eager = torch.nn.Sequential(torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1, bias=False))
    eager.load_state_dict({k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in fused.state_dict().items()})
    fused, eager = fused.to(DEVICE).half().train(train), eager.to(DEVICE).half().train(train)
    x = torch.randn(2, 16, 6, 6, device=DEVICE)
    if tiny:
        x = x * 1000.0
        x[:, 3] /= 1000.0  # channel 3: σ = 1, scale γ/σ = 1
    x = x.half()
    (yf, dxf, gf, _), (ye, dxe, ge, _) = _run(fused, eager, x)
    assert fused.last_backend == "triton"
    _assert_same_pattern(yf, ye, "output")
    _assert_same_pattern(dxf, dxe, "input gradient")
    for (name, a), b in zip(gf.items(), ge.values()):
        _assert_same_pattern(a, b, f"grad {name}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_gamma_near_float32_max_is_applied_last(train, backend):
    """γ = 3e38 with invstd = 4: ``invstd·γ`` overflows fp32, ``(dz·invstd)·γ`` does not. dx applies γ
    last, as eager's ``batch_norm_backward`` does, so it is finite and eager's."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 4, 1, backend=backend).to(DEVICE)
    with torch.no_grad():
        fused.bn.weight[0] = 3e38
        fused.conv.weight.mul_(1e-3)
        fused.bn.running_var.fill_(1 / 16)
    fused.train(train)
    eager = copy.deepcopy(fused)
    eager.backend = "reference"
    x = torch.randn(2, 4, 3, 3, device=DEVICE) * (0.25 if train else 1.0)
    (_, dx, _, _), (_, dx_eager, _, _) = _run(fused, eager, x)
    assert torch.isfinite(dx_eager).all()
    assert torch.isfinite(dx).all()
    for c in range(4):  # per channel: γ's channel is 1e35 where the others are 1e-4
        assert rel_err(dx[:, c], dx_eager[:, c]) <= 1e-5, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_eval_with_zero_variance_and_zero_eps_is_eager(backend, dtype):
    """Eval, eps = 0, a zero running variance: invstd = inf, and eager's ``(x − mean)·invstd·γ + β`` is
    ±inf or NaN element by element, which ``x·scale + shift`` cannot follow; the call runs plain PyTorch,
    saying why, with eager's NaN/inf pattern. A nonzero variance runs fused."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 4, 1, eps=0.0, backend=backend).to(DEVICE, dtype).eval()
    fused.bn.running_mean.fill_(0.5)
    fused.bn.running_var.fill_(0.25)
    x = torch.randn(2, 4, 3, 3, device=DEVICE, dtype=dtype)
    x[0, :, 0, 0] = 0.5
    fused(x)
    assert fused.last_backend == backend
    fused.bn.running_var[1] = 0.0
    eager = copy.deepcopy(fused)
    eager.backend = "reference"
    (y, dx, grads, _), (y_e, dx_e, grads_e, _) = _run(fused, eager, x)
    assert fused.last_backend == "reference" and "zero running variance" in fused.fallback_reason
    for what, a, b in [("y", y, y_e), ("dx", dx, dx_e), ("dγ", grads["bn.weight"], grads_e["bn.weight"])]:
        _assert_same_pattern(a, b, what)
