"""The fprop and wgrad kernels' 16-bit transform: ``relu((x − m̃)·s̃ + b̃)`` in the input's dtype (packed PTX on a
GPU, its float64 form under Triton's interpreter; see ``fused_preact/ops/triton/prologue16.py``).

1. The interpreter form computes its definition exactly (two roundings to fp16), NaN/Inf included,
   and zeroes the rows its mask drops (padded taps: 0, not ``relu(shift)``).
2. A fused unit and a projection block in fp16 stay within the eager-relative rule
   (``helpers.assert_within_eager``) against float64 — output, input gradient and every parameter
   gradient (the wgrad kernel uses the same transform) — on ordinary data, on an adversarial input
   whose mean is large against its spread (where rounding scale and shift to fp16 without centring
   would not: checked, so the input is adversarial), where scale = γ/σ exceeds fp16's range, and where
   shift does too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE, HAS_CUDA
from helpers import EAGER_FLOOR, EAGER_RATIO, ErrorPool, assert_close, assert_within_eager

from fused_preact import FusedBNReLUConv2d, FusedPreActBottleneck
from fused_preact.models import PreActBottleneck
from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.prologue16 import _preact16


# ------------------------------------------------------------------------------ the definition
def _definition(x, nm, s, b, keep):
    """float64 reference of the transform: fp16(relu(fp16(x/2 + nm)·s + b)), 0 in dropped rows."""
    d = (x.double() * 0.5 + nm.double()).half().double()
    z = d * s.double() + b.double()
    a = torch.where(z < 0, torch.zeros_like(z), z).half()  # NaN stays NaN
    return torch.where(keep[:, None], a, torch.zeros_like(a))


@triton.jit
def _transform_kernel(x_ptr, v_ptr, k_ptr, out_ptr, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BK)
    xt = tl.load(x_ptr + rows[:, None] * BK + cols[None, :])
    nm = tl.load(v_ptr + cols)
    s = tl.load(v_ptr + BK + cols)
    b = tl.load(v_ptr + 2 * BK + cols)
    keep = tl.load(k_ptr + rows)
    tl.store(out_ptr + rows[:, None] * BK + cols[None, :], _preact16(xt, nm, s, b, keep, True, False))


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter form (a GPU runs the PTX form)")
def test_interpreter_form_is_its_definition():
    g = torch.Generator().manual_seed(0)
    BM, BK = 16, 16
    x = (torch.randn(BM, BK, generator=g, dtype=torch.float64) * 3 + 1).half()
    inf = float("inf")
    x[0, :4] = torch.tensor([float("nan"), inf, -inf, -inf]).half()
    x[1, 0] = float("nan")  # in a dropped row: 0
    vec = torch.randn(3, BK, generator=g, dtype=torch.float64).half()
    vec[1, :4] = torch.tensor([1.0, 1.0, 1.0, -1.0]).half()  # relu(NaN) = NaN, inf, relu(−inf) = 0, +inf
    keep = torch.ones(BM, dtype=torch.bool)
    keep[1] = keep[5] = False
    out = torch.empty_like(x)
    _transform_kernel[(1,)](x, vec.reshape(-1), torch.where(keep, -1, 0).int(), out, BM, BK)
    ref = _definition(x, vec[0], vec[1], vec[2], keep)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    assert out[1].eq(0).all() and out[5].eq(0).all()
    assert out[0, 0].isnan() and out[0, 1] == inf and out[0, 2] == 0 and out[0, 3] == inf


# ------------------------------------------------------------------------------ against float64
#: (input mean, input std, γ scale): ordinary data; a mean 200 standard deviations out; σ = 1e-3 with
#: γ ≈ 300, so scale = γ/σ ≈ 3e5 > 65504 (fp16's largest finite value); and a mean of −4 with
#: scale ≈ 3e5, so shift = β − mean·scale ≈ 1.2e6 lies 2^5 beyond scale: the wgrad kernel's masked
#: (padded) rows transform to about shift·2^−e, finite only if e covers |shift| too.
REGIMES = {"normal": (0.7, 2.0, 1.0), "large_mean": (100.0, 0.5, 1.0), "scale_beyond_fp16": (0.3, 1e-3, 300.0),
           "shift_beyond_fp16": (-4.0, 0.02, 8000.0), "scale_below_fp16": (0.3, 1000.0, 0.003)}
#: β's scale per regime (1 unless given): σ = 1000 with γ ≈ 0.002 makes scale ≈ 2e-6, below fp16's
#: smallest normal number (6.1e-5), with β ≈ ±2.5e-3: fprop scales the vectors up into fp16's range
#: (without it, 3-35× eager's error: found by a hostile test run)
BETA_SCALE = {"scale_below_fp16": 1e-3}

def _set_bn(model: nn.Module, gamma_scale: float, seed: int, beta_scale: float = 1.0) -> None:
    """γ in [0.5, 1] (the first BatchNorm's times ``gamma_scale``), β = ±[2, 3] (the first's times
    ``beta_scale``): ReLU kinks 2+ standard deviations out, so 16-bit rounding rarely flips a ReLU
    decision (see test_convert's ``_randomize_bn``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, m in enumerate(b for b in model.modules() if isinstance(b, nn.BatchNorm2d)):
            sign = torch.randint(0, 2, (m.num_features,), generator=g) * 2 - 1
            m.weight.copy_((torch.rand(m.num_features, generator=g) * 0.5 + 0.5) * (gamma_scale if i == 0 else 1.0))
            m.bias.copy_(sign * (torch.rand(m.num_features, generator=g) + 2.0) * (beta_scale if i == 0 else 1.0))


def _pools(build, regime: str, train: bool, draws: int = 2):
    """Error pools (fused, eager) against float64 of ``build() -> (fused, eager)`` in fp16 on inputs of
    ``regime``; also returns the float64 statistics the first BatchNorm sees (mean, std)."""
    mean, std, gamma_scale = REGIMES[regime]
    torch.manual_seed(0)
    fused, eager = build()
    _set_bn(fused, gamma_scale, 1, BETA_SCALE.get(regime, 1.0))
    eager.load_state_dict(_eager_state(fused, eager))
    if not train:  # running statistics of the regime's data
        with torch.no_grad():
            for m in list(fused.modules()) + list(eager.modules()):
                if isinstance(m, nn.BatchNorm2d):
                    first = m is _first_bn(fused) or m is _first_bn(eager)
                    m.running_mean.fill_(mean if first else 0.0)
                    m.running_var.fill_(std * std if first else 1.0)
    builds = {"float64": copy.deepcopy(eager).double(), "eager": eager.half(), "fused": fused.to(DEVICE).half()}
    pools = {"eager": ErrorPool(), "fused": ErrorPool()}
    for draw in range(draws):
        gen = torch.Generator().manual_seed(10 + draw)
        x = (torch.randn(2, _first_bn(eager).num_features, 10, 10, dtype=torch.float64, generator=gen) * std + mean)
        x = x.half().double()  # every build sees the same fp16 input
        outs, grads = {}, {}
        gout = None
        for name, m in builds.items():
            m = copy.deepcopy(m).train(train)
            dt = torch.float64 if name == "float64" else torch.float16
            dev = DEVICE if name == "fused" else "cpu"
            xi = x.to(dev, dt).contiguous(memory_format=torch.channels_last).requires_grad_()
            out = m(xi)
            if gout is None:  # small enough that the weight gradients stay in fp16's range
                gout = torch.randn(out.shape, dtype=torch.float64, generator=gen) * 1e-2
            out.backward(gout.to(dev, dt).contiguous(memory_format=torch.channels_last))
            outs[name] = out.detach().cpu()
            grads[name] = {"input grad": xi.grad.cpu(), **{_canonical(n): p.grad.cpu() for n, p in m.named_parameters()}}
            for what, t in [("output", outs[name]), *grads[name].items()]:  # NaN passes no rule
                assert torch.isfinite(t).all(), f"{name} {regime}: non-finite {what}"
        for name, pool in pools.items():
            pool.add("output", outs[name], outs["float64"])
            assert grads[name].keys() == grads["float64"].keys(), (sorted(grads[name]), sorted(grads["float64"]))
            for what, t in grads[name].items():
                pool.add(what, t, grads["float64"][what])
    return pools


def _canonical(name: str) -> str:
    """A parameter's name in the eager build's terms (the unit's Sequential numbers its modules)."""
    return name.replace("bn.", "0.").replace("conv.", "2.") if name.startswith(("bn.", "conv.")) else name


def _first_bn(m: nn.Module) -> nn.BatchNorm2d:
    return next(b for b in m.modules() if isinstance(b, nn.BatchNorm2d))


def _eager_state(fused: nn.Module, eager: nn.Module) -> dict:
    state = fused.state_dict()
    if isinstance(eager, nn.Sequential):
        state = {k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in state.items()}
    return state


def _unit():
    fused = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="triton")
    return fused, nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv))


