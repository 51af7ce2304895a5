"""The host side of the fused path: ATen ops and kernel launches per block, per-unit launch budgets,
and the per-module plan cache (nothing is decided twice).

Counted as the hot-path issue defines it: profiler events named ``aten::*`` with no ``aten::*``
ancestor, leaving out the torch calls Triton's interpreter makes inside a launch, plus Triton kernel
launches; the eager twin's ATen ops are counted the same way.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from torch.profiler import ProfilerActivity, profile

import fused_preact.ops.triton.plan as triton_plans
from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck
from fused_preact.models import PreActBlock, PreActBottleneck

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="counts launches through Triton's interpreter")

_LAUNCH = "triton_launch"


def _count(step, monkeypatch) -> tuple[int, int, collections.Counter]:
    """(top-level ATen ops, Triton launches, ATen op names) of one call of ``step``."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = [0]
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[0] += 1
        with torch.profiler.record_function(_LAUNCH):
            return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    monkeypatch.setattr(InterpretedFunction, "run", real)
    names: collections.Counter = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not (parent.name.startswith("aten::") or parent.name == _LAUNCH):
            parent = parent.cpu_parent
        if parent is None:
            names[e.name] += 1
    return sum(names.values()), launches[0], names


def _fwd_bwd(module: nn.Module, x: torch.Tensor):
    def step():
        module(x).sum().backward()

    return step


@pytest.mark.parametrize("fused_cls,eager_cls,args", [
    (FusedPreActBottleneck, PreActBottleneck, (256, 64)),
    (FusedPreActBlock, PreActBlock, (64, 128, 2)),
], ids=["bottleneck-256-64", "basic-64-128-s2"])
def test_fused_block_issues_at_most_125_percent_of_eager_ops(fused_cls, eager_cls, args, monkeypatch, capsys):
    torch.manual_seed(0)
    fused = fused_cls(*args, backend="triton")
    eager = eager_cls(*args)
    eager.load_state_dict(fused.state_dict())
    x = torch.randn(2, args[0], 8, 8, requires_grad=True)
    counts = {}
    for name, m in (("eager", eager), ("fused", fused)):
        step = _fwd_bwd(m, x)
        step()  # warm-up: plans built, .grad allocated
        counts[name] = _count(step, monkeypatch)
    e_ops, e_launch, _ = counts["eager"]
    f_ops, f_launch, f_names = counts["fused"]
    with capsys.disabled():
        print(f"\n{fused_cls.__name__}{args}: fused {f_ops} ATen + {f_launch} launches = {f_ops + f_launch}, "
              f"eager {e_ops} ATen ({(f_ops + f_launch) / e_ops:.2f}x); fused ATen: {dict(f_names)}")
    assert e_launch == 0
    assert f_ops + f_launch <= 1.25 * e_ops, (f_ops, f_launch, e_ops, f_names)


def _launches(step, monkeypatch) -> int:
    return _count(step, monkeypatch)[1]


def test_launch_budget_per_unit(monkeypatch):
    """Forward ≤ 2 launches per unit whose statistics come from its producer's epilogue (plus the
    statistics pass of the first BatchNorm); backward 3 per unit."""
    torch.manual_seed(0)
    block = FusedPreActBottleneck(32, 8, backend="triton")
    x = torch.randn(2, 32, 6, 6, requires_grad=True)
    block(x).sum().backward()
    fwd = _launches(lambda: block(x), monkeypatch)
    assert fwd == 1 + 2 * 3  # statistics pass of x, then (finalize, fprop) per unit
    y = block(x)
    bwd = _launches(lambda: y.sum().backward(), monkeypatch)
    assert bwd <= 3 * 3


def test_repeated_calls_decide_nothing_again(monkeypatch):
    """The second call with the same input signature builds no plan; a new signature, a module move
    (``.to()``) or an optimizer step is handled (the plan reads the weights in place)."""
    built = []
    real = triton_plans.TritonPlan.__init__
    monkeypatch.setattr(triton_plans.TritonPlan, "__init__", lambda self, *a, **k: built.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    block = FusedPreActBlock(8, 8, backend="triton")
    x = torch.randn(2, 8, 5, 5)
    block(x)
    block(x)
    assert len(built) == 1
    block(torch.randn(3, 8, 5, 5))
    assert len(built) == 2
    block.to(torch.float32)
    block(x)
    assert len(built) == 3
    # A step small enough to keep the outputs O(1): with lr = 0.5 they reach 1e6 and cancel to O(100)
    # in places, where fp32's summation order alone exceeds an elementwise rtol of 1e-4.
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    before = block.eval()(x)
    block.train()(x).square().sum().backward()
    opt.step()
    ref = PreActBlock(8, 8)
    ref.load_state_dict(block.state_dict())
    after = block.eval()(x)
    assert (after - before).abs().max() > 1e-2  # the step changed what the cached plan computes
    torch.testing.assert_close(after, ref.eval()(x), rtol=1e-4, atol=1e-5)


def test_unit_plans_are_per_module_and_copies_start_empty():
    import copy

    m = FusedBNReLUConv2d(4, 4, 3, padding=1, backend="triton")
    m(torch.randn(2, 4, 5, 5))
    assert len(m._plans) == 1
    assert len(copy.deepcopy(m)._plans) == 0


def _project_frames_at_first_launch(step, monkeypatch) -> list[str]:
    """The fused_preact functions on the stack when ``step`` makes its first Triton launch, outermost
    first."""
    import inspect
    import os

    from triton.runtime.interpreter import InterpretedFunction

    import fused_preact

    root = os.path.dirname(fused_preact.__file__)
    seen: list = []
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not seen:
            seen.append([f.function for f in reversed(inspect.stack()[1:]) if f.filename.startswith(root)])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    step()
    monkeypatch.setattr(InterpretedFunction, "run", real)
    return seen[0]


@pytest.mark.parametrize("module", [lambda: FusedBNReLUConv2d(8, 8, 3, padding=1, backend="triton"),
                                    lambda: FusedPreActBlock(8, 16, 2, backend="triton"),
                                    lambda: FusedPreActBottleneck(16, 4, backend="triton")],
                         ids=["unit", "basic", "bottleneck"])
def test_frames_from_forward_and_backward_to_the_first_launch(module, monkeypatch):
    """≤ 6 project frames from a module's forward to its first kernel launch, ≤ 4 from the autograd
    node's backward (forward → run_units → run_chain → ChainFunction.forward → plan.forward →
    launcher; ChainFunction.backward → plan.backward → plan._backward_unit → launcher)."""
    torch.manual_seed(0)
    m = module()
    x = torch.randn(2, m.bn1.num_features if hasattr(m, "bn1") else 8, 6, 6, requires_grad=True)
    m(x).sum().backward()  # plans built
    fwd = _project_frames_at_first_launch(lambda: m(x), monkeypatch)
    assert fwd[0] == "forward" and len(fwd) <= 6, fwd
    y = m(x).sum()
    bwd = _project_frames_at_first_launch(lambda: y.backward(), monkeypatch)
    assert bwd[0] == "backward" and len(bwd) <= 4, bwd
