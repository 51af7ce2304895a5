"""MMA utilization and the useful bound of the static report (tools.static_report.utilization)."""

from __future__ import annotations

import pytest
import torch

from tools.static_report.utilization import (
    PEAKS,
    dot_replication,
    memory_ratio,
    mma_utilization,
    roofline_figures,
    useful_bound,
    useful_figures,
)

GEO = dict(GROUPS=1, R=3, S=3, STRIDE_H=1, STRIDE_W=1, PAD_H=1, PAD_W=1, DIL_H=1, DIL_W=1)


@pytest.mark.parametrize("kernel, kw, util", [
    # fprop: output channels over BLOCK_N, input channels over BLOCK_K
    ("fprop", dict(C=16, K=16, BLOCK_M=128, BLOCK_N=16, BLOCK_K=16), 1.0),
    ("fprop", dict(C=16, K=16, BLOCK_M=128, BLOCK_N=64, BLOCK_K=16), 0.25),
    ("fprop", dict(C=48, K=64, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32), 0.75),  # 48 channels in two 32-deep chunks
    ("fprop", dict(C=64, K=64, GROUPS=4, BLOCK_M=64, BLOCK_N=16, BLOCK_K=16), 1.0),
    # dgrad: input channels over BLOCK_N, the reduction step over output channels or a filter row's slots
    ("dgrad", dict(C=64, K=16, BLOCK_M=256, BLOCK_N=64, BLOCK_K=64, SLOTS=4), 0.75),  # 3 taps in 4 slots
    ("dgrad", dict(C=64, K=16, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SLOTS=1), 0.25),
    # stride 2 by phases, pad 1: the phases reach 1 and 2 of the 3 taps (1.5 of 2 slots)
    ("dgrad", dict(C=32, K=32, BLOCK_M=128, BLOCK_N=32, BLOCK_K=64, SLOTS=2, STRIDE_H=2, STRIDE_W=2), 0.75),
    ("dgrad", dict(C=16, K=16, BLOCK_M=128, BLOCK_N=16, BLOCK_K=64, SLOTS=4, R=1, S=1), 0.25),
    # wgrad: input channels over BLOCK_N (the MMA's M), output channels over BLOCK_M
    ("wgrad", dict(C=16, K=64, BLOCK_M=64, BLOCK_N=64, BLOCK_R=256), 0.25),
    ("wgrad_proj", dict(C=64, K=256, BLOCK_M=128, BLOCK_N=64, BLOCK_R=64), 1.0),
    ("wgrad", dict(C=32, K=32, BLOCK_M=32, BLOCK_N=64, BLOCK_R=128), 0.5),
    ("wgrad", dict(C=64, K=64, GROUPS=4, BLOCK_M=16, BLOCK_N=64, BLOCK_R=64), 0.25),
])
def test_mma_utilization(kernel, kw, util):
    assert mma_utilization(kernel, {**GEO, **kw}) == pytest.approx(util)


def test_other_kernels_have_none():
    assert mma_utilization("dx", {**GEO, "C": 16, "K": 16, "BLOCK_M": 64, "BLOCK_C": 64}) is None
    assert mma_utilization("fprop", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}) is None


# TTGIR lines as Triton 3.9 writes them (an mma.sync loop of 16×16 dots in 4 warps, whose several dots
# put every warp along M; a wgmma warpgroup over 64 rows; mma.sync 64×64 in 2×2 warps)
_V2_4x1 = "#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 8]}>"
_V3 = "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>"
_V2_2x2 = "#mma2 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [2, 2], instrShape = [16, 8]}>"
_DOT = ("      %acc_81 = tt.dot %a_69, %b_70, %acc_59, inputPrecision = tf32 : tensor<{m}x16xbf16, #ttg.dot_op<{{opIdx = 0, "
        "parent = {lay}, kWidth = 2}}>> * tensor<16x{n}xbf16, #ttg.dot_op<{{opIdx = 1, parent = {lay}, kWidth = 2}}>> "
        "-> tensor<{m}x{n}xf32, {lay}> loc(#loc33)")
_WGMMA = ("      %acc_63 = ttng.warp_group_dot %a_61, %b_62, %acc_48 {{inputPrecision = 0 : i32, isAsync = true}} : "
          "!ttg.memdesc<{m}x64xbf16, #shared, #smem, mutable> * !ttg.memdesc<64x{n}xbf16, #shared, #smem, mutable> "
          "-> tensor<{m}x{n}xf32, #mma1> loc(#loc33)")


