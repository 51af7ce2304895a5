"""Modules against their eager twins: outputs, gradients, running stats, state_dict, backend choice."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from helpers import FUSED_BACKENDS, assert_close, rel_err

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
from fused_preact.dispatch import BACKENDS, select_backend
from fused_preact.models import PreActBlock, PreActBottleneck


def _randomize_bn(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                if m.weight is not None:
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.5)
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


def _compare(fused: nn.Module, eager64: nn.Module, x: torch.Tensor, train: bool, steps: int = 2):
    """Run both modules ``steps`` times on fresh data; compare outputs, input/param grads and buffers."""
    fused.train(train)
    eager64.train(train)
    for step in range(steps):
        xs = (x + step).clone()
        xf = xs.to(DEVICE).detach().requires_grad_()
        xr = xs.double().cpu().detach().requires_grad_()
        y = fused(xf)
        y_ref = eager64(xr)
        dy = torch.randn(y_ref.shape, dtype=torch.float64)
        y.backward(dy.to(DEVICE, y.dtype))
        y_ref.backward(dy)
        assert_close(y, y_ref, torch.float32, f"step {step} forward")
        assert_close(xf.grad, xr.grad, torch.float32, f"step {step} grad x")
    for (name, p), (_, p_ref) in zip(fused.named_parameters(), eager64.named_parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, f"grad {name}")
    for (name, b), (_, b_ref) in zip(fused.named_buffers(), eager64.named_buffers()):
        if b.dtype == torch.long:
            assert torch.equal(b.cpu(), b_ref), name
        else:
            assert_close(b, b_ref, torch.float32, name)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3, padding=1),
        dict(kernel_size=3, stride=2, padding=2, dilation=2, groups=2, bias=True),
        dict(kernel_size=1, momentum=None),
        dict(kernel_size=3, padding=1, affine=False),
        dict(kernel_size=3, padding=(1, 0), track_running_stats=False),
    ],
    ids=["3x3", "strided-dilated-grouped-bias", "1x1-cumulative", "no-affine", "no-running-stats"],
)
def test_fused_bn_relu_conv_matches_eager(kw, train, backend):
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(6, 10, **kw, backend=backend).to(DEVICE)
    _randomize_bn(fused)
    bn_kw = {k: kw[k] for k in ("momentum", "affine", "track_running_stats") if k in kw}
    conv_kw = {"bias": False, **{k: v for k, v in kw.items() if k not in bn_kw}}
    eager = nn.Sequential(nn.BatchNorm2d(6, **bn_kw), nn.ReLU(), nn.Conv2d(6, 10, **conv_kw))
    eager.load_state_dict({k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in fused.state_dict().items()})
    _compare(fused, eager.double(), torch.randn(3, 6, 9, 8) * 1.5 + 0.3, train, steps=3)
    assert fused.last_backend == backend and fused.fallback_reason is None


def test_state_dict_keys_are_pytorch_keys():
    m = FusedBNReLUConv2d(4, 8, 3, bias=True)
    assert list(m.state_dict()) == [
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "conv.weight", "conv.bias",
    ]
    assert isinstance(m.bn, nn.BatchNorm2d) and isinstance(m.conv, nn.Conv2d)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "cls,eager_cls,in_planes,planes,stride",
    [
        (FusedPreActBlock, PreActBlock, 8, 8, 1),
        (FusedPreActBlock, PreActBlock, 5, 8, 2),
        (FusedPreActBottleneck, PreActBottleneck, 16, 4, 1),
        (FusedPreActBottleneck, PreActBottleneck, 6, 4, 2),
    ],
    ids=["basic-identity", "basic-projection", "bottleneck-identity", "bottleneck-projection"],
)
def test_blocks_match_eager(cls, eager_cls, in_planes, planes, stride, train, backend):
    torch.manual_seed(1)
    fused = cls(in_planes, planes, stride, backend=backend).to(DEVICE)
    _randomize_bn(fused, seed=2)
    eager = eager_cls(in_planes, planes, stride)
    eager.load_state_dict(fused.state_dict())
    assert list(eager.state_dict()) == list(fused.state_dict())
    _compare(fused, eager.double(), torch.randn(2, in_planes, 9, 7) + 0.5, train)


@pytest.mark.parametrize("value", [2, (2,)], ids=["int", "1-tuple"])
@pytest.mark.parametrize("attr", ["stride", "padding", "dilation"])
def test_conv_attributes_set_as_int_after_construction(attr, value):
    """An int or a 1-tuple assigned to a conv's stride, padding or dilation (``F.conv2d`` expands both):
    the fused unit and a block's projection shortcut compute what eager does."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 4, 3, padding=1, backend="triton").to(DEVICE)
    eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
    for conv in (fused.conv, eager[2]):
        setattr(conv, attr, value)
    x = torch.randn(2, 4, 7, 7)
    assert_close(fused(x.to(DEVICE)), eager(x.double()), torch.float32, attr)
    block = FusedPreActBlock(4, 8, 2, backend="triton").to(DEVICE)
    ref = PreActBlock(4, 8, 2).double()
    ref.load_state_dict(block.state_dict())
    for b in (block, ref):
        b.shortcut.stride = b.conv1.stride = 2 if value == 2 else (2,)
    assert_close(block(x.to(DEVICE)), ref(x.double()), torch.float32, "block")
    assert block.last_backend == "triton"


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_identity_shortcut_reads_raw_input(backend):
    """With the residual branch zeroed, the block is exactly the identity on the raw input."""
    block = FusedPreActBlock(6, 6, backend=backend).to(DEVICE)
    nn.init.zeros_(block.conv2.weight)
    x = torch.randn(2, 6, 5, 5, device=DEVICE) * 3 - 1
    assert torch.equal(block(x), x)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_projection_reads_preactivation_and_shares_bn1_stats(backend):
    """bn1 is counted once per forward although its statistics feed conv1 and the projection, and
    with the residual branch zeroed the block is exactly the projection of relu(bn1(x))."""
    block = FusedPreActBlock(4, 8, stride=2, backend=backend).to(DEVICE)
    _randomize_bn(block, seed=3)
    block(torch.randn(2, 4, 6, 6, device=DEVICE))
    assert int(block.bn1.num_batches_tracked) == 1
    nn.init.zeros_(block.conv2.weight)
    block.eval()
    x = torch.randn(2, 4, 6, 6, device=DEVICE) * 2 + 1
    expected = block.shortcut(torch.relu(block.bn1(x)))
    assert_close(block(x), expected.double(), torch.float32, "projection of the pre-activation")
    assert rel_err(block(x), block.shortcut(x)) > 1e-2  # projecting raw x would be distinguishable


