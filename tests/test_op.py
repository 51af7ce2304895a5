"""The fused BN→ReLU→Conv op against a float64 PyTorch reference: forward, every gradient, running stats.

Kernels run on CUDA when present, otherwise through Triton's interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import FUSED_BACKENDS, TOL, assert_close

import fused_preact.ops.bn_relu_conv as op_mod
import fused_preact.ops.triton.layout as triton_layout
from fused_preact.ops import bn_relu_conv2d, bn_relu_conv2d_reference
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.configs import GemmConfig

# (N, C, H, W, K, R, stride, padding, dilation, groups): odd channel counts, 1×1 images, all paddings;
# the last two are strided with input sizes exactly twice the output's (the wgrad kernel's pixel-linear
# strided path).
SHAPES = [
    (2, 3, 7, 7, 8, 3, 1, 1, 1, 1),
    (2, 5, 9, 9, 6, 3, 2, 1, 1, 1),
    (3, 24, 7, 9, 16, 1, 1, 0, 1, 1),
    (2, 24, 9, 9, 24, 1, 2, 0, 1, 1),
    (2, 5, 9, 7, 7, 3, 1, 2, 2, 1),
    (2, 5, 7, 7, 3, 3, 2, 2, 1, 1),
    (2, 16, 7, 7, 16, 3, 1, 0, 1, 1),
    (2, 8, 9, 9, 12, 3, 2, 2, 2, 4),
    (4, 3, 1, 1, 5, 3, 1, 1, 1, 1),
    (3, 5, 1, 1, 3, 1, 1, 0, 1, 1),
    (2, 40, 5, 5, 72, 3, 1, 1, 1, 1),
    (2, 6, 8, 8, 10, 3, 2, 1, 1, 1),
    (2, 12, 8, 6, 8, 1, 2, 0, 1, 1),
]


def _ids(shape):
    n, c, h, w, k, r, s, p, d, g = shape
    return f"n{n}c{c}h{h}w{w}k{k}r{r}s{s}p{p}d{d}g{g}"


def _run(shape, training, channels_last, dtype, *, affine=True, bias=False, track=True, momentum=0.1, seed=0,
         backend="triton", dy_channels_last=False):
    """Run fused (in ``dtype``) and float64 reference on the same (rounded) data; compare everything.
    ``dy_channels_last``: the output gradient arrives in channels_last (as from a following fused conv)."""
    N, C, H, W, K, R, stride, pad, dil, groups = shape
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, mean=0.0, std=1.0):
        return torch.randn(*s, dtype=torch.float64, generator=gen) * std + mean

    leaves = {
        "x": rnd(N, C, H, W, mean=0.7, std=2.0).to(dtype).double(),
        "weight": (rnd(K, C // groups, R, R) / (C * R * R / groups) ** 0.5).to(dtype).double(),
        "bias": rnd(K) if bias else None,
        "gamma": rnd(C, mean=1.0, std=0.3) if affine else None,
        "beta": rnd(C, mean=0.5, std=0.5) if affine else None,
    }
    running = (rnd(C, std=0.5), rnd(C).abs() + 0.5) if track else (None, None)
    conv = dict(stride=stride, padding=pad, dilation=dil, groups=groups)

    ref_leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in leaves.items()}
    ref_running = [r.clone() if r is not None else None for r in running]
    y_ref = bn_relu_conv2d_reference(
        ref_leaves["x"], ref_leaves["weight"], ref_leaves["bias"], *ref_running,
        ref_leaves["gamma"], ref_leaves["beta"], training, momentum, 1e-5, **conv,
    )
    dy = rnd(*y_ref.shape)
    grads_ref = torch.autograd.grad(y_ref, [v for v in ref_leaves.values() if v is not None], dy)

    def to_dev(k, v):
        if v is None:
            return None
        t = v.to(DEVICE, torch.float32 if k in ("gamma", "beta", "bias") else dtype)
        if k == "x" and channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.requires_grad_()

    fused_leaves = {k: to_dev(k, v) for k, v in leaves.items()}
    if bias:
        fused_leaves["bias"] = fused_leaves["bias"].detach().to(dtype).requires_grad_()
    fused_running = [r.to(DEVICE, torch.float32).clone() if r is not None else None for r in running]
    y = bn_relu_conv2d(
        fused_leaves["x"], fused_leaves["weight"], fused_leaves["bias"], *fused_running,
        fused_leaves["gamma"], fused_leaves["beta"], training, momentum, 1e-5, **conv, backend=backend,
    )
    assert y.dtype == dtype and y.shape == y_ref.shape
    expect_cl = channels_last and not fused_leaves["x"].is_contiguous()
    assert y.is_contiguous(memory_format=torch.channels_last if expect_cl else torch.contiguous_format)
    dy_dev = dy.to(DEVICE, dtype)
    if dy_channels_last:
        dy_dev = dy_dev.contiguous(memory_format=torch.channels_last)
    grads = torch.autograd.grad(y, [v for v in fused_leaves.values() if v is not None], dy_dev)

    assert_close(y, y_ref, dtype, "forward")
    names = [k for k, v in leaves.items() if v is not None]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.dtype == fused_leaves[name].dtype, name
        assert_close(g, g_ref, dtype, f"grad {name}")
    for name, r, r_ref in zip(("running_mean", "running_var"), fused_running, ref_running):
        if r is not None:
            assert_close(r, r_ref, torch.float32 if dtype == torch.float32 else dtype, name)
            if not training:
                assert torch.equal(r.cpu().double(), r_ref.float().double()), f"{name} changed in eval"


def _fp32_cases():
    """Every shape in NHWC; NCHW (a layout copy around the same kernels) on SHAPES[0] and SHAPES[7] and
    ``slow`` on the others (on a GPU each test is mostly Triton compilation; see pyproject's markers)."""
    for i, shape in enumerate(SHAPES):
        yield pytest.param(shape, True, id=f"{_ids(shape)}-nhwc")
        marks = () if i in (0, 7) else pytest.mark.slow
        yield pytest.param(shape, False, id=f"{_ids(shape)}-nchw", marks=marks)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("shape,channels_last", list(_fp32_cases()))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fp32(shape, training, channels_last, backend):
    _run(shape, training, channels_last, torch.float32, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[7], SHAPES[10], SHAPES[11]], ids=_ids)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_half(dtype, shape, training, backend):
    _run(shape, training, True, dtype, backend=backend)


