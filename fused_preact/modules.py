"""Drop-in modules: ``FusedBNReLUConv2d``, ``FusedPreActBlock``, ``FusedPreActBottleneck``.

Every module holds plain ``nn.BatchNorm2d`` and ``nn.Conv2d`` children, so parameters, buffers and
state_dict keys are exactly those of the eager modules they replace, and ``.eval()``, momentum,
``momentum=None`` (cumulative average), ``affine=False`` and ``track_running_stats=False`` behave as
in ``nn.BatchNorm2d``. Only ``forward`` differs: it runs the fused op (``fused_preact.ops``) when a
fused backend can serve the input and the reference PyTorch path otherwise. The backend that ran
is in ``module.last_backend`` and any fallback's reason in ``module.fallback_reason``.

Source: He, Zhang, Ren, Sun, "Identity Mappings in Deep Residual Networks", ECCV 2016, Fig. 4(e)
(full pre-activation unit) and §4 (projection shortcut on the pre-activated input).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.ops import (
    BACKENDS,
    BATCH,
    EXTERNAL,
    RUNNING,
    BNMode,
    ChainSpec,
    ChainTensors,
    ConvGeom,
    PlanCache,
    StatsHandoff,
    UnitTensors,
    run_chain,
    select_backend,
)
from fused_preact.ops.auto import check_memory
from fused_preact.ops.backends import LastCall, TritonBackend, check_backend_name, eager_fallback
from fused_preact.ops.chain import ChainResult
from fused_preact.ops.spec import check_running_buffers, functorch_reasons, projection_problem, trace_reasons
from fused_preact.ops.sync_stats import sync_bn_statistics, sync_enabled

__all__ = ["FusedBNReLUConv2d", "FusedPreActBlock", "FusedPreActBottleneck", "FusedModuleBase", "bottleneck_width",
           "convert_sync_batchnorm", "run_units", "run_blocks", "plain_call", "bn_mode", "init_fused_state", "describe_backend",
           "backend_path", "record_eager"]

logger = logging.getLogger("fused_preact")

Residual = Union[None, str, torch.Tensor]


def bn_mode(bn: nn.BatchNorm2d) -> BNMode:
    """What ``bn``'s forward will do now, by ``nn.BatchNorm2d.forward``'s rules: batch statistics in
    training or without running buffers, else the running ones; buffers updated (and
    ``num_batches_tracked`` counted) in training with ``track_running_stats``; ``momentum=None`` is the
    cumulative average."""
    has_buffers = bn.running_mean is not None and bn.running_var is not None
    batch = bn.training or not has_buffers
    update = bn.training and bn.track_running_stats and has_buffers
    return BNMode(BATCH if batch else RUNNING, _affine(bn), update, bn.momentum is None)


def _affine(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn`` has a scale or a shift (either may be None: F.batch_norm takes γ = 1, β = 0 for
    the missing one, e.g. a BatchNorm whose weight was removed to learn only a shift)."""
    return bn.weight is not None or bn.bias is not None


