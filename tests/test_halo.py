"""The staged-halo fprop (``kernels_halo``, ``GemmConfig.halo``): its numerics against float64 and eager
PyTorch through the interpreter, its staging bound, and the tile rules that choose it.

GPU tiles (256 and 128 rows) only run on a GPU; here small halo tiles are forced on the plans, with the
launches spied to show the halo kernel ran."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from helpers import assert_close, assert_within_eager, pooled_training_errors
from test_convert import _randomize_bn as _randomize_kinks
from test_modes import _check_backward
from test_modules import _randomize_bn
from test_nan import _assert_same_pattern
from test_op import _run

import fused_preact.ops.bn_relu_conv as op_mod
import fused_preact.ops.triton.configs as configs
import fused_preact.ops.triton.layout as triton_layout
import fused_preact.ops.triton.plan as triton_plans
from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import PreActBlock
from fused_preact.ops.spec import ConvGeom
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.configs import GemmConfig, candidates, fprop_config, halo_config, halo_geometry, halo_rows, p2


class _Spy:
    """Stands in for the halo kernel: counts its launches, then launches."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch_(*args, **kwargs):
            self.seen.append(grid)
            return run(*args, **kwargs)

        return launch_


def _force_halo(monkeypatch, block_m: int) -> list:
    """Every fprop of 16-bit compute over several taps and 16 or 32 input channels (groups 1 in these
    tests) without a projection beside it runs on a ``block_m``-row halo tile; the others keep their
    default tiles."""
    original = triton_layout.fprop_config

    def config(M, Kg, Cg, dtype, stats, arch=0, x32=False, taps=1, proj=False, halo=False):
        if taps > 1 and Cg in (16, 32) and dtype != torch.float32 and not proj:  # (the GPU tiles' staging bound aside)
            return GemmConfig(block_m, p2(Kg, 16, 32), Cg, halo=True)
        return original(M, Kg, Cg, dtype, stats, arch, x32, taps, proj, halo)

    monkeypatch.setattr(triton_layout, "fprop_config", config)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none
    seen: list = []
    monkeypatch.setattr(launch.HK, "_fprop_halo_kernel", _Spy(launch.HK._fprop_halo_kernel, seen))
    return seen


# (N, C, H, W, K, R, stride, padding, dilation, groups), rows per tile, channels_last: a 3×3 with
# padding over 16 channels; stride 2 with 24 output channels (not a multiple of the tile's 32);
# dilation 2 with padding 2 over a non-square image and a K of 8; 32 channels on 30-pixel images,
# 64-row tiles that span three images; no padding, in NCHW; stride 3.
SHAPES = [
    ((2, 16, 7, 7, 16, 3, 1, 1, 1, 1), 16, True),
    ((2, 16, 9, 9, 24, 3, 2, 1, 1, 1), 32, True),
    ((2, 16, 9, 7, 8, 3, 1, 2, 2, 1), 16, True),
    ((3, 32, 5, 6, 16, 3, 1, 1, 1, 1), 64, True),
    ((2, 16, 7, 8, 16, 3, 1, 0, 1, 1), 16, False),
    ((2, 16, 10, 11, 16, 3, 3, 1, 1, 1), 16, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape, block_m, channels_last", SHAPES,
                         ids=["3x3", "strided", "dilated", "c32-images", "unpadded-nchw", "stride3"])
def test_halo_fprop_matches_float64(monkeypatch, shape, block_m, channels_last, training, dtype):
    """Forward, every gradient and the running statistics within the dtype's tolerance of float64 (the
    backward runs the usual kernels; the forward's output and saved statistics come from the halo)."""
    seen = _force_halo(monkeypatch, block_m)
    _run(shape, training, channels_last, dtype)
    assert seen, "the halo kernel did not run"


def test_halo_fprop_with_bias_and_a_one_by_three_filter(monkeypatch):
    """A bias without BatchNorm affine (training), then a 1×3 filter in eval mode (one filter row, two
    accumulators): fp16 within its tolerance of float64."""
    seen = _force_halo(monkeypatch, 16)
    _run((2, 16, 5, 8, 16, 3, 1, 1, 1, 1), True, True, torch.float16, affine=False, bias=True)
    assert seen
    seen.clear()
    from fused_preact.ops import bn_relu_conv2d, bn_relu_conv2d_reference

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 5, 8, dtype=torch.float64, generator=gen).to(torch.float16)
    w = (torch.randn(16, 16, 1, 3, dtype=torch.float64, generator=gen) / 7).to(torch.float16)
    mean = torch.randn(16, dtype=torch.float64, generator=gen) * 0.3
    var = torch.rand(16, dtype=torch.float64, generator=gen) + 0.5
    ref = bn_relu_conv2d_reference(x.double(), w.double(), None, mean.clone(), var.clone(), None, None, False, 0.1,
                                   1e-5, stride=1, padding=(0, 1), dilation=1, groups=1)
    y = bn_relu_conv2d(x.to(DEVICE).contiguous(memory_format=torch.channels_last), w.to(DEVICE), None,
                       mean.float().to(DEVICE), var.float().to(DEVICE), None, None, False, 0.1, 1e-5, stride=1,
                       padding=(0, 1), dilation=1, groups=1, backend="triton")
    assert seen
    assert_close(y, ref, torch.float16, "1×3 forward")