def test_auto_falls_back_visibly(monkeypatch):
    """auto: the choice and the reason for a fallback are recorded on the module."""
    monkeypatch.setattr(BACKENDS["triton"], "dtypes", ())
    m = FusedBNReLUConv2d(3, 4, 3, padding=1).to(DEVICE)
    m(torch.randn(2, 3, 5, 5, device=DEVICE))
    assert m.last_backend == "reference"
    assert "dtype" in m.fallback_reason


def test_float64_runs_reference_path():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1).double().to(DEVICE)
    m(torch.randn(2, 3, 5, 5, device=DEVICE, dtype=torch.float64))
    assert m.last_backend == "reference" and "float64" in m.fallback_reason


def test_unfusable_conv_falls_back_or_raises():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1).to(DEVICE)
    m.conv.padding_mode = "reflect"
    m(torch.randn(2, 3, 5, 5, device=DEVICE))
    assert m.last_backend == "reference" and "padding_mode" in m.fallback_reason
    m.backend = "triton"
    with pytest.raises(RuntimeError, match="padding_mode"):
        m(torch.randn(2, 3, 5, 5, device=DEVICE))


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("cutlass9", torch.randn(1, 2, 3, 3))


@pytest.mark.parametrize(
    "x,exc,match",
    [
        (torch.randn(2, 3, 5), ValueError, "expected 4D input"),
        (torch.randn(2, 4, 5, 5), RuntimeError, "running_mean should contain 4 elements not 3"),
        (torch.randn(1, 3, 1, 1), ValueError,  # eager's words, size included
         re.escape("Expected more than 1 value per channel when training, got input size torch.Size([1, 3, 1, 1])")),
        (torch.ones(2, 3, 4, 4, dtype=torch.long), RuntimeError, "expected a floating-point input, got torch.int64"),
        (torch.ones(2, 3, 4, 4, dtype=torch.bool), RuntimeError, "expected a floating-point input, got torch.bool"),
        (torch.randn(2, 3, 4, 4, dtype=torch.float16), RuntimeError, r"Input type \(torch.float16\) and weight type"),
        (torch.randn(2, 3, 1, 4), RuntimeError, re.escape(  # eager's words
            "Calculated padded input size per channel: (1 x 4). Kernel size: (3 x 1). Kernel size can't be greater "
            "than actual input size")),
    ],
    ids=["rank", "channels", "one-value", "int", "bool", "dtype-mismatch", "too-small"],
)
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_bad_input_raises_and_leaves_buffers(x, exc, match, backend):
    m = FusedBNReLUConv2d(3, 4, (3, 1), backend=backend).to(DEVICE)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(exc, match=match):
        m(x.to(DEVICE))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_an_empty_image_in_a_nonempty_batch_raises_eagers_error(backend, training, grad):
    """N > 0 with H = 0, padded so that the output would not be empty: F.conv2d refuses it; the fused
    path wrote nothing (training: finalize read partial sums never written; eval: zeros or a division
    by zero in backward)."""
    m = FusedBNReLUConv2d(3, 4, 3, padding=2, backend=backend).to(DEVICE).train(training)
    x = torch.randn(2, 3, 0, 5, device=DEVICE, requires_grad=grad)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=re.escape(
            "Only zero batch or zero channel inputs are supported, but got input shape: [2, 3, 0, 5]")):
        m(x)


