"""Fused modules against eager ``nn.BatchNorm2d → nn.ReLU → nn.Conv2d`` where users meet the edges:
double backward, modules changed between calls, replaced buffers, eager's argument checks, meta
tensors, hooks, in-place changes between forward and backward, empty batches, overflowing statistics,
the interpreter switched on late, and compile-safety of fallbacks.

Every comparison runs the fused kernels (``last_backend == "triton"`` is asserted) or asserts which
path ran and why; references are eager twins with the same parameters, in float32 and float64.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE
from helpers import assert_close

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import PreActBlock
from fused_preact.ops import bn_relu_conv2d

pytestmark = pytest.mark.usefixtures("one_thread")


def _twins(C=4, K=6, k=3, padding=1, stride=1, seed=0, **bn):
    torch.manual_seed(seed)
    fused = FusedBNReLUConv2d(C, K, k, stride=stride, padding=padding, backend="auto", **bn).to(DEVICE)
    with torch.no_grad():
        if fused.bn.weight is not None:
            fused.bn.weight.uniform_(0.5, 1.5)
            fused.bn.bias.uniform_(-0.5, 0.5)
    eager = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv))
    return fused, eager


def _x(*shape, seed=1, dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(requires_grad)


def _grads(module, x, loss_fn):
    xg = x.detach().clone().requires_grad_()
    loss = loss_fn(module, xg)
    loss.backward()
    return loss.detach(), xg.grad, [p.grad.clone() for p in module.parameters()]


# ------------------------------------------------------------------------------- double backward
def _penalty_loss(m, x):
    """loss + ‖∂loss/∂x‖²: an R1 / input-gradient penalty (needs the gradient's graph)."""
    y = m(x)
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)).sum()
    gx, = torch.autograd.grad(loss, x, create_graph=True)
    return loss + gx.square().sum()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_double_backward_matches_eager(train):
    fused, eager = _twins()
    fused.train(train)
    eager.train(train)
    x = _x(2, 4, 5, 5)
    lf, gxf, gpf = _grads(fused, x, _penalty_loss)
    assert fused.last_backend == "triton"
    le, gxe, gpe = _grads(eager, x, _penalty_loss)
    assert_close(lf, le, torch.float32, "loss")
    assert_close(gxf, gxe, torch.float32, "dx")
    for a, b in zip(gpf, gpe):
        assert_close(a, b, torch.float32, "param grad")
    assert_close(fused.bn.running_mean, eager[0].running_mean, torch.float32, "running_mean")


def test_double_backward_of_a_block_matches_eager():
    torch.manual_seed(0)
    fused = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    eager = PreActBlock(4, 8, stride=2).to(DEVICE)
    eager.load_state_dict(fused.state_dict())
    x = _x(2, 4, 6, 6)
    _, gxf, gpf = _grads(fused, x, _penalty_loss)
    _, gxe, gpe = _grads(eager, x, _penalty_loss)
    assert_close(gxf, gxe, torch.float32, "dx")
    for (name, _), a, b in zip(fused.named_parameters(), gpf, gpe):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("what", ["bn.bias", "conv.bias"])
def test_double_backward_after_an_inplace_change_raises(what):
    """A double backward recomputes the chain from β and the conv biases as they are at backward
    time; one changed in place since the forward (e.g. an optimizer step) would silently change the
    gradient, so it raises autograd's in-place error. A plain backward still gives the forward's
    gradient, as eager's does (its ReLU saved the forward's output)."""
    torch.manual_seed(0)
    fused = FusedPreActBlock(4, 4, backend="triton").to(DEVICE)
    fused.conv1.bias = nn.Parameter(torch.randn(4, device=DEVICE))  # the chain's inner bias feeds bn2
    tensor = fused.bn1.bias if what == "bn.bias" else fused.conv1.bias
    x = _x(2, 4, 5, 5)
    for create_graph in (True, False):
        y = fused(x)
        with torch.no_grad():
            tensor.add_(1.0)
        if create_graph:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(y.square().sum(), x, create_graph=True)
        else:
            gx, = torch.autograd.grad(y.square().sum(), x)
            with torch.no_grad():
                tensor.sub_(1.0)
            ref = x.detach().clone().requires_grad_()
            assert_close(gx, torch.autograd.grad(fused(ref).square().sum(), ref)[0], torch.float32, what)
    assert fused.last_backend == "triton"