def _projection_block():
    return FusedPreActBottleneck(16, 8, stride=2, backend="triton"), PreActBottleneck(16, 8, stride=2)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("build", [_unit, _projection_block], ids=["unit3x3", "bottleneck-projection"])
def test_fp16_transform_within_eager(build, regime, train):
    pools = _pools(build, regime, train)
    assert_within_eager(pools["fused"], pools["eager"], torch.float16, f"{build.__name__} {regime}")


def test_large_mean_input_is_adversarial():
    """Without centring (x·fp16(scale) + fp16(shift), one rounding) the large-mean input breaks the
    eager-relative rule: the regime tests something the ordinary data does not."""
    mean, std, _ = REGIMES["large_mean"]
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4096, dtype=torch.float64, generator=gen) * std + mean).half().double()
    gamma, beta = 0.8, 2.5
    scale = gamma / x.std(unbiased=False)
    shift = beta - x.mean() * scale
    exact = torch.relu(x * scale + shift)
    eager = torch.relu((x.float() * scale.float() + shift.float())).half().double()
    plain = torch.relu(x * scale.half().double() + shift.half().double()).half().double()
    m16 = x.mean().half().double()
    centred = torch.relu(((x - m16).half().double() * scale.half().double()
                          + (shift + m16 * scale).half().double()).half().double())

    def rel(a):
        return ((a - exact).norm() / exact.norm()).item()

    floor = EAGER_FLOOR[torch.float16]
    assert rel(plain) > EAGER_RATIO * rel(eager) + floor
    assert rel(centred) <= EAGER_RATIO * rel(eager) + floor



