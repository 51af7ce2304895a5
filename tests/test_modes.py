"""Numeric modes and edge modes of the fused modules: autocast, TF32 rule, empty batch, determinism,
ResNeXt (grouped) bottlenecks — each against eager PyTorch / a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE, HAS_CUDA
from helpers import FUSED_BACKENDS, TOL, assert_close, rel_err
from test_modules import _compare, _randomize_bn

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
from fused_preact.models import PreActBlock, PreActBottleneck, preact_resnext50_32x4d
from fused_preact.modules import bottleneck_width
from fused_preact.ops._common import input_precision

AUTOCAST_DTYPES = [torch.float16, torch.bfloat16]


def _twins(kind: str, backend: str = "triton"):
    torch.manual_seed(0)
    if kind == "unit":
        fused = FusedBNReLUConv2d(6, 8, 3, stride=2, padding=1, backend=backend)
        eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv))
    else:
        fused = FusedPreActBlock(6, 8, stride=2, backend=backend)
        eager = PreActBlock(6, 8, stride=2)
    _randomize_bn(fused, seed=3)
    eager.load_state_dict(fused.state_dict() if kind == "block" else
                          {k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in fused.state_dict().items()})
    return fused.to(DEVICE), eager


def _check_backward(y, y64, xf, x64, fused, eager64, dtype, dy_scale: float = 1.0):
    """Backpropagate one float64 output gradient (standard normal times ``dy_scale``) through the fused
    and the float64 build; the output, the input gradient and every parameter gradient within
    ``dtype``'s tolerance of float64."""
    dy = torch.randn(y64.shape, dtype=torch.float64) * dy_scale
    y.backward(dy.to(DEVICE, dtype))
    y64.backward(dy)
    assert_close(y, y64, dtype, "forward")
    assert_close(xf.grad, x64.grad, dtype, "grad x")
    for (name, p), (_, p64) in zip(fused.named_parameters(), eager64.named_parameters()):
        assert_close(p.grad, p64.grad, dtype, f"grad {name}")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["unit", "block"])
def test_autocast_runs_conv_in_autocast_dtype_and_stats_in_fp32(kind, dtype, backend):
    """Under torch.autocast the fused output has eager's dtype, gradients come back in fp32, the
    running statistics are fp32-accurate, and values are within the 16-bit tolerance of float64."""
    fused, eager = _twins(kind, backend)
    eager_ac = copy.deepcopy(eager).to(DEVICE)
    eager64 = eager.double()
    x = torch.randn(3, 6, 9, 7) * 2 + 0.5
    xf = x.to(DEVICE, copy=True).requires_grad_()
    xe = x.to(DEVICE, copy=True).requires_grad_()
    x64 = x.double().requires_grad_()
    with torch.autocast(DEVICE, dtype=dtype):
        y = fused(xf)
        y_eager = eager_ac(xe)
    y64 = eager64(x64)
    assert y.dtype == y_eager.dtype == dtype
    assert fused.last_backend == backend
    _check_backward(y, y64, xf, x64, fused, eager64, dtype)
    assert xf.grad.dtype == torch.float32
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.float32, name
    for (name, b), (_, b64) in zip(fused.named_buffers(), eager64.named_buffers()):
        if b.is_floating_point():  # the first BN reads the fp32 input: its statistics are fp32-accurate
            first = name.split(".")[0] in ("0", "bn1")
            assert_close(b, b64, torch.float32 if first else dtype, name)