@pytest.mark.parametrize("lines, dots, rep", [
    ([_V2_4x1, _DOT.format(m=16, n=16, lay="#mma"), _DOT.format(m=16, n=16, lay="#mma")],
     [([16, 16], [4, 1], 4.0)], 4.0),  # one distinct dot, each element in 4 warps
    ([_V2_4x1, _DOT.format(m=16, n=64, lay="#mma")], [([16, 64], [4, 1], 4.0)], 4.0),
    ([_V2_2x2, _DOT.format(m=16, n=16, lay="#mma2")], [([16, 16], [2, 2], 2.0)], 2.0),
    ([_V2_2x2, _DOT.format(m=64, n=64, lay="#mma2")], [([64, 64], [2, 2], 1.0)], 1.0),
    ([_V2_2x2, _DOT.format(m=32, n=8, lay="#mma2")], [([32, 8], [2, 2], 2.0)], 2.0),  # two warps on 8 columns
    ([_V3, _WGMMA.format(m=128, n=64)], [([128, 64], [4, 1], 1.0)], 1.0),
    ([_V3.replace("64, 16]", "16, 16]"), _WGMMA.format(m=64, n=16)], [([64, 16], [4, 1], 1.0)], 1.0),
    (["module {}"], [], 1.0),
    # a batched dot: the last two dimensions and warps
    (["#mma3 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4, 1], instrShape = [16, 8]}>",
      _DOT.format(m=16, n=16, lay="#mma3").replace("-> tensor<16x16xf32", "-> tensor<2x16x16xf32")],
     [([16, 16], [4, 1], 4.0)], 4.0),
])
def test_dot_replication(lines, dots, rep):
    got = dot_replication("\n".join(lines))
    assert [(d["shape"], d["warps"], d["replication"]) for d in got["dots"]] == dots
    assert got["replication"] == rep and got["unparsed"] == 0


def test_dot_replication_counts_dots_it_cannot_read():
    inline = _DOT.format(m=16, n=16, lay="#mma9")  # no alias for #mma9
    got = dot_replication("\n".join([_V2_4x1, inline, _DOT.format(m=16, n=16, lay="#mma")]))
    assert got["unparsed"] == 1 and got["replication"] == 4.0


def test_useful_bound():
    assert useful_bound(2.0, 0.25) == 8.0  # issue-bound: instructions over the useful tensor clocks
    assert useful_bound(0.66, 0.25) == 4.0  # tensor-bound on padding
    assert useful_bound(0.5, 1.0) == 1.0
    assert useful_bound(None, 1.0) is None and useful_bound(1.0, None) is None


def _entry(ratio, util, defaults, kernel="wgrad"):
    return {"kind": "triton", "kernel": kernel, "variant": "1x1s1", "dtype": "bf16", "arch": "sm_90",
            "loop": {"issue_ratio": ratio}, "mma_util": util, "default_shapes": defaults}


def test_useful_figures_take_the_worst_default_layer():
    entries = [_entry(0.66, {"a": 0.25, "b": 1.0}, ["a", "b"]),
               _entry(3.0, {"a": 0.5, "e": 1.0}, ["e"]),  # a candidate at layer a: not judged there
               _entry(1.5, {"c": 1.0}, ["c"]),
               _entry(2.0, {"d": 1.0}, ["d"], kernel="fprop")]
    figs = useful_figures(entries)
    assert list(figs) == ["triton wgrad [1x1s1] bf16 sm_90", "triton fprop [1x1s1] bf16 sm_90"]  # worst first
    w = figs["triton wgrad [1x1s1] bf16 sm_90"]
    assert w == {"default": 4.0, "layer": "a", "utilization": 0.25, "issue_ratio": 0.66}
    assert figs["triton fprop [1x1s1] bf16 sm_90"]["default"] == 2.0
    no_roles = dict(entries[0])
    del no_roles["default_shapes"]  # an entry without the field: every layer counts
    assert useful_figures([no_roles])["triton wgrad [1x1s1] bf16 sm_90"]["layer"] == "a"