@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_values_more_than_65504_from_the_mean_stay_finite(train):
    """A channel of mean ≈ −8,500 holding a value of 58,000: ``x − m̃`` is beyond fp16's range, the
    halved difference is not, so output and gradients are finite, as eager's are, and within fp16's
    tolerance of float64."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 8, 1, backend="triton").to(DEVICE).half()
    eager = copy.deepcopy(fused).cpu().double()
    eager.backend = "reference"
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64) * 10
    x[:, 0] -= 9000
    x[0, 0, 0, 0] = 58000
    x = x.half()
    if not train:
        fused.eval(), eager.eval()
        for m in (fused, eager):
            m.bn.running_mean.fill_(-8600.0)
            m.bn.running_var.fill_(1.0e4)
    xf = x.to(DEVICE).requires_grad_()
    xd = x.detach().double().requires_grad_()
    y, ref = fused(xf), eager(xd)
    assert fused.last_backend == "triton"
    assert torch.isfinite(y).all()
    dy = torch.randn_like(ref)
    y.backward(dy.to(DEVICE, torch.float16))
    ref.backward(dy)
    for got, want, what in [(y, ref, "y"), (xf.grad, xd.grad, "dx"), (fused.conv.weight.grad, eager.conv.weight.grad, "dw")]:
        assert torch.isfinite(got).all(), what
        assert_close(got, want, torch.float16, what)