# Pixel-linear shapes of the wgrad kernel (x and dy both channels_last): padding on every side, dilation,
# strided with exact halving, 1×1 images, groups, and row counts that do and do not fill the row blocks.
_LINEAR_SHAPES = [
    (2, 8, 6, 6, 8, 3, 1, 1, 1, 1),
    (2, 8, 7, 8, 12, 3, 1, 1, 1, 4),
    (2, 5, 9, 7, 7, 3, 1, 2, 2, 1),
    (2, 6, 8, 8, 10, 3, 2, 1, 1, 1),
    (2, 12, 8, 6, 8, 1, 2, 0, 1, 1),
    (2, 8, 8, 8, 8, 1, 1, 0, 1, 1),
    (4, 3, 1, 1, 5, 3, 1, 1, 1, 1),
]


@pytest.mark.parametrize("shape", _LINEAR_SHAPES, ids=_ids)
def test_channels_last_output_gradient(shape):
    _run(shape, True, True, torch.float32, dy_channels_last=True)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_eval_batch_one(backend):
    _run((1, 5, 7, 9, 6, 3, 1, 1, 1, 1), False, False, torch.float32, backend=backend)
    _run((1, 24, 1, 1, 8, 1, 1, 0, 1, 1), False, True, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_affine_false_with_bias(training, backend):
    _run(SHAPES[1], training, False, torch.float32, affine=False, bias=True, backend=backend)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_no_running_stats(backend):
    _run(SHAPES[0], True, True, torch.float32, track=False, backend=backend)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_momentum_one_and_zero(backend):
    _run(SHAPES[4], True, False, torch.float32, momentum=1.0, backend=backend)
    _run(SHAPES[4], True, False, torch.float32, momentum=0.0, backend=backend)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[10], SHAPES[2], SHAPES[9]], ids=_ids)