def test_utilization_reads_the_launchers_keywords():
    """Every convolution launch of a PreActResNet-164 bottleneck with a projection (16 → 64 channels)
    carries the keywords the utilization reads; forced 64-channel wgrad tiles over the units'
    16-channel inputs use a quarter of their MMA work, the 3×3 dgrad's filter rows three of four slots."""
    from fused_preact.bench.shapes import enumerate_blocks
    from fused_preact.ops import BATCH, BNMode
    from fused_preact.ops.triton.configs import GemmConfig
    from tools.static_report.jobs import _chain, _record

    block = next(b for b in enumerate_blocks("preact_resnet164", 2) if b.name.endswith("layer1.0"))
    spec, x_shape = _chain(block)
    modes = tuple(BNMode(BATCH, True, True) for _ in spec.convs)
    wg = [GemmConfig(16 if g.out_channels == 16 else 64, 64, 64) for g in spec.convs]
    _, launches = _record(spec, modes, x_shape, torch.float32, True, overrides={"wgrad": wg})
    utils: dict[str, list[float]] = {}
    for rec in launches:
        u = mma_utilization(rec.name, rec.kwargs)
        if rec.name in ("fprop", "dgrad", "wgrad", "wgrad_proj"):
            assert u is not None and 0 < u <= 1, (rec.name, rec.kwargs)
            utils.setdefault(rec.name, []).append(u)
        else:
            assert u is None
    assert sorted(utils) == ["dgrad", "fprop", "wgrad", "wgrad_proj"]
    assert utils["wgrad"] == [0.25, 0.25, 0.25]
    assert utils["wgrad_proj"] == [1.0]  # its own tile: the interpreter's, fitted to the channels
    assert 0.75 in utils["dgrad"]  # the 3×3's slots


LAYER = dict(H=32, W=32, C=16, P=32, Q=32, K=16, R=3, S=3, GROUPS=1, DOT_DTYPE="bf16")
B16 = {"x_ptr": 2, "y_ptr": 2, "dy_ptr": 2, "out_ptr": 2}


def test_memory_ratio_counts_each_activation_once():
    """PreActResNet-164's 3×3 16→16 at 32² on sm_90: 64 bytes of activations per pixel (x and y in bf16)
    against 2,304 MACs: memory takes 4.1× the tensor time at H100's peaks; dgrad reads x for its mask
    and writes the gradient (96 bytes), wgrad reads x and dy; a residual (fprop's ``xin``, in its own
    dtype; dgrad's gradient ``res``), fp32 inputs and a stride add or remove their bytes (a strided
    1×1 reads only the pixels it samples)."""
    mac16, mac32, bw = PEAKS["sm_90"]
    per_pixel = lambda nbytes, macs, rate=mac16: (nbytes / bw) / (macs / rate)
    assert memory_ratio("fprop", LAYER, B16, "sm_90") == pytest.approx(per_pixel(64, 2304))
    assert memory_ratio("fprop", LAYER, B16, "sm_90") == pytest.approx(4.102, abs=1e-3)
    assert memory_ratio("dgrad", LAYER, B16, "sm_90") == pytest.approx(per_pixel(96, 2304))
    assert memory_ratio("wgrad", LAYER, B16, "sm_90") == pytest.approx(per_pixel(64, 2304))
    res32 = {**B16, "xin_ptr": 4, "res_ptr": 4}
    assert memory_ratio("fprop", {**LAYER, "HAS_RES": True}, res32, "sm_90") == pytest.approx(per_pixel(128, 2304))
    assert memory_ratio("dgrad", {**LAYER, "HAS_RES": True}, res32, "sm_90") == pytest.approx(per_pixel(160, 2304))
    assert memory_ratio("wgrad", LAYER, {**B16, "x_ptr": 4}, "sm_90") == pytest.approx(per_pixel(96, 2304))
    strided = {**LAYER, "P": 16, "Q": 16}  # four input pixels per output pixel, all read by a 3×3
    assert memory_ratio("fprop", strided, B16, "sm_90") == pytest.approx(per_pixel(4 * 32 + 32, 2304))
    one = {**strided, "R": 1, "S": 1, "K": 64}  # a strided 1×1 reads one of them: 32 + 128 bytes, 1,024 MACs
    assert memory_ratio("wgrad_proj", one, B16, "sm_90") == pytest.approx(per_pixel(32 + 128, 1024))
    assert memory_ratio("dgrad", one, B16, "sm_90") == pytest.approx(per_pixel(128 + 32 + 4 * 32, 1024))
    conv3 = {**LAYER, "R": 1, "S": 1, "K": 64, "HAS_RES": True}  # a bottleneck's conv3: the residual is y-sized
    assert memory_ratio("fprop", conv3, res32, "sm_90") == pytest.approx(per_pixel(32 + 128 + 256, 1024))
    grouped = {**LAYER, "C": 64, "K": 64, "GROUPS": 4}  # a quarter of the MACs of the dense 64→64
    assert memory_ratio("fprop", grouped, B16, "sm_90") == pytest.approx(per_pixel(256, 64 * 16 * 9))
    row = {**strided, "R": 1}  # a 1×3 strided filter row still reads every pixel it strides over
    assert memory_ratio("fprop", row, B16, "sm_90") == pytest.approx(per_pixel(4 * 32 + 32, 16 * 16 * 3))
    tf32 = {**LAYER, "DOT_DTYPE": "fp32", "INPUT_PRECISION": "tf32"}
    assert memory_ratio("fprop", tf32, {"x_ptr": 4, "y_ptr": 4}, "sm_90") == pytest.approx(per_pixel(128, 2304, mac32))
    mac16_80, _, bw80 = PEAKS["sm_80"]
    assert memory_ratio("fprop", LAYER, B16, "sm_80") == pytest.approx((64 / bw80) / (2304 / mac16_80))