@pytest.mark.parametrize("grad_mode", ["no_grad", "frozen"])
def test_forward_mode_ad_tangent_as_eager(grad_mode):
    """Forward-mode AD (a dual input) where no autograd node is built — under no_grad, or with frozen
    parameters: the fused kernels would drop the tangent; the chain runs the reference ops, named."""
    import torch.autograd.forward_ad as fwAD

    fused, eager = _twins()
    if grad_mode == "frozen":
        for p in (*fused.parameters(), *eager.parameters()):
            p.requires_grad_(False)
    x, tangent = _x(2, 4, 5, 5, requires_grad=False), _x(2, 4, 5, 5, seed=2, requires_grad=False)
    outs = []
    for m in (fused, eager):
        with fwAD.dual_level(), (torch.no_grad() if grad_mode == "no_grad" else contextlib.nullcontext()):
            outs.append(fwAD.unpack_dual(m(fwAD.make_dual(x, tangent))).tangent)
    assert outs[0] is not None and "forward-mode AD" in fused.fallback_reason
    assert_close(outs[0], outs[1], torch.float32, "tangent")


def test_non_reentrant_checkpoint_on_the_first_call():
    """torch.utils.checkpoint (non-reentrant) counts the tensors saved in forward and in its
    recomputation: the first call's checks (a cache miss) must save none of their own."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    fused = FusedPreActBlock(4, 8, stride=2, backend="triton").to(DEVICE)
    eager = PreActBlock(4, 8, stride=2).to(DEVICE)
    eager.load_state_dict(fused.state_dict())
    grads = []
    for m in (fused, eager):
        x = _x(2, 4, 6, 6)
        checkpoint(m, x, use_reentrant=False).square().sum().backward()
        grads.append(x.grad)
    assert fused.last_backend == "triton"
    assert_close(grads[0], grads[1], torch.float32, "dx")


# ------------------------------------------------------------------ modules changed between calls
@pytest.mark.parametrize("change", ["padding", "stride", "dilation"])
def test_conv_geometry_changed_after_the_first_call(change):
    fused, eager = _twins()
    x = _x(2, 4, 7, 7, requires_grad=False)
    fused(x)
    for conv in (fused.conv, eager[2]):
        setattr(conv, change, (2, 2))
    y = fused(x)
    assert fused.last_backend == "triton"
    ref = eager(x)
    assert y.shape == ref.shape
    assert_close(y, ref, torch.float32, change)


@pytest.mark.parametrize("buffer", ["running_mean", "running_var", "weight", "bias"])
def test_replaced_bn_tensor_of_the_wrong_length_is_refused_after_a_cached_call(buffer):
    fused, eager = _twins()
    x = _x(2, 4, 5, 5, requires_grad=False)
    fused(x)
    wrong = torch.ones(7, device=DEVICE)
    for bn in (fused.bn, eager[0]):
        if buffer in ("weight", "bias"):
            setattr(bn, buffer, nn.Parameter(wrong.clone()))
        else:
            setattr(bn, buffer, wrong.clone())
    with pytest.raises(RuntimeError) as eager_err:
        eager(x)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(RuntimeError, match="should contain 4 elements not 7"):
        fused(x)
    assert "7" in str(eager_err.value)
    for k, v in fused.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------------------- eager's checks
@pytest.mark.parametrize("train,eps", [(True, 0.0), (True, -1.0), (False, -1.0)])
def test_eps_checks_as_eager_with_state_untouched(train, eps):
    fused, eager = _twins()
    fused.train(train)
    eager.train(train)
    fused.bn.eps = eager[0].eps = eps
    x = _x(2, 4, 5, 5, requires_grad=False)
    with pytest.raises(ValueError) as e:
        eager(x)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(ValueError, match=str(e.value).split(",")[0]):
        fused(x)
    for k, v in fused.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_eps_zero_in_eval_runs_as_eager():
    fused, eager = _twins()
    fused.eval()
    eager.eval()
    fused.bn.eps = eager[0].eps = 0.0
    x = _x(2, 4, 5, 5, requires_grad=False)
    assert_close(fused(x), eager(x), torch.float32)


@pytest.mark.parametrize("case", ["eval-none", "eval-mean-only", "train-mean-only", "train-var-only"])
def test_functional_running_buffer_checks_as_f_batch_norm(case):
    x = _x(2, 4, 5, 5, requires_grad=False)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    train = case.startswith("train")
    args = {"eval-none": (None, None), "eval-mean-only": (rm, None), "train-mean-only": (rm, None),
            "train-var-only": (None, rv)}[case]
    with pytest.raises((RuntimeError, ValueError)) as eager_err:
        F.batch_norm(x, *args, training=train)
    with pytest.raises(type(eager_err.value), match=str(eager_err.value)):
        bn_relu_conv2d(x, w, None, *args, training=train, padding=1)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("missing", ["running_mean", "running_var"])
def test_one_running_buffer_raises_as_eager(missing, train):
    """A BatchNorm with one of its two running buffers set to None: ``nn.BatchNorm2d`` raises (a
    ValueError in training, a RuntimeError in eval); the fused module did run, on batch statistics."""
    errors = []
    for m in _twins():
        m.train(train)
        setattr(m.bn if isinstance(m, FusedBNReLUConv2d) else m[0], missing, None)
        with pytest.raises((ValueError, RuntimeError)) as err:
            m(_x(2, 4, 5, 5))
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1]


def _autograd_buffer_outcome(m, bn, case, grad, x_grad, frozen, cached):
    """Call ``m`` once if ``cached`` (a cached plan), give ``bn`` a running buffer autograd refuses and
    call it: the error (type, message) or, without one, the output and running buffers."""
    if cached:
        m(_x(2, 4, 5, 5))
    name = "running_var" if case.endswith("var") else "running_mean"
    if case.startswith("requires-grad"):
        getattr(bn, name).requires_grad_()
    else:
        with torch.inference_mode():
            setattr(bn, name, getattr(bn, name).clone())
    for p in m.parameters():
        p.requires_grad_(not frozen)
    try:
        with torch.set_grad_enabled(grad):
            y = m(_x(2, 4, 5, 5, seed=3, requires_grad=x_grad))
    except RuntimeError as e:
        return type(e), str(e)
    return y.detach(), bn.running_mean.detach().clone(), bn.running_var.detach().clone()


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "first"])
@pytest.mark.parametrize("frozen", [False, True], ids=["params", "frozen"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", ["requires-grad-mean", "requires-grad-var", "inference-mean", "inference-var"])
@pytest.mark.parametrize("kind", ["unit", "block-bn2"])
def test_running_buffer_autograd_refuses(kind, case, train, grad, x_grad, frozen, cached):
    """A running buffer that requires grad (``F.batch_norm``: not differentiable with respect to it) or
    an inference tensor where the call records a graph (cannot be saved for backward): eager raises
    on every call, whatever ran before, and so must the fused module, on a first call and after a
    cached one. Without an error (no grad mode, nothing requiring grad) both run alike, the buffers
    updated in place."""
    if kind == "unit":
        fused, eager = _twins()
        pairs = ((fused, fused.bn), (eager, eager[0]))
    else:
        torch.manual_seed(0)
        fused = FusedPreActBlock(4, 4, backend="auto").to(DEVICE)
        eager = PreActBlock(4, 4).to(DEVICE)
        eager.load_state_dict(fused.state_dict())
        pairs = ((fused, fused.bn2), (eager, eager.bn2))
    outcomes = []
    for m, bn in pairs:
        m.train(train)
        outcomes.append(_autograd_buffer_outcome(m, bn, case, grad, x_grad, frozen, cached))
    got, want = outcomes
    if isinstance(want[0], type):
        assert got == want
    else:
        assert not isinstance(got[0], type), got
        for a, b, what in zip(got, want, ("output", "running_mean", "running_var")):
            assert_close(a, b, torch.float32, what)


def _outcome(fn):
    try:
        y = fn()
    except RuntimeError as e:
        return type(e), str(e)
    return tuple(y.shape)


@pytest.mark.parametrize("case", ["requires-grad-mean", "inference-var"])
def test_empty_batch_with_a_refused_buffer_runs_as_eager(case):
    """An empty batch: eager's batch_norm returns before it reads the running buffers, so a buffer
    autograd would refuse raises nothing (the case of a rank with no samples)."""
    outcomes = []
    for m in _twins():
        bn = m.bn if isinstance(m, FusedBNReLUConv2d) else m[0]
        if case == "requires-grad-mean":
            bn.running_mean.requires_grad_()
        else:
            with torch.inference_mode():
                bn.running_var = bn.running_var.clone()
        outcomes.append(_outcome(lambda: m(_x(0, 4, 5, 5))))
    assert outcomes[0] == outcomes[1] == (0, 6, 5, 5)


@pytest.mark.parametrize("what", ["module", "num_batches_tracked"])
def test_inference_tensors_of_the_module_as_eager(what):
    """A module built under inference_mode, run in eval with grad on (eager: its tensors cannot be
    saved for backward); an inference-tensor num_batches_tracked in training (eager: the in-place
    count refused). Same error types and messages."""
    if what == "module":
        with torch.inference_mode():
            twins = _twins()
    else:
        twins = _twins()
    outcomes = []
    for m in twins:
        bn = m.bn if isinstance(m, FusedBNReLUConv2d) else m[0]
        if what == "module":
            m.eval()
        else:
            with torch.inference_mode():
                bn.num_batches_tracked = bn.num_batches_tracked.clone()
        outcomes.append(_outcome(lambda: m(_x(2, 4, 5, 5, requires_grad=False))))
    assert isinstance(outcomes[1][0], type), outcomes[1]
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cumulative_average_without_a_counter_as_eager(backend):
    """``momentum=None`` and ``num_batches_tracked`` set to None: ``nn.BatchNorm2d``'s factor stays 0,
    so the running statistics do not move (the reference path divided by None)."""
    fused, eager = _twins(momentum=None)
    fused.backend = backend
    for bn in (fused.bn, eager[0]):
        bn.num_batches_tracked = None
    x = _x(2, 4, 5, 5, requires_grad=False)
    for _ in range(2):
        assert_close(fused(x), eager(x), torch.float32)
    assert fused.last_backend == backend
    assert torch.equal(fused.bn.running_mean, eager[0].running_mean)
    assert torch.equal(fused.bn.running_var, eager[0].running_var)


@pytest.mark.parametrize("train,eps", [(True, 0.0), (False, -0.5)], ids=["train-eps0", "eval-eps-neg"])
def test_eps_checked_under_torch_compile(train, eps):
    """The eps rules hold where the eager probe of ``F.batch_norm`` cannot run (while torch.compile
    traces): the compiled call raises eager's message too."""
    fused, _ = _twins()
    fused.train(train)
    fused.bn.eps = eps
    with pytest.raises(Exception, match="eps must be"):
        torch.compile(fused, backend="eager", fullgraph=True)(_x(2, 4, 5, 5, requires_grad=False))


