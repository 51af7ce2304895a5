"""torch.library plumbing, in one place: the fused chain as opaque custom ops for ``torch.compile``.

Eager calls never come here (they run :class:`fused_preact.ops.chain.ChainFunction` directly: a custom
op costs tens of microseconds of dispatcher and Python per call). Under ``torch.compile`` the modules
call :func:`compiled_chain`, which Dynamo traces: two custom ops with fake implementations and an
autograd formula, ``fused_preact::chain_forward`` and ``fused_preact::chain_backward``, whose
implementations run the plan the eager path runs (the ``compiled_plan`` of a backend that declares
``traceable``). The backend and chain structure travel as a string key (the backend's name, ``|``,
and a ``repr`` of plain tuples, decoded with ``ast.literal_eval``), so a compiled graph needs no
Python objects of ours. The running-statistics update (a mutation) is done
outside the op in traced ATen code from the batch mean and variance the op returns in its ``aux``
buffer; inductor fuses it.

Pattern: quack ``quack/dsl/torch_library_op.py`` and flash-attention ``flash_attn/utils/library.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Optional

import torch

from fused_preact.ops.backends import BACKENDS, Backend, Plan
from fused_preact.ops.chain import ChainResult
from fused_preact.ops.spec import (
    CHAIN_FIELDS,
    EXTERNAL,
    OP_FIELDS,
    BNMode,
    ChainGrads,
    ChainSpec,
    ChainTensors,
    ConvGeom,
    GradNeeds,
    SavedChain,
    UnitTensors,
)
from fused_preact.ops.triton.pack import PACK_GAMMA, PACK_ROWS, PACK_SHIFT

__all__ = ["compiled_chain", "encode_key", "decode_key"]


def encode_key(spec: ChainSpec, modes: tuple[BNMode, ...], cdtype: torch.dtype,
               residual_dtype: Optional[torch.dtype]) -> str:
    """The chain signature as a string of plain Python literals (see :func:`decode_key`)."""
    return repr((tuple(dataclasses.astuple(g) for g in spec.convs),
                 dataclasses.astuple(spec.proj) if spec.proj is not None else None, spec.proj_out, spec.residual,
                 tuple((int(m.kind), m.affine, m.update, m.cumulative) for m in modes), str(cdtype).replace("torch.", ""),
                 str(residual_dtype).replace("torch.", "") if residual_dtype is not None else None))


@functools.lru_cache(maxsize=None)
def decode_key(key: str):
    """``(spec, modes, cdtype, residual_dtype)`` from :func:`encode_key`'s string."""
    convs, proj, proj_out, residual, modes, cd, rd = ast.literal_eval(key)
    spec = ChainSpec(tuple(ConvGeom(*c) for c in convs), ConvGeom(*proj) if proj is not None else None, proj_out,
                     residual)
    return (spec, tuple(BNMode(*m) for m in modes), getattr(torch, cd),
            getattr(torch, rd) if rd is not None else None)


#: Plans of the custom ops by (chain key, shape, strides, dtype, device). Not evicted: a backward must find
#: the very plan (its tiles lay out the ``aux`` the forward saved) that served its forward, however many
#: other signatures ran in between. Its size is bounded by what ``torch.compile`` compiles, whose
#: recompilations per frame Dynamo caps (``torch._dynamo.config.recompile_limit``).
_PLANS: dict = {}


def _plan(key: str, x: torch.Tensor) -> Plan:
    # Tile counts and buffer sizes depend on the concrete shape: symbolic sizes are specialized here
    # (int() guards on them), so a compiled graph is specific to its input shapes.
    shape, stride = tuple(int(s) for s in x.shape), tuple(int(s) for s in x.stride())
    k = (key, shape, stride, x.dtype, x.device)
    plan = _PLANS.get(k)
    if plan is None:
        backend, chain = key.split("|", 1)  # the op's key: "<backend>|<encode_key>"
        spec, modes, cd, rd = decode_key(chain)
        plan = _PLANS[k] = BACKENDS[backend].compiled_plan(spec, modes, shape, stride, x.dtype, x.device, cd, rd)
    return plan


def _present(tensors) -> list:
    """The op's tensor list with its empty placeholders back to None (custom ops take no None inside a
    differentiable tensor list: autograd would treat the whole list as one non-tensor)."""
    return [t if t.numel() > 0 else None for t in tensors]