def test_fprop_unrolled_loop(monkeypatch, shape):
    """fprop with its main loop unrolled twice into two accumulators (GPU tiles of
    :func:`fprop_unroll`) on small tiles: 9 taps × 1 chunk and 9 taps × 3 chunks (odd trip counts: the
    step after the loop), 1 tap × 2 chunks (one iteration: both accumulators, the loop folded away:
    ``STEPS`` 2), 1 × 1 (one step). Even trip counts of the loop itself: test_modes'
    test_autocast_unrolled_loops (36 steps)."""
    monkeypatch.setattr(triton_layout, "fprop_config", lambda *args, **kwargs: GemmConfig(16, 16, 16, unroll=2))
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    _run(shape, True, True, torch.float16)


def _force_wgrad(monkeypatch, cfg: GemmConfig, split: int) -> None:
    """Every wgrad launch takes the tile ``cfg`` and the K-split ``split`` (the cached plans dropped)."""
    monkeypatch.setattr(triton_layout, "wgrad_config", lambda *args, **kwargs: cfg)
    monkeypatch.setattr(triton_layout, "wgrad_split", lambda m_total, tiles, block_k, device: split)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_wide_wgrad_tiles_with_split_k(monkeypatch, dtype):
    """sm_90's wgrad tiles of 64 output channels (256 rows, 2 stages) with split-K partials (tap-major)
    run through the interpreter: 64 → 64 channels 3×3 over 2·20·20 = 800 rows in 3 splits, i.e. 267-row
    chunks of one full and one partial row block each."""
    _force_wgrad(monkeypatch, GemmConfig(64, 64, 256, 4, 2), 3)
    _run((2, 64, 20, 20, 64, 3, 1, 1, 1, 1), True, True, dtype)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], (2, 16, 4, 12, 16, 1, 1, 0, 1, 1),
                                   (2, 16, 8, 8, 16, 1, 1, 0, 1, 1)], ids=_ids)
def test_wgrad_unrolled_loop(monkeypatch, shape, split):
    """wgrad's loop unrolled into two accumulators (GPU tiles of :func:`wgrad_unroll`): two row blocks
    per iteration, alone and in split-K chunks — a padded 3×3, a strided 1×1 and a 1×1 over 96 rows
    (whole row blocks) whose last iteration's second block runs past the rows (masked), and a 1×1
    over 128 rows (whole iterations, no row mask)."""
    _force_wgrad(monkeypatch, GemmConfig(16, 16, 32, unroll=2), split)
    _run(shape, True, True, torch.float16)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("shape, cfg", [
    ((2, 16, 5, 7, 16, 3, 1, 1, 1, 1), GemmConfig(16, 16, 32)),
    ((2, 16, 5, 7, 16, 3, 1, 1, 1, 1), GemmConfig(16, 16, 32, unroll=2)),
    ((3, 16, 5, 7, 16, 1, 2, 0, 1, 1), GemmConfig(16, 16, 32)),
    ((2, 16, 6, 6, 32, 3, 2, 1, 1, 1), GemmConfig(32, 16, 16)),
    ((2, 16, 7, 7, 16, 3, 2, 1, 1, 1), GemmConfig(16, 16, 16)),
], ids=lambda v: _ids(v) if isinstance(v, tuple) else v.label())
def test_wgrad_row_tails(monkeypatch, shape, cfg, split):
    """wgrad over rows that do and do not fill its steps (EVEN_M: no row mask but the padding's): 70
    rows in steps of 32 (two full, 6 rows left) and of 2·32 (one full), a strided 1×1 over an odd image
    (not pixel-linear: divisions) of 36 rows, a padded strided 3×3 of 18 rows in steps of 16, and a
    padded strided 3×3 over an odd image (divisions) of 32 rows in steps of 16 (every step full);
    alone and in split-K chunks."""
    _force_wgrad(monkeypatch, cfg, split)
    _run(shape, True, True, torch.float16, dy_channels_last=True)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("shape, cfg", [
    ((2, 16, 9, 7, 16, 3, 1, 1, 1, 1), GemmConfig(16, 16, 128, 1, 2, unroll=2)),
    ((2, 32, 9, 9, 32, 3, 2, 1, 1, 1), GemmConfig(32, 32, 128, 2, 2, unroll=2)),
    ((2, 16, 12, 12, 64, 1, 1, 0, 1, 1), GemmConfig(64, 16, 256, 1, 3)),
    ((2, 32, 8, 12, 72, 1, 1, 0, 1, 1), GemmConfig(128, 32, 128, 2, 3)),
    ((2, 48, 7, 7, 96, 3, 1, 1, 1, 3), GemmConfig(32, 16, 64, 1, 3)),
], ids=lambda v: _ids(v) if isinstance(v, tuple) else v.label())
def test_narrow_wgrad_tiles(monkeypatch, shape, cfg, split):
    """The wgrad tiles fitted to ≤ 32 input channels (``configs._narrow_wgrad_tiles``, sm_80 and
    sm_90): BLOCK_N of 16 or 32 channels in 1 or 2 warps, unrolled with one output-channel piece, or up to four pieces of them (72
    output channels: the last tile partly masked; 3 groups of 16 → 32 channels), alone and in split-K
    chunks."""
    _force_wgrad(monkeypatch, cfg, split)
    _run(shape, True, True, torch.float16)


