"""Running a fused chain: the autograd node of the fused backends and the plain-PyTorch reference.

A whole chain — a pre-activation block's residual branch with its shortcut, or one unit — is ONE
autograd node (:class:`ChainFunction`): its forward enqueues every kernel of the chain from one Python
call, its backward likewise, and it saves only the units' inputs, the weights, the BN weights (so
autograd's version counters catch an in-place change between forward and backward, as eager's do) and
fp32 per-channel buffers. Under ``torch.compile`` the same plans run behind opaque custom ops
(:mod:`fused_preact.ops.library`), so Dynamo traces no Python of the op layer.

Order of this file: reference → autograd.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    RUNNING,
    BNMode,
    ChainSpec,
    ChainTensors,
    GradNeeds,
    SavedChain,
    StatsHandoff,
    UnitTensors,
    add_shortcut,
)

__all__ = ["ChainResult", "ChainFunction", "reference_chain"]


class ChainResult(NamedTuple):
    """What a chain call returns.

    Attributes:
        out: (N, K, P, Q) output, in the input's memory format.
        proj_out: the projection's output when ``spec.proj_out == "return"``, else None.
        stats: the output's partial statistics (:class:`StatsHandoff`) when they were asked for and the
            backend provides them, else None.
    """

    out: torch.Tensor
    proj_out: Optional[torch.Tensor] = None
    stats: Optional[StatsHandoff] = None


# ------------------------------------------------------------------------------------- reference
def _preact_reference(x: torch.Tensor, t: ChainTensors, u: UnitTensors, mode: BNMode) -> torch.Tensor:
    if mode.kind == EXTERNAL:
        shape = (1, -1, 1, 1)
        acc = t.ext_mean.dtype  # fp32 statistics, fp64 for a float64 model
        a = (x.to(acc) - t.ext_mean.view(shape)) * t.ext_invstd.view(shape)
        if u.gamma is not None:
            a = a * u.gamma.to(acc).view(shape) + u.beta.to(acc).view(shape)
        return F.relu(a).to(x.dtype)
    if mode.update and u.num_batches is not None:
        u.num_batches.add_(1)
    if mode.cumulative:  # nn.BatchNorm2d: 1/num_batches_tracked when it is counted, else 0
        momentum = 1.0 / float(u.num_batches) if mode.update and u.num_batches is not None else 0.0
    else:
        momentum = u.momentum
    keep = mode.kind == BATCH and not mode.update
    rm, rv = (None, None) if keep else (u.running_mean, u.running_var)
    return F.relu(F.batch_norm(x, rm, rv, u.gamma, u.beta, mode.kind == BATCH, momentum, u.eps))


def reference_chain(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...]) -> ChainResult:
    """The chain in plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d`` per unit, then the
    shortcut): the semantics every fused backend reproduces, for any device and dtype PyTorch serves,
    differentiable to any order. Running statistics and ``num_batches_tracked`` change exactly as
    ``nn.BatchNorm2d`` changes them."""
    h = x
    a0 = None
    for i, (g, u) in enumerate(zip(spec.convs, t.units)):
        a = _preact_reference(h, t, u, modes[i])
        if i == 0:
            a0 = a
        h = F.conv2d(a, u.weight, u.bias, g.stride, g.padding, g.dilation, g.groups)
    p = F.conv2d(a0, t.proj_weight, None, spec.proj.stride) if spec.proj is not None else None
    return ChainResult(*add_shortcut(spec, h, p, x, t), None)


# -------------------------------------------------------------------------------------- autograd
def _slot_needs(needs_input_grad, n: int, bn_dtypes) -> tuple[GradNeeds, bool, bool]:
    """(the :class:`GradNeeds` of the per-unit slots, residual wanted, external statistics wanted) from
    autograd's flags of ``ChainFunction.forward``'s inputs (plan, t, x, *slots)."""
    f = ChainTensors.empty(n).unflatten(bool(v) for v in needs_input_grad[3:])
    bn = tuple(d if (u.gamma or u.beta) else None for u, d in zip(f.units, bn_dtypes))
    needs = GradNeeds(bool(needs_input_grad[2]), tuple(u.weight for u in f.units), tuple(u.bias for u in f.units),
                      bn, f.proj_weight)
    return needs, f.residual, f.ext_mean or f.ext_invstd


class ChainFunction(torch.autograd.Function):
    """One autograd node for a whole fused chain (eager path of the fused backends).

    ``apply(plan, t, x, *t.flatten())`` (the differentiable tensors, :meth:`ChainTensors.flatten`;
    absent ones None): ``plan`` implements
    :class:`fused_preact.ops.backends.Plan`; ``t`` carries the non-differentiable buffers (running
    statistics, counters, momenta, handed-over statistics). Returns ``out``, then the projection's
    output when returned separately, then the output's partial statistics when asked for
    (non-differentiable).

    Saved: the units' inputs, the plan's per-channel buffers, the conv weights and, as eager's
    ``batch_norm`` saves them, γ and (eval mode) the running statistics, so autograd's version counters
    catch an in-place change between forward and backward. A backward with ``create_graph=True``
    (double backward, e.g. a gradient penalty) recomputes the chain with the differentiable reference
    ops from the saved inputs and differentiates that, so second-order gradients are those of eager
    PyTorch (it also reads the conv biases and β, whose versions it checks: a change in place since the
    forward raises autograd's error); a plain backward runs the plan's fused kernels.
    """

    @staticmethod
    def forward(ctx, plan, t: ChainTensors, x: torch.Tensor, *flat):
        t = t.unflatten(flat)
        fwd = plan.forward(x, t)
        saved = fwd.saved
        n = len(t.units)
        running = [i for i, m in enumerate(plan.modes) if m.kind == RUNNING]
        ctx.plan, ctx.n_inputs, ctx.n_aux, ctx.n_units = plan, len(saved.inputs), len(saved.aux), n
        ctx.bn_dtypes = [u.gamma.dtype if u.gamma is not None else None for u in t.units]
        ctx.gamma_slots = [i for i, u in enumerate(t.units) if u.gamma is not None]
        ctx.running_slots = running
        ctx.save_for_backward(*saved.inputs, *saved.aux, *[u.weight for u in t.units], t.proj_weight,
                              *[t.units[i].gamma for i in ctx.gamma_slots],
                              *[v for i in running for v in (t.units[i].running_mean, t.units[i].running_var)])
        # For a double backward only: the recomputed chain reads the conv biases and β as they are then,
        # so their versions are checked there (eager's double backward uses saved activations instead).
        ctx.biases, ctx.betas, ctx.residual = [u.bias for u in t.units], [u.beta for u in t.units], t.residual
        ctx.versions = [v._version if v is not None else 0 for v in (*ctx.biases, *ctx.betas)]
        ctx.input_strides = [v.stride() for v in saved.inputs]  # what the plan's kernels will address
        ctx.ext = (t.ext_mean, t.ext_invstd)
        ctx.eps = [u.eps for u in t.units]
        ctx.set_materialize_grads(False)
        ctx.has_proj_out = fwd.proj_out is not None
        outs = [fwd.out]
        if fwd.proj_out is not None:
            outs.append(fwd.proj_out)
        if fwd.stats is not None:
            ctx.mark_non_differentiable(fwd.stats.part)
            outs.append(fwd.stats.part)
        return tuple(outs) if len(outs) > 1 else fwd.out

    @staticmethod
    def backward(ctx, dy, *rest):
        plan, n = ctx.plan, ctx.n_units
        tensors = ctx.saved_tensors
        k = ctx.n_inputs + ctx.n_aux
        saved = SavedChain(list(tensors[:ctx.n_inputs]), list(tensors[ctx.n_inputs:k]))
        weights, proj_w = list(tensors[k:k + n]), tensors[k + n]
        dy_proj = rest[0] if ctx.has_proj_out else None
        if dy is None and dy_proj is None:
            return (None,) * (3 + 4 * n + 4)
        if dy is None:
            dy = saved.inputs[0].new_zeros(plan.out_shape, dtype=plan.out_dtype)
        if ctx.has_proj_out and dy_proj is None:
            dy_proj = saved.inputs[0].new_zeros(plan.proj_shape, dtype=plan.cdtype)
        # create_graph=True: second-order gradients through the reference. A saved input that a
        # saved-tensors hook handed back in another layout (save_on_cpu(pin_memory=True) unpacks NCHW)
        # cannot be read with the plan's strides: the reference differentiates it as it is.
        relaid = [v.stride() for v in saved.inputs] != ctx.input_strides
        if torch.is_grad_enabled() or relaid:
            return (None, None, *_differentiable_backward(ctx, saved.inputs[0], weights, proj_w, tensors[k + n + 1:],
                                                          dy, dy_proj, create_graph=torch.is_grad_enabled()))
        needs, need_res, _ = _slot_needs(ctx.needs_input_grad, n, ctx.bn_dtypes)
        g = plan.backward(dy, dy_proj, saved, weights, proj_w, needs)
        return (None, None, g.dx, *g.flatten(residual=dy if need_res else None))


def _differentiable_backward(ctx, x, weights, proj_w, extra, dy, dy_proj, create_graph: bool = True) -> list:
    """Gradients of x and of every slot, as a differentiable graph: the chain recomputed with
    :func:`reference_chain` (batch statistics recomputed, running statistics not updated again) from
    the saved inputs, then ``torch.autograd.grad(..., create_graph=True)``. Raises RuntimeError (autograd's
    message for a saved tensor) when a conv bias or β it reads changed in place since the forward."""
    plan = ctx.plan
    for v, seen in zip((*ctx.biases, *ctx.betas), ctx.versions):
        if v is not None and v._version != seen:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{v.type()} {list(v.shape)}] is at version {v._version}; expected version {seen} instead "
                "(fused_preact: a double backward recomputes the chain from the conv biases and BatchNorm β)")
    units = [UnitTensors(w, b, None, beta, momentum=0.0, eps=e)
             for w, b, beta, e in zip(weights, ctx.biases, ctx.betas, ctx.eps)]
    for j, i in enumerate(ctx.gamma_slots):
        units[i].gamma = extra[j]
    for j, i in enumerate(ctx.running_slots):
        k = len(ctx.gamma_slots) + 2 * j
        units[i].running_mean, units[i].running_var = extra[k], extra[k + 1]
    t = ChainTensors(units, proj_w, ctx.residual, *ctx.ext)
    modes = tuple(dataclasses.replace(m, update=False) for m in plan.modes)
    if not create_graph:  # plain gradients, of fresh leaves (a hook's unpacked tensors need not require grad)
        x = x.detach().requires_grad_(x.is_floating_point())
        t = t.unflatten([v.detach().requires_grad_() if v is not None else None for v in t.flatten()])
    slots = [x] + t.flatten()
    wanted = [j for j, v in enumerate(slots) if v is not None and ctx.needs_input_grad[2 + j]]
    with torch.enable_grad():
        res = reference_chain(plan.spec, x, t, modes)
    outs, gouts = [res.out], [dy]
    if dy_proj is not None:
        outs.append(res.proj_out)
        gouts.append(dy_proj)
    got = torch.autograd.grad(outs, [slots[j] for j in wanted], gouts, create_graph=create_graph, allow_unused=True)
    grads: list = [None] * len(slots)
    for j, v in zip(wanted, got):
        grads[j] = v if v is not None else torch.zeros_like(slots[j])
    return grads