def test_forced_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = textwrap.dedent(
        """
        import torch
        from fused_preact import FusedBNReLUConv2d
        m = FusedBNReLUConv2d(3, 4, 1, backend="triton")
        try:
            m(torch.randn(2, 3, 4, 4))
        except RuntimeError as e:
            print("ERR", e)
        m.backend = "auto"
        m(torch.randn(2, 3, 4, 4))
        print("AUTO", m.last_backend, m.fallback_reason)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ERR fused_preact: backend='triton' cannot serve this input" in out.stdout
    assert "TRITON_INTERPRET=1" in out.stdout
    assert "AUTO reference triton: CPU tensor and Triton's interpreter is off" in out.stdout


def test_backends_report():
    from fused_preact import backends

    report = backends(["cpu"])
    assert set(report) == {"cuda", "triton", "recompute", "reference"}
    assert report["cuda"]["priority"] is None  # opt-in until verified on a GPU
    assert report["recompute"]["priority"] is None  # chosen by measurement (or memory="lean"), not statically
    assert report["recompute"]["cpu/float32"] == "ok" and "not in" in report["recompute"]["cpu/float64"]
    assert "extension is not available" in report["cuda"]["cpu/float16"] or DEVICE == "cuda"
    assert report["reference"]["cpu/float64"] == "ok"
    assert "not in" in report["triton"]["cpu/float64"]
    expected = "ok" if DEVICE == "cpu" else "interpreter is off"
    assert expected in report["triton"]["cpu/float32"]


@pytest.mark.parametrize("kind", ["numpy-int", "0-d-tensor", "pair-of-them"])
def test_functional_takes_int_like_conv_arguments(kind):
    """``bn_relu_conv2d`` takes what ``F.conv2d`` takes for stride/padding/dilation: int-like scalars
    (numpy integers, 0-d integer tensors), alone or in a pair."""
    import torch.nn.functional as F

    from fused_preact.ops import bn_relu_conv2d

    if kind == "numpy-int":
        stride = pytest.importorskip("numpy").int64(2)
    else:
        stride = torch.tensor(2) if kind == "0-d-tensor" else (torch.tensor(2), 1)

    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 7, 7, device=DEVICE), torch.randn(4, 3, 3, 3, device=DEVICE)
    ref = F.conv2d(F.relu(F.batch_norm(x, None, None, training=True)), w, None, stride)
    got = bn_relu_conv2d(x, w, None, None, None, None, None, True, 0.1, 1e-5, stride, backend="triton")
    assert_close(got, ref, torch.float32, "stride")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(groups=2), "Given groups=2"),
        (dict(stride=0), "non-positive stride is not supported"),
        (dict(stride=(1, 0), padding=-1), "negative padding is not supported"),
        (dict(dilation=(1, 0)), "non-positive dilation is not supported"),
        (dict(groups=0, stride=0), "non-positive groups is not supported"),
        (dict(padding=(1, 2, 3)), "expected padding to be a single integer value or a list of 2 values"),
    ],
    ids=["groups", "stride", "padding", "dilation", "groups-0", "padding-length"],
)
def test_functional_bad_conv_arguments(kw, match):
    """F.conv2d's errors for bad geometry, its type (RuntimeError), message and order, before any
    buffer changes (they were ValueErrors of our own)."""
    import torch.nn.functional as F

    from fused_preact.ops import bn_relu_conv2d

    x, w = torch.randn(2, 3, 5, 5, device=DEVICE), torch.randn(4, 3, 3, 3, device=DEVICE)
    with pytest.raises(RuntimeError, match=match):
        F.conv2d(x, w, **kw)
    rm, rv = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(RuntimeError, match=match):
        bn_relu_conv2d(torch.randn(2, 3, 5, 5, device=DEVICE), torch.randn(4, 3, 3, 3, device=DEVICE),
                       running_mean=rm, running_var=rv, training=True, backend="triton", **kw)
    assert torch.equal(rm, torch.zeros(3, device=DEVICE)) and torch.equal(rv, torch.ones(3, device=DEVICE))


@pytest.mark.gpu
def test_device_mismatch():
    m = FusedBNReLUConv2d(3, 4, 1, backend="triton").cuda()
    m.conv.weight.data = m.conv.weight.data.cpu()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        m(torch.randn(2, 3, 4, 4, device="cuda"))


def _assert_raises_untouched(m: nn.Module, x: torch.Tensor, exc, match: str) -> None:
    """The call raises ``exc`` matching ``match`` and leaves every buffer (running stats,
    num_batches_tracked) exactly as it was."""
    before = {k: v.clone() for k, v in m.named_buffers()}
    with pytest.raises(exc, match=match):
        m(x)
    for k, v in m.named_buffers():
        assert torch.equal(v, before[k]), k


def test_forced_backend_that_cannot_serve_raises_and_leaves_buffers():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1, groups=1, backend="cuda").to(DEVICE)
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    _assert_raises_untouched(m, x, RuntimeError, r"backend='cuda' cannot serve this input: cuda: ")


def test_weight_on_another_device_raises_and_leaves_buffers():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1, backend="triton").to(DEVICE)
    m.conv.weight = nn.Parameter(torch.empty(4, 3, 3, 3, device="meta"))
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    _assert_raises_untouched(m, x, RuntimeError, "Expected all tensors to be on the same device")


def test_groups_not_dividing_channels_raises_and_leaves_buffers():
    m = FusedBNReLUConv2d(4, 4, 3, padding=1, groups=2, backend="triton").to(DEVICE)
    m.conv.groups = 3
    x = torch.randn(2, 4, 6, 6, device=DEVICE)
    _assert_raises_untouched(m, x, RuntimeError, "Given groups=3")


def test_backend_is_chosen_for_the_autocast_dtype(monkeypatch):
    """Under autocast the backend sees the dtype the convolution runs in, not the fp32 parameters':
    a 16-bit-only backend is chosen for an fp32 module under bf16 autocast and refused without it."""
    from fused_preact.ops.backends import CudaBackend
    from fused_preact.ops.cuda import ext as _cuda

    monkeypatch.setattr(_cuda, "available", lambda: True)
    monkeypatch.setattr(_cuda, "not_supported_reasons", lambda *a, **k: [])
    monkeypatch.setattr(CudaBackend, "devices", None)  # as if it served this test's CPU tensors
    m = FusedBNReLUConv2d(8, 8, 3, padding=1, backend="cuda")
    x = torch.randn(2, 8, 5, 5)
    with pytest.raises(RuntimeError, match=r"dtype torch.float32 not in"):
        m(x)
    seen = []
    monkeypatch.setattr(CudaBackend, "make_plan", classmethod(lambda cls, spec, modes, x, cd, *a: seen.append(cd)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    assert seen == [torch.bfloat16] and m.last_backend == "cuda"


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU modules run the kernels only through the interpreter")
def test_repr_and_report_say_which_path_runs():
    m = FusedBNReLUConv2d(4, 4, 3, backend="auto")
    assert "runs='triton'" in repr(m)  # the interpreter is on in this test session
    m64 = FusedBNReLUConv2d(4, 4, 3, backend="auto").double()
    assert "runs='reference (triton: dtype torch.float64" in repr(m64)
    # After a call, what that call ran: a hook on a child overrules the device check.
    m.conv.register_forward_pre_hook(lambda mod, args: None)
    m(torch.randn(2, 4, 5, 5))
    assert "runs='reference (hooks:" in repr(m), repr(m)


def test_dispatch_report_names_calls_that_ran_eagerly():
    """The report lists every cached decision under the backend it was decided for, and a module's
    latest call when that call ran something no cached entry says (an eager fallback decided before
    the plan cache, or a cached plan overruled by forward-mode AD)."""
    from fused_preact import dispatch_report

    x = torch.randn(2, 4, 5, 5, device=DEVICE)
    hooked = FusedBNReLUConv2d(4, 4, 3, backend="auto").to(DEVICE)
    hooked.conv.register_forward_hook(lambda mod, args, out: None)
    hooked(x)
    (e,) = dispatch_report(hooked)
    assert (e["runs"], e["source"]) == ("reference", "last call") and "hooks" in e["reason"]

    m = FusedBNReLUConv2d(4, 4, 3, backend="auto").to(DEVICE)
    m(x)
    (first,) = dispatch_report(m)
    assert first["runs"] == m.last_backend != "reference"
    with torch.autograd.forward_ad.dual_level():
        m(torch.autograd.forward_ad.make_dual(x, torch.randn_like(x)))
    assert m.last_backend == "reference"
    cached, last = dispatch_report(m)
    assert cached["runs"] == first["runs"] and (last["runs"], last["source"]) == ("reference", "last call")
    assert "forward-mode AD" in last["reason"]
    m(x)  # the cached plan runs again: no separate entry
    assert [e["runs"] for e in dispatch_report(m)] == [first["runs"]]

    m.backend = "reference"
    m(x)
    entries = dispatch_report(m)
    assert [(e["requested"], e["runs"]) for e in entries] == [("auto", first["runs"]), ("reference", "reference")]
    assert [e["source"] for e in entries] == ["priority", "forced"]


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU modules run the kernels only through the interpreter")
def test_repr_and_report_forget_calls_made_under_other_settings():
    """What the last call ran is shown only while it still describes the module: not after ``.to()``
    (the cache is rebuilt), a new ``backend`` or a new memory policy."""
    from fused_preact import dispatch_report
    from fused_preact.dispatch import set_memory_policy

    m = FusedBNReLUConv2d(4, 4, 3)
    m(torch.randn(2, 4, 5, 5))
    assert "runs='triton'" in repr(m) and len(dispatch_report(m)) == 1
    m.double()
    assert "runs='reference (triton: dtype torch.float64" in repr(m)
    assert len(dispatch_report(m)) == 0
    m.float()
    m.conv.register_forward_pre_hook(lambda mod, args: None)
    m(torch.randn(2, 4, 5, 5))
    assert "runs='reference (hooks" in repr(m)
    m.backend = "reference"
    assert "backend='reference', runs='reference'" in repr(m)
    set_memory_policy(m, "lean")
    assert len(dispatch_report(m)) == 0


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown backend 'trition'"):
        FusedPreActBlock(4, 4, backend="trition")
    m = FusedBNReLUConv2d(4, 4, 3)
    m.backend = "trition"
    m.conv.register_forward_pre_hook(lambda mod, args: None)  # an eager fallback decided before any lookup
    with pytest.raises(ValueError, match="unknown backend 'trition'"):
        m(torch.randn(2, 4, 5, 5, device=DEVICE).to(next(m.parameters()).device))


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_frozen_conv_weights(backend):
    """Conv weights that need no gradient (a frozen backbone, fine-tuning BN only): the backward runs
    without weight gradients (the wgrad kernel's fold alone on the Triton path) and x's and the BN
    parameters' gradients are still eager's."""
    torch.manual_seed(5)
    fused = FusedPreActBlock(5, 8, 2, backend=backend).to(DEVICE)
    _randomize_bn(fused, seed=6)
    for conv in (fused.conv1, fused.conv2, fused.shortcut):
        conv.weight.requires_grad_(False)
    eager = PreActBlock(5, 8, 2)
    eager.load_state_dict(fused.state_dict())
    for conv in (eager.conv1, eager.conv2, eager.shortcut):
        conv.weight.requires_grad_(False)
    eager = eager.double()
    x = torch.randn(2, 5, 9, 7) + 0.5
    xf, xe = x.to(DEVICE, copy=True).requires_grad_(), x.double().requires_grad_()
    y, ye = fused(xf), eager(xe)
    dy = torch.randn(ye.shape, dtype=torch.float64)
    y.backward(dy.to(DEVICE, y.dtype))
    ye.backward(dy)
    assert_close(y, ye, torch.float32, "forward")
    assert_close(xf.grad, xe.grad, torch.float32, "grad x")
    for (name, p), (_, pe) in zip(fused.named_parameters(), eager.named_parameters()):
        assert (p.grad is None) == (pe.grad is None) == (not p.requires_grad), name
        if p.grad is not None:
            assert_close(p.grad, pe.grad, torch.float32, f"grad {name}")
    assert fused.last_backend == backend


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_stateful_parametrization_is_evaluated_once_per_call(backend):
    """spectral_norm on every conv of a block with a projection shortcut: in training each evaluation
    of the weight runs a power iteration that updates the parametrization's u and v buffers, and
    the eager modules evaluate it once per forward — so must the fused path (outputs, gradients and
    u/v stay eager's over three training calls)."""
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(7)
    fused = FusedPreActBlock(5, 8, 2, backend=backend)
    _randomize_bn(fused, seed=8)
    eager = PreActBlock(5, 8, 2)
    for m in (fused, eager):
        for conv in (m.conv1, m.conv2, m.shortcut):
            spectral_norm(conv)
    eager.load_state_dict(fused.state_dict())  # the same u, v and original weights
    fused = fused.to(DEVICE)
    _compare(fused, eager.double(), torch.randn(2, 5, 9, 7) + 0.5, train=True, steps=3)
    assert fused.last_backend == backend


class _Adapter(nn.Module):
    """A LoRA-style wrapper around a conv (what adapter libraries put in a conv's place)."""

    def __init__(self, base: nn.Conv2d):
        super().__init__()
        self.base = base
        self.down = nn.Conv2d(base.in_channels, 2, 1, bias=False)
        self.up = nn.Conv2d(2, base.out_channels, 1, bias=False)

    def forward(self, a):
        return self.base(a) + self.up(self.down(a))


class _FrozenBN(nn.Module):
    """detectron2's FrozenBatchNorm2d: affine and statistics as buffers, no momentum or training mode."""

    def __init__(self, n: int):
        super().__init__()
        for name, init in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((n,), init) + 0.3 * torch.randn(n).abs())

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        return x * scale[None, :, None, None] + (self.bias - self.running_mean * scale)[None, :, None, None]


@pytest.mark.parametrize("edit", ["groupnorm", "identity-norm", "frozen-bn", "adapter-conv", "identity-shortcut"])
def test_children_of_other_types_run_their_own_forward(edit):
    """A fused block whose BatchNorm, conv or shortcut was replaced by a module of another type (a
    GroupNorm, as opacus' ModuleValidator.fix does; nn.Identity; detectron2's FrozenBatchNorm2d; an
    adapter around a conv; an Identity shortcut) runs the children's own forward, as its eager twin
    does, with the reason recorded (these raised AttributeError reading BatchNorm/Conv attributes)."""
    torch.manual_seed(0)
    fused, eager = FusedPreActBlock(8, 8), PreActBlock(8, 8)
    eager.load_state_dict(fused.state_dict())
    new = {"groupnorm": ("bn1", lambda: nn.GroupNorm(2, 8)), "identity-norm": ("bn2", nn.Identity),
           "frozen-bn": ("bn1", lambda: _FrozenBN(8)), "adapter-conv": ("conv2", lambda: _Adapter(fused.conv2)),
           "identity-shortcut": ("shortcut", nn.Identity)}[edit]
    child = new[1]()
    setattr(fused, new[0], child)
    setattr(eager, new[0], copy.deepcopy(child) if edit != "adapter-conv" else _Adapter(eager.conv2))
    if edit == "adapter-conv":
        eager.conv2.load_state_dict(child.state_dict())
    _compare(fused.to(DEVICE), eager.double(), torch.randn(2, 8, 5, 6), train=True)
    assert fused.last_backend == "reference" and "is not exactly nn." in fused.fallback_reason


def test_frozen_batchnorm_in_a_fused_network_breaks_the_statistics_handoff():
    """A fused network whose second block's bn1 is not a BatchNorm: the first block hands no
    statistics to it (run_blocks read its BatchNorm mode and raised AttributeError); output as the
    unfused network's."""
    from fused_preact.models import PreActResNet

    torch.manual_seed(0)
    fused = PreActResNet("basic", [2], [8], "cifar", 8, 5, fused=True)
    eager = PreActResNet("basic", [2], [8], "cifar", 8, 5, fused=False)
    eager.load_state_dict(fused.state_dict())
    fused.layer1[1].bn1 = _FrozenBN(8)
    eager.layer1[1].bn1 = copy.deepcopy(fused.layer1[1].bn1)
    x = torch.randn(2, 3, 8, 8)
    assert_close(fused.to(DEVICE)(x.to(DEVICE)), eager.double()(x.double()), torch.float32)


@pytest.mark.parametrize("missing", ["weight", "bias"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batchnorm_with_only_a_shift_or_only_a_scale(missing, train):
    """A BatchNorm2d whose weight (or bias) was removed — a BatchNorm that learns only a shift, as
    Keras' ``scale=False`` — normalizes as F.batch_norm does with γ = 1 (β = 0) for the missing one:
    output and every gradient, the remaining parameter's included, as eager's. The Triton path read
    a missing weight as ``affine=False`` and dropped β (output off by O(1)); a missing bias raised."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(8, 8, 3, padding=1, backend="triton")
    _randomize_bn(fused)
    fused.bn.register_parameter(missing, None)
    with torch.no_grad():
        (fused.bn.bias if missing == "weight" else fused.bn.weight).uniform_(0.5, 1.5)
    eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv))
    _compare(fused.to(DEVICE), eager.double(), torch.randn(2, 8, 5, 5), train)
    assert fused.last_backend == "triton"


def test_torch_func_transforms_run_the_plain_ops():
    """Under torch.func transforms (vmap; per-sample gradients: vmap over grad of functional_call) a
    fused module in eval mode and the functional op compute what eager computes (they raised: the
    fused autograd Functions have no functorch rules); the reason is recorded, and a forced fused
    backend raises."""
    import torch.func as tf

    from fused_preact.ops import bn_relu_conv2d

    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 6, 3, padding=1).eval()
    _randomize_bn(fused)
    eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).eval()
    x = torch.randn(3, 2, 4, 5, 5)
    assert_close(tf.vmap(fused)(x), tf.vmap(eager)(x), torch.float32, "vmap")
    assert fused.last_backend == "reference" and "torch.func" in fused.fallback_reason
    params = {k: v.detach() for k, v in fused.named_parameters()}
    loss = lambda m: lambda p, xx: tf.functional_call(m, p, (xx[None],)).square().sum()  # noqa: E731
    per_sample = tf.vmap(tf.grad(loss(fused)), in_dims=(None, 0))(params, x[0])
    eager_params = {k.replace("bn.", "0.").replace("conv.", "2."): v for k, v in params.items()}
    per_sample_eager = tf.vmap(tf.grad(loss(eager)), in_dims=(None, 0))(eager_params, x[0])
    assert_close(per_sample["conv.weight"], per_sample_eager["2.weight"], torch.float32, "per-sample grad")
    bn = fused.bn
    op = lambda xx, backend="auto": bn_relu_conv2d(xx, fused.conv.weight, None, bn.running_mean,  # noqa: E731
                                                   bn.running_var, bn.weight, bn.bias, False, padding=1,
                                                   backend=backend)
    assert_close(tf.vmap(op)(x), tf.vmap(eager)(x), torch.float32, "functional vmap")
    with pytest.raises(RuntimeError, match="torch.func"):
        tf.vmap(lambda xx: op(xx, "triton"))(x)
    fused.backend = "triton"
    with pytest.raises(RuntimeError, match="torch.func"):
        tf.vmap(fused)(x)
    assert fused(x[0]).shape == (2, 6, 5, 5) and fused.last_backend == "triton"  # outside: fused again


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_grouped_conv1_beside_a_projection(groups, train):
    """A basic block whose conv1 is grouped and whose projection shortcut reads the same pre-activation:
    the projection's dgrad (fused into conv1's, one program per group) reads the shortcut's weight at
    the group's global channels (it read the first group's for every group: input and bn1 gradients
    off by 60–140%)."""
    torch.manual_seed(0)
    fused, eager = FusedPreActBlock(8, 16, backend="triton"), PreActBlock(8, 16)
    fused.conv1 = nn.Conv2d(8, 16, 3, 1, 1, groups=groups, bias=False)
    eager.conv1 = nn.Conv2d(8, 16, 3, 1, 1, groups=groups, bias=False)
    _randomize_bn(fused)
    eager.load_state_dict(fused.state_dict())
    _compare(fused.to(DEVICE), eager.double(), torch.randn(2, 8, 6, 6), train)
    assert fused.last_backend == "triton"


@pytest.mark.parametrize("stride, planes", [(2, 4), (1, 8)])
def test_bias_of_an_inner_conv_whose_output_is_not_the_largest_intermediate(stride, planes):
    """A bottleneck whose conv2 has a bias: its gradient sums the head of the backward's scratch
    buffer, which is sized for the largest intermediate (the view of the whole buffer raised when the
    intermediates differ: a strided conv2, or conv1 wider than conv2). In eval mode against float64;
    in training the next BatchNorm's batch mean removes the bias, and its gradient is 0 up to
    rounding (a relative comparison with float64's ~1e-17 means nothing there)."""
    torch.manual_seed(0)
    fused, eager = FusedPreActBottleneck(16, planes, stride=stride, backend="triton"), PreActBottleneck(16, planes, stride)
    if stride == 1:  # conv1 16 → 16, conv2 16 → planes: the intermediates differ in width
        for m in (fused, eager):
            m.conv1, m.bn2 = nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16)
            m.conv2 = nn.Conv2d(16, planes, 3, 1, 1, bias=False)
    fused.conv2.bias = nn.Parameter(torch.randn(planes) * 0.1)
    eager.conv2.bias = nn.Parameter(torch.zeros(planes))
    _randomize_bn(fused)
    eager.load_state_dict(fused.state_dict())
    fused = fused.to(DEVICE)
    _compare(fused, eager.double(), torch.randn(2, 16, 6, 6), False)
    assert fused.last_backend == "triton"
    fused.zero_grad()
    fused.train()(torch.randn(2, 16, 6, 6, device=DEVICE)).square().sum().backward()
    assert fused.conv2.bias.grad.abs().max() <= 1e-5 * fused.conv2.weight.grad.abs().max()