def _gamma_beta(bn: nn.BatchNorm2d) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``bn``'s (weight, bias), the missing one of the two filled in as F.batch_norm does (γ = 1,
    β = 0); (None, None) without either."""
    g, b = bn.weight, bn.bias
    if (g is None) == (b is None):
        return g, b
    other = g if g is not None else b
    fill = torch.ones if g is None else torch.zeros
    value = fill(bn.num_features, device=other.device, dtype=other.dtype)
    return (value, b) if g is None else (g, value)


def _conv_reasons(conv: nn.Conv2d) -> list[str]:
    reasons = []
    if conv.padding_mode != "zeros":
        reasons.append(f"fused conv: padding_mode={conv.padding_mode!r} (only 'zeros' is fused)")
    if isinstance(conv.padding, str):
        reasons.append(f"fused conv: string padding {conv.padding!r} (give explicit ints)")
    return reasons


def _tensors(units: list, proj: Optional[nn.Conv2d], residual: Optional[torch.Tensor],
             modes: tuple[BNMode, ...]) -> ChainTensors:
    per_unit = []
    for (bn, conv), mode in zip(units, modes):
        keep = mode.kind == RUNNING or mode.update
        per_unit.append(UnitTensors(conv.weight, conv.bias, *_gamma_beta(bn), bn.running_mean if keep else None,
                                    bn.running_var if keep else None,
                                    bn.num_batches_tracked if mode.update else None, bn.momentum, bn.eps))
    return ChainTensors(per_unit, proj.weight if proj is not None else None, residual)


def _spec(units: list, proj: Optional[nn.Conv2d], proj_out: str, residual: str) -> ChainSpec:
    """The chain's structure from the convs' current attributes (read on every call: a conv's stride,
    padding or dilation may change between calls, e.g. to change a network's output stride)."""
    return ChainSpec(tuple(ConvGeom.of(c) for _, c in units), ConvGeom.of(proj) if proj is not None else None,
                     proj_out, residual)


def _exactly(m: nn.Module, cls: type) -> bool:
    """``type(m) is cls``, or a ``torch.nn.utils.parametrize`` class over it (its forward is cls's)."""
    return type(m) is cls or (nn.utils.parametrize.is_parametrized(m) and type(m).__bases__ == (cls,))


def _norm_act(bn: nn.Module) -> list[nn.Module]:
    """A timm-style BatchNormAct2d's ``act`` and ``drop`` (which the fused path never calls), else []."""
    mods = getattr(bn, "_modules", None) or {}  # registered children: no __getattr__ miss per call
    act, drop = mods.get("act"), mods.get("drop")
    return [act, drop] if isinstance(act, nn.Module) and isinstance(drop, nn.Module) else []


def _type_reasons(units: list, proj: Optional[nn.Module] = None) -> list[str]:
    """Children whose own forward the fused path would bypass: a BatchNorm that is not exactly
    ``nn.BatchNorm2d``/``nn.SyncBatchNorm`` (or a BatchNorm2d carrying ReLU ``act`` and Identity ``drop``,
    timm's BatchNormAct2d), a conv or projection that is not exactly ``nn.Conv2d``; e.g. a frozen-BN
    subclass, a GroupNorm, an adapter around a conv or an ``nn.Identity`` swapped in after ``convert()``;
    and any of them (or a BatchNormAct2d's ``act``/``drop``) whose ``forward`` was set on the instance
    (accelerate's offload hooks, a monkeypatch)."""
    reasons = []
    if proj is not None and "forward" in proj.__dict__:
        reasons.append(f"{type(proj).__name__} has a forward set on the instance (it runs)")
    if proj is not None and not _exactly(proj, nn.Conv2d):
        reasons.append(f"{type(proj).__name__} shortcut is not exactly nn.Conv2d (its own forward runs)")
    for bn, conv in units:
        act = _norm_act(bn)
        for m in (bn, *act, conv):
            if "forward" in m.__dict__:
                reasons.append(f"{type(m).__name__} has a forward set on the instance (it runs)")
        if not (_exactly(bn, nn.BatchNorm2d) or _exactly(bn, nn.SyncBatchNorm) or (
                isinstance(bn, nn.BatchNorm2d) and act and type(act[0]) is nn.ReLU and type(act[1]) is nn.Identity)):
            reasons.append(f"{type(bn).__name__} is not exactly nn.BatchNorm2d (its own forward runs)")
        if not _exactly(conv, nn.Conv2d):
            reasons.append(f"{type(conv).__name__} is not exactly nn.Conv2d (its own forward runs)")
    return reasons


def _hook_reasons(units: list, proj: Optional[nn.Conv2d]) -> list[str]:
    """Hooks that must see plain ``bn(x)`` / ``conv(a)`` module calls (the fused path makes none),
    including a BatchNormAct2d's ``act``/``drop``."""
    mods = [m for bn, conv in units for m in (bn, *_norm_act(bn), conv)] + ([proj] if proj is not None else [])
    reasons = []
    for m in mods:
        kinds = [k for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                 if getattr(m, k, None)]
        if kinds:
            reasons.append(f"{type(m).__name__} child has {', '.join(k.strip('_').replace('_', ' ') for k in kinds)}")
    mm = nn.modules.module
    if (mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks
            or mm._global_backward_pre_hooks):
        reasons.append("global module hooks are registered")
    return [f"hooks: {'; '.join(reasons)} (the fused path calls no child module; running them as eager does)"] \
        if reasons else []


def run_units(owner: nn.Module, x: torch.Tensor, units: list, proj: Optional[nn.Conv2d] = None,
              proj_out: str = "add", residual: Residual = None, in_stats: Optional[StatsHandoff] = None,
              want_stats: bool = False) -> ChainResult:
    """Run ``units`` — ``[(bn_0, conv_0), …]``, each ``conv_i(relu(bn_i(·)))`` on the previous output —
    as one fused chain, with a pre-activation block's shortcut.

    Args:
        owner: the fused module; its ``backend`` is requested, its ``last_backend`` and
            ``fallback_reason`` record what ran, its ``_plans`` cache holds the plans.
        x: (N, C, H, W) input of ``bn_0``.
        units: (BatchNorm2d, Conv2d) pairs.
        proj: a 1×1 conv on ``relu(bn_0(x))`` (projection shortcut), added to the output
            (``proj_out="add"``) or returned (``"return"``).
        residual: None, ``"input"`` (add x: identity shortcut) or a tensor of the output's shape.
        in_stats: x's partial statistics from the producer's epilogue (used when bn_0 normalizes with
            batch statistics on the Triton path). want_stats: return the output's partial statistics.

    Returns:
        :class:`ChainResult` ``(out, proj_out, stats)`` (proj_out and stats None unless asked for and
        available).

    Raises:
        ValueError / RuntimeError: PyTorch's input errors; a forced backend that cannot serve the input.

    A parametrized module's tensors (``torch.nn.utils.parametrize``, e.g. spectral_norm's weight, whose
    evaluation in training runs a power iteration) are evaluated once per call, as the eager modules'
    forward reads them: the call runs under ``parametrize.cached()``.
    """
    modules = [m for pair in units for m in pair] + ([proj] if proj is not None else [])
    with _cached_parametrizations(modules):
        # children of other types first: their own forward runs (and raises what it raises); the checks
        # below read BatchNorm2d and Conv2d attributes
        eager_reasons = _type_reasons(units, proj)
        if not eager_reasons:
            _check_buffers(units)
            convs = [c for _, c in units] + ([proj] if proj is not None else [])
            eager_reasons = [r for c in convs for r in _conv_reasons(c)]
            proj_problem = projection_problem(proj) if proj is not None else None
            if proj_problem is not None:
                eager_reasons.append(proj_problem)
        eager_reasons += _hook_reasons(units, proj) + functorch_reasons() + trace_reasons(x)
        if eager_reasons:
            record_eager(owner, "; ".join(eager_reasons), x)
            return _eager_units(x, units, proj, proj_out, residual)
        if any(sync_enabled(bn) for bn, _ in units):
            result = _synchronized_units(owner, x, units, proj, proj_out, residual)
        else:
            kind = residual if isinstance(residual, str) or residual is None else "tensor"
            spec = _spec(units, proj, proj_out, kind or "none")
            modes = tuple(bn_mode(bn) for bn, _ in units)
            t = _tensors(units, proj, residual if kind == "tensor" else None, modes)
            if in_stats is not None and modes[0].kind == BATCH:
                t.in_stats = in_stats
            result, choice = run_chain(owner.backend, owner._plans, spec, x, t, modes, out_stats=want_stats,
                                       memory=getattr(owner, "memory", "fastest"))
            _record(owner, choice.name, choice.reason, x)
        _count_without_buffers(units)
        return result


def record_eager(owner: nn.Module, why: str, x: torch.Tensor) -> None:
    """Before ``owner`` runs its modules' eager forward because of ``why``: raise if its backend was
    forced (``RuntimeError``: that backend cannot serve the module), else record the reference path
    and the reason (``last_backend``, ``fallback_reason``, a warning on CUDA; the last call for
    :func:`fused_preact.dispatch_report`)."""
    choice = eager_fallback(owner.backend, why, "module")
    _record(owner, choice.name, why, x, stacklevel=4)
    if not torch.compiler.is_compiling():
        owner._plans.last = LastCall(None, owner.backend, getattr(owner, "memory", "fastest"), choice.name, why)


def _cached_parametrizations(modules: list) -> contextlib.AbstractContextManager:
    """``parametrize.cached()`` when one of ``modules`` is parametrized (run_units), else a no-op."""
    if any(nn.utils.parametrize.is_parametrized(m) for m in modules):
        return nn.utils.parametrize.cached()
    return contextlib.nullcontext()


def _check_buffers(units: list) -> None:
    """Raise what ``nn.BatchNorm2d.forward`` raises for a BatchNorm with only one of its running buffers
    (the chains take both or neither): ``F.batch_norm``'s errors for the arguments it would pass."""
    for bn, _ in units:
        if (bn.running_mean is None) != (bn.running_var is None):  # what nn.BatchNorm2d.forward passes
            passed = not bn.training or bn.track_running_stats
            check_running_buffers(bn.training, bn.running_mean if passed else None, bn.running_var if passed else None)


def _count_without_buffers(units: list) -> None:
    """``num_batches_tracked += 1`` for the BatchNorms that count a training batch but have no running
    buffers to update (``running_mean``/``running_var`` set to None with ``track_running_stats``), as
    ``nn.BatchNorm2d.forward`` counts it; the chains count the others with their buffer update."""
    for bn, _ in units:
        if (bn.training and bn.track_running_stats and bn.num_batches_tracked is not None
                and not bn_mode(bn).update):
            bn.num_batches_tracked.add_(1)


def _add_shortcut(out, x, proj_val, residual):
    if proj_val is not None:
        out = out + proj_val
    if isinstance(residual, str):
        return out + x
    return out + residual if residual is not None else out


def _eager_units(x, units, proj, proj_out, residual):
    """The modules' own eager forward (convs the fused kernels do not serve)."""
    h, a0 = x, None
    for i, (bn, conv) in enumerate(units):
        a = F.relu(bn(h))
        a0 = a if i == 0 else a0
        h = conv(a)
    p = proj(a0) if proj is not None else None
    if proj_out == "return":
        return ChainResult(_add_shortcut(h, x, None, residual), p)
    return ChainResult(_add_shortcut(h, x, p, residual))


def _synchronized_units(owner, x, units, proj, proj_out, residual):
    """Units with a synchronizing ``nn.SyncBatchNorm``: one chain per unit, whose BatchNorm uses the
    statistics all-gathered over its process group (``EXTERNAL`` mode: their gradients are all-reduced
    in backward); the shortcut is added with ATen."""
    h, p = x, None
    for i, (bn, conv) in enumerate(units):
        unit_proj = proj if i == 0 else None
        spec = _spec([(bn, conv)], unit_proj, "return", "none")
        mode = bn_mode(bn)
        if sync_enabled(bn):
            # nn.SyncBatchNorm.forward's factor and buffers: updated only in training with
            # track_running_stats; 1/num_batches_tracked for momentum=None when it is counted.
            factor = 0.0 if bn.momentum is None else bn.momentum
            if mode.update and bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
                if bn.momentum is None:
                    factor = 1.0 / float(bn.num_batches_tracked)
            rm, rv = (bn.running_mean, bn.running_var) if mode.update else (None, None)
            # the local statistics by the Triton statistics kernel where a fused backend may run
            fused = (owner.backend == "auto" or BACKENDS[owner.backend].fused) \
                and not TritonBackend.not_supported_reasons(h)
            mean, invstd = sync_bn_statistics(h, rm, rv, factor, bn.eps, bn.process_group, fused=fused)
            mode = BNMode(EXTERNAL, _affine(bn))
            t = _tensors([(bn, conv)], unit_proj, None, (mode,))
            t.ext_mean, t.ext_invstd = mean, invstd
        else:
            t = _tensors([(bn, conv)], unit_proj, None, (mode,))
        result, choice = run_chain(owner.backend, owner._plans, spec, h, t, (mode,),
                                   memory=getattr(owner, "memory", "fastest"))
        _record(owner, choice.name, choice.reason, h)
        h = result.out
        if i == 0 and proj is not None:
            p = result.proj_out
    if proj_out == "return":
        return ChainResult(_add_shortcut(h, x, None, residual), p)
    return ChainResult(_add_shortcut(h, x, p, residual))


def _record(owner: nn.Module, name: str, reason: Optional[str], x: torch.Tensor, stacklevel: int = 3) -> None:
    """Set ``owner.last_backend`` / ``fallback_reason``; a new fallback reason is warned on CUDA and
    logged on the ``fused_preact`` logger otherwise — except while ``torch.compile`` traces (logging
    would break the graph; the attributes still record what the compiled graph runs, and
    ``owner._traced`` the (backend, memory) of a traced call, None after an eager one)."""
    traced = (owner.backend, getattr(owner, "memory", "fastest")) if torch.compiler.is_compiling() else None
    if getattr(owner, "_traced", None) != traced:
        owner._traced = traced
    if owner.last_backend != name or owner.fallback_reason != reason:
        owner.last_backend = name
        owner.fallback_reason = reason
        if reason is not None and not torch.compiler.is_compiling():
            msg = f"fused_preact: {type(owner).__name__} runs the {name} path: {reason}"
            if x.device.type == "cuda":
                warnings.warn(msg, stacklevel=stacklevel)
            else:
                logger.info(msg)


def plain_call(m: nn.Module) -> bool:
    """Whether ``m(x)`` is exactly ``type(m).forward(m, x)``: no hooks of its own (forward, forward
    pre, backward, backward pre) or global ones, no ``forward`` set on the instance, no ``__call__`` of
    its class's own, not compiled in place (``Module.compile``). A caller may then run the forward's
    body itself."""
    mm = nn.modules.module
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or mm._global_forward_hooks or mm._global_forward_pre_hooks or mm._global_backward_hooks
                or mm._global_backward_pre_hooks or "forward" in vars(m)
                or getattr(m, "_compiled_call_impl", None) is not None or type(m).__call__ is not nn.Module.__call__)


