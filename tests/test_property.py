"""Property-based differential testing (hypothesis): random conv geometry, groups, layouts and modes,
fused kernels vs the float64 reference — forward, every gradient and the running statistics.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default; fixed seed, sized for the interpreter) and ``gpu``
(many more examples, for sessions with a CUDA device).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_op import _run

from fused_preact.ops._common import conv_out_size

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@st.composite
def geometries(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    C = groups * draw(st.integers(1, 8))
    K = groups * draw(st.integers(1, 8))
    R = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 3))
    pad = draw(st.integers(0, 2))
    dil = draw(st.integers(1, 2))
    N = draw(st.integers(1, 3))
    H = draw(st.integers(1, 9))
    W = draw(st.integers(1, 9))
    assume(conv_out_size(H, R, stride, pad, dil) > 0 and conv_out_size(W, R, stride, pad, dil) > 0)
    return (N, C, H, W, K, R, stride, pad, dil, groups)


# Random geometries add shapes to the kernel paths test_op.py covers one by one; on a GPU each example
# is a handful of Triton compilations, so the whole test is ``slow`` (run last by gpu_session.sh check).
@pytest.mark.slow
@given(
    shape=geometries(),
    training=st.booleans(),
    channels_last=st.booleans(),
    affine=st.booleans(),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_reference(shape, training, channels_last, affine, bias, dtype, seed):
    N, _, H, W = shape[:4]
    # BN backward over fewer than 4 values per channel is ill-conditioned (x̂ = ±1 for 2 values),
    # so a relative comparison of dx says nothing there.
    assume(not training or N * H * W >= 4)
    _run(shape, training, channels_last, dtype, affine=affine, bias=bias, seed=seed)


# ------------------------------------------------------------------------ mutations between calls
_MUTATIONS = ("train", "eval", "padding", "stride", "dilation", "replace_buffers", "momentum_none",
              "momentum", "hook_on", "hook_off", "float64", "float32", "channels_last", "replace_weight")


def _mutate(kind: str, arg: int, fused, eager, state: dict) -> None:
    """Apply one user-level change to both twins (fused module and its eager nn.Sequential)."""
    import torch.nn as nn

    pairs = ((fused.bn, fused.conv, fused), (eager[0], eager[2], eager))
    for bn, conv, mod in pairs:
        if kind in ("train", "eval"):
            mod.train(kind == "train")
        elif kind in ("padding", "stride", "dilation"):
            setattr(conv, kind, (arg % 3 if kind == "padding" else 1 + arg % 2,) * 2)
        elif kind == "replace_buffers":
            g = torch.Generator().manual_seed(arg)
            bn.running_mean = torch.randn(bn.num_features, generator=g).to(bn.weight)
            bn.running_var = (torch.rand(bn.num_features, generator=g) + 0.5).to(bn.weight)
        elif kind == "momentum_none":
            bn.momentum = None
        elif kind == "momentum":
            bn.momentum = 0.3
        elif kind == "hook_on":
            state.setdefault("hooks", []).append(bn.register_forward_hook(lambda *a: None))
        elif kind == "hook_off":
            for h in state.pop("hooks", []):
                h.remove()
        elif kind in ("float64", "float32"):
            mod.to(getattr(torch, kind))
        elif kind == "replace_weight":
            g = torch.Generator().manual_seed(arg)
            w = torch.randn(conv.weight.shape, generator=g).to(conv.weight) * 0.3
            conv.weight = nn.Parameter(w.contiguous(memory_format=torch.channels_last) if arg % 2 else w)
    if kind == "channels_last":
        state["channels_last"] = not state.get("channels_last", False)


@pytest.mark.slow
@given(steps=st.lists(st.tuples(st.sampled_from(_MUTATIONS), st.integers(0, 5)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
@settings(max_examples=int(os.environ.get("MUTATION_EXAMPLES", "10")))
def test_mutations_between_calls_match_eager(steps, seed):
    """The plan cache against eager: after each drawn change to the modules (geometry, buffers, BN
    flags, hooks, dtype, layout, weights), forward + backward of the fused module matches its eager
    twin — output, every gradient, running statistics, counters."""
    import copy

    import torch.nn as nn
    from conftest import DEVICE
    from helpers import assert_close

    from fused_preact import FusedBNReLUConv2d

    torch.manual_seed(seed)
    fused = FusedBNReLUConv2d(4, 6, 3, padding=1, backend="auto").to(DEVICE)
    eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv))
    state: dict = {}
    seen_fp32 = False
    for i, (kind, arg) in enumerate([("train", 0)] + steps):
        _mutate(kind, arg, fused, eager, state)
        dtype = fused.conv.weight.dtype
        x = torch.randn(2, 4, 7, 7, dtype=dtype, device=DEVICE)
        if state.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        outs = []
        for m in (fused, eager):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.square().sum().backward()
            outs.append([y, xi.grad] + [p.grad for p in m.parameters()] + list(m.state_dict().values()))
        # Running statistics (and, in eval mode, outputs) carry an fp32 call's rounding into later calls.
        seen_fp32 |= dtype == torch.float32
        tol = torch.float32 if seen_fp32 else dtype
        expected = "reference" if dtype == torch.float64 or state.get("hooks") else "triton"
        assert fused.last_backend == expected, (i, kind, fused.last_backend, fused.fallback_reason)
        for j, (a, b) in enumerate(zip(*outs)):
            if a.is_floating_point():
                assert_close(a, b, tol, f"step {i} ({kind}) tensor {j}")
            else:
                assert torch.equal(a, b), (i, kind, j)