@pytest.mark.parametrize("what", ["bias", "weight"])
def test_float64_conv_tensor_under_autocast_raises_as_eager(what):
    """Autocast casts every floating tensor of the conv but a float64 one: a float64 bias or weight
    meets a 16-bit input, and eager raises the dtype mismatch (the fused path ran it)."""
    fused = FusedBNReLUConv2d(4, 4, 3, padding=1, bias=True, backend="auto").to(DEVICE)
    p = getattr(fused.conv, what)
    setattr(fused.conv, what, nn.Parameter(p.detach().double()))
    eager = nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
    x = _x(2, 4, 5, 5, requires_grad=False)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="should be the same"):
            eager(x)
        with pytest.raises(RuntimeError, match="should be the same"):
            fused(x)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU autocast to fp16")
def test_autocast_decision_not_reused_without_autocast():
    """A plan cached under autocast (fp16 compute from an fp32 module) is not a cache hit for the same
    fp16 input outside autocast, where eager raises the dtype mismatch."""
    fused, eager = _twins()
    x = _x(2, 4, 5, 5, requires_grad=False).half()
    with torch.autocast("cpu", dtype=torch.float16):
        assert fused(x).dtype == torch.float16
    with pytest.raises(RuntimeError):
        eager(x)
    with pytest.raises(RuntimeError, match="should be the same"):
        fused(x)