def _unpack(tensors, floats=None, present: bool = True) -> ChainTensors:
    """The op's flat tensor list (:meth:`ChainTensors.flatten` of :data:`OP_FIELDS`) and its floats
    (momentum, eps per unit) as :class:`ChainTensors`; ``present``: the empty placeholders as None."""
    n = (len(tensors) - len(CHAIN_FIELDS)) // len(OP_FIELDS)
    floats = floats if floats is not None else [0.0, 0.0] * n
    units = [UnitTensors(momentum=m, eps=e) for m, e in zip(floats[0::2], floats[1::2])]
    return ChainTensors(units).unflatten(_present(tensors) if present else tensors, OP_FIELDS)


# ---------------------------------------------------------------------------------------- forward
@torch.library.custom_op("fused_preact::chain_forward", mutates_args=(), device_types=("cpu", "cuda"))
def _chain_forward(x: torch.Tensor, tensors: list[torch.Tensor], floats: list[float],
                   key: str) -> list[torch.Tensor]:
    plan = _plan(key, x)
    fwd = plan.forward(x, _unpack(tensors, floats))
    for name, region in zip(plan.aux_names, fwd.saved.aux):  # only the packs carry data: the rest deterministic
        if not name.startswith("pack"):
            region.zero_()
        else:  # rows past the BatchNorm's: the fprop kernel's scratch (not always written)
            region.view(PACK_ROWS, -1)[PACK_SHIFT + 1:PACK_GAMMA].zero_()
    proj_out = fwd.proj_out if fwd.proj_out is not None else x.new_empty(0)
    return [fwd.out, proj_out, fwd.saved.aux_base, *fwd.saved.inputs[1:]]


@_chain_forward.register_fake
def _(x, tensors, floats, key):
    plan = _plan(key, x)
    fmt = torch.channels_last if plan.channels_last else torch.contiguous_format
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=x.device, memory_format=fmt)
    proj = (torch.empty(plan.proj_shape, dtype=plan.cdtype, device=x.device, memory_format=fmt)
            if plan.spec.proj is not None and plan.spec.proj_out == "return" else x.new_empty(0))
    aux = x.new_empty(sum(plan.aux_sizes), dtype=torch.float32)
    inter = [x.new_empty(u.M_in * u.in_shape[1], dtype=plan.cdtype) for u in plan.units[1:]]
    return [out, proj, aux, *inter]


# --------------------------------------------------------------------------------------- backward
@torch.library.custom_op("fused_preact::chain_backward", mutates_args=(), device_types=("cpu", "cuda"))
def _chain_backward(dy: torch.Tensor, dy_proj: Optional[torch.Tensor], x: torch.Tensor,
                    intermediates: list[torch.Tensor], aux: torch.Tensor, tensors: list[torch.Tensor],
                    key: str) -> list[torch.Tensor]:
    # The backward writes its per-tile sums into the aux regions the forward's partials used; the op
    # works on a copy so that its inputs stay unmutated (the eager path reuses the buffer itself).
    plan = _plan(key, x)
    t = _unpack(tensors)
    n = len(plan.units)
    needs = GradNeeds(True, (True,) * n, tuple(plan.units[i].geom.bias for i in range(n)),
                      tuple(u.gamma.dtype if u.gamma is not None else None for u in t.units), t.proj_weight is not None)
    g = plan.backward(dy, dy_proj, SavedChain([x, *intermediates], list(aux.clone().split(plan.aux_sizes))),
                      [u.weight for u in t.units], t.proj_weight, needs)
    # γ/β and the statistics' gradients are views of one buffer: a custom op's outputs may not alias
    units = [dataclasses.replace(u, gamma=_own(u.gamma), beta=_own(u.beta)) for u in g.units]
    stats = tuple(_own(v) for v in g.ext_stats) if g.ext_stats is not None else None
    flat = [g.dx, *ChainGrads(None, units, g.proj_weight, stats).flatten()]
    return [f if f is not None else x.new_empty(0) for f in flat]