def test_block_through_the_halo_is_within_eager(monkeypatch):
    """A basic block over 16 channels in fp16 (channels_last, training), both 3×3 convs through the halo:
    conv1's epilogue writes the statistics of bn2, conv2's adds the identity shortcut. As close to
    float64 as eager PyTorch in fp16 (the eager-relative rule, errors pooled over two draws)."""
    seen = _force_halo(monkeypatch, 32)
    torch.manual_seed(1)
    model = PreActBlock(16, 16)
    _randomize_kinks(model, kink=3.0)  # ReLU kinks 3σ out: few 16-bit rounding flips (test_convert)
    fused = FusedPreActBlock(16, 16, backend="triton")
    fused.load_state_dict(model.state_dict())
    low = copy.deepcopy(model).to(DEVICE, torch.float16).to(memory_format=torch.channels_last)
    builds = {"float64": model.to(DEVICE, torch.float64), "eager": low,
              "fused": fused.to(DEVICE, torch.float16).to(memory_format=torch.channels_last)}
    pools = pooled_training_errors(builds, (3, 16, 7, 6), (3, 16, 7, 6), torch.float16)
    assert_within_eager(pools["fused"], pools["eager"], torch.float16, "halo block")
    assert len(seen) == 4  # two 3×3 convs per forward, two draws


def positive_blocks() -> tuple:
    """A fused 16→16 block whose BatchNorm buffers and parameters are positive (seeded), and its
    float64 eager twin: where a non-finite input reaches is then eager's pattern, not cancellation's."""
    torch.manual_seed(0)
    fused = FusedPreActBlock(16, 16, backend="triton")
    for b in fused.buffers():
        if b.is_floating_point():
            b.uniform_(0.5, 1.5)
    for p in fused.parameters():
        p.data.normal_(0.5, 0.5)
    eager = PreActBlock(16, 16).double()
    eager.load_state_dict(fused.state_dict())
    return fused, eager


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_halo_nonfinite_pattern_matches_eager(monkeypatch, value, train):
    """A NaN or ±inf input element: the halo's output has eager's (float64) NaN/±inf pattern — a
    non-finite pre-activation reaches exactly the outputs whose taps read it, padded taps stay 0."""
    seen = _force_halo(monkeypatch, 16)
    fused, eager = positive_blocks()
    fused = fused.to(DEVICE, torch.float16).to(memory_format=torch.channels_last).train(train)
    eager.train(train)
    x = torch.randn(2, 16, 6, 6)
    x[0, 3, 0, 2] = value  # on the image's edge: its taps border the padding
    y = fused(x.to(DEVICE, torch.float16).contiguous(memory_format=torch.channels_last))
    ye = eager(x.double())
    _assert_same_pattern(y, ye, "output")
    assert seen
    if train or value != float("-inf"):
        assert not torch.isfinite(ye).all()  # the patterns compared are not all-finite: the test can fail