@pytest.mark.parametrize("kind, beyond", [("unit", "first"), ("block", "first"), ("block", "last")])
def test_fp16_autocast_scales_an_fp32_input_beyond_fp16_range(kind, beyond):
    """fp16 autocast with an fp32 input and a BatchNorm whose scale γ/σ exceeds fp16's range (≈ 2e5; its
    activations do not): the fused kernels scale the transforms' vectors by 2^−e into the fp16 operands'
    range and the accumulator back by 2^e (e > 0 here; the fp32 input's vectors scaled once per
    program into the pack's scratch rows), so the output and every gradient stay within fp16's
    tolerance of float64. ``first``: the fp32 input's own BatchNorm (the first unit; in the block also
    the projection shortcut). ``last``: the block's second BatchNorm (a small conv1 output, σ ≈ 1e-4),
    so only the last unit's launch, which also runs the projection over the fp32 input, has e > 0: its
    scaled copy of the first BatchNorm's vectors is its own, not the first unit's (e = 0)."""
    fused, eager = _twins(kind, "triton")
    eager64 = eager.double()
    bns = [[m for m in net.modules() if isinstance(m, nn.BatchNorm2d)] for net in (fused, eager64)]
    big = 0 if beyond == "first" else 1
    with torch.no_grad():
        for net_bns in bns:
            net_bns[big].weight.mul_(300.0)
        if beyond == "last":
            for net in (fused, eager64):
                net.conv1.weight.mul_(1e-4)
    seen = []
    hook = bns[1][big].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    x = torch.randn(3, 6, 9, 7) * (1e-3 if beyond == "first" else 1.0) + 0.5
    xf = x.to(DEVICE, copy=True).requires_grad_()
    x64 = x.double().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.float16):
        y = fused(xf)
    y64 = eager64(x64)
    hook.remove()
    bn64 = bns[1][big]
    scale = (bn64.weight / seen[0].var((0, 2, 3), unbiased=False).add(bn64.eps).sqrt()).abs()
    assert scale.max() > torch.finfo(torch.float16).max  # the regime: e > 0
    if beyond == "last":  # and e = 0 in the first unit's launch
        s0 = (bns[1][0].weight / x64.detach().var((0, 2, 3), unbiased=False).add(bns[1][0].eps).sqrt()).abs()
        assert s0.max() < 2**10
    _check_backward(y, y64, xf, x64, fused, eager64, torch.float16, 1.0 if beyond == "first" else 1e-3)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast_kernels_read_weights_in_the_autocast_dtype(dtype):
    """Mixed-precision training (fp32 parameters, fp32 input, autocast): every Triton conv launch,
    forward and backward, projection included, reads its weight in the autocast dtype and channels_last
    (cast once per call, as ``F.conv2d`` under autocast casts it), not fp32 tiles that every program
    converts; the cast of the block's (K, C, R, S)-contiguous 3×3 filter is channels_last."""
    import inspect

    from fused_preact.ops.triton import launch

    fused = FusedPreActBottleneck(8, 4, stride=2, backend="triton").to(DEVICE)
    assert not fused.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 6, device=DEVICE).requires_grad_()
    with launch.recording() as recs:  # the launches are recorded, not run
        with torch.autocast(DEVICE, dtype=dtype):
            y = fused(x)
        y.float().sum().backward()
    seen = []
    for r in recs:
        names = inspect.signature(getattr(r.fn, "fn", r.fn)).parameters
        for name, a in zip(names, r.args):
            if name in ("w_ptr", "w2_ptr") and a is not None:
                seen.append((r.name, name))
                assert a.dtype == dtype and a.is_contiguous(memory_format=torch.channels_last), (r.name, name)
    assert {("fprop", "w_ptr"), ("fprop", "w2_ptr"), ("dgrad", "w_ptr"), ("dgrad", "w2_ptr")} <= set(seen)


def _autocast_against_float64(fused, eager64, x, dtype):
    """Run the fused module on the fp32 ``x`` under autocast (the Triton backend) and its float64 twin
    on x in float64; output and every gradient within ``dtype``'s tolerance (:func:`_check_backward`)."""
    xf = x.to(DEVICE, copy=True).requires_grad_()
    x64 = x.double().requires_grad_()
    with torch.autocast(DEVICE, dtype=dtype):
        y = fused(xf)
    assert fused.last_backend == "triton" and y.dtype == dtype
    _check_backward(y, eager64(x64), xf, x64, fused, eager64, dtype)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