def run_blocks(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run consecutive residual blocks, handing each fused block's output statistics to the next.

    When a fused block is followed by another fused block whose bn1 normalizes with batch
    statistics, the last conv's epilogue of the first computes them (together with the residual
    add), so the second runs no statistics pass over its input. Blocks that are not fused, whose
    class overrides ``forward``, or whose call is not plain (:func:`plain_call`: hooks of any kind,
    a ``forward`` set on the instance) are called normally and break the chain. Same result as
    ``for b in blocks: x = b(x)``.

    Args:
        blocks: modules mapping (N, C, H, W) → (N, C', H', W'), e.g. a stage's ``nn.Sequential``.
        x: the first block's input.
    """
    chained = [isinstance(b, (FusedPreActBlock, FusedPreActBottleneck)) and type(b).forward is FusedPreActBlock.forward
               and plain_call(b) for b in blocks]
    stats = None
    for i, blk in enumerate(blocks):
        if not chained[i]:
            x, stats = blk(x), None
            continue
        nxt = blocks[i + 1].bn1 if i + 1 < len(blocks) and chained[i + 1] else None
        want = isinstance(nxt, nn.modules.batchnorm._BatchNorm) and bn_mode(nxt).kind == BATCH
        x, _, stats = run_units(blk, x, blk._units(), blk.shortcut, residual=blk._residual(), in_stats=stats,
                                want_stats=want)
    return x


class FusedModuleBase(nn.Module):
    """Common state of the fused modules: the requested backend, what ran last and why, and the
    per-input-signature plan cache, cleared whenever the module's parameters move or change dtype
    (``_apply``: ``.to()``, ``.cuda()``, ``.half()`` …)."""

    def __init__(self, backend: str, memory: str = "fastest"):
        super().__init__()
        init_fused_state(self, backend, memory)

    def _apply(self, fn, recurse=True):
        self._plans.clear()
        self._traced = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return describe_backend(self)


def init_fused_state(module: nn.Module, backend: str, memory: str = "fastest") -> None:
    """Give ``module`` the attributes the fused paths read and write (``backend``, ``memory`` — the
    ``backend="auto"`` policy, see :mod:`fused_preact.ops.auto` —, ``last_backend``,
    ``fallback_reason``, plan caches).

    Raises:
        ValueError: ``memory`` is not ``"fastest"`` or ``"lean"``; ``backend`` is not ``"auto"`` or a name
            in :data:`fused_preact.ops.BACKENDS`.
    """
    module.memory = check_memory(memory)
    module.backend = check_backend_name(backend)
    module.last_backend = None
    module.fallback_reason = None
    module._traced = None
    module._plans = PlanCache()


def backend_path(module: nn.Module) -> str:
    """Which path the module's forward takes: ``"triton"``, or ``"reference (<why the others refuse>)"``.
    After a call under the module's current ``backend``/``memory`` (and no cache reset since: ``.to()``,
    ``set_memory_policy``), what that call ran; otherwise the backend an input on the parameters'
    device and dtype would get (outside autocast), which the module's geometry, hooks or child types can
    still overrule."""
    last = module._plans.last if isinstance(getattr(module, "_plans", None), PlanCache) else None
    if last is not None and (last.requested, last.memory) == (module.backend, getattr(module, "memory", "fastest")):
        return last.runs if last.reason is None else f"{last.runs} ({last.reason})"
    p = next(module.parameters(), None)
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    probe = torch.empty(1, device=device, dtype=dtype).expand(1, 8, 1, 1)
    try:
        choice = select_backend(module.backend, probe)
    except (RuntimeError, ValueError) as e:
        return f"error: {e}"
    return choice.name if choice.reason is None else f"{choice.name} ({choice.reason})"


def describe_backend(module: nn.Module) -> str:
    """``backend='auto', runs='triton'``: the requested backend and :func:`backend_path` (``repr``)."""
    return f"backend={module.backend!r}, runs={backend_path(module)!r}"


def _bn(c, eps, momentum, affine=True, track_running_stats=True, **kw):
    return nn.BatchNorm2d(c, eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats, **kw)


def build_basic_layers(block: nn.Module, in_planes: int, planes: int, stride: int, eps: float,
                       momentum: Optional[float], **factory) -> None:
    """Give ``block`` the basic unit's children: ``bn1, conv1 (3×3, stride), bn2, conv2 (3×3), shortcut``.

    ``shortcut`` is a 1×1 strided conv (no BN) when the shape changes, else ``None``. Shared by the
    fused and the eager block so both have the same parameters in the same order.
    """
    block.bn1 = _bn(in_planes, eps, momentum, **factory)
    block.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False, **factory)
    block.bn2 = _bn(planes, eps, momentum, **factory)
    block.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False, **factory)
    block.shortcut = (
        nn.Conv2d(in_planes, planes, 1, stride, bias=False, **factory) if stride != 1 or in_planes != planes else None
    )


def bottleneck_width(planes: int, groups: int = 1, base_width: int = 64) -> int:
    """Channels of a bottleneck's 3×3 conv: ``⌊planes·base_width/64⌋·groups`` (ResNeXt, Xie et al. 2017,
    Table 1; torchvision's ``Bottleneck`` convention). ``groups=1, base_width=64`` gives ``planes``.

    Raises:
        ValueError: ``groups`` or ``base_width`` < 1, or a width of 0.
    """
    if groups < 1 or base_width < 1:
        raise ValueError(f"groups and base_width must be ≥ 1, got groups={groups}, base_width={base_width}")
    width = (planes * base_width // 64) * groups
    if width < 1:
        raise ValueError(f"bottleneck width is 0 for planes={planes}, base_width={base_width}")
    return width


def build_bottleneck_layers(block: nn.Module, in_planes: int, planes: int, stride: int, eps: float,
                            momentum: Optional[float], groups: int = 1, base_width: int = 64, **factory) -> None:
    """Give ``block`` the bottleneck's children: ``bn1, conv1 1×1, bn2, conv2 3×3 (stride, groups), bn3,
    conv3 1×1`` to ``4·planes``, and ``shortcut`` (1×1 strided conv when the shape changes, else
    ``None``). The inner width is :func:`bottleneck_width` (``planes`` for a ResNet, ResNeXt's
    ``groups × base_width`` cardinality otherwise)."""
    out_planes = planes * 4
    width = bottleneck_width(planes, groups, base_width)
    block.bn1 = _bn(in_planes, eps, momentum, **factory)
    block.conv1 = nn.Conv2d(in_planes, width, 1, bias=False, **factory)
    block.bn2 = _bn(width, eps, momentum, **factory)
    block.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False, **factory)
    block.bn3 = _bn(width, eps, momentum, **factory)
    block.conv3 = nn.Conv2d(width, out_planes, 1, bias=False, **factory)
    block.shortcut = (
        nn.Conv2d(in_planes, out_planes, 1, stride, bias=False, **factory) if stride != 1 or in_planes != out_planes
        else None
    )


class FusedBNReLUConv2d(FusedModuleBase):
    """BatchNorm2d → ReLU → Conv2d as one fused module (a pre-activation unit's basic step).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias: as ``nn.Conv2d``.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d``.
        backend: ``"auto"``, ``"triton"``, ``"cuda"``, ``"recompute"`` or ``"reference"`` (see
            ``fused_preact.dispatch``).
        device, dtype: factory kwargs for both children.
        memory: ``backend="auto"``'s policy: ``"fastest"`` (the fastest valid backend) or ``"lean"`` (the
            fastest of those that save only the BN input for backward; see :mod:`fused_preact.ops.auto`).

    Shapes: input (N, in_channels, H, W), NCHW or channels_last; output (N, out_channels, P, Q) in
    the input's memory format. dtypes: float32/float16/bfloat16 fused; float64 on the reference path.

    Attributes: ``bn`` (nn.BatchNorm2d), ``conv`` (nn.Conv2d); state_dict keys ``bn.weight``,
    ``bn.bias``, ``bn.running_mean``, ``bn.running_var``, ``bn.num_batches_tracked``, ``conv.weight``
    (and ``conv.bias``).

    Raises: ValueError at construction for an unknown ``backend`` or ``memory``; in forward, ValueError
    for non-4D input or one value per channel in training, RuntimeError for a wrong channel count or a
    forced backend that cannot serve the input.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
        memory: str = "fastest",
    ):
        super().__init__(backend, memory)
        kw = dict(device=device, dtype=dtype)
        self.bn = _bn(in_channels, eps, momentum, affine, track_running_stats, **kw)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, **kw)

    @classmethod
    def from_modules(cls, bn: nn.BatchNorm2d, conv: nn.Conv2d, backend: str = "auto") -> "FusedBNReLUConv2d":
        """Wrap existing ``bn`` and ``conv`` modules (shared, not copied) into a fused module."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        init_fused_state(mod, backend)
        mod.bn = bn
        mod.conv = conv
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_units(self, x, [(self.bn, self.conv)]).out


class FusedPreActBlock(FusedModuleBase):
    """Full pre-activation basic block (He et al. 2016, Fig. 4(e)): ``x + conv2(relu(bn2(conv1(relu(bn1(x))))))``.

    Args:
        in_planes: input channels. planes: output channels (``expansion = 1``).
        stride: stride of conv1 and of the projection shortcut.
        eps, momentum: of both BatchNorms. backend: see ``fused_preact.dispatch``. memory: ``backend="auto"``'s
        policy (``"fastest"`` or ``"lean"``), as in :class:`FusedBNReLUConv2d`.

    Attributes: ``bn1``, ``conv1`` (3×3, stride), ``bn2``, ``conv2`` (3×3), and ``shortcut``: a 1×1
    conv with the block's stride (no BN) when the shape changes, otherwise ``None``.

    Shortcut rule: the projection reads the pre-activated input ``relu(bn1(x))`` (the paper's code,
    timm ``resnetv2``, kuangliu's CIFAR code); the identity shortcut reads the raw ``x``. Some
    published snippets take the identity from the pre-activated tensor, which puts BN and ReLU on the
    skip path and breaks the clean identity propagation the paper is about (§3). bn1's statistics are
    computed once and feed both conv1 and the projection.

    Shapes: (N, in_planes, H, W) → (N, planes, ⌈H/stride⌉, ⌈W/stride⌉).
    Raises: as :class:`FusedBNReLUConv2d` (an unknown ``backend`` or ``memory`` at construction).
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 backend: str = "auto", device=None, dtype=None, memory: str = "fastest"):
        super().__init__(backend, memory)
        build_basic_layers(self, in_planes, planes, stride, eps, momentum, device=device, dtype=dtype)

    def _units(self) -> list[tuple[nn.BatchNorm2d, nn.Conv2d]]:
        return [(self.bn1, self.conv1), (self.bn2, self.conv2)]

    def _residual(self) -> Optional[str]:
        return None if self.shortcut is not None else "input"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_units(self, x, self._units(), self.shortcut, residual=self._residual()).out