def test_functional_momentum_none_raises_as_f_batch_norm():
    x = _x(2, 4, 5, 5, requires_grad=False)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(TypeError) as eager_err:
        F.batch_norm(x, rm, rv, training=True, momentum=None)
    with pytest.raises(TypeError, match=re.escape(str(eager_err.value))):
        bn_relu_conv2d(x, w, None, rm, rv, training=True, momentum=None, padding=1)
    assert torch.equal(rm, torch.zeros_like(rm))


@pytest.mark.parametrize("training", [1, 0, None, "yes", torch.tensor(True)], ids=str)
def test_functional_training_must_be_bool_as_f_batch_norm(training):
    """``training=1`` ran (as training) where ``F.batch_norm`` raises its TypeError; every non-bool now
    raises that error, with its message, before anything runs."""
    import numpy as np

    x = _x(2, 4, 5, 5, requires_grad=False)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    for value in (training, np.bool_(True)):
        with pytest.raises(TypeError) as eager_err:
            F.batch_norm(x, rm, rv, training=value)
        with pytest.raises(TypeError, match=re.escape(str(eager_err.value))):
            bn_relu_conv2d(x, w, None, rm, rv, training=value, padding=1)
    assert torch.equal(rm, torch.zeros_like(rm))


@pytest.mark.parametrize("kind", ["unit", "block"])
def test_batches_counted_without_running_buffers(kind):
    """``running_mean``/``running_var`` set to None (batch statistics always) with
    ``track_running_stats``: ``nn.BatchNorm2d`` still counts each training batch."""
    if kind == "unit":
        fused, eager = _twins()
        bns = [(fused.bn, eager[0])]
    else:
        torch.manual_seed(0)
        fused = FusedPreActBlock(4, 8, stride=2, backend="auto").to(DEVICE)
        eager = PreActBlock(4, 8, stride=2).to(DEVICE)
        eager.load_state_dict(fused.state_dict())
        bns = [(fused.bn1, eager.bn1), (fused.bn2, eager.bn2)]
    for pair in bns[:1] if kind == "block" else bns:  # block: bn1 only, bn2 keeps its buffers
        for bn in pair:
            bn.running_mean = bn.running_var = None
    x = _x(2, 4, 6, 6, requires_grad=False)
    for _ in range(3):
        assert_close(fused(x), eager(x), torch.float32)
    assert fused.last_backend == "triton"
    for f, e in bns:
        assert int(e.num_batches_tracked) == 3
        assert int(f.num_batches_tracked) == 3
    fused.eval()
    eager.eval()
    assert_close(fused(x), eager(x), torch.float32)  # eval: bn1 normalizes with batch statistics
    assert int(bns[0][0].num_batches_tracked) == 3