def autocast_block(dtype: torch.dtype, shape: tuple) -> None:
    """Mixed precision (fp32 parameters and input of ``shape``, autocast to ``dtype``) through a 16→16
    FusedPreActBlock: output (fp32: conv2's plus the fp32 input) and every gradient within the 16-bit
    tolerance of float64 (the halo kernels' tests)."""
    torch.manual_seed(3)  # (seed 2 puts ReLU kinks where fp16 rounding flips them: conv1's dW 1.4e-2 off, the
    # implicit GEMM's tiles alike)
    fused = FusedPreActBlock(16, 16, backend="triton")
    _randomize_bn(fused)
    eager64 = PreActBlock(16, 16)
    eager64.load_state_dict(fused.state_dict())
    eager64 = eager64.double()
    fused = fused.to(DEVICE)
    x = torch.randn(*shape) * 2 + 0.5
    xf = x.to(DEVICE, copy=True).requires_grad_()
    x64 = x.double().requires_grad_()
    with torch.autocast(DEVICE, dtype=dtype):
        y = fused(xf)
    assert fused.last_backend == "triton" and y.dtype == torch.float32  # conv2's output + the fp32 input
    y64 = eager64(x64)
    dy = torch.randn(y64.shape, dtype=torch.float64)
    y.backward(dy.to(DEVICE, y.dtype))
    y64.backward(dy)
    assert_close(y, y64, dtype, "forward")
    assert_close(xf.grad, x64.grad, dtype, "grad x")
    for (name, p), (_, p64) in zip(fused.named_parameters(), eager64.named_parameters()):
        assert_close(p.grad, p64.grad, dtype, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_block_through_the_halo(monkeypatch, dtype):
    """Mixed precision (:func:`autocast_block`): conv1 stages the fp32 input through the fp32
    transform, rounded once to the operand dtype; conv2 stages its 16-bit input and adds the fp32
    residual."""
    seen = _force_halo(monkeypatch, 32)
    autocast_block(dtype, (2, 16, 6, 7))
    assert len(seen) == 2


def fp16_vectors_out_of_range(x_dtype: torch.dtype, shape: tuple) -> None:
    """A 3×3 16→16 FusedBNReLUConv2d in fp16 whose BatchNorm vectors leave fp16's range: an fp32 input
    (``x_dtype``) under autocast with a scale γ/σ beyond 65504 (the vectors scaled down by 2^e, e > 0),
    or an fp16 input of spread 1e3 whose scale is below 1/4 (scaled up, e < 0), of ``shape``; forward
    and backward within fp16's tolerance of float64 (the halo kernels' tests)."""
    torch.manual_seed(4)
    fused = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="triton")
    _randomize_bn(fused)
    big = x_dtype == torch.float32
    with torch.no_grad():
        fused.bn.weight.mul_(300.0 if big else 1.0)
    eager64 = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
    x = torch.randn(*shape) * (1e-3 if big else 1e3) + 0.5
    if big:
        xf = x.to(DEVICE, copy=True).requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.float16):
            y = fused.to(DEVICE)(xf)
        s = (fused.bn.weight.detach().cpu().double() / x.double().var((0, 2, 3), unbiased=False).add(1e-5).sqrt())
        assert s.abs().max() > torch.finfo(torch.float16).max  # the regime: e > 0
    else:
        fused = fused.to(DEVICE, torch.float16)
        xf = x.to(DEVICE, torch.float16).contiguous(memory_format=torch.channels_last).requires_grad_()
        x = xf.detach().cpu().double()
        y = fused(xf)
    x64 = x.double().requires_grad_()
    _check_backward(y, eager64(x64), xf, x64, fused, eager64, torch.float16)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32-autocast", "fp16"])
def test_halo_scales_fp16_vectors_out_of_range(monkeypatch, x_dtype):
    """fp16 operands whose BatchNorm vectors leave fp16's range (:func:`fp16_vectors_out_of_range`):
    the staged vectors scaled by 2^−e, the accumulator scaled back."""
    seen = _force_halo(monkeypatch, 16)
    fp16_vectors_out_of_range(x_dtype, (2, 16, 6, 5))
    assert seen