def _own(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.clone() if t is not None else None


@_chain_backward.register_fake
def _(dy, dy_proj, x, intermediates, aux, tensors, key):
    plan = _plan(key, x)
    t = _unpack(tensors)

    def like(v, dtype=None):
        return v.new_empty(v.shape, dtype=dtype or v.dtype) if v is not None else x.new_empty(0)

    units = [UnitTensors(torch.empty_like(u.weight), like(u.bias, torch.float32), like(u.gamma), like(u.gamma))
             for u in t.units]
    C = x.shape[1] if plan.modes[0].kind == EXTERNAL else 0  # an external bn_0's statistics' gradients
    stats = tuple(x.new_empty(C, dtype=torch.float32) for _ in range(2))
    flat = [torch.empty_like(x), *ChainGrads(None, units, like(t.proj_weight), stats).flatten()]
    return [f if f is not None else x.new_empty(0) for f in flat]


def _setup(ctx, inputs, output):
    x, tensors, floats, key = inputs
    ctx.key = key
    ctx.present = [v.numel() > 0 for v in tensors]
    # The running buffers are not needed in backward (and are updated in place after the op).
    t = _unpack(tensors, present=False)
    empty = x.new_empty(0)
    kept = dataclasses.replace(t, units=[dataclasses.replace(u, running_mean=empty, running_var=empty)
                                         for u in t.units]).flatten(OP_FIELDS)
    ctx.save_for_backward(x, output[2], *output[3:], *kept)
    ctx.n_inter = len(output) - 3
    ctx.n_floats = len(floats)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    x, aux = saved[0], saved[1]
    inter = list(saved[2:2 + ctx.n_inter])
    tensors = list(saved[2 + ctx.n_inter:])
    plan = _plan(ctx.key, x)
    dy = grads[0] if grads[0] is not None else x.new_zeros(plan.out_shape, dtype=plan.out_dtype)
    dy_proj = None
    if plan.spec.proj is not None and plan.spec.proj_out == "return":
        dy_proj = grads[1] if grads[1] is not None else x.new_zeros(plan.proj_shape, dtype=plan.cdtype)
    flat = _chain_backward(dy, dy_proj, x, inter, aux, tensors, ctx.key)
    n = len(plan.units)
    g = ChainTensors.empty(n).unflatten(flat[1:])  # the gradients, in the slots of their tensors
    g.residual = dy if plan.spec.residual == "tensor" else None
    if plan.modes[0].kind != EXTERNAL:  # statistics not given from outside
        g.ext_mean = g.ext_invstd = None
    tgrads = [v if present else None for v, present in zip(g.flatten(OP_FIELDS), ctx.present)]
    return flat[0], tgrads, None, None


torch.library.register_autograd("fused_preact::chain_forward", _backward, setup_context=_setup)


# ----------------------------------------------------------------------------------- traced entry
def compiled_chain(backend: type[Backend], spec: ChainSpec, x: torch.Tensor, t: ChainTensors,
                   modes: tuple[BNMode, ...], plan) -> ChainResult:
    """The chain under ``torch.compile``: the custom ops above, then the running-statistics update in
    traced ATen (``nn.BatchNorm2d``'s formula: ``r ← (1 − f)·r + f·batch``, unbiased variance,
    ``f = 1/num_batches_tracked`` for ``momentum=None``). Statistics handoff is not used here.

    Raises:
        NotImplementedError: ``backend`` does not declare ``traceable`` (its ops are not traced).
    """
    if not (backend.traceable and backend.fused):
        traced = [n for n, b in BACKENDS.items() if b.traceable and b.fused]
        raise NotImplementedError(f"fused_preact: backend {backend.name!r} under torch.compile (use one of {traced})")
    quiet = tuple(dataclasses.replace(m, update=False) for m in modes)
    key = f"{backend.name}|{encode_key(spec, quiet, plan.cdtype, t.residual.dtype if t.residual is not None else None)}"
    floats = [float(v) for u in t.units for v in (u.momentum or 0.0, u.eps)]
    tensors = [v if v is not None else x.new_empty(0) for v in t.flatten(OP_FIELDS)]
    outs = _chain_forward(x, tensors, floats, key)
    aux = outs[2]
    offset = 0
    sizes = dict(zip(plan.aux_names, plan.aux_sizes))
    for name in plan.aux_names:
        if name.startswith("pack"):
            i = int(name[4:])
            m = modes[i]
            if m.update:
                C = plan.units[i].in_shape[1]
                _update_running(aux[offset:offset + C], aux[offset + C:offset + 2 * C], t, i, m,
                                plan.units[i].M_in)
        offset += sizes[name]
    proj_out = outs[1] if spec.proj is not None and spec.proj_out == "return" else None
    return ChainResult(outs[0], proj_out, None)


def _update_running(mean: torch.Tensor, var: torch.Tensor, t: ChainTensors, i: int, m: BNMode, count: int) -> None:
    with torch.no_grad():
        u = t.units[i]
        nbt = u.num_batches
        if nbt is not None:
            nbt.add_(1)
        f = u.momentum if not m.cumulative else (1.0 / nbt if nbt is not None else 0.0)
        rm, rv = u.running_mean, u.running_var
        rm.copy_(f * mean + (1 - f) * rm)
        rv.copy_(f * var * (count / max(count - 1, 1)) + (1 - f) * rv)