def _spy_wgrad(monkeypatch, *names: str) -> list:
    """Spy on the implicit-GEMM wgrad kernel's launches: the returned list gets, per launch, the tuple
    of the named arguments it was launched with — a keyword argument's value (constexprs, launch
    options), a positional tensor's dtype."""
    seen: list = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def launch_(*args, **kwargs):
                positional = dict(zip(self.kernel.arg_names, args))
                seen.append(tuple(kwargs[n] if n in kwargs else positional[n].dtype for n in names))
                return run(*args, **kwargs)

            return launch_

    monkeypatch.setattr(launch.WK, "_wgrad_kernel", Spy(launch.WK._wgrad_kernel))
    return seen


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("shape, cfg", [
    ((2, 64, 6, 6, 16, 1, 1, 0, 1, 1), GemmConfig(16, 64, 32, 2, 2, unroll=2)),
    ((2, 96, 5, 7, 16, 1, 1, 0, 1, 1), GemmConfig(16, 32, 32, 1, 2, unroll=2)),
    ((2, 64, 6, 6, 32, 1, 1, 0, 1, 2), GemmConfig(16, 16, 32, 1, 2)),
    ((2, 32, 7, 9, 12, 3, 1, 1, 1, 1), GemmConfig(16, 16, 64, 1, 2, unroll=2)),
    ((2, 16, 12, 12, 16, 1, 1, 0, 1, 1), GemmConfig(16, 16, 512, 1, 2)),
], ids=lambda v: _ids(v) if isinstance(v, tuple) else v.label())
def test_wgrad_of_16_output_channels(monkeypatch, shape, cfg, split):
    """The wgrad tiles of 16 output channels over a stride-1 conv (the 2-warp tile over 64 input
    channels, ``configs._thin_wgrad_tile``; 16-channel tiles of 512 rows), whose launches take x's and
    dy's pixel strides as constexprs and x's channel block into the scalar base pointer: several
    channel blocks (96 input channels in blocks of 32), groups (two of 16 output channels over 32
    input channels, in blocks of 16), a padded 3×3 with 12 output channels (masked), and one iteration
    longer than all the rows (masked), alone and in split-K chunks; the launches did take the
    constexpr strides."""
    _force_wgrad(monkeypatch, cfg, split)
    seen = _spy_wgrad(monkeypatch, "XW", "DW")
    _run(shape, True, True, torch.float16, dy_channels_last=True)
    K = shape[4]
    assert (shape[1], K) in seen, seen  # channels_last x and dy: pixel strides C and K


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("shape, cfg", [
    ((4, 32, 8, 8, 32, 3, 2, 1, 1, 1), GemmConfig(32, 32, 32)),
    ((3, 32, 8, 8, 16, 3, 2, 1, 1, 1), GemmConfig(16, 32, 32, unroll=2)),
    ((3, 16, 4, 4, 24, 3, 1, 1, 1, 1), GemmConfig(32, 16, 16)),
    ((5, 16, 4, 4, 16, 1, 1, 0, 1, 1), GemmConfig(16, 16, 32)),
], ids=lambda v: _ids(v) if isinstance(v, tuple) else v.label())
def test_wgrad_row_blocks_of_whole_images(monkeypatch, shape, cfg, split):
    """wgrad row blocks that hold whole output images (BLOCK_R a multiple of P·Q, pixel-linear tensors):
    the padding tests and a strided conv's step back to the row's start are computed once per lane,
    outside the loop. Several row blocks per program (two 4×4 images per block of 32 rows, one 16-row
    image per block), the last one partly past the rows (3 or 5 images), unrolled, a masked
    output-channel tile, alone and in split-K chunks; the launches did take that path."""
    _force_wgrad(monkeypatch, cfg, split)
    seen = _spy_wgrad(monkeypatch, "WHOLE")
    _run(shape, True, True, torch.float16, dy_channels_last=True)
    assert seen and all(w for (w,) in seen), seen