def test_halo_rows_bound_every_tile():
    """:func:`halo_rows` bounds, for every tile of random geometries (strides, dilations, paddings,
    tiles spanning rows and images), the staged span its rows' taps read — and equals it on some."""
    rng = random.Random(0)
    tight = 0
    for _ in range(300):
        R, S = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3])
        sh, sw, ph, pw = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([0, 1, 2]), rng.choice([0, 1, 2])
        dh, dw = rng.choice([1, 2]), rng.choice([1, 2])
        N, H, W, bm = rng.randint(1, 3), rng.randint(1, 11), rng.randint(1, 11), rng.choice([16, 32, 64])
        P, Q = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
        if P < 1 or Q < 1:
            continue
        g = ConvGeom(4, 4, (R, S), (sh, sw), (ph, pw), (dh, dw))
        Hp, Wp = H + 2 * ph, W + 2 * pw

        def idx(m):
            n, r = divmod(m, P * Q)
            return (n * Hp + r // Q * sh) * Wp + r % Q * sw

        bound = halo_rows((N, 4, H, W), (N, 4, P, Q), g, bm)
        M = N * P * Q
        worst = max(idx(min(m0 + bm, M) - 1) - idx(m0) + (R - 1) * dh * Wp + (S - 1) * dw + 1 for m0 in range(0, M, bm))
        assert worst <= bound, (N, H, W, R, S, sh, sw, ph, pw, dh, dw, bm, worst, bound)
        tight += worst == bound
    assert tight > 10


def test_halo_rules(monkeypatch):
    """The default tiles take the halo on sm_80 and later for 16-bit 3×3s over 16 or 32 channels, and
    nowhere else; the candidates add it where it applies."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's rules
    big = 128 * 32 * 32
    for arch in (80, 90):
        for dtype in (torch.float16, torch.bfloat16):
            cfg = fprop_config(big, 16, 16, dtype, True, arch, taps=9, halo=True)
            assert cfg == halo_config(16, 16, arch) and cfg.halo and cfg.BLOCK_M == 256
            assert fprop_config(big // 4, 32, 32, dtype, True, arch, taps=9, halo=True).BLOCK_M == 128
            assert halo_config(16, 16, arch) in candidates("fprop", big, 16, 16, dtype, arch, taps=9, halo=True)
    assert fprop_config(big, 16, 16, torch.bfloat16, True, 90, x32=True, taps=9, halo=True).halo  # autocast's input
    off = [dict(halo=False), dict(proj=True), dict(taps=1)]
    for kw in off:
        args = dict(arch=90, taps=9, halo=True) | kw
        assert not fprop_config(big, 16, 16, torch.bfloat16, True, **args).halo, kw
        assert not any(c.halo for c in candidates("fprop", big, 16, 16, torch.bfloat16, **args)), kw
    assert not fprop_config(big, 64, 64, torch.bfloat16, True, 90, taps=9, halo=True).halo  # 64 channels
    assert not fprop_config(big, 16, 16, torch.float32, True, 90, taps=9, halo=True).halo
    assert not fprop_config(1024, 16, 16, torch.bfloat16, True, 90, taps=9, halo=True).halo  # < 8 tiles
    assert not fprop_config(big, 16, 16, torch.bfloat16, True, 0, taps=9, halo=True).halo  # not a GPU arch


def test_halo_geometry():
    """The geometries the plan offers the halo: groups 1, ≤ 3 taps per filter row, and a staging buffer
    within :data:`HALO_MAX_STAGED` times the input (PreActResNet-164's 16- and 32-channel 3×3s, stride
    2 included, fit; a 3×3 over 1024-wide rows or dilated by 16 does not)."""
    def fits(C, K, H, W, k=(3, 3), stride=1, dilation=1, groups=1, N=128):
        g = ConvGeom(C, K, k, (stride, stride), (dilation * (k[0] // 2), dilation * (k[1] // 2)), (dilation,) * 2,
                     groups)
        P, Q = g.out_hw(H, W)
        return halo_geometry(g, (N, C, H, W), (N, K, P, Q), 90)

    assert fits(16, 16, 32, 32) and fits(32, 32, 32, 32, stride=2) and fits(32, 32, 16, 16) and fits(16, 32, 32, 32, stride=2)
    assert fits(16, 16, 32, 32, k=(5, 3)) and not fits(16, 16, 32, 32, k=(3, 5)) and not fits(16, 16, 32, 32, k=(1, 8))
    assert not fits(32, 32, 32, 32, groups=2)
    assert not fits(16, 16, 1024, 1024, N=16) and not fits(32, 32, 512, 1024, dilation=16, N=8)


def test_halo_launch_refuses_more_outputs_than_its_tile(monkeypatch):
    """K > BLOCK_N would start several programs per row tile, all writing its staging region."""
    monkeypatch.setattr(triton_layout, "fprop_config", lambda *a, **k: GemmConfig(16, 16, 16, halo=True))
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    with pytest.raises(ValueError, match="staged-halo"):
        _run((2, 16, 5, 5, 32, 3, 1, 1, 1, 1), True, True, torch.float16)


def test_plans_choose_the_halo_for_narrow_convs(monkeypatch):
    """PreActResNet-164's 16-channel bottleneck planned for sm_90 on the meta device: its 3×3 takes the
    halo, its 1×1s do not; a grouped 3×3 does not (``plan.tile_args``' halo)."""
    from fused_preact.ops import BATCH, BNMode
    from fused_preact.ops.spec import ChainSpec

    monkeypatch.setattr(configs, "interpreting", lambda: False)

    def plan(convs):
        spec = ChainSpec(tuple(convs), residual="none")
        x = torch.empty(128, convs[0].in_channels, 32, 32, device="meta", dtype=torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last)
        modes = tuple(BNMode(BATCH, True, True) for _ in convs)
        return triton_plans.TritonPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, torch.bfloat16, False,
                                       True, tune=False, arch=90)

    p = plan([ConvGeom(64, 16, (1, 1)), ConvGeom(16, 16, (3, 3), padding=(1, 1)), ConvGeom(16, 64, (1, 1))])
    assert [u.fcfg.halo for u in p.units] == [False, True, False]
    p = plan([ConvGeom(32, 32, (3, 3), padding=(1, 1), groups=2)])
    assert not p.units[0].fcfg.halo


def test_halo_sync_tile_is_an_sm90_candidate(monkeypatch):
    """On sm_90 the 16 → 16 staged halo's autotune candidates add the 2-warp mma.sync tile
    (``halo_sync_config``) beside the wgmma default, where its 128 rows' staging fits: not over
    160-wide images (where the default's 256 rows fit), not on sm_80, not over 32 channels."""
    from fused_preact.ops import BATCH, BNMode
    from fused_preact.ops.spec import ChainSpec

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    sync = GemmConfig(128, 16, 16, 2, 2, halo=True)

    def fprop_candidates(C, K, hw, arch, N=16):
        g = ConvGeom(C, K, (3, 3), padding=(1, 1))
        x = torch.empty(N, C, hw, hw, device="meta", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        p = triton_plans.TritonPlan(ChainSpec((g,), residual="none"), (BNMode(BATCH, True, True),), x.shape, x.stride(),
                                    x.dtype, x.device, torch.bfloat16, False, True, tune=False, arch=arch)
        assert p.units[0].fcfg == halo_config(K, C, arch)  # the default stays the wgmma (sm_80: 4-warp) tile
        return p.unit_candidates(p.units[0], 0, "fprop")

    assert sync in fprop_candidates(16, 16, 32, 90)
    assert sync not in fprop_candidates(16, 16, 32, 80) and sync not in fprop_candidates(32, 32, 32, 90)
    g = ConvGeom(16, 16, (3, 3), padding=(1, 1))
    wide = ((16, 16, 160, 160), (16, 16, 160, 160))
    assert halo_geometry(g, *wide, 90) and not halo_geometry(g, *wide, 90, rows=128)
    wide_candidates = fprop_candidates(16, 16, 160, 90)
    assert halo_config(16, 16, 90) in wide_candidates and sync not in wide_candidates


def test_halo_launch_refuses_what_it_does_not_take(monkeypatch):
    """An fp32 conv forced onto a halo tile is refused with the reason, not run."""
    monkeypatch.setattr(triton_layout, "fprop_config", lambda *a, **k: GemmConfig(16, 16, 16, halo=True))
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    with pytest.raises(ValueError, match="staged-halo"):
        _run((2, 16, 5, 5, 16, 3, 1, 1, 1, 1), True, True, torch.float32)