def test_memory_ratio_is_none_where_not_modelled():
    assert memory_ratio("fprop", {**LAYER, "HAS_PROJ": True}, B16, "sm_90") is None  # a second GEMM
    assert memory_ratio("fprop", {**LAYER, "DOT_DTYPE": "fp32", "INPUT_PRECISION": "ieee"}, B16, "sm_90") is None
    assert memory_ratio("fprop", LAYER, B16, "sm_75") is None
    assert memory_ratio("dx", LAYER, B16, "sm_90") is None
    assert memory_ratio("fprop", {"C": 16, "K": 16}, B16, "sm_90") is None


def test_roofline_figures_take_the_worst_default_layer():
    """excess = max(b, m) / max(1, m): 1 where the memory floor covers the loop's bound, b / m above it,
    b where the launch is tensor-bound (m < 1); candidates' layers are not judged."""
    def entry(ratio, util, mem, defaults, kernel="fprop"):
        return {**_entry(ratio, util, defaults, kernel), "mem_ratio": mem}

    figs = roofline_figures([entry(6.0, {"a": 1.0, "b": 1.0}, {"a": 4.0, "b": 8.0}, ["a", "b"]),
                             entry(9.0, {"c": 1.0}, {"c": 1.0}, []),  # a candidate: not judged
                             entry(2.0, {"d": 0.5}, {"d": 0.5}, ["d"], kernel="wgrad"),
                             entry(0.5, {"e": 1.0}, {"e": 3.0}, ["e"], kernel="dgrad")])
    assert list(figs) == ["triton wgrad [1x1s1] bf16 sm_90", "triton fprop [1x1s1] bf16 sm_90",
                          "triton dgrad [1x1s1] bf16 sm_90"]
    assert figs["triton fprop [1x1s1] bf16 sm_90"] == {"excess": 1.5, "layer": "a", "useful_bound": 6.0,
                                                        "memory_ratio": 4.0}
    assert figs["triton wgrad [1x1s1] bf16 sm_90"]["excess"] == 4.0  # tensor-bound: the useful bound itself
    assert figs["triton dgrad [1x1s1] bf16 sm_90"]["excess"] == 1.0
    assert roofline_figures([_entry(6.0, {"a": 1.0}, ["a"])]) == {}  # no memory ratio: not judged


def test_memory_ratio_reads_the_launchers_keywords():
    """Every convolution launch of PreActResNet-164's first bottleneck (16 → 64 channels, a projection)
    carries what the memory ratio reads; each one it models is memory-bound at H100's peaks."""
    from fused_preact.bench.shapes import enumerate_blocks
    from fused_preact.ops import BATCH, BNMode
    from tools.static_report.compile import element_bytes
    from tools.static_report.jobs import _chain, _record

    block = next(b for b in enumerate_blocks("preact_resnet164", 2) if b.name.endswith("layer1.0"))
    spec, x_shape = _chain(block)
    modes = tuple(BNMode(BATCH, True, True) for _ in spec.convs)
    _, launches = _record(spec, modes, x_shape, torch.float16, True)
    kernels = set()
    for rec in launches:
        m = memory_ratio(rec.name, rec.kwargs, element_bytes(rec.fn, rec.args), "sm_90")
        if rec.name in ("fprop", "dgrad", "wgrad", "wgrad_proj") and not rec.kwargs.get("HAS_PROJ"):
            assert m is not None and m > 1.0, (rec.name, rec.kwargs)
            kernels.add(rec.name)
        else:
            assert m is None, rec.name
    assert kernels == {"fprop", "dgrad", "wgrad", "wgrad_proj"}