@pytest.mark.parametrize("k, groups", [(3, 1), (1, 2)], ids=["3x3", "1x1-g2"])
def test_autocast_first_conv_takes_channels_in_quads(k, groups, dtype):
    """An fp32 input under autocast with 16·j channels per group: fprop reorders the channels of its fp32
    tile in quads (``configs.quad_channels``) and the plan hands it the filter in the same order; the
    output and every gradient stay within the 16-bit tolerance of float64 (two 16-channel groups per
    chunk: a wrong order in either place moves whole products to other channels)."""
    torch.manual_seed(1)
    fused = FusedBNReLUConv2d(64, 16, k, padding=k // 2, groups=groups, backend="triton")
    _randomize_bn(fused, seed=5)
    eager64 = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
    _autocast_against_float64(fused.to(DEVICE), eager64, torch.randn(2, 64, 5, 6) * 2 + 0.5, dtype)


def _one_conv_with_projection(seed: int):
    """(fused, float64 eager twin): a one-conv chain (3×3 stride 2, 32 → 16) whose projection shortcut,
    added to the output, reads the same BatchNorm (reachable through ``run_units``)."""
    import torch.nn.functional as F

    from fused_preact.modules import FusedModuleBase, run_units

    class OneConv(FusedModuleBase):
        def __init__(self):
            super().__init__("triton")
            self.bn = nn.BatchNorm2d(32)
            self.conv = nn.Conv2d(32, 16, 3, 2, 1, bias=False)
            self.shortcut = nn.Conv2d(32, 16, 1, 2, bias=False)

        def forward(self, x):
            return run_units(self, x, [(self.bn, self.conv)], proj=self.shortcut).out

    class Eager(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.bn, self.conv, self.shortcut = m.bn, m.conv, m.shortcut

        def forward(self, x):
            a = F.relu(self.bn(x))
            return self.conv(a) + self.shortcut(a)

    torch.manual_seed(seed)
    fused = OneConv()
    _randomize_bn(fused, seed=2)
    return fused, Eager(copy.deepcopy(fused)).double()


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast_quads_beside_a_projection_of_the_same_batchnorm(dtype):
    """A one-conv chain whose projection shortcut (added to the output) reads the same BatchNorm: the
    fprop launch's two packs are one buffer, so the main loop's quad-ordered (interleaved) vectors and
    the projection's fp16-scaled ones share its scratch rows; every gradient and the output within the
    16-bit tolerance of float64 (found by review: fp16 wrote the two layouts over each other)."""
    fused, eager64 = _one_conv_with_projection(0)
    _autocast_against_float64(fused.to(DEVICE), eager64, torch.randn(2, 32, 6, 6) * 2 + 0.5, dtype)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast_unrolled_loops(monkeypatch, dtype):
    """fprop's and wgrad's loops unrolled into two accumulators (``GemmConfig.unroll``, sm_90's rules,
    also on autocast's fp32 input) with quad-ordered 16-channel chunks in fprop and pair-ordered rows
    in wgrad: a 1×1 of 3 chunks (odd: the step after the loop), a 3×3 of 4 chunks (36 steps) and the
    one-conv chain with a projection of the same BatchNorm; output and every gradient within the
    16-bit tolerance of float64."""
    import fused_preact.ops.triton.layout as triton_layout
    from fused_preact.ops.triton.configs import GemmConfig

    monkeypatch.setattr(triton_layout, "fprop_config", lambda *args, **kwargs: GemmConfig(16, 16, 16, unroll=2))
    monkeypatch.setattr(triton_layout, "wgrad_config", lambda *args, **kwargs: GemmConfig(16, 16, 32, unroll=2))
    for c, k in ((48, 1), (64, 3)):
        torch.manual_seed(c)
        fused = FusedBNReLUConv2d(c, 16, k, padding=k // 2, backend="triton")
        _randomize_bn(fused, seed=5)
        eager64 = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
        _autocast_against_float64(fused.to(DEVICE), eager64, torch.randn(2, c, 5, 6) * 2 + 0.5, dtype)
    fused, eager64 = _one_conv_with_projection(3)
    _autocast_against_float64(fused.to(DEVICE), eager64, torch.randn(2, 32, 6, 6) * 2 + 0.5, dtype)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast_wgrad_on_the_thin_tile(monkeypatch, dtype):
    """The 2-warp wgrad tile of ≤ 16 output channels over more than 32 input channels
    (``configs._thin_wgrad_tile``: autocast's default on sm_80 and sm_90) on autocast's fp32 input: a
    1×1 64→16 over 5·8·8 = 320 rows (two row blocks of 128 per iteration: one full iteration, one
    masked past the rows) and a 1×1 96→12 (two 64-channel blocks, the second masked; a masked
    output-channel tile); output and every gradient within the 16-bit tolerance of float64, and the
    launches took the tile on the fp32 input."""
    from test_op import _force_wgrad, _spy_wgrad

    from fused_preact.ops.triton import configs

    with monkeypatch.context() as m:  # the GPU's tile (the interpreter's rules do not unroll)
        m.setattr(configs, "interpreting", lambda: False)
        thin = configs._thin_wgrad_tile(dtype, 90, True)
    assert (thin.BLOCK_M, thin.BLOCK_N, thin.num_warps, thin.unroll) == (16, 64, 2, 2)
    _force_wgrad(monkeypatch, thin, 1)
    seen = _spy_wgrad(monkeypatch, "x_ptr", "BLOCK_M", "BLOCK_N", "num_warps")
    for c, k in ((64, 16), (96, 12)):
        torch.manual_seed(c)
        fused = FusedBNReLUConv2d(c, k, 1, backend="triton")
        _randomize_bn(fused, seed=5)
        eager64 = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
        _autocast_against_float64(fused.to(DEVICE), eager64, torch.randn(5, c, 8, 8) * 2 + 0.5, dtype)
    assert seen and set(seen) == {(torch.float32, 16, 64, 2)}, seen


def test_autocast_leaves_float64_alone():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1).double().to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = m(torch.randn(2, 3, 5, 5, dtype=torch.float64, device=DEVICE))
    assert y.dtype == torch.float64 and m.last_backend == "reference"


@pytest.mark.parametrize("allow", [True, False])
def test_fp32_matmul_precision_follows_cudnn_allow_tf32(allow, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow)
    expected = "tf32" if allow and HAS_CUDA else "ieee"  # the interpreter computes in IEEE fp32
    assert input_precision(torch.float32) == expected
    assert input_precision(torch.float16) == "ieee"


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["unit", "block"])
def test_empty_batch_behaves_as_pytorch(kind, train, backend):
    """N = 0: empty output of the right shape, zero parameter gradients, running stats untouched,
    num_batches_tracked counted (what nn.BatchNorm2d does)."""
    fused, eager = _twins(kind, backend)
    fused.train(train)
    eager.train(train)
    x = torch.randn(0, 6, 9, 7)
    xf = x.to(DEVICE, copy=True).requires_grad_()
    xe = x.clone().requires_grad_()
    y, y_e = fused(xf), eager(xe)
    assert y.shape == y_e.shape
    y.sum().backward()
    y_e.sum().backward()
    assert xf.grad.shape == x.shape
    for (name, p), (_, pe) in zip(fused.named_parameters(), eager.named_parameters()):
        assert torch.equal(p.grad.cpu(), pe.grad), name
    for (name, b), (_, be) in zip(fused.named_buffers(), eager.named_buffers()):
        assert torch.equal(b.cpu(), be), name


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_deterministic_algorithms_give_bitwise_repeats(backend):
    """The fused kernels use no atomics (split-K partials are summed in order), so under
    torch.use_deterministic_algorithms(True) two identical steps agree bit for bit (the recompute
    backend's cuDNN convolutions are then deterministic too)."""
    results = []
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            fused, _ = _twins("block", backend)
            x = (torch.randn(4, 6, 11, 10, generator=torch.Generator().manual_seed(5)) + 1).to(DEVICE).requires_grad_()
            y = fused(x)
            y.square().sum().backward()
            results.append([y, x.grad] + [p.grad for p in fused.parameters()] + list(fused.buffers()))
    finally:
        torch.use_deterministic_algorithms(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("in_planes,planes,stride,groups,base_width", [(16, 4, 1, 4, 32), (12, 8, 2, 2, 8)])
def test_resnext_bottleneck_matches_eager(in_planes, planes, stride, groups, base_width, train, backend):
    torch.manual_seed(4)
    fused = FusedPreActBottleneck(in_planes, planes, stride, backend=backend, groups=groups, base_width=base_width)
    assert fused.conv2.groups == groups and fused.conv2.out_channels == bottleneck_width(planes, groups, base_width)
    _randomize_bn(fused, seed=5)
    eager = PreActBottleneck(in_planes, planes, stride, groups=groups, base_width=base_width)
    eager.load_state_dict(fused.state_dict())
    _compare(fused.to(DEVICE), eager.double(), torch.randn(2, in_planes, 7, 8) + 0.5, train)


def test_resnext_factory_widths():
    m = preact_resnext50_32x4d(fused=False)
    blk = m.layer1[0]
    assert (blk.conv2.groups, blk.conv2.in_channels, blk.conv3.out_channels) == (32, 128, 256)
    assert m.layer4[0].conv2.in_channels == 32 * 4 * 8
    with pytest.raises(ValueError, match="groups"):
        bottleneck_width(4, groups=0)


def test_error_bounds_are_not_vacuous():
    """The tolerance table is tight enough to see a real defect (a flipped ReLU on a tenth of the
    activations), so the comparisons above can fail."""
    fused, eager = _twins("unit")
    x = torch.randn(3, 6, 9, 7, dtype=torch.float64)
    ref = eager.double()(x)
    bad = nn.Sequential(eager[0], nn.LeakyReLU(0.1), eager[2])(x)
    assert rel_err(bad, ref) > TOL[torch.bfloat16]


class _LaunchSpy:
    """Stands in for a Triton kernel object: records the shape of each launch's first argument."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(tuple(args[0].shape))
            return launch(*args, **kwargs)

        return run


def _count_statistics_passes(monkeypatch) -> list:
    """Shapes of the activations the standalone statistics kernel reads (one entry per pass)."""
    import fused_preact.ops.triton.kernels_bn as bn_kernels

    calls: list = []
    monkeypatch.setattr(bn_kernels, "_stats_partial_kernel", _LaunchSpy(bn_kernels._stats_partial_kernel, calls))
    return calls


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls,planes", [(FusedPreActBlock, 6), (FusedPreActBottleneck, 3)])
def test_block_statistics_come_from_the_producing_epilogue(cls, planes, train, monkeypatch):
    """Inside a block only bn1 runs a statistics pass; bn2 (and bn3) take their batch statistics
    from the epilogue of the conv that produced their input, and the last conv's epilogue adds the
    shortcut. In eval mode no statistics are computed at all."""
    calls = _count_statistics_passes(monkeypatch)
    torch.manual_seed(0)
    block = cls(6, planes, 1, backend="triton").to(DEVICE).train(train)
    _randomize_bn(block)
    eager = (PreActBlock if cls is FusedPreActBlock else PreActBottleneck)(6, planes, 1)
    eager.load_state_dict(block.state_dict())
    _compare(block, eager.double().train(train), torch.randn(2, 6, 7, 6) + 0.3, train, steps=1)
    assert calls == ([(2, 6, 7, 6)] if train else [])


def test_model_chains_statistics_across_blocks(monkeypatch):
    """In a fused PreActResNet only the first block's bn1 runs a statistics pass: every later BN's
    batch statistics come from the epilogue of the conv that produced its input (across blocks and
    stages), and a forward hook on a block makes that block run as a plain call (hooks see it)."""
    from fused_preact.models import preact_resnet_cifar

    calls = _count_statistics_passes(monkeypatch)
    torch.manual_seed(0)
    model = preact_resnet_cifar(14, fused=True, backend="triton").to(DEVICE)
    eager = preact_resnet_cifar(14, fused=False)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    assert_close(model(x.to(DEVICE)), eager.double()(x.double()), torch.float32, "chained model")
    assert calls == [(2, 16, 8, 8)]
    seen = []
    model.layer2[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls.clear()
    model(x.to(DEVICE))
    # the hooked block and the one after it compute their own bn1 statistics
    assert seen == [torch.Size([2, 32, 4, 4])] and calls == [(2, 16, 8, 8), (2, 16, 8, 8), (2, 32, 4, 4)]
