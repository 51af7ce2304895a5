"""Backends declare what they can do, and everything else reads the declaration.

Every fused backend's plan satisfies the :class:`~fused_preact.ops.backends.Plan` protocol (what
callers read of it), and a backend registered from outside the package is enrolled everywhere —
forced and automatic dispatch, measured candidates, the parity helpers' list, the dispatch report,
``torch.compile``'s refusal — without an edit elsewhere.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import DEVICE
from helpers import TOL, assert_close

from fused_preact import FusedBNReLUConv2d
from fused_preact.dispatch import backends as backend_report
from fused_preact.ops import auto, backends, library
from fused_preact.ops.backends import BACKENDS, Plan, RecomputeBackend
from fused_preact.ops.spec import BATCH, BNMode, ChainSpec, ConvGeom

SPEC = ChainSpec((ConvGeom(8, 8, (3, 3), padding=(1, 1)), ConvGeom(8, 8, (1, 1))), ConvGeom(8, 8, (1, 1)),
                 "return", "none")
MODES = (BNMode(BATCH, True), BNMode(BATCH, True))


def _protocol_members() -> dict:
    return {n: v for n, v in vars(Plan).items() if not n.startswith("_")}


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if b.fused])
def test_every_fused_plan_satisfies_the_protocol(name):
    """Each plan has every attribute of the protocol (proj_shape included, None without a projection)
    and its methods take the protocol's parameters."""
    backend = BACKENDS[name]
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    for spec in (SPEC, ChainSpec(SPEC.convs[:1])):
        if name == "cuda":  # the extension's plan composes its ops at call time: it builds anywhere
            from fused_preact.ops.cuda.plan import CudaPlan
            plan = CudaPlan(spec, MODES[:len(spec.convs)], x.shape, x.dtype, torch.float16, None)
        else:
            if backend.not_supported_reasons(x, spec):
                pytest.skip(f"{name} does not serve {DEVICE}")
            plan = backend.make_plan(spec, MODES[:len(spec.convs)], x, x.dtype, False, False, None)
        assert isinstance(plan, Plan)
        assert (plan.proj_shape is None) == (spec.proj is None)
        for member, value in _protocol_members().items():
            if callable(value):
                want = list(inspect.signature(value).parameters)
                got = ["self"] + list(inspect.signature(getattr(plan, member)).parameters)
                assert got == want, (member, got, want)
    if vars(type(plan)).get("out_stats") is False:  # a plan that never hands out statistics says so
        with pytest.raises(RuntimeError, match="no output statistics"):
            plan.handoff_geometry()


class ToyBackend(RecomputeBackend):
    """A backend from outside the package: recompute's plan under another name, opt-in, not traceable."""

    name = "toy"
    static = ()
    traceable = False


@pytest.fixture
def toy():
    backends.register(ToyBackend)
    try:
        yield ToyBackend
    finally:
        backends.unregister("toy")
    assert "toy" not in BACKENDS


def test_a_registered_backend_is_enrolled_everywhere(toy):
    # forced dispatch: the module accepts the name and runs it, with eager's results
    torch.manual_seed(0)
    m = FusedBNReLUConv2d(8, 8, 3, padding=1, backend="toy").to(DEVICE)
    ref = FusedBNReLUConv2d(8, 8, 3, padding=1, backend="reference").to(DEVICE)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [mod(xi) for mod, xi in zip((m, ref), xs)]
    assert m.last_backend == "toy"
    for o in outs:
        o.square().sum().backward()
    assert_close(outs[0], outs[1], torch.float32, "toy out")
    assert_close(xs[0].grad, xs[1].grad, torch.float32, "toy dx")
    assert_close(m.conv.weight.grad, ref.conv.weight.grad, torch.float32, "toy dw")
    assert TOL[torch.float32] > 0
    # the reference stays the static orders' last resort; an opt-in backend is in none of them
    assert list(BACKENDS)[-1] == "reference" and "toy" not in backends.static_order("fastest") + \
        backends.static_order("lean")
    # auto measures it as a candidate; the dispatch report lists its capabilities
    spec = ChainSpec((ConvGeom(8, 8, (3, 3), padding=(1, 1)),))
    assert "toy" in [c.name for c in auto._candidates(x, spec, x.dtype, None)]
    assert backend_report([DEVICE])["toy"]["traceable"] is False
    # the parity helpers' list reads the same declarations
    import helpers
    assert "toy" in [n for n, b in BACKENDS.items()
                     if b.fused and not b.not_supported_reasons(torch.empty(1, device=DEVICE).expand(1, 8, 1, 1))]
    assert set(helpers.FUSED_BACKENDS) <= set(BACKENDS)
    # torch.compile: refused as declared (not traceable), and auto traces another backend in its place
    with pytest.raises(NotImplementedError, match="'toy' under torch.compile"):
        library.compiled_chain(toy, spec, x, None, (BNMode(BATCH, True),), None)
    with pytest.raises(NotImplementedError, match="does not run under torch.compile"):
        toy.compiled_plan(spec, (BNMode(BATCH, True),), tuple(x.shape), x.stride(), x.dtype, x.device, x.dtype, None)


def test_register_refuses_a_taken_or_reserved_name():
    class Clash(RecomputeBackend):
        name = "triton"

    class Auto(RecomputeBackend):
        name = "auto"

    for cls in (Clash, Auto):
        with pytest.raises(ValueError, match="cannot register"):
            backends.register(cls)
    assert BACKENDS["triton"] is backends.TritonBackend