@pytest.mark.skipif(DEVICE != "cpu", reason="eager's mixed-dtype rule differs on CUDA; the probe follows the device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("what", ["buffers", "params"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_bn_in_another_dtype_raises_as_eager(dtype, what, train):
    fused, eager = _twins()
    fused.train(train)
    eager.train(train)
    for bn in (fused.bn, eager[0]):
        if what == "buffers":
            bn.running_mean, bn.running_var = bn.running_mean.to(dtype), bn.running_var.to(dtype)
        else:
            bn.weight.data, bn.bias.data = bn.weight.data.to(dtype), bn.bias.data.to(dtype)
    x = _x(2, 4, 5, 5, requires_grad=False)
    with pytest.raises(RuntimeError) as e:
        eager(x)
    with pytest.raises(RuntimeError, match=re.escape(str(e.value))):
        fused(x)


# ------------------------------------------------------------------- geometries the kernels refuse
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k, pad, dil", [((7, 7), 3, 1), ((1, 33), (0, 16), 1), ((9, 9), 4, 1), ((6, 6), 5, 2)])
def test_padded_kernel_over_32_taps_is_fused(k, pad, dil, dtype):
    """Padded kernels of more than 32 taps (the fprop kernel's per-row padding word holds 32; beyond,
    its loop tests each tap's row and column) run on the Triton kernels and match a float64 reference:
    output, input, weight and BatchNorm gradients."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(4, 6, k, padding=pad, dilation=dil, backend="triton").to(DEVICE)
    with torch.no_grad():
        fused.bn.weight.uniform_(0.5, 1.5)
        fused.bn.bias.uniform_(-0.5, 0.5)
    ref = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
    fused = fused.to(dtype)
    x = _x(2, 4, 9, 40, dtype=torch.float64)  # wide: taps 0 and 32 of the 1×33 differ
    xf = x.detach().to(dtype).requires_grad_(True)
    out = fused(xf)
    assert fused.last_backend == "triton", fused.fallback_reason
    want = ref(x)
    dy = torch.randn_like(want)
    out.backward(dy.to(dtype))
    want.backward(dy)
    what = f"{k} pad {pad} dil {dil}"
    tol = torch.float32 if dtype == torch.float32 else torch.float16
    assert_close(out.double(), want, tol, f"{what}: out")
    assert_close(xf.grad.double(), x.grad, tol, f"{what}: dx")
    assert_close(fused.conv.weight.grad.double(), ref[2].weight.grad, tol, f"{what}: dW")
    assert_close(fused.bn.weight.grad.double(), ref[0].weight.grad, tol, f"{what}: dgamma")
    assert_close(fused.bn.bias.grad.double(), ref[0].bias.grad, tol, f"{what}: dbeta")


@pytest.mark.parametrize("cin, cout", [(4, 80), (16, 128), (8, 256)])
def test_many_output_channels_per_input_channel_weight_gradient(cin, cout):
    """Output channels over 4× the input channels (a 1×1 expansion): the wgrad kernel holds four
    pieces of output channels per tile, and the interpreter's tiles once took eight (half of dW never
    written)."""
    torch.manual_seed(0)
    fused = FusedBNReLUConv2d(cin, cout, 1, backend="triton").to(DEVICE)
    ref = nn.Sequential(copy.deepcopy(fused.bn), nn.ReLU(), copy.deepcopy(fused.conv)).double()
    x = _x(2, cin, 3, 3, dtype=torch.float64)
    fused(x.detach().float()).backward(torch.ones(2, cout, 3, 3, device=DEVICE))
    ref(x).backward(torch.ones(2, cout, 3, 3, dtype=torch.float64))
    assert fused.last_backend == "triton", fused.fallback_reason
    assert_close(fused.conv.weight.grad.double(), ref[2].weight.grad, torch.float32, f"{cin}->{cout}: dW")


@pytest.mark.parametrize("shortcut", ["stride-2x1", "bias", "3x3"])
def test_projection_the_kernels_cannot_fuse_runs_eagerly(shortcut):
    """The chains fuse a bias-free 1×1 projection with one stride; any other shortcut conv (a tuple
    stride, a bias, a larger kernel) runs the block eagerly, with the reason."""
    stride = (2, 1) if shortcut == "stride-2x1" else 2
    torch.manual_seed(0)
    fused = FusedPreActBlock(4, 6, stride=stride, backend="auto").to(DEVICE)
    eager = PreActBlock(4, 6, stride=stride).to(DEVICE)
    if shortcut != "stride-2x1":
        fused.shortcut = nn.Conv2d(4, 6, 1 if shortcut == "bias" else 3, stride=2, padding=0 if shortcut == "bias" else 1,
                                   bias=shortcut == "bias").to(DEVICE)
        eager.shortcut = copy.deepcopy(fused.shortcut)
    eager.load_state_dict(fused.state_dict())
    x = _x(2, 4, 6, 6)
    _, gxf, gpf = _grads(fused, x, lambda m, xg: m(xg).square().sum())
    _, gxe, gpe = _grads(eager, x, lambda m, xg: m(xg).square().sum())
    assert fused.last_backend == "reference" and "projection shortcut with" in fused.fallback_reason
    assert_close(gxf, gxe, torch.float32, "dx")
    for a, b in zip(gpf, gpe):
        assert_close(a, b, torch.float32, "param grad")


def test_convert_keeps_a_3x3_shortcut_out_of_the_fused_chain():
    """A block whose shortcut is a 3×3 conv (conv1 unpadded too, so the shapes agree): convert() runs
    the shortcut as its own module instead of as the chain's 1×1 projection."""
    import fused_preact

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn1, self.conv1 = nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, 1, 0, bias=False)
            self.bn2, self.conv2 = nn.BatchNorm2d(6), nn.Conv2d(6, 6, 3, 1, 1, bias=False)
            self.shortcut = nn.Conv2d(4, 6, 3, 1, 0, bias=False)

        def forward(self, x):
            out = F.relu(self.bn1(x))
            return self.conv2(F.relu(self.bn2(self.conv1(out)))) + self.shortcut(out)

    torch.manual_seed(0)
    block = Block().to(DEVICE)
    converted = fused_preact.convert(copy.deepcopy(block))
    assert converted.shortcut_mode != "proj_fused"
    x = _x(2, 4, 8, 8, requires_grad=False)
    assert_close(converted(x), block(x), torch.float32, "output")
    assert converted.last_backend == "triton"


