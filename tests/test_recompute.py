"""The recompute backend's own contracts: its ATen path (no Triton interpreter) against the reference,
its launches per unit, and how deep in the project's frames its kernels are launched.

Its numerics with the Triton kernels (interpreter) are tested with every other backend in
test_op/test_modules/test_modes/test_models/test_nan/test_sync_bn (``helpers.FUSED_BACKENDS``), its
saved-tensor economy in test_saved_tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
from fused_preact.dispatch import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "fused_preact")
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="counts launches through Triton's interpreter")

_ATEN_PATH = textwrap.dedent(
    """
    from collections import OrderedDict
    import torch
    import torch.nn as nn
    from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
    from fused_preact.models import PreActBlock, PreActBottleneck
    from fused_preact.ops import BNMode, ChainSpec, ChainTensors, ConvGeom, EXTERNAL, PlanCache, UnitTensors, run_chain
    from fused_preact.ops.backends import RecomputeBackend
    from fused_preact.ops.validate import EAGER_FLOOR, ErrorPool, rule_violations

    assert "aten on CPU" in RecomputeBackend.runtime_mode(), RecomputeBackend.runtime_mode()
    worst = 0.0

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()

    def check(fused, eager, shape, train, cl):
        global worst
        torch.manual_seed(1)
        for m in fused.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.data.uniform_(0.5, 1.5); m.bias.data.normal_(0, 0.5)
                m.running_mean.normal_(0, 0.5); m.running_var.uniform_(0.5, 1.5)
        eager.load_state_dict(fused.state_dict())
        fused.train(train); eager.train(train)
        x = torch.randn(shape) + 0.5
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        xf, xe = x.clone().requires_grad_(), x.double().requires_grad_()
        y = fused(xf)
        ye = eager.double()(xe)
        dy = torch.randn(ye.shape, dtype=torch.float64)
        y.backward(dy.to(y.dtype)); ye.backward(dy)
        assert fused.last_backend == "recompute", fused.fallback_reason
        tol = 1e-4
        errs = [rel(y, ye), rel(xf.grad, xe.grad)]
        errs += [rel(p.grad, q.grad) for p, q in zip(fused.parameters(), eager.parameters())]
        errs += [rel(b, c) for b, c in zip(fused.buffers(), eager.buffers()) if b.is_floating_point()]
        assert max(errs) <= tol, (type(fused).__name__, shape, train, cl, errs)
        assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
        worst = max(worst, max(errs))

    for train in (True, False):
        for cl in (False, True):
            unit = FusedBNReLUConv2d(6, 10, 3, stride=2, padding=2, dilation=2, groups=2, bias=True, backend="recompute")
            eager = nn.Sequential(OrderedDict(bn=nn.BatchNorm2d(6), relu=nn.ReLU(),
                                              conv=nn.Conv2d(6, 10, 3, 2, 2, 2, 2, bias=True)))
            check(unit, eager, (3, 6, 9, 8), train, cl)
            for cls, ecls, args in ((FusedPreActBlock, PreActBlock, (8, 8, 1)), (FusedPreActBlock, PreActBlock, (5, 8, 2)),
                                    (FusedPreActBottleneck, PreActBottleneck, (16, 4, 1)),
                                    (FusedPreActBottleneck, PreActBottleneck, (6, 4, 2))):
                check(cls(*args, backend="recompute"), ecls(*args), (2, args[0], 9, 7), train, cl)
    # bf16 autocast: the eager-relative rule against float64, pooled over three draws (helpers.assert_within_eager)
    torch.manual_seed(4)
    fused = FusedPreActBottleneck(6, 4, 2, backend="recompute")
    twin, exact = PreActBottleneck(6, 4, 2), PreActBottleneck(6, 4, 2).double()
    twin.load_state_dict(fused.state_dict()); exact.load_state_dict(fused.state_dict())
    pools = {"fused": ErrorPool(), "eager": ErrorPool()}
    for draw in range(3):
        x = (torch.randn(4, 6, 9, 7) + 0.5).contiguous(memory_format=torch.channels_last)
        x64 = x.double().requires_grad_()
        y64 = exact(x64)
        dy = torch.randn(y64.shape, dtype=torch.float64)
        y64.backward(dy)
        ref = [y64, x64.grad] + [p.grad for p in exact.parameters()] + list(exact.buffers())
        for name, m in (("fused", fused), ("eager", twin)):
            xx = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(xx)
            y.backward(dy.to(y.dtype))
            got = [y, xx.grad] + [p.grad for p in m.parameters()] + list(m.buffers())
            for j, (g, r) in enumerate(zip(got, ref)):
                if r.is_floating_point():
                    pools[name].add(str(j), g, r)
            m.zero_grad()
        exact.zero_grad()
    bad = rule_violations(pools["fused"].rels(), pools["eager"].rels(), EAGER_FLOOR[torch.bfloat16])
    assert not bad and fused.last_backend == "recompute", bad

    # statistics given from outside (synchronized BN) and a returned projection, at the op level
    torch.manual_seed(2)
    spec = ChainSpec((ConvGeom(6, 8, (3, 3), (2, 2), (1, 1)),), ConvGeom(6, 8, (1, 1), (2, 2)), "return")
    x = torch.randn(3, 6, 7, 7)
    leaves = dict(w=torch.randn(8, 6, 3, 3) * 0.2, g=torch.rand(6) + 0.5, b=torch.randn(6), pw=torch.randn(8, 6, 1, 1),
                  m=torch.randn(6) * 0.3, s=torch.rand(6) + 0.5)
    outs = {}
    for backend in ("recompute", "reference"):
        lv = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        xx = x.clone().requires_grad_()
        t = ChainTensors([UnitTensors(lv["w"], None, lv["g"], lv["b"])], proj_weight=lv["pw"], ext_mean=lv["m"],
                         ext_invstd=lv["s"])
        res, choice = run_chain(backend, PlanCache(), spec, xx, t, (BNMode(EXTERNAL, True),))
        assert choice.name == backend
        gen = torch.Generator().manual_seed(3)
        (res.out * torch.randn(res.out.shape, generator=gen)).sum().backward(retain_graph=True)
        (res.proj_out * torch.randn(res.proj_out.shape, generator=gen)).sum().backward()
        outs[backend] = [res.out, res.proj_out, xx.grad] + [lv[k].grad for k in sorted(lv)]
    errs = [rel(a, b) for a, b in zip(outs["recompute"], outs["reference"])]
    assert max(errs) <= 1e-4, errs
    worst = max(worst, max(errs))
    print("OK", worst)
    """
)


def test_aten_path_without_interpreter_matches_eager():
    """Without Triton's interpreter (and without CUDA) the recompute backend runs its elementwise
    steps as ATen ops: unit (strided, dilated, grouped, bias), basic and bottleneck blocks with both
    shortcuts, train and eval, NCHW and channels_last, bf16 autocast, and externally given statistics
    with a returned projection, against float64 eager / the reference path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _ATEN_PATH], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("OK"), out.stdout