@pytest.mark.parametrize("split", [2, 3])
def test_wgrad_split_k(monkeypatch, split):
    """The deterministic split-K path of the wgrad kernel (used on GPUs for long reductions)."""
    monkeypatch.setattr(triton_layout, "wgrad_split", lambda m_total, tiles, block_k, device: split)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none
    _run(SHAPES[0], True, True, torch.float32)
    _run(SHAPES[7], True, False, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[7], SHAPES[10]], ids=_ids)
def test_small_tiles(monkeypatch, shape, dtype):
    """Tiles far smaller than the problem in every kernel: reductions over several channel chunks with
    a partial last one (fprop over taps × chunks, dgrad over taps × output-channel chunks), several
    row and channel tiles, wgrad over several row blocks. The interpreter's default tiles cover a whole
    problem, so this is the only CPU run of the kernels' chunk loops."""
    small = GemmConfig(16, 16, 16) if DEVICE == "cpu" else GemmConfig(64, 64, 32)
    for name in ("fprop_config", "dgrad_config", "wgrad_config"):
        monkeypatch.setattr(triton_layout, name, lambda *args, **kwargs: small)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none
    _run(shape, True, True, dtype)


def test_wrong_results_are_caught():
    """The comparison can fail: a perturbed gradient exceeds the fp32 tolerance."""
    ref = torch.randn(64, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close(ref * (1 + 10 * TOL[torch.float32]), ref, torch.float32)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_deterministic(backend):
    """Two runs of forward+backward are bitwise identical (no atomics in any reduction; cuDNN's
    convolutions of the recompute backend are deterministic on the CPU and under
    ``torch.backends.cudnn.deterministic``)."""
    def once():
        torch.manual_seed(3)
        x = torch.randn(2, 8, 9, 9, device=DEVICE).requires_grad_()
        w = torch.randn(8, 8, 3, 3, device=DEVICE).requires_grad_()
        g = torch.rand(8, device=DEVICE).add(0.5).requires_grad_()
        b = torch.randn(8, device=DEVICE).requires_grad_()
        y = bn_relu_conv2d(x, w, None, None, None, g, b, True, padding=1, backend=backend)
        return (y, *torch.autograd.grad(y.square().sum(), (x, w, g, b)))

    old = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        for a, b in zip(once(), once()):
            assert torch.equal(a, b)
    finally:
        torch.backends.cudnn.deterministic = old


@pytest.mark.gpu
def test_offsets_beyond_int32():
    """x with more than 2^31 elements in two images: the image offsets are int64 (one image of 2^31
    elements is refused: tests/test_index_range.py)."""
    N, C, H, W = 2, 8, 8192, 16400
    assert N * C * H * W > 2**31
    x = torch.randn(N, H, W, C, device="cuda", dtype=torch.bfloat16).permute(0, 3, 1, 2)  # channels_last
    w = torch.randn(16, C, 1, 1, device="cuda", dtype=torch.bfloat16)
    gamma = torch.rand(C, device="cuda") + 0.5
    beta = torch.randn(C, device="cuda")
    y = bn_relu_conv2d(x, w, None, None, None, gamma, beta, True, backend="triton")
    full_var, full_mean = torch.var_mean(x.float(), dim=(0, 2, 3), correction=0)
    a = torch.relu((x[:, :, -8:].float() - full_mean[:, None, None]) * torch.rsqrt(full_var + 1e-5)[:, None, None]
                   * gamma[:, None, None] + beta[:, None, None])
    ref = torch.nn.functional.conv2d(a, w.float())
    assert_close(y[:, :, -8:], ref, torch.bfloat16, "tail of a >2^31-element input")
