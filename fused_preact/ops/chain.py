"""Running a fused chain: the autograd node of the fused backends and the plain-PyTorch reference.

A whole chain — a pre-activation block's residual branch with its shortcut, or one unit — is ONE
autograd node (:class:`ChainFunction`): its forward enqueues every kernel of the chain from one Python
call, its backward likewise, and it saves only the units' inputs, the weights and fp32 per-channel
buffers. Under ``torch.compile`` the same plans run behind opaque custom ops
(:mod:`fused_preact.ops.library`), so Dynamo traces no Python of the op layer.

Order of this file: reference → autograd → functional entry.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from fused_preact.ops.chain_spec import BATCH, EXTERNAL, BNMode, ChainSpec, ChainTensors, StatsHandoff, add_shortcut

__all__ = ["ChainResult", "ChainFunction", "reference_chain", "fused_chain", "differentiable_slots"]


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
def _preact_reference(x: torch.Tensor, t: ChainTensors, i: int, mode: BNMode) -> torch.Tensor:
    if mode.kind == EXTERNAL:
        shape = (1, -1, 1, 1)
        acc = t.ext_mean.dtype  # fp32 statistics, fp64 for a float64 model
        a = (x.to(acc) - t.ext_mean.view(shape)) * t.ext_invstd.view(shape)
        if t.gammas[i] is not None:
            a = a * t.gammas[i].to(acc).view(shape) + t.betas[i].to(acc).view(shape)
        return F.relu(a).to(x.dtype)
    if mode.update and t.num_batches[i] is not None:
        t.num_batches[i].add_(1)
    if mode.cumulative:
        momentum = 1.0 / float(t.num_batches[i]) if mode.update else 0.0
    else:
        momentum = t.momenta[i]
    keep = mode.kind == BATCH and not mode.update
    rm, rv = (None, None) if keep else (t.running_means[i], t.running_vars[i])
    return F.relu(F.batch_norm(x, rm, rv, t.gammas[i], t.betas[i], mode.kind == BATCH, momentum, t.eps[i]))


def reference_chain(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...]) -> ChainResult:
    """The chain in plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d`` per unit, then the
    shortcut): the semantics every fused backend reproduces, for any device and dtype PyTorch serves.
    Running statistics and ``num_batches_tracked`` change exactly as ``nn.BatchNorm2d`` changes them."""
    h = x
    a0 = None
    for i, g in enumerate(spec.convs):
        a = _preact_reference(h, t, i, modes[i])
        if i == 0:
            a0 = a
        h = F.conv2d(a, t.weights[i], t.biases[i], g.stride, g.padding, g.dilation, g.groups)
    p = F.conv2d(a0, t.proj_weight, None, spec.proj.stride) if spec.proj is not None else None
    return ChainResult(*add_shortcut(spec, h, p, x, t), None)


# -------------------------------------------------------------------------------------- autograd
#: Differentiable tensors of a chain call, in the order :class:`ChainFunction` takes them after x:
#: per unit (weight, bias, γ, β), then the projection weight, the residual tensor and the external
#: statistics (mean, invstd).
def differentiable_slots(t: ChainTensors) -> list:
    flat = []
    for i in range(len(t.weights)):
        flat += [t.weights[i], t.biases[i], t.gammas[i], t.betas[i]]
    return flat + [t.proj_weight, t.residual, t.ext_mean, t.ext_invstd]


def _with_slots(t: ChainTensors, flat) -> ChainTensors:
    n = len(t.weights)
    return dataclasses.replace(
        t, weights=list(flat[0:4 * n:4]), biases=list(flat[1:4 * n:4]), gammas=list(flat[2:4 * n:4]),
        betas=list(flat[3:4 * n:4]), proj_weight=flat[4 * n], residual=flat[4 * n + 1],
        ext_mean=flat[4 * n + 2], ext_invstd=flat[4 * n + 3])


class ChainFunction(torch.autograd.Function):
    """One autograd node for a whole fused chain (eager path of the fused backends).

    ``apply(plan, t, x, *differentiable_slots(t))``: ``plan`` has ``forward(x, t)`` and ``backward(...)``
    (:class:`fused_preact.ops._triton.TritonPlan`); ``t`` carries the non-differentiable buffers
    (running statistics, counters, momenta, handed-over statistics). Returns ``out``, then the
    projection's output when returned separately, then the output's partial statistics when asked
    for (non-differentiable).
    """

    @staticmethod
    def forward(ctx, plan, t: ChainTensors, x: torch.Tensor, *flat):
        t = _with_slots(t, flat)
        out, proj_out, inputs, aux, handoff, _ = plan.forward(x, t)
        n = len(t.weights)
        ctx.plan, ctx.n_inputs, ctx.n_aux = plan, len(inputs), len(aux)
        ctx.bn_dtypes = [g.dtype if g is not None else None for g in t.gammas]
        ctx.save_for_backward(*inputs, *aux, *t.weights, t.proj_weight)
        ctx.set_materialize_grads(False)
        ctx.has_proj_out = proj_out is not None
        del n
        outs = [out]
        if proj_out is not None:
            outs.append(proj_out)
        if handoff is not None:
            ctx.mark_non_differentiable(handoff.part)
            outs.append(handoff.part)
        return tuple(outs) if len(outs) > 1 else out

    @staticmethod
    def backward(ctx, dy, *rest):
        plan = ctx.plan
        n = len(plan.units)
        saved = ctx.saved_tensors
        k = ctx.n_inputs + ctx.n_aux
        inputs, aux, weights, proj_w = list(saved[:ctx.n_inputs]), list(saved[ctx.n_inputs:k]), saved[k:k + n], saved[-1]
        dy_proj = rest[0] if ctx.has_proj_out else None
        if dy is None and dy_proj is None:
            return (None,) * (3 + 4 * n + 4)
        if dy is None:
            dy = inputs[0].new_zeros(plan.out_shape, dtype=plan.out_dtype)
        if ctx.has_proj_out and dy_proj is None:
            dy_proj = inputs[0].new_zeros(plan.proj_shape, dtype=plan.cdtype)
        needs = ctx.needs_input_grad[3:]
        bn_dtypes = [ctx.bn_dtypes[i] if (needs[4 * i + 2] or needs[4 * i + 3]) else None for i in range(n)]
        dx, dws, dbs, dgs, dbetas, dproj_w, dstats = plan.backward(
            dy, dy_proj, inputs, aux, weights, proj_w, bool(ctx.needs_input_grad[2]),
            [needs[4 * i] for i in range(n)], [needs[4 * i + 1] for i in range(n)], bool(needs[4 * n]), bn_dtypes)
        grads = []
        for i in range(n):
            grads += [dws[i], dbs[i], dgs[i] if needs[4 * i + 2] else None, dbetas[i] if needs[4 * i + 3] else None]
        grads += [dproj_w, dy if needs[4 * n + 1] else None]
        grads += list(dstats) if dstats is not None else [None, None]
        return (None, None, dx, *grads)


# ------------------------------------------------------------------------------------ functional
def fused_chain(plan, x: torch.Tensor, t: ChainTensors) -> ChainResult:
    """Run ``plan`` (a fused backend's plan) on x: through :class:`ChainFunction` when autograd must
    record it, directly otherwise (no saved tensors)."""
    flat = differentiable_slots(t)
    if torch.is_grad_enabled() and (x.requires_grad or any(f is not None and f.requires_grad for f in flat)):
        outs = ChainFunction.apply(plan, t, x, *flat)
        outs = outs if isinstance(outs, tuple) else (outs,)
        proj_out = outs[1] if plan.spec.proj is not None and plan.spec.proj_out == "return" else None
        part = outs[-1] if plan.out_stats else None
        stats = StatsHandoff(part, *plan.handoff_geometry()) if part is not None else None
        return ChainResult(outs[0], proj_out, stats)
    out, proj_out, _, _, handoff, _ = plan.forward(x, t)
    return ChainResult(out, proj_out, handoff)