def test_conv_bias_of_the_wrong_size_raises_as_eager():
    x = _x(2, 4, 5, 5, requires_grad=False)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    for b in (torch.randn(5, device=DEVICE), torch.randn(6, 1, device=DEVICE)):
        with pytest.raises(RuntimeError) as eager_err:
            F.conv2d(x, w, b)
        with pytest.raises(RuntimeError, match=re.escape(str(eager_err.value))):
            bn_relu_conv2d(x, w, b, training=True, padding=1)


@pytest.mark.parametrize("case", ["valid", "same", "same-dilated", "stride-1-list"])
def test_functional_geometry_arguments_as_f_conv2d(case):
    x = _x(2, 4, 6, 6, requires_grad=False)
    w = torch.randn(6, 4, 3, 3, device=DEVICE)
    geo = {"valid": dict(padding="valid"), "same": dict(padding="same"),
           "same-dilated": dict(padding="same", dilation=2), "stride-1-list": dict(stride=[2], padding=[1])}[case]
    ref = F.conv2d(F.relu(F.batch_norm(x, None, None, training=True)), w, **geo)
    assert_close(bn_relu_conv2d(x, w, None, training=True, **geo), ref, torch.float32, case)


@pytest.mark.parametrize("case", ["same-strided", "same-asymmetric", "no-filters", "3d-weight"])
def test_functional_geometry_errors(case):
    x = _x(2, 4, 6, 6, requires_grad=False)
    w, geo = {"same-strided": (torch.randn(6, 4, 3, 3), dict(padding="same", stride=2)),
              "same-asymmetric": (torch.randn(6, 4, 4, 4), dict(padding="same")),
              "no-filters": (torch.randn(0, 4, 3, 3), dict(padding=1)),
              "3d-weight": (torch.randn(6, 4, 3), dict(padding=1))}[case]
    w = w.to(DEVICE)
    with pytest.raises(RuntimeError) as err:
        bn_relu_conv2d(x, w, None, training=True, **geo)
    if case in ("same-strided", "no-filters"):  # eager's own message
        with pytest.raises(RuntimeError, match=re.escape(str(err.value))):
            F.conv2d(x, w, **geo)


