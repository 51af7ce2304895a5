"""torch.compile over the fused modules: no graph breaks (fullgraph=True) and eager's results; the
tracers the fused path cannot serve (torch.jit.trace, export with a dynamic dimension)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE
from helpers import assert_close

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_block_matches_eager(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    twin = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    twin.load_state_dict(block.state_dict())
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    x = torch.randn(2, 4, 9, 9, device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = compiled(xa), twin(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert_close(ya, yb, torch.float32, "forward")
    assert_close(xa.grad, xb.grad, torch.float32, "grad x")
    for (name, p), q in zip(block.named_parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, torch.float32, f"grad {name}")
    for (name, b), c in zip(block.named_buffers(), twin.buffers()):
        assert torch.equal(b, c) if b.dtype == torch.long else torch.allclose(b, c, rtol=1e-5, atol=1e-6), name


def test_compiled_eval_mode():
    torch._dynamo.reset()
    m = FusedBNReLUConv2d(3, 5, 3, padding=1, backend="triton").to(DEVICE).eval()
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), m(x), torch.float32, "eval forward")


def test_compiled_block_under_autocast():
    """The autocast rule of the custom op is traced too: compiled output equals eager's, in the
    autocast dtype, with fp32 gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.float16 if DEVICE == "cuda" else torch.bfloat16
    block = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, 9, 9, device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=dtype):
        ya = compiled(xa)
        yb = block(xb)
    assert ya.dtype == yb.dtype == dtype
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    assert_close(ya, yb, dtype, "forward")
    assert xa.grad.dtype == torch.float32
    assert_close(xa.grad, xb.grad, dtype, "grad x")


def test_compiled_model_fullgraph_matches_eager():
    """A whole fused CIFAR PreActResNet (blocks chained through their epilogue statistics) compiles
    without graph breaks and matches the uncompiled model, forward and backward."""
    from fused_preact.models import preact_resnet_cifar

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = preact_resnet_cifar(8, fused=True, backend="triton").to(DEVICE)
    twin = preact_resnet_cifar(8, fused=True, backend="triton").to(DEVICE)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    ya = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    yb = twin(x)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert_close(ya, yb, torch.float32, "forward")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, torch.float32, f"grad {name}")


def test_dispatch_report_after_compiled_calls_only():
    """A module whose calls were all traced by torch.compile has no plan-cache entry (a traced call
    keeps no Python state): dispatch_report() lists what its graph runs from the module's own record
    (``last_backend``, ``fallback_reason``) as ``traced``, not nothing."""
    from fused_preact.dispatch import dispatch_report

    torch.manual_seed(0)
    m = FusedPreActBlock(8, 8, backend="auto").to(DEVICE)
    torch.compile(m, backend="aot_eager")(torch.randn(2, 8, 6, 6, device=DEVICE))
    report = dispatch_report(m)
    assert len(report) == 1 and report[0]["source"] == "traced", report
    assert (report[0]["runs"], report[0]["reason"]) == (m.last_backend, m.fallback_reason) and m.last_backend
    assert "[traced]" in str(report)
    m.memory = "lean"  # another policy: the record no longer describes the module
    assert len(dispatch_report(m)) == 0
    m.memory = "fastest"
    assert len(dispatch_report(m)) == 1
    m.to(DEVICE)  # _apply: plans and the record rebuilt on the next call
    assert len(dispatch_report(m)) == 0


def test_converted_block_with_attributes_of_every_kind_compiles_fullgraph():
    """A converted block checks on every call whether the original block's public attributes changed
    (``ConvertedPreActBlock._changed_attributes``); the check traces without a graph break whatever
    the attributes hold — a tuple with a tensor (``is`` between tuples does not trace), NaN, a list,
    a dict, a tensor — and a NaN attribute that came back from torch.save/load (another float object,
    NaN ≠ NaN) does not read as changed."""
    import copy
    import io

    import torch.nn as nn
    from test_convert import CifarPreActBlock

    from fused_preact.conversion import convert

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = CifarPreActBlock(4, 4)
    block.pair, block.nan, block.items, block.table, block.scale = (torch.ones(1), 2), float("nan"), [1], {"a": 1}, \
        torch.ones(3)
    model = convert(nn.Sequential(block)).to(DEVICE)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4, 6, 6, device=DEVICE)
    assert_close(torch.compile(model, fullgraph=True, backend="aot_eager")(x), eager(x), torch.float32, "forward")
    assert model[0].last_backend != "reference"
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded(x)
    assert loaded[0].last_backend != "reference", loaded[0].fallback_reason


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_tracers_the_fused_path_cannot_serve_record_the_plain_ops(train):
    """``torch.jit.trace`` and ``torch.export`` with a dynamic batch dimension (non-strict) record the
    plain PyTorch ops (``spec.trace_reasons``): the traced module computes eager's result at another
    batch size; a forced fused backend raises there, naming the tracer."""
    torch.manual_seed(0)
    block = FusedPreActBlock(4, 8, 2).to(DEVICE).train(train)
    x, x5 = torch.randn(2, 4, 6, 6, device=DEVICE), torch.randn(5, 4, 6, 6, device=DEVICE)
    twin = copy.deepcopy(block)
    traced = torch.jit.trace(copy.deepcopy(block), (x,), check_trace=False)
    assert_close(traced(x5), copy.deepcopy(block)(x5), torch.float32, "jit.trace")
    batch = torch.export.Dim("batch", min=2, max=16)
    exported = torch.export.export(twin, (x,), dynamic_shapes=({0: batch},), strict=False)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "aten.conv2d.default" in targets and not any("fused_preact" in t for t in targets)
    assert_close(exported.module()(x5), copy.deepcopy(block)(x5), torch.float32, "export")
    forced = FusedPreActBlock(4, 8, 2, backend="triton").to(DEVICE).train(train)
    with pytest.raises(RuntimeError, match="torch.jit.trace"):
        torch.jit.trace(forced, (x,), check_trace=False)
    with pytest.raises(RuntimeError, match="symbolic sizes"):
        torch.export.export(forced, (x,), dynamic_shapes=({0: batch},), strict=False)
