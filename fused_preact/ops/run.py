"""Running a chain: the per-signature cache of decisions and plans, the checks a call meets before
anything runs, and the hand-off to the autograd node, the compiled custom op or the reference.

:func:`run_chain` is the op layer's one entry point (modules and the functional API call it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from fused_preact.ops import auto as _auto
from fused_preact.ops import library
from fused_preact.ops._common import autocast_enabled, compute_dtype
from fused_preact.ops.backends import BackendChoice, LastCall, PlanCache, ReferenceBackend, eager_fallback, select_backend
from fused_preact.ops.chain import ChainFunction, ChainResult, reference_chain
from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    GRAD_FIELDS,
    RUNNING,
    BNMode,
    ChainSpec,
    ChainTensors,
    StatsHandoff,
    UnitTensors,
    chain_shapes,
    validate_chain,
)

__all__ = ["run_chain"]


def _sig(v) -> Optional[tuple]:
    return None if v is None else (v.dtype, v.device, v.shape, v.stride(), v.requires_grad)


def _buf_sig(v, tracing: bool) -> Optional[tuple]:
    # a running buffer's: whether it is an inference tensor too (Dynamo cannot trace is_inference();
    # a traced call's key is never stored)
    return None if v is None else (v.dtype, v.device, v.shape, v.stride(), v.requires_grad,
                                   not tracing and v.is_inference())


def _signature(requested: str, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes, cd, out_stats) -> tuple:
    """Everything a cached decision, validation and plan derive from: the chain, the BN modes and eps,
    the layout, dtype and device of x and of every tensor of the call (and whether it requires grad
    or is an inference tensor: eager's errors depend on both), the compute dtype, whether autocast is
    on (it decides which dtype mixes validation accepts) and grad mode (``auto`` times forward only
    without it)."""
    tr = torch.compiler.is_compiling()
    per_unit = tuple((_sig(u.weight), _sig(u.bias), _sig(u.gamma), _sig(u.beta), _buf_sig(u.running_mean, tr),
                      _buf_sig(u.running_var, tr), _buf_sig(u.num_batches, tr), u.eps) for u in t.units)
    extra = (_sig(t.proj_weight), _sig(t.residual), _sig(t.ext_mean), _sig(t.ext_invstd),
             None if t.in_stats is None else _sig(t.in_stats.part))
    return (requested, spec, modes, x.shape, x.stride(), x.dtype, x.device, cd, autocast_enabled(x.device.type),
            out_stats, per_unit, extra, x.requires_grad, torch.is_grad_enabled(),
            not tr and torch.is_inference_mode_enabled())


def _check_like_eager(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...],
                      cd: torch.dtype) -> None:
    """Raise what eager ``F.batch_norm`` raises for each unit's arguments (eps rules, dtype mixing as the
    device allows it, …) by calling it on a 2-value-per-channel stand-in of the unit's input, with copies
    of the running buffers (nothing of the caller's changes). O(C) work, once per input signature."""
    shapes = chain_shapes(spec, x.shape)
    for i, mode in enumerate(modes):
        if mode.kind == EXTERNAL:  # statistics given from outside (synchronized BN checks its own)
            continue
        C = shapes[i][1]
        if i == 0 and x.numel() > 0:
            src = x.detach()[:1, :, :1, :1]
        else:
            src = torch.zeros(1, C, 1, 1, device=x.device, dtype=x.dtype if i == 0 else cd)
        u = t.units[i]
        rm, rv, nb = u.running_mean, u.running_var, u.num_batches
        if mode.update and nb is not None and nb.is_inference() and not torch.is_inference_mode_enabled():
            nb.add_(0)  # nn.BatchNorm2d's num_batches_tracked.add_(1): autograd's in-place error, no change
        training = mode.kind == BATCH
        # A materialized stand-in (an expanded one takes another CPU kernel, whose dtype check is an
        # internal assert instead of eager's message); no graph: nothing saved for backward (a
        # checkpoint counts saved tensors).
        with torch.no_grad():
            F.batch_norm(src.expand(2, C, 1, 1).contiguous(), rm.clone() if rm is not None else None,
                         rv.clone() if rv is not None else None, u.gamma, u.beta, training,
                         0.0 if u.momentum is None else u.momentum, u.eps)
        # (eager's batch_norm returns before reading the buffers for an empty input)
        if (torch.is_grad_enabled() and 0 not in shapes[i]
                and any(b is not None and (b.requires_grad or b.is_inference()) for b in (rm, rv))):
            upstream = [x] + t.flatten()[:len(GRAD_FIELDS) * i]  # the units' before i
            _check_buffers_under_autograd(src, u, training,
                                          needs_input_grad=any(v is not None and v.requires_grad for v in upstream))


def _check_buffers_under_autograd(src: torch.Tensor, u: UnitTensors, training: bool, needs_input_grad: bool) -> None:
    """Eager's errors for running buffers that autograd refuses: one that requires grad, and an inference
    tensor where the call records a graph. ``F.batch_norm`` runs with grad on detached stand-ins (the
    buffers' flags copied, nothing of the caller's in the graph), its saved tensors kept out of any
    outer ``saved_tensors_hooks`` (a checkpoint counts what a forward saves)."""
    def stand_in(v: Optional[torch.Tensor], requires_grad: bool) -> Optional[torch.Tensor]:
        if v is None:
            return None
        if v.is_inference():
            with torch.inference_mode():
                return v.clone().requires_grad_(requires_grad and v.is_floating_point())
        return v.detach().clone().requires_grad_(requires_grad and v.is_floating_point())

    def copy(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return stand_in(v, v is not None and v.requires_grad)

    with torch.autograd.graph.saved_tensors_hooks(lambda v: v, lambda v: v):
        F.batch_norm(stand_in(src.expand(2, -1, 1, 1).contiguous(), needs_input_grad), copy(u.running_mean),
                     copy(u.running_var), copy(u.gamma), copy(u.beta), training,
                     0.0 if u.momentum is None else u.momentum, u.eps)


def _has_tangents(x: torch.Tensor, t: ChainTensors) -> bool:
    """Whether forward-mode AD is on (a ``forward_ad.dual_level``) and x or a tensor of the chain is
    a dual tensor; the fused kernels would read only its primal."""
    if fwAD._current_level < 0:
        return False
    tensors = [x, *t.flatten()]
    return any(v is not None and fwAD.unpack_dual(v).tangent is not None for v in tensors)


def _infinite_invstd(t: ChainTensors, modes) -> bool:
    """Whether a unit normalizes with running statistics, eps = 0 and a zero running variance: invstd is
    infinite, and eager's ``(x − mean)·invstd·γ + β`` is ±inf or NaN element by element where the fused
    ``x·scale + shift`` cannot follow. Reads the variance (a device sync) only for eps = 0 in eval; not
    under ``torch.compile``, which would break the graph there."""
    if torch.compiler.is_compiling():
        return False
    return any(m.kind == RUNNING and u.eps == 0 and u.running_var is not None and bool((u.running_var == 0).any())
               for u, m in zip(t.units, modes))


def _vector_reasons(t: ChainTensors) -> list[str]:
    """Per-channel vectors the fused kernels cannot address (they read ``ptr + c``)."""
    bad = []
    for i, u in enumerate(t.units):
        for name in ("gamma", "beta", "running_mean", "running_var"):
            v = getattr(u, name)
            if v is not None and not v.is_contiguous():
                bad.append(f"{name} of unit {i}")
    return [f"fused kernels: non-contiguous per-channel vector ({', '.join(bad)})"] if bad else []


_EMPTY = BackendChoice(ReferenceBackend, ("empty batch (N = 0): plain PyTorch, as nn.BatchNorm2d/nn.Conv2d",))
_META = BackendChoice(ReferenceBackend, ("meta tensors: shapes only (plain PyTorch's meta kernels)",))


def run_chain(requested: str, cache: PlanCache, spec: ChainSpec, x: torch.Tensor, t: ChainTensors,
              modes: tuple[BNMode, ...], out_stats: bool = False,
              memory: str = "fastest") -> tuple[ChainResult, BackendChoice]:
    """Run a chain with the backend ``requested`` (``"auto"`` or a name in :data:`BACKENDS`).

    The call's signature (:func:`_signature`: chain, BN modes and eps, x's shape/strides/dtype/device,
    the compute dtype, and dtype/device/shape/strides of every weight, BN vector and buffer) keys
    ``cache``: on a miss the inputs are validated (:func:`validate_chain` and eager ``F.batch_norm``'s
    own checks), the backend chosen and its plan built; a hit has met all of that with tensors of the
    same signature. An empty batch (N = 0) and meta tensors run the reference path, as PyTorch.
    For ``"auto"`` the choice on a miss is :func:`fused_preact.ops.auto.decide`'s (measured and
    validated on CUDA, under the ``memory`` policy ``"fastest"`` or ``"lean"``).

    Returns:
        ``(result, choice)``: the :class:`ChainResult` and the :class:`BackendChoice` that ran.

    Raises:
        ValueError / RuntimeError: invalid inputs, with eager PyTorch's types and messages; a forced
            backend that cannot serve them; an unknown backend name.
    """
    cd = compute_dtype(x)
    key = _signature(requested if memory == "fastest" else (requested, memory), spec, x, t, modes, cd, out_stats)
    entry = cache.get(key)
    if entry is None:
        validate_chain(spec, x, t, modes)
        if x.device.type != "meta" and not torch.compiler.is_compiling():
            _check_like_eager(spec, x, t, modes, cd)
        if x.device.type == "meta":
            choice = _META
        else:
            choice = select_backend(requested, x, spec, cd)
        vector_reasons = _vector_reasons(t) if choice.backend.fused else []
        if vector_reasons:
            eager_fallback(requested, "; ".join(vector_reasons), "input")
            choice = BackendChoice(ReferenceBackend, choice.skipped + tuple(vector_reasons))
        plan = None
        if x.shape[0] == 0 and choice.backend.fused:
            choice = _EMPTY
        elif requested == "auto" and not vector_reasons and x.device.type != "meta" and x.shape[0] > 0:
            choice, plan = _auto.decide(choice, key, spec, x, t, modes, cd, out_stats, memory)
        if plan is None and choice.backend.fused:
            in_stats = t.in_stats is not None and modes[0].kind == BATCH
            rd = t.residual.dtype if t.residual is not None else None
            plan = choice.backend.make_plan(spec, modes, x, cd, in_stats, out_stats, rd)
        entry = (choice, plan)
        if not torch.compiler.is_compiling():  # a traced call leaves no Python state behind (Dynamo
            cache[key] = entry                 # would have to rebuild the frozen spec in the key)
    choice, plan = entry
    if plan is not None and _has_tangents(x, t):
        choice = BackendChoice(ReferenceBackend, choice.skipped + (
            "forward-mode AD (dual tensors): the fused kernels have no JVP; plain PyTorch ops",))
        plan = None
    if plan is not None and _infinite_invstd(t, modes):
        choice = BackendChoice(ReferenceBackend, choice.skipped + (
            "eval with eps = 0 and a zero running variance: an infinite invstd, which the folded transform "
            "x·scale + shift cannot carry; plain PyTorch ops",))
        plan = None
    if not torch.compiler.is_compiling():
        cache.last = LastCall(key, requested, memory, choice.name, choice.reason)
    if plan is None:
        return reference_chain(spec, x, t, modes), choice
    if torch.compiler.is_compiling():
        if requested == "auto" and not choice.backend.traceable:  # a decision of a backend that does not trace
            choice, plan = _auto.traceable(choice, spec, x, t, modes, cd)
            if plan is None:
                return reference_chain(spec, x, t, modes), choice
        return library.compiled_chain(choice.backend, spec, x, t, modes, plan), choice
    flat = t.flatten()
    if torch.is_grad_enabled() and (x.requires_grad or any(f is not None and f.requires_grad for f in flat)):
        outs = ChainFunction.apply(plan, t, x, *flat)
        outs = outs if isinstance(outs, tuple) else (outs,)
        proj_out = outs[1] if spec.proj is not None and spec.proj_out == "return" else None
        stats = StatsHandoff(outs[-1], *plan.handoff_geometry()) if plan.out_stats else None
        return ChainResult(outs[0], proj_out, stats), choice
    fwd = plan.forward(x, t)
    return ChainResult(fwd.out, fwd.proj_out, fwd.stats), choice


# The measured dispatch builds on everything above (and imports it): bound last, used at call time only.
