"""The modules :func:`fused_preact.convert` puts in place: :class:`ConvertedPreActBlock` (a recognized
residual block running its BN → ReLU → Conv steps as one fused chain) and :class:`FusedSequential`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.conversion.matching import (
    _MODES,
    _conv_problem,
    _has_act,
    _hook_problem,
)
from fused_preact.modules import (
    FusedBNReLUConv2d,
    FusedModuleBase,
    FusedPreActBlock,
    FusedPreActBottleneck,
    describe_backend,
    init_fused_state,
    record_eager,
    run_units,
)


def _preact(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The materialized pre-activation ``relu(bn(x))``: a BatchNormAct2d applies its own ReLU."""
    return norm(x) if _has_act(norm) else F.relu(norm(x))


class ConvertedPreActBlock(FusedModuleBase):
    """A pre-activation residual block rebuilt on the fused op, holding the original block's children.

    Built by :func:`convert` from a timm-style (``norm1, conv1, …, downsample, drop_path``) or
    CIFAR-style (``bn1, conv1, …, shortcut``) block; every child of the original, and every parameter
    and buffer it holds itself, is registered under the same name in the same order, so parameters,
    buffers and state_dict keys are unchanged.

    Forward: ``drop_path(conv_k(relu(bn_k(… conv_1(relu(bn_1(x))) …)))) + shortcut``, each
    BN → ReLU → Conv step fused, the steps run as one chain (:func:`fused_preact.modules.run_units`)
    with the shortcut added in the last conv's epilogue unless a drop path is active; ``shortcut`` is
    read as ``shortcut_mode`` says (see :mod:`fused_preact.conversion`). With ``module_preact`` or
    ``identity_preact`` the first BN → ReLU runs unfused (its output is materialized once).

    That reading was matched (and probed) against the original class's forward and the children it
    had. When the children change afterwards — one replaced by a module of another type, one added
    or removed anywhere below the block (``_convert_layout``) — the block runs the original class's
    forward on its current children instead, unfused, and says so (``fallback_reason``; a forced
    fused backend raises): a shortcut turned into a projection, a norm without its ReLU, are then
    computed as the original block computes them. The same when one of the original block's own
    public attributes (copied onto this block, e.g. a residual scale or a dropout rate its forward
    reads) is assigned another value or changed in place (``_changed_attributes``: lists, dicts,
    sets and tuples of plain values and small tensors, nested, up to 256 values with the containers,
    are compared with a record taken at conversion, a tensor by its version counter and then its
    value — not under torch.compile tracing, which cannot read it; another mutable object, or a
    larger one, changed in place is not seen). Replacing a child by one of the same type, a hook, or a changed attribute of
    a child is read by the fused path on every call, as before.

    Attributes:
        backend: requested backend (``"auto"``, ``"triton"``, ``"reference"``).
        last_backend, fallback_reason: what the last fused step ran, and why it fell back.
        steps: ((norm name, conv name), …) of the residual branch.
        shortcut_name, shortcut_mode, proj_path, drop_path_name: how the shortcut and drop path
            are found and read.
        source_type: the original block's qualified class name.
        _convert_layout: ((module path, type), …) of every module below the block at conversion.
        _source_attrs: the original block's public non-module attributes at conversion.
        _source_snaps: for those of them that can change in place, what they held at conversion
            (:func:`_snapshot`).

    Shapes and dtypes: those of the original block (input (N, C, H, W)).
    Raises (in forward): as :func:`fused_preact.modules.run_units` (bad rank or channels, forced backend that
    cannot serve the input).
    """

    def __init__(self, block: nn.Module, steps: tuple[tuple[str, str], ...], shortcut_name: Optional[str],
                 shortcut_mode: str, proj_path: tuple[str, ...], drop_path_name: Optional[str],
                 backend: str = "auto"):
        super().__init__(backend)
        # the block's own parameters and buffers too (a learnable scale, a step counter): state_dict
        # keeps their keys, values and order (own ones before the children's)
        for name, param in block._parameters.items():
            self.register_parameter(name, param)
        for name, buf in block._buffers.items():
            self.register_buffer(name, buf, persistent=name not in block._non_persistent_buffers_set)
        for name, child in block._modules.items():
            self.register_module(name, child)
        self.training = block.training
        self.steps = steps
        self.shortcut_name = shortcut_name
        self.shortcut_mode = shortcut_mode
        self.proj_path = proj_path
        self.drop_path_name = drop_path_name
        self.source_type = f"{type(block).__module__}.{type(block).__qualname__}"
        if hasattr(type(block), "expansion"):
            self.expansion = type(block).expansion
        # the original forward's class and attributes, to run it on the current children
        self._source_cls = type(block)
        self._source_state = {k: v for k, v in block.__dict__.items() if k != "_modules"}
        self._convert_layout = _layout(self)
        # its public attributes, readable (and settable) here as on the original block
        self._source_attrs = {k: v for k, v in self._source_state.items()
                              if not k.startswith("_") and k != "training" and k not in block._modules
                              and k not in self.__dict__ and not hasattr(type(self), k)}
        self.__dict__.update(self._source_attrs)
        self._source_snaps = {k: snap for k, v in self._source_attrs.items() if (snap := _snapshot(v)) is not None}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shortcut={_MODES[self.shortcut_mode]!r}, source={self.source_type}"

    def _shortcut(self) -> nn.Module:
        return self._modules[self.shortcut_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) → the original block's output; see the class docstring."""
        if _layout(self) != self._convert_layout or self._changed_attributes():
            return self._source_forward(x)
        mods = self._modules
        steps = [(mods[n], mods[c]) for n, c in self.steps]
        mode = self.shortcut_mode
        dp = mods.get(self.drop_path_name) if self.drop_path_name is not None else None
        # A module the fused reading would not call runs when hooks were added to it after conversion:
        # a drop path that changes nothing, an identity shortcut, the containers around the projection.
        drop = _drop_path_active(dp) or _hook_problem("", dp) is not None
        hooked_sc = self.shortcut_name is not None and _hook_problem("", mods.get(self.shortcut_name)) is not None
        if mode == "proj_fused" and any(_hook_problem("", m) for m in self._proj_containers()):
            mode = "module_preact"  # the shortcut module on the materialized pre-activation: the same value
        if mode in ("module_preact", "identity_preact"):
            a = _preact(steps[0][0], x)
            h = steps[0][1](a)
            sc = a if mode == "identity_preact" and not hooked_sc else self._shortcut()(a)
            if drop:
                return dp(run_units(self, h, steps[1:])[0]) + sc
            return run_units(self, h, steps[1:], residual=sc)[0]
        if mode == "proj_fused":
            proj = mods[self.proj_path[0]]
            for part in self.proj_path[1:]:
                proj = proj._modules[part]
            if drop:
                out, sc, _ = run_units(self, x, steps, proj=proj, proj_out="return")
                return dp(out) + sc
            return run_units(self, x, steps, proj=proj)[0]
        identity = mode == "identity_raw" and not hooked_sc
        sc = x if identity else self._shortcut()(x)
        if drop:
            return dp(run_units(self, x, steps)[0]) + sc
        return run_units(self, x, steps, residual="input" if identity else sc)[0]

    def _changed_attributes(self) -> list[str]:
        """The original's public attributes (``_source_attrs``) assigned another value since
        conversion (an immutable value compared by value, any other by identity), deleted, or changed
        in place where :func:`_snapshot` can tell."""
        d, snaps = self.__dict__, self.__dict__.get("_source_snaps", {})  # a pickle of an older version
        return [k for k, v in self._source_attrs.items()
                if not _same(d.get(k, _MISSING), v) or (k in snaps and _changed_in_place(v, snaps[k]))]

    def _source_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The original class's forward on the block's current children, training mode and public
        attributes (the original's, as set on this block since), called without module hooks (this
        block's call runs them)."""
        now = dict(_layout(self))
        old = dict(self._convert_layout)
        changed = sorted({p for p, t in old.items() if now.get(p, None) is not t} | (now.keys() - old.keys()))
        what = [f"its modules changed since convert() ({', '.join(changed)})"] if changed else []
        attrs = self._changed_attributes()
        what += [f"its attributes changed since convert() ({', '.join(attrs)})"] if attrs else []
        record_eager(self, f"{'; '.join(what)}: the original {self.source_type}.forward runs, unfused", x)
        state = {k: v for k, v in self._source_state.items() if k not in self._modules}  # a child now
        state.update((k, v) for k, v in self.__dict__.items() if k in state and not k.startswith("_"))
        block = self._source_cls.__new__(self._source_cls)
        block.__dict__.update(state)
        block.__dict__["_modules"] = self._modules
        block.__dict__["_parameters"] = self._parameters
        block.__dict__["_buffers"] = self._buffers
        block.__dict__["training"] = self.training
        return block.forward(x)

    def _proj_containers(self) -> list[nn.Module]:
        """The modules around the fused projection conv on its path (e.g. a ``Sequential(conv)``)."""
        mods, m = [], self._modules[self.proj_path[0]]
        for part in self.proj_path[1:]:
            mods.append(m)
            m = m._modules[part]
        return mods


#: instance attributes ConvertedPreActBlock sets beside FusedModuleBase's (see :func:`state_name_clashes`)
_BLOCK_ATTRS = ("steps", "shortcut_name", "shortcut_mode", "proj_path", "drop_path_name", "source_type", "expansion",
                "_source_cls", "_source_state", "_convert_layout", "_source_attrs", "_source_snaps")


def state_name_clashes(block: nn.Module) -> list[str]:
    """Names of ``block``'s own parameters and buffers (not its children's) that a
    :class:`ConvertedPreActBlock` cannot adopt: it uses them itself (an attribute, a method)."""
    reserved = set(vars(FusedModuleBase("reference"))) | set(_BLOCK_ATTRS)
    return [n for n in (*block._parameters, *block._buffers) if n in reserved or hasattr(ConvertedPreActBlock, n)]


_MISSING = object()
_SCALARS = (int, float, bool, str, bytes, type(None))


def _same(a: object, b: object) -> bool:
    """``a is b``, or equal scalars of one type (a float assigned again is a new object; NaN equals
    NaN: a pickled one comes back as another object), or tuples of such, element by element (a tensor
    in one by identity: never compared by value, which torch.compile cannot trace)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, _SCALARS):
        return a == b or (isinstance(a, float) and a != a and b != b)
    if isinstance(a, tuple):  # element by element (torch.compile cannot trace ``is`` between tuples)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


#: The most values (scalars, tensors, containers) of an attribute watched for changes in place, and
#: the most elements of a watched tensor: larger ones are not watched (the comparison per call stays cheap).
_WATCH_LEAVES = 256
_WATCH_ELEMENTS = 1 << 16
_NAN = ("nan",)  # a NaN set element or dict key, made comparable (pickling makes another float object)


class _Unwatchable(Exception):
    pass


class _TensorSnap:
    """A watched tensor: the object, its version and a copy of its value (renewed when a copy of the
    block — torch.save/load — holds an equal tensor at another version)."""

    __slots__ = ("obj", "version", "value")

    def __init__(self, t: torch.Tensor):
        self.obj, self.version, self.value = t, t._version, t.detach().clone()


def _canon(k: object) -> object:
    return _NAN if isinstance(k, float) and k != k else k


def _snapshot(v: object) -> Optional[tuple]:
    """A record of what an attribute value holds that can change in place — a list, dict, set or
    tuple of plain values and small tensors, nested, or such a tensor itself — for
    :func:`_changed_in_place`; None for anything else (immutable, or not watched: other objects, an
    inference tensor, which has no version counter, more than ``_WATCH_LEAVES`` leaves or a tensor of
    more than ``_WATCH_ELEMENTS`` elements)."""
    budget = [_WATCH_LEAVES]

    def snap(e):
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unwatchable
        if isinstance(e, _SCALARS):
            return ("scalar", e)
        if isinstance(e, torch.Tensor):
            if e.is_inference() or e.numel() > _WATCH_ELEMENTS or e.device.type == "meta":
                raise _Unwatchable
            return ("tensor", _TensorSnap(e))
        if isinstance(e, (list, tuple)):
            return (type(e), [snap(x) for x in e])
        if isinstance(e, dict) and all(isinstance(k, _SCALARS) for k in e):
            return (type(e), [(_canon(k), snap(x)) for k, x in e.items()])
        if isinstance(e, (set, frozenset)) and all(isinstance(k, _SCALARS) for k in e):
            return (type(e), frozenset(_canon(k) for k in e))
        raise _Unwatchable

    mutable = (torch.Tensor, list, dict, set)
    if not isinstance(v, (*mutable, tuple)) or (isinstance(v, tuple) and _immutable(v)):
        return None
    try:
        return snap(v)
    except _Unwatchable:
        return None


def _immutable(v: object) -> bool:
    return isinstance(v, (*_SCALARS, frozenset)) or (isinstance(v, tuple) and all(_immutable(e) for e in v))


def _changed_in_place(v: object, snap: tuple) -> bool:
    """Whether ``v`` no longer holds what :func:`_snapshot` recorded: scalars by value (NaN equal to
    NaN), containers element by element, a tensor by identity and version and, when either moved, by
    value (an equal one renews the record). Tensors are not read under torch.compile tracing, which
    cannot read a version counter."""
    kind, rec = snap
    if kind == "scalar":
        return not (type(v) is type(rec) and (v == rec or (isinstance(v, float) and v != v and rec != rec)))
    if kind == "tensor":
        return not isinstance(v, torch.Tensor) or _tensor_moved(v, rec)
    if type(v) is not kind:
        return True
    if kind in (set, frozenset):
        return frozenset(_canon(k) for k in v) != rec
    if isinstance(v, dict):
        cur = {_canon(k): x for k, x in v.items()}
        return len(cur) != len(rec) or any(k not in cur or _changed_in_place(cur[k], r) for k, r in rec)
    return len(v) != len(rec) or any(_changed_in_place(x, r) for x, r in zip(v, rec))


def _tensor_moved(v: torch.Tensor, rec: _TensorSnap) -> bool:
    if torch.compiler.is_compiling() or (v is rec.obj and not v.is_inference() and v._version == rec.version):
        return False
    ref = rec.value
    if v.is_inference() or v.shape != ref.shape or v.dtype != ref.dtype or v.device.type == "meta":
        return True
    a = v.detach().to(ref.device)
    same = torch.equal(a, ref) if not (a.is_floating_point() or a.is_complex()) else \
        bool(((a == ref) | (a.isnan() & ref.isnan())).all())
    if same:
        rec.obj, rec.version = v, v._version
    return not same


def _layout(block: nn.Module) -> tuple[tuple[str, type], ...]:
    """((path, kind), …) of every module below ``block`` (``None`` entries too), depth first. A
    module's kind is its class, read as the fused path reads it: a ``torch.nn.utils.parametrize``
    class as the class it parametrizes (its ``parametrizations`` are not listed: the fused path
    evaluates them), ``nn.SyncBatchNorm`` as ``nn.BatchNorm2d`` (``convert_sync_batchnorm`` keeps
    converted blocks fused)."""
    out, stack = [], [("", block)]
    while stack:
        prefix, m = stack.pop()
        parametrized = nn.utils.parametrize.is_parametrized(m)
        for name, child in m._modules.items():
            if parametrized and name == "parametrizations":
                continue
            kind = type(child)
            if child is not None and nn.utils.parametrize.is_parametrized(child):
                kind = kind.__bases__[0]
            out.append((prefix + name, nn.BatchNorm2d if kind is nn.SyncBatchNorm else kind))
            if child is not None:
                stack.append((f"{prefix}{name}.", child))
    return tuple(out)


def _drop_path_active(dp: Optional[nn.Module]) -> bool:
    """Whether the drop-path module changes its input now: never for None / ``nn.Identity`` or a
    timm-style ``DropPath`` in eval mode or with ``drop_prob == 0``; always for unknown modules."""
    if dp is None or isinstance(dp, nn.Identity):
        return False
    prob = getattr(dp, "drop_prob", None)
    if isinstance(prob, (int, float)):
        return dp.training and prob > 0
    return True


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose recorded BN → ReLU → Conv runs execute as one fused op each.

    :func:`convert` turns an exact ``nn.Sequential`` into this class in place, so children keep
    their names and indices (``seq.2.weight`` stays ``seq.2.weight``) and hooks on the container
    stay. ``fused_runs`` maps a run's BatchNorm name to the names of the run,
    ``(bn, relu, conv)`` or ``(bnact, conv)``. A run is fused only while those children are still
    consecutive, of the recorded kinds and free of hooks; otherwise its children run one by one,
    so editing the Sequential later never changes what it computes. Slicing keeps the runs that
    lie wholly inside the slice.

    Args:
        *args: as ``nn.Sequential``. backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Attributes: ``backend``, ``last_backend``, ``fallback_reason`` as in :class:`FusedBNReLUConv2d`.
    Shapes and dtypes: those of the children.
    """

    def __init__(self, *args, backend: str = "auto"):
        super().__init__(*args)
        _init_fused_sequential(self, backend)

    def extra_repr(self) -> str:
        return f"{describe_backend(self)}, fused_runs={list(self.fused_runs.values())}"

    def _apply(self, fn, recurse=True):
        self._plans.clear()
        self._traced = None
        return super()._apply(fn, recurse)

    def __getitem__(self, idx):
        """As ``nn.Sequential``; a slice is a FusedSequential keeping the runs wholly inside it."""
        out = super().__getitem__(idx)
        if isinstance(idx, slice):
            out.backend = self.backend
            out.fused_runs = {k: v for k, v in self.fused_runs.items() if all(n in out._modules for n in v)}
        return out

    def _run_at(self, items: list, i: int) -> int:
        run = self.fused_runs.get(items[i][0])
        if run is None or tuple(name for name, _ in items[i:i + len(run)]) != run:
            return 0
        mods = [m for _, m in items[i:i + len(run)]]
        if any(_hook_problem("", m) for m in mods) or _conv_problem("", mods[-1]):
            return 0
        bn = mods[0]
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            return 0
        if len(run) == 3:
            return 3 if type(mods[1]) is nn.ReLU and not _has_act(bn) else 0
        return 2 if _has_act(bn) and type(bn.act) is nn.ReLU and type(bn.drop) is nn.Identity else 0

    def forward(self, input):
        """Run the children in order, each intact recorded run as one fused BN → ReLU → Conv."""
        items = list(self._modules.items())
        i = 0
        while i < len(items):
            n = self._run_at(items, i) if items[i][0] in self.fused_runs else 0
            if n:
                input = run_units(self, input, [(items[i][1], items[i + n - 1][1])])[0]
                i += n
            else:
                input = items[i][1](input)
                i += 1
        return input


def _init_fused_sequential(seq: nn.Sequential, backend: str) -> None:
    init_fused_state(seq, backend)
    seq.fused_runs = {}


_FUSED_TYPES = (FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck, ConvertedPreActBlock)


# ----------------------------------------------------------------------------------------------
# numeric probe