class FusedPreActBottleneck(FusedModuleBase):
    """Full pre-activation bottleneck block (He et al. 2016, Fig. 4(e); expansion 4).

    ``x + conv3(relu(bn3(conv2(relu(bn2(conv1(relu(bn1(x)))))))))`` with conv1 1×1, conv2 3×3
    (stride), conv3 1×1 to ``4·planes``; ``shortcut`` is a 1×1 strided conv on the pre-activated
    input when the shape changes, else ``None`` (identity on raw x) — the same rule as
    :class:`FusedPreActBlock`.

    Args: in_planes, planes (output has ``4·planes`` channels), stride, eps, momentum, backend, memory as
    :class:`FusedPreActBlock`; ``groups`` and ``base_width`` make it a ResNeXt bottleneck (grouped
    3×3 conv of width ``⌊planes·base_width/64⌋·groups``, Xie et al. 2017).
    Shapes: (N, in_planes, H, W) → (N, 4·planes, ⌈H/stride⌉, ⌈W/stride⌉).
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 backend: str = "auto", groups: int = 1, base_width: int = 64, device=None, dtype=None,
                 memory: str = "fastest"):
        super().__init__(backend, memory)
        build_bottleneck_layers(self, in_planes, planes, stride, eps, momentum, groups, base_width,
                                device=device, dtype=dtype)

    def _units(self) -> list[tuple[nn.BatchNorm2d, nn.Conv2d]]:
        return [(self.bn1, self.conv1), (self.bn2, self.conv2), (self.bn3, self.conv3)]

    _residual = FusedPreActBlock._residual
    forward = FusedPreActBlock.forward


def convert_sync_batchnorm(model: nn.Module, process_group=None) -> nn.Module:
    """Turn every BatchNorm of ``model`` (fused modules included) into ``nn.SyncBatchNorm``.

    This is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (same arguments, same result), given
    here so the contract is explicit: the fused modules hold their BatchNorms as plain children, so
    the converter swaps those children for ``nn.SyncBatchNorm`` and leaves the fused modules in
    place; their forward then sees a SyncBatchNorm and synchronizes the statistics over its
    ``process_group`` (all-gather of (count, mean, var) in forward, all-reduce of the statistics'
    gradients in backward). Calling torch's converter directly is therefore equally safe: it cannot
    silently turn a fused model back into an unsynchronized or unfused one.

    Args:
        model: any module tree. process_group: group to synchronize over (``None``: default group).

    Returns:
        ``model`` itself if it is not a BatchNorm, else its SyncBatchNorm replacement (as torch).
    """
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
