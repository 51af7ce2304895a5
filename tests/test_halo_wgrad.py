"""The staged-halo wgrad (``kernels_halo._wgrad_halo_kernel``, a wgrad ``GemmConfig.halo``): its numerics
against float64 and eager PyTorch through the interpreter, its staging bound, and the rules that choose it.

GPU tiles (128 and 64 rows) only run on a GPU; here small halo tiles are forced on the plans (with a
forced number of programs, so that programs cross images and one has no rows), the launches spied to
show the halo kernel ran."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE
from test_halo import _Spy, autocast_block, fp16_vectors_out_of_range, positive_blocks
from test_modules import _randomize_bn
from test_nan import _assert_same_pattern
from test_op import _run

import fused_preact.ops.bn_relu_conv as op_mod
import fused_preact.ops.triton.configs as configs
import fused_preact.ops.triton.layout as triton_layout
import fused_preact.ops.triton.plan as triton_plans
from fused_preact import FusedBNReLUConv2d
from fused_preact.ops.spec import ConvGeom
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.configs import (
    GemmConfig,
    candidates,
    halo_chunk,
    halo_wgrad_config,
    halo_wgrad_rows,
    halo_wgrad_span,
    halo_wgrad_split,
    p2,
    wgrad_config,
)


def _force_halo_wgrad(monkeypatch, rows: int, programs: int = 0) -> list:
    """Every wgrad of 16-bit compute over several taps, 16 or 32 input and ≤ 32 output channels whose
    image rows fit ``rows`` (:func:`halo_wgrad_rows`' rule for that BLOCK_R) runs on a halo tile of
    ``rows`` output pixels per iteration, in ``programs`` programs (0: the plan's); the others keep
    their default tiles. Returns the halo launches' grids."""
    original = triton_layout.wgrad_config

    def config(Kg, Cg, M, dtype, arch=0, x32=False, strided=False, taps=1, halo=0, proj=False):
        if taps > 1 and Cg in (16, 32) and Kg <= 32 and dtype != torch.float32 and halo:
            return halo_wgrad_config(Kg, Cg, rows)
        return original(Kg, Cg, M, dtype, arch, x32, strided, taps, proj=proj)

    def geometry(g, in_shape, out_shape):
        P, Q = out_shape[2:]
        ok = g.groups == 1 and max(g.kernel) <= 3 and rows % Q == 0 and P % (rows // Q) == 0
        return rows if ok else 0

    monkeypatch.setattr(triton_layout, "wgrad_config", config)
    monkeypatch.setattr(triton_layout, "halo_wgrad_rows", geometry)
    if programs:
        monkeypatch.setattr(triton_layout, "halo_wgrad_programs", lambda rows_total, rpi, device: programs)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none
    seen: list = []
    monkeypatch.setattr(launch.HK, "_wgrad_halo_kernel", _Spy(launch.HK._wgrad_halo_kernel, seen))
    return seen


# (N, C, H, W, K, R, stride, padding, dilation, groups), rows per iteration, programs, channels_last:
# a 3×3 over 16 channels in 5 programs of 6 image rows (two cross an image, the last has none);
# stride 2 with 24 output channels (not a multiple of the tile's 32), an iteration a whole image;
# dilation 2 with padding 2 and 8 output channels; 32 channels; no padding in NCHW over a 6×10 image
# (4×8 outputs, two image rows per iteration); 32 → 16 channels, stride 2, the plan's programs.
SHAPES = [
    ((3, 16, 8, 8, 16, 3, 1, 1, 1, 1), 16, 5, True),
    ((2, 16, 8, 8, 24, 3, 2, 1, 1, 1), 16, 3, True),
    ((2, 16, 8, 8, 8, 3, 1, 2, 2, 1), 16, 4, True),
    ((3, 32, 4, 4, 32, 3, 1, 1, 1, 1), 16, 2, True),
    ((2, 16, 6, 10, 16, 3, 1, 0, 1, 1), 16, 3, False),
    ((2, 32, 8, 8, 16, 3, 2, 1, 1, 1), 16, 0, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape, rows, programs, channels_last", SHAPES,
                         ids=["3x3-crossing", "strided", "dilated", "c32", "unpadded-nchw", "c32-k16-strided"])
def test_halo_wgrad_matches_float64(monkeypatch, shape, rows, programs, channels_last, dtype):
    """Forward, every gradient (dW from the halo kernel, split over its programs and folded) and the
    running statistics within the dtype's tolerance of float64."""
    seen = _force_halo_wgrad(monkeypatch, rows, programs)
    _run(shape, True, channels_last, dtype)
    assert seen, "the halo wgrad did not run"
    if programs:
        assert seen[0][0] >= programs  # the wgrad programs, then the fold's


def test_halo_wgrad_eval_and_one_program(monkeypatch):
    """Eval mode (running statistics, no fold of the sums), then one program (dW stored directly)."""
    seen = _force_halo_wgrad(monkeypatch, 16, 3)
    _run((2, 16, 8, 8, 16, 3, 1, 1, 1, 1), False, True, torch.float16)
    assert seen
    seen.clear()
    monkeypatch.setattr(triton_layout, "halo_wgrad_programs", lambda rows_total, rpi, device: 1)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    _run((2, 16, 8, 8, 16, 3, 1, 1, 1, 1), True, True, torch.float16)
    assert seen and seen[0][0] >= 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_halo_wgrad_nonfinite_pattern_matches_eager(monkeypatch, value):
    """A NaN or ±inf input element on the image's edge: conv1's dW (through the halo) has eager's
    (float64) NaN/±inf pattern — it reaches exactly the taps that read it, and no tap whose products
    with real output pixels do not."""
    seen = _force_halo_wgrad(monkeypatch, 16, 3)
    fused, eager = positive_blocks()
    fused = fused.to(DEVICE, torch.float16).to(memory_format=torch.channels_last).eval()
    eager.eval()  # running statistics: the non-finite element stays one pixel's
    x = torch.randn(2, 16, 8, 8)
    x[0, 3, 0, 7] = value  # top-right corner: taps of the left column never read it
    y = fused(x.to(DEVICE, torch.float16).contiguous(memory_format=torch.channels_last))
    ye = eager(x.double())
    dy = torch.rand(ye.shape, dtype=torch.float64) + 0.5
    y.backward(dy.to(DEVICE, y.dtype).contiguous(memory_format=torch.channels_last))
    ye.backward(dy)
    for (name, p), (_, pe) in zip(fused.named_parameters(), eager.named_parameters()):
        if name.endswith("conv1.weight"):
            _assert_same_pattern(p.grad, pe.grad, name)
            if value != float("-inf"):  # (relu(−inf·scale + shift) = 0 for a positive scale: all finite)
                assert not torch.isfinite(pe.grad).all() and torch.isfinite(pe.grad).any()  # the test can fail
    assert seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_block_through_the_halo_wgrad(monkeypatch, dtype):
    """Mixed precision (:func:`test_halo.autocast_block`): conv1's wgrad stages the fp32 input through
    the fp32 transform, conv2's its 16-bit input."""
    seen = _force_halo_wgrad(monkeypatch, 16, 3)
    autocast_block(dtype, (2, 16, 8, 8))
    assert len(seen) == 2


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32-autocast", "fp16"])
def test_halo_wgrad_scales_fp16_vectors_out_of_range(monkeypatch, x_dtype):
    """fp16 operands whose BatchNorm vectors leave fp16's range (as the halo fprop's test,
    :func:`test_halo.fp16_vectors_out_of_range`): the staged rows scaled by 2^−e (e > 0 with an fp32
    input, e < 0 with an fp16 one), dW scaled back."""
    seen = _force_halo_wgrad(monkeypatch, 16, 2)
    fp16_vectors_out_of_range(x_dtype, (2, 16, 4, 8))
    assert seen


def test_halo_wgrad_span_bounds_every_program():
    """:func:`halo_wgrad_span` bounds, for every program of random geometries and chunk sizes, the span
    of padded input pixels its rows' taps read — and equals it on some."""
    rng = random.Random(0)
    tight = 0
    for _ in range(300):
        R, S = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        sh, sw, ph, pw = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([0, 1, 2]), rng.choice([0, 1, 2])
        dh, dw = rng.choice([1, 2]), rng.choice([1, 2])
        N, H, W = rng.randint(1, 4), rng.randint(1, 12), rng.randint(1, 12)
        P, Q = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
        if P < 1 or Q < 1:
            continue
        chunk = rng.randint(1, 2 * P + 1)
        g = ConvGeom(4, 4, (R, S), (sh, sw), (ph, pw), (dh, dw))
        Hp, Wp = H + 2 * ph, W + 2 * pw

        def top(rho):  # padded index of image row rho's first pixel's top-left tap
            n, p = divmod(rho, P)
            return (n * Hp + p * sh) * Wp

        bound = halo_wgrad_span((N, 4, H, W), (N, 4, P, Q), g, chunk)
        worst = max(top(min(r0 + chunk, N * P) - 1) - top(r0) + (R - 1) * dh * Wp + (Q - 1) * sw + (S - 1) * dw + 1
                    for r0 in range(0, N * P, chunk))
        assert worst <= bound, (N, H, W, R, S, sh, sw, ph, pw, dh, dw, chunk, worst, bound)
        tight += worst == bound
    assert tight > 50


def test_halo_wgrad_staging_within_its_bound():
    """For random geometries :func:`halo_wgrad_rows` admits, the staging of every split a GPU (108 or
    132 SMs) or the interpreter picks stays within :data:`HALO_MAX_STAGED` times the input's pixels
    (the rule bounds it for programs starting at any image row)."""
    rng = random.Random(1)
    admitted = 0
    for _ in range(3000):
        R, S = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        sh, sw, dh, dw = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2, 4, 7]), rng.choice([1, 2, 8])
        ph, pw = rng.choice([0, 1, 2, 3]), rng.choice([0, 1, 2, 4])
        N, C, H, W = rng.choice([1, 3, 32]), rng.choice([16, 32]), rng.randint(4, 100), rng.choice([8, 16, 32, 64])
        g = ConvGeom(C, 16, (R, S), (sh, sw), (ph, pw), (dh, dw))
        P, Q = g.out_hw(H, W)
        if P < 1 or Q < 1:
            continue
        rows = halo_wgrad_rows(g, (N, C, H, W), (N, 16, P, Q))
        if not rows:
            continue
        admitted += 1
        for sms in (0, 108, 132):
            split = halo_wgrad_split(N * P, rows // Q, sms)
            chunk = halo_chunk(N * P, rows // Q, split)
            staged = split * halo_wgrad_span((N, C, H, W), (N, 16, P, Q), g, chunk)
            assert staged <= configs.HALO_MAX_STAGED * N * H * W, (N, C, H, W, R, S, sh, sw, ph, pw, dh, dw, sms)
    assert admitted > 100


def test_halo_wgrad_chunks_cover_the_rows():
    """``split`` programs of :func:`halo_chunk` rows cover every image row, each a multiple of RPI."""
    for rows_total, rpi in ((4096, 4), (24, 2), (16, 16), (2048, 4), (30, 3)):
        for split in (1, 2, 3, 5, 64, 264):
            chunk = halo_chunk(rows_total, rpi, split)
            assert chunk % rpi == 0 and chunk * split >= rows_total
    assert halo_wgrad_split(4096, 4, 132) == 256 and halo_wgrad_split(4096, 4, 0) == 3
    assert halo_wgrad_split(8, 4, 132) == 1


def _geom(C, K, H, W, k=3, stride=1, dilation=1, groups=1, N=128):
    g = ConvGeom(C, K, (k, k), (stride, stride), (dilation * (k // 2),) * 2, (dilation,) * 2, groups)
    P, Q = g.out_hw(H, W)
    return g, (N, C, H, W), (N, K, P, Q)


def test_halo_wgrad_rows_rule():
    """The geometries that admit the halo wgrad and the rows an iteration takes: PreActResNet-164's
    16-channel 3×3 (4 rows of 32), its 32-channel ones (4 rows of 16, stride 2 too), 8-pixel images
    (8 rows of 8); not groups, filters over 3 × 3, image widths that are not powers of two, or a
    staging beyond :data:`HALO_MAX_STAGED` times the input."""
    assert halo_wgrad_rows(*_geom(16, 16, 32, 32)) == 128
    assert halo_wgrad_rows(*_geom(32, 32, 16, 16)) == 64 and halo_wgrad_rows(*_geom(32, 32, 32, 32, stride=2)) == 64
    assert halo_wgrad_rows(*_geom(16, 16, 8, 8)) == 64
    assert halo_wgrad_rows(*_geom(16, 16, 56, 56)) == 0 and halo_wgrad_rows(*_geom(16, 16, 32, 32, k=5)) == 0
    assert halo_wgrad_rows(*_geom(32, 32, 16, 16, groups=2)) == 0
    assert halo_wgrad_rows(*_geom(16, 16, 32, 32, dilation=2, N=2)) == 128
    assert halo_wgrad_rows(*_geom(16, 16, 32, 32, dilation=8, N=2)) == 0


def test_halo_wgrad_tile_rules(monkeypatch):
    """The default wgrad tile is the halo on sm_80 and later for 16-bit multi-tap convs over 16 or 32
    input and ≤ 32 output channels whose geometry admits it, and a candidate there; never elsewhere.
    Its warps hold each result element once (mma.sync takes 16 × 8 per warp)."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's rules
    M = 128 * 32 * 32
    for arch in (80, 90):
        for dtype in (torch.float16, torch.bfloat16):
            cfg = wgrad_config(16, 16, M, dtype, arch, taps=9, halo=128)
            assert cfg == GemmConfig(16, 16, 128, 1, 2, halo=True)
            assert cfg in candidates("wgrad", 16, 16, M, dtype, arch, taps=9, halo=128)
            assert wgrad_config(32, 32, M, dtype, arch, taps=9, halo=64) == GemmConfig(32, 32, 64, 2, 2, halo=True)
            assert wgrad_config(32, 16, M, dtype, arch, taps=9, halo=128).num_warps == 2
    for kw in (dict(halo=0), dict(taps=1), dict(arch=0)):
        args = dict(arch=90, taps=9, halo=128) | kw
        assert not wgrad_config(16, 16, M, torch.bfloat16, **args).halo, kw
        assert not any(c.halo for c in candidates("wgrad", 16, 16, M, torch.bfloat16, **args)), kw
    assert not wgrad_config(64, 16, M, torch.bfloat16, 90, taps=9, halo=128).halo  # 64 output channels
    assert not wgrad_config(16, 64, M, torch.bfloat16, 90, taps=9, halo=128).halo  # 64 input channels
    assert not wgrad_config(16, 16, M, torch.float32, 90, taps=9, halo=128).halo
    for k, c in ((16, 16), (32, 16), (16, 32), (32, 32)):
        cfg = halo_wgrad_config(k, c, 64)
        assert cfg.num_warps * 16 <= max(p2(k, 16, 32), c)  # warps along the larger side, 16 rows or 8+ columns


def test_plans_choose_the_halo_wgrad(monkeypatch):
    """PreActResNet-164's 16-channel bottleneck planned for sm_90 on the meta device: its 3×3's wgrad takes
    the halo (3 programs off a GPU), its 1×1s do not."""
    from fused_preact.ops import BATCH, BNMode
    from fused_preact.ops.spec import ChainSpec

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    convs = [ConvGeom(64, 16, (1, 1)), ConvGeom(16, 16, (3, 3), padding=(1, 1)), ConvGeom(16, 64, (1, 1))]
    x = torch.empty(128, 64, 32, 32, device="meta", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    p = triton_plans.TritonPlan(ChainSpec(tuple(convs), residual="none"), tuple(BNMode(BATCH, True, True) for _ in convs),
                                x.shape, x.stride(), x.dtype, x.device, torch.bfloat16, False, True, tune=False, arch=90)
    assert [u.wcfg.halo for u in p.units] == [False, True, False]
    assert p.units[1].split == 3


def test_halo_wgrad_launch_refuses_what_it_does_not_take(monkeypatch):
    """A conv the kernel cannot take, forced onto a halo wgrad tile, is refused with the reason: fp32
    compute; an image width the tile's rows do not hold whole."""
    monkeypatch.setattr(triton_layout, "wgrad_config", lambda *a, **k: GemmConfig(16, 16, 16, 1, 2, halo=True))
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    with pytest.raises(ValueError, match="staged-halo"):
        _run((2, 16, 4, 4, 16, 3, 1, 1, 1, 1), True, True, torch.float32)
    with pytest.raises(ValueError, match="staged-halo"):
        _run((2, 16, 6, 6, 16, 3, 1, 1, 1, 1), True, True, torch.float16)
    with pytest.raises(ValueError, match="staged-halo"):  # an image row wider than the tile's 16 pixels
        _run((2, 16, 4, 32, 16, 3, 1, 1, 1, 1), True, True, torch.float16)


def test_halo_wgrad_multiplies_the_padding_zeros(monkeypatch):
    """A NaN output gradient at a corner pixel: the halo wgrad multiplies the padding's staged zeros (as
    eager's CPU im2col does), so every tap of that output channel is NaN — the implicit GEMM's wgrad
    leaves the taps that read the padding finite there (docs/semantics.md). Other channels stay finite."""
    seen = _force_halo_wgrad(monkeypatch, 16, 2)
    torch.manual_seed(5)
    fused = FusedBNReLUConv2d(16, 16, 3, padding=1, backend="triton")
    _randomize_bn(fused)
    fused = fused.to(DEVICE, torch.float16).eval()
    x = (torch.randn(2, 16, 4, 8) + 0.5).to(DEVICE, torch.float16).contiguous(memory_format=torch.channels_last)
    y = fused(x)
    dy = torch.rand(y.shape) + 0.5
    dy[0, 2, 0, 0] = float("nan")
    y.backward(dy.to(DEVICE, y.dtype).contiguous(memory_format=torch.channels_last))
    g = fused.conv.weight.grad.float()
    assert torch.isnan(g[2]).all() and torch.isfinite(torch.cat([g[:2], g[3:]])).all()
    assert seen