@pytest.mark.parametrize("shape", [(8, 4, 3, 3), (6, 4, 1, 1), (6, 4, 5, 5)], ids=["K8", "1x1", "5x5"])
def test_replaced_conv_weight_defines_the_conv(shape):
    """``nn.Conv2d.forward`` reads channels and kernel from the weight (a pruned or replaced weight),
    not from the module's ``out_channels``/``kernel_size``."""
    fused, eager = _twins()
    x = _x(2, 4, 6, 6, requires_grad=False)
    fused(x)  # a plan for the original weight first
    w = nn.Parameter(torch.randn(shape, device=DEVICE))
    fused.conv.weight = w
    eager[2].weight = w
    assert_close(fused(x), eager(x), torch.float32, "output")
    assert fused.last_backend == "triton"


# ------------------------------------------------------------------------------------- meta tensors
@pytest.mark.parametrize("cls_args", [(FusedBNReLUConv2d, (4, 6, 3), {"padding": 1, "stride": 2}),
                                      (FusedPreActBlock, (4, 8, 2), {})], ids=["unit", "block"])
def test_meta_module_and_input_give_eager_shapes(cls_args):
    cls, args, kw = cls_args
    m = cls(*args, **kw, device="meta")
    x = torch.empty(2, 4, 9, 9, device="meta")
    y = m(x)
    assert y.device.type == "meta"
    eager = PreActBlock(4, 8, 2) if cls is FusedPreActBlock else nn.Sequential(
        nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1, stride=2))
    assert y.shape == eager(torch.zeros(2, 4, 9, 9)).shape
    assert m.last_backend == "reference" and "meta" in m.fallback_reason


# ------------------------------------------------------------------------------------------ hooks
@pytest.mark.parametrize("where", ["bn-forward", "conv-pre", "conv-backward"])
def test_hooks_on_children_run_as_eager(where):
    fused, eager = _twins()
    seen = {"fused": 0, "eager": 0}

    def hook(name):
        def f(*args):
            seen[name] += 1
        return f

    for name, bn, conv in (("fused", fused.bn, fused.conv), ("eager", eager[0], eager[2])):
        if where == "bn-forward":
            bn.register_forward_hook(hook(name))
        elif where == "conv-pre":
            conv.register_forward_pre_hook(hook(name))
        else:
            conv.register_full_backward_hook(hook(name))
    x = _x(2, 4, 5, 5)
    _, gxf, _ = _grads(fused, x, lambda m, v: m(v).square().sum())
    _, gxe, _ = _grads(eager, x, lambda m, v: m(v).square().sum())
    assert seen["fused"] == seen["eager"] == 1
    assert fused.last_backend == "reference" and "hook" in fused.fallback_reason
    assert_close(gxf, gxe, torch.float32, "dx")