def _launches(step, monkeypatch) -> list:
    """Names of the Triton kernels ``step()`` launches (through the interpreter), in order."""
    from triton.runtime.interpreter import InterpretedFunction

    names = []
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    try:
        step()
    finally:
        monkeypatch.setattr(InterpretedFunction, "run", real)
    return names


@interpreter_only
def test_launches_per_unit(monkeypatch):
    """Forward, per unit: statistics pass, finalize, the pre-activation pass (cuDNN's convolution is
    ATen). Backward, per unit: the pre-activation again, BN's backward reduction, the fold of its sums,
    the dx pass."""
    torch.manual_seed(0)
    block = FusedPreActBottleneck(32, 8, backend="recompute")
    x = torch.randn(2, 32, 6, 6, requires_grad=True)
    block(x).sum().backward()
    fwd = _launches(lambda: block(x), monkeypatch)
    assert fwd == ["_stats_partial_kernel", "_finalize_kernel", "_preact_kernel"] * 3
    y = block(x)
    bwd = _launches(lambda: y.sum().backward(), monkeypatch)
    assert bwd == ["_preact_kernel", "_mask_sums_kernel", "_wgrad_kernel", "_dx_kernel"] * 3
    block.eval()
    fwd = _launches(lambda: block(x), monkeypatch)  # eval: no statistics pass
    assert fwd == ["_finalize_kernel", "_preact_kernel"] * 3


def _first_launch_depth(step, monkeypatch) -> list[str]:
    """The project frames (files under fused_preact/) on the stack at the first Triton launch of
    ``step()``, outermost first."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list = []
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not seen:
            seen.append([f"{Path(f.filename).name}:{f.name}" for f in traceback.extract_stack()
                         if f.filename.startswith(PACKAGE)])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    try:
        step()
    finally:
        monkeypatch.setattr(InterpretedFunction, "run", real)
    return seen[0]


@interpreter_only
@pytest.mark.parametrize("backend", ["triton", "recompute"])
def test_first_launch_within_six_frames_forward_four_backward(backend, monkeypatch):
    """On a plan-cache hit a block's forward reaches its first kernel launch through module.forward →
    run_units → run_chain → ChainFunction.forward → plan.forward → launcher (6 project frames), its
    backward through ChainFunction.backward → plan.backward → plan._backward_unit → launcher (4)."""
    torch.manual_seed(0)
    block = FusedPreActBlock(8, 8, backend=backend)
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    block(x).sum().backward()  # plans built
    fwd = _first_launch_depth(lambda: block(x), monkeypatch)
    assert len(fwd) <= 6, fwd
    y = block(x)
    bwd = _first_launch_depth(lambda: y.sum().backward(), monkeypatch)
    assert len(bwd) <= 4, bwd
    assert bwd[0] == "chain.py:backward", bwd


def test_forced_recompute_under_compile_says_it_does_not_trace():
    m = FusedBNReLUConv2d(3, 4, 3, padding=1, backend="recompute")
    with pytest.raises(Exception, match="recompute"):
        torch.compile(m, fullgraph=True, backend="eager")(torch.randn(2, 3, 5, 5))
    torch._dynamo.reset()


def test_runtime_mode_and_refusals():
    rb = BACKENDS["recompute"]
    assert rb.runtime_mode().startswith("interpreter on CPU" if DEVICE == "cpu" else "triton on CUDA")
    assert rb.not_supported_reasons(torch.empty(1, device="cpu").expand(1, 8, 1, 1)) == []
    assert "not in" in rb.not_supported_reasons(torch.empty(1, dtype=torch.float64).expand(1, 8, 1, 1))[0]