# ----------------------------------------------------------------- in-place change before backward
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("what", ["weight", "bias", "running_mean"])
def test_inplace_change_between_forward_and_backward_as_eager(what, train):
    outcomes = []
    for m in _twins():
        m.train(train)
        y = m(_x(2, 4, 5, 5))
        with torch.no_grad():
            bn = m.bn if isinstance(m, FusedBNReLUConv2d) else m[0]
            getattr(bn, what).add_(1.0)
        try:
            y.sum().backward()
            outcomes.append("ok")
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            outcomes.append("error")
    fused_outcome, eager_outcome = outcomes
    if what == "running_mean" and train:
        # eager saves its running buffers in training too (and raises); the fused kernels never read
        # them in backward, so the gradient stays that of the forward that ran.
        assert eager_outcome == "error" and fused_outcome == "ok"
    else:
        assert fused_outcome == eager_outcome


# ------------------------------------------------------------------------------------ empty batch
def test_empty_batch_names_the_path_that_ran():
    fused, _ = _twins()
    fused(_x(0, 4, 5, 5))
    assert fused.last_backend == "reference" and "empty batch" in fused.fallback_reason
    fused(_x(2, 4, 5, 5))
    assert fused.last_backend == "triton" and fused.fallback_reason is None


# ------------------------------------------------------------------------------ overflowing statistics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_variance_overflow_gives_eager_inf_and_finite_pattern(dtype):
    fused, eager = _twins()
    fused.to(dtype)
    eager.to(dtype)
    x = (_x(2, 4, 5, 5, requires_grad=False) * 1e30).to(dtype)
    y, ref = fused(x), eager(x)
    assert fused.last_backend == "triton"
    assert torch.isinf(fused.bn.running_var).all() and torch.equal(fused.bn.running_var, eager[0].running_var)
    assert torch.equal(torch.isfinite(y), torch.isfinite(ref))
    assert_close(y, ref, dtype, "output")


# ---------------------------------------------------------------------- numerics at a large mean
def test_large_mean_small_variance_is_within_eager_error():
    """Inputs with mean 1e4 and std 0.03: the fused output's error against float64, relative to
    eager fp32's own, over 8 seeds (the single-rounding FMA in the prologue and in shift keep the
    fused path at eager's level)."""
    ratios = []
    for seed in range(8):
        fused, eager = _twins(C=8, K=8, seed=seed)
        ref = copy.deepcopy(eager).double()
        x = (_x(4, 8, 6, 6, seed=seed, dtype=torch.float64, requires_grad=False) * 0.03 + 1e4).float()
        r = ref(x.double())
        e = (eager(x).double() - r).norm() / r.norm()
        f = (fused(x).double() - r).norm() / r.norm()
        assert fused.last_backend == "triton"
        ratios.append((f / e).item())
    ratios.sort()
    assert ratios[len(ratios) // 2] <= 1.5 and ratios[-1] <= 2.5, ratios


# ------------------------------------------------------------------ the interpreter switched on late
@pytest.mark.skipif(DEVICE != "cpu", reason="about the CPU fallback")
def test_interpreter_set_after_import_falls_back_with_a_reason(tmp_path):
    code = textwrap.dedent("""
        import os, torch
        os.environ.pop("TRITON_INTERPRET", None)
        from fused_preact import FusedBNReLUConv2d
        import fused_preact.ops
        os.environ["TRITON_INTERPRET"] = "1"
        m = FusedBNReLUConv2d(4, 4, 3, padding=1)
        m(torch.randn(2, 4, 5, 5))
        print(m.last_backend, "|", m.fallback_reason)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    name, reason = out.stdout.strip().split(" | ")
    assert name == "reference" and "interpreter is off" in reason


# ------------------------------------------------------------------------- compile-safe fallbacks
@pytest.mark.parametrize("case", ["triton", "reference-dtype", "empty-batch"])
def test_fullgraph_compile_on_every_auto_path(case):
    torch._dynamo.reset()
    m = FusedPreActBlock(8, 16, stride=2).to(DEVICE)
    x = _x(0 if case == "empty-batch" else 2, 8, 6, 6, requires_grad=False)
    if case == "reference-dtype":
        m, x = m.double(), x.double()
    eager = PreActBlock(8, 16, 2).to(DEVICE, x.dtype)
    eager.load_state_dict(m.state_dict())
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    expect = {"triton": "triton", "reference-dtype": "reference", "empty-batch": "reference"}[case]
    assert m.last_backend == expect
    assert_close(y, eager(x), x.dtype if x.dtype == torch.float64 else torch.float32, case)
