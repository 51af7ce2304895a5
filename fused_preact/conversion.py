"""``convert(model)``: replace recognized BatchNorm → ReLU → Conv structures of a model with fused modules.

What is recognized
    * Pre-activation residual blocks whose children are named like timm's ``resnetv2``
      (``PreActBasic`` / ``PreActBottleneck``: ``norm1, conv1, norm2, conv2[, norm3, conv3]``,
      ``downsample``, ``drop_path``; the norms are ``BatchNormAct2d``, i.e. a ``BatchNorm2d`` with
      its own ``act`` and ``drop``), or like the widely copied CIFAR code (kuangliu/pytorch-cifar
      ``PreActBlock`` / ``PreActBottleneck`` and :mod:`fused_preact.models`: plain ``nn.BatchNorm2d``
      ``bn1, conv1, bn2, conv2[, bn3, conv3]`` with ``F.relu`` in forward, and ``shortcut``: absent,
      ``None``, a 1×1 conv or an ``nn.Sequential`` holding one). Such a block is replaced by a
      :class:`ConvertedPreActBlock` that adopts the block's children under the same names.
    * Runs of consecutive children of an exact ``nn.Sequential``: ``nn.BatchNorm2d → nn.ReLU →
      nn.Conv2d`` (pre-activation DenseNet layers, Wide ResNet blocks) or timm
      ``BatchNormAct2d → nn.Conv2d`` (the deep stem of the ``resnetv2_*d`` models). The Sequential
      becomes a :class:`FusedSequential` (its class is changed in place; children, indices, hooks
      and attributes stay), whose forward runs each recorded run as one fused op.

Only ``type(conv) is nn.Conv2d`` with ``padding_mode='zeros'`` and integer padding is fused (subclasses
such as timm's ``StdConv2d`` or ``Conv2dSame`` change the computation); only ``nn.ReLU`` activations and
an ``nn.Identity`` ``BatchNormAct2d.drop`` are fused. Modules with hooks that the fused path would
bypass are left alone (hooks registered globally with ``nn.modules.module.register_module_forward_hook``
are not looked at). Everything not converted is listed with its reason in the
:class:`ConversionReport`.

What the converted block computes
    Exactly the original's forward (checked numerically, see ``verify``). A block's shortcut is
    read in one of five ways; the first that reproduces the block is used:

    ``identity on raw x``              ``x + F(x)`` (timm, the paper, kuangliu).
    ``projection fused with conv1``    the 1×1 projection reads the pre-activation ``relu(bn1(x))``
                                       (timm ``DownsampleConv``, kuangliu, the paper): bn1's
                                       statistics are computed once and feed conv1 and the projection.
    ``shortcut module on pre-activation``  any other shortcut module reading ``relu(bn1(x))``, e.g.
                                       timm ``DownsampleAvg`` (average pool, then 1×1 conv): the
                                       pre-activation is materialized once by the unfused
                                       ``bn1`` → ReLU and read by conv1 and the shortcut; the later
                                       BN → ReLU → Conv steps are fused. The pooled projection
                                       reads a quarter of the pixels, so fusing bn1 into it would
                                       save little and cost a second statistics pass.
    ``identity on pre-activation``     ``relu(bn1(x)) + F(x)`` (seen in some snippets): as above.
    ``shortcut module on raw x``       the shortcut (e.g. a projection) reads the raw input, as in
                                       some codebases; it runs unfused, the residual branch fused.

Verification (``verify=True``, the default)
    A block's forward cannot be checked by name (a kuangliu look-alike may project the raw input),
    so every candidate is probed before anything is replaced: a deep copy of the original, its
    parameters and buffers re-drawn at random (so zero-initialized last convs cannot hide a
    difference), and a converted copy of it running ``backend="reference"`` are run in float64 on
    two random (2, C, S, S) images (S = 4 unless the convs need more), in eval mode and then in
    training mode, with the same RNG seed (so ``DropPath`` draws the same mask). Outputs, input
    gradients, parameter gradients and buffers must agree to 1e-6 (relative, max-norm). The probe
    runs on the block's own device (where its parameters and buffers are; a block spread over
    several devices is not converted) and allocates nothing elsewhere; it seeds only the CPU
    generator and that device's generator and restores both, so the global RNG state, and the
    model's device, dtype, ``training`` flags, parameters and buffers, are as they were before
    ``convert``. Probe results are reused for modules with the same class, ``repr``, plain
    attributes and devices (the repeated blocks of a stage), so a ResNet-152 costs about a dozen
    probes, each two deep copies of one block.

Source semantics copied: timm 1.0 ``timm/models/resnetv2.py`` (``PreActBasic``,
``PreActBottleneck``, ``DownsampleConv``, ``DownsampleAvg``, ``create_resnetv2_stem``) and
``timm/layers/norm_act.py`` (``BatchNormAct2d``: ``act(drop(batch_norm(x)))``); He et al., "Identity
Mappings in Deep Residual Networks", ECCV 2016, Fig. 4(e) and §4.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import weakref
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.modules import (FusedBNReLUConv2d, FusedModuleBase, FusedPreActBlock, FusedPreActBottleneck, backend_path,
                                  describe_backend, init_fused_state, run_units)
from fused_preact.ops import BACKENDS

__all__ = ["ConversionReport", "ConvertedPreActBlock", "FusedSequential", "Replaced", "Skipped", "convert"]

logger = logging.getLogger("fused_preact")

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PROBE_TOL = 1e-6

#: block layouts: (norm names, conv names, shortcut name, drop-path name, norm kind)
_LAYOUTS = {
    "timm": (("norm1", "norm2", "norm3"), ("conv1", "conv2", "conv3"), "downsample", "drop_path", "bnact"),
    "cifar": (("bn1", "bn2", "bn3"), ("conv1", "conv2", "conv3"), "shortcut", None, "bn"),
}

#: shortcut readings, in the order they are tried, with their report text
_MODES = {
    "identity_raw": "identity on raw x",
    "proj_fused": "projection on the pre-activation, fused with conv1",
    "module_preact": "shortcut module on the pre-activation; first BN→ReLU unfused",
    "identity_preact": "identity on the pre-activation; first BN→ReLU unfused",
    "module_raw": "shortcut module on raw x, unfused",
}


class Replaced(NamedTuple):
    """One replacement: qualified module name, original type, what runs now."""

    name: str
    original: str
    fused: str


class Skipped(NamedTuple):
    """One structure left as it was: qualified module name, its type, why."""

    name: str
    type: str
    reason: str


@dataclasses.dataclass
class ConversionReport:
    """What :func:`convert` replaced and what it left alone (and why).

    Attributes:
        replaced: :class:`Replaced` entries. Blocks are named by their qualified module name,
            Sequential runs as ``"<sequential>.<bn>+<relu>+<conv>"``.
        skipped: :class:`Skipped` entries: candidate blocks and runs that were refused, modules that
            were already fused, and every other ``BatchNorm2d`` that stays unfused.
        path: which path the replaced modules will run for an input on the model's device and in its
            parameters' dtype (outside autocast) — ``"triton"``, or the fallback and why (e.g. a CPU
            model without ``TRITON_INTERPRET=1`` runs ``reference``). With ``backend="auto"`` the backend
            of each block is decided (measured and validated on CUDA) on its first forward:
            :meth:`dispatch` and ``str()`` report those decisions once they are made.
    """

    replaced: list[Replaced] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    path: str = ""
    model: Optional[Callable[[], Optional[nn.Module]]] = dataclasses.field(default=None, repr=False, compare=False)

    def dispatch(self):
        """:func:`fused_preact.dispatch.dispatch_report` of the converted model (empty before its first
        forward, or when the model is gone): per block the candidates, their times, validation errors and
        the winner."""
        from fused_preact.dispatch import DispatchReport, dispatch_report

        model = self.model() if self.model is not None else None
        return dispatch_report(model) if model is not None else DispatchReport()

    def __str__(self) -> str:
        lines = [f"fused_preact.convert: {len(self.replaced)} replaced, {len(self.skipped)} not replaced"]
        if self.replaced and self.path:
            lines.append(f"runs: {self.path}")
        if self.replaced:
            lines.append("replaced:")
            lines += [f"  {r.name or '<model>'}: {r.original} -> {r.fused}" for r in self.replaced]
        if self.skipped:
            lines.append("not replaced:")
            lines += [f"  {s.name or '<model>'} ({s.type}): {s.reason}" for s in self.skipped]
        decided = self.dispatch()
        if decided:
            lines.append(str(decided))
        return "\n".join(lines)


def _hook_problem(name: str, module: Optional[nn.Module]) -> Optional[str]:
    if module is None:
        return None
    for attr in _HOOK_DICTS:
        if getattr(module, attr, None):
            kind = attr.strip("_").replace("_", " ")
            return f"{name or 'the module'} has {kind} that the fused forward would bypass"
    return None


def _conv_problem(name: str, conv: Optional[nn.Module]) -> Optional[str]:
    if type(conv) is not nn.Conv2d:
        return (f"{name} is {type(conv).__name__}, not exactly nn.Conv2d (a subclass such as timm's "
                "StdConv2d or Conv2dSame computes something else)")
    if conv.padding_mode != "zeros":
        return f"{name} has padding_mode={conv.padding_mode!r} (only 'zeros' is fused)"
    if isinstance(conv.padding, str):
        return f"{name} has string padding {conv.padding!r} (only explicit integers are fused)"
    return None


def _has_act(norm: nn.Module) -> bool:
    return isinstance(getattr(norm, "act", None), nn.Module) and isinstance(getattr(norm, "drop", None), nn.Module)


def _norm_problem(name: str, norm: Optional[nn.Module], kind: str) -> Optional[str]:
    """Why ``norm`` is not a fusable BN → ReLU: ``kind`` ``"bn"`` (exact nn.BatchNorm2d, ReLU applied by
    the caller) or ``"bnact"`` (a BatchNorm2d carrying its own ``act``/``drop``, timm BatchNormAct2d)."""
    if kind == "bn":
        if type(norm) is not nn.BatchNorm2d:
            return f"{name} is {type(norm).__name__}, not exactly nn.BatchNorm2d"
        return None
    if not isinstance(norm, nn.BatchNorm2d) or not _has_act(norm):
        return f"{name} is {type(norm).__name__}, not a BatchNorm2d with .act and .drop (timm BatchNormAct2d)"
    if type(norm.act) is not nn.ReLU:
        return f"{name}.act is {type(norm.act).__name__} (only nn.ReLU is fused)"
    if type(norm.drop) is not nn.Identity:
        return f"{name}.drop is {type(norm.drop).__name__} (only nn.Identity is fused)"
    return None


def _preact(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The materialized pre-activation ``relu(bn(x))``: a BatchNormAct2d applies its own ReLU."""
    return norm(x) if _has_act(norm) else F.relu(norm(x))


class ConvertedPreActBlock(FusedModuleBase):
    """A pre-activation residual block rebuilt on the fused op, holding the original block's children.

    Built by :func:`convert` from a timm-style (``norm1, conv1, …, downsample, drop_path``) or
    CIFAR-style (``bn1, conv1, …, shortcut``) block; every child of the original is registered
    under the same name in the same order, so parameters, buffers and state_dict keys are unchanged.

    Forward: ``drop_path(conv_k(relu(bn_k(… conv_1(relu(bn_1(x))) …)))) + shortcut``, each
    BN → ReLU → Conv step fused, the steps run as one chain (:func:`fused_preact.modules.run_units`)
    with the shortcut added in the last conv's epilogue unless a drop path is active; ``shortcut`` is
    read as ``shortcut_mode`` says (see :mod:`fused_preact.conversion`). With ``module_preact`` or
    ``identity_preact`` the first BN → ReLU runs unfused (its output is materialized once).

    Attributes:
        backend: requested backend (``"auto"``, ``"triton"``, ``"reference"``).
        last_backend, fallback_reason: what the last fused step ran, and why it fell back.
        steps: ((norm name, conv name), …) of the residual branch.
        shortcut_name, shortcut_mode, proj_path, drop_path_name: how the shortcut and drop path
            are found and read.
        source_type: the original block's qualified class name.

    Shapes and dtypes: those of the original block (input (N, C, H, W)).
    Raises (in forward): as :func:`fused_preact.modules.run_units` (bad rank or channels, forced backend that
    cannot serve the input).
    """

    def __init__(self, block: nn.Module, steps: tuple[tuple[str, str], ...], shortcut_name: Optional[str],
                 shortcut_mode: str, proj_path: tuple[str, ...], drop_path_name: Optional[str],
                 backend: str = "auto"):
        super().__init__(backend)
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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shortcut={_MODES[self.shortcut_mode]!r}, source={self.source_type}"

    def _shortcut(self) -> nn.Module:
        return self._modules[self.shortcut_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) → the original block's output; see the class docstring."""
        mods = self._modules
        steps = [(mods[n], mods[c]) for n, c in self.steps]
        mode = self.shortcut_mode
        dp = mods.get(self.drop_path_name) if self.drop_path_name is not None else None
        drop = _drop_path_active(dp)
        if mode in ("module_preact", "identity_preact"):
            a = _preact(steps[0][0], x)
            h = steps[0][1](a)
            sc = a if mode == "identity_preact" else self._shortcut()(a)
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
        sc = x if mode == "identity_raw" else self._shortcut()(x)
        if drop:
            return dp(run_units(self, x, steps)[0]) + sc
        return run_units(self, x, steps, residual="input" if mode == "identity_raw" else sc)[0]


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


def _randomize_(module: nn.Module) -> None:
    """Re-draw every floating parameter and buffer of ``module`` (a probe copy) from the global RNG."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_(0.0, 0.5)
                if m.running_mean is not None:
                    m.running_mean.normal_(0.0, 0.5)
                    m.running_var.uniform_(0.5, 1.5)
                continue
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    fan_in = p[0].numel() if p.dim() > 1 else 1
                    p.normal_(0.0, 1.0 / math.sqrt(fan_in))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _probe_size(convs: list[nn.Conv2d]) -> int:
    """Smallest S ≥ 4 (a power of two) such that a chain of ``convs`` maps an S×S input to at least 1×1."""
    size = 4
    while size < 4096:
        s = size
        for c in convs:
            s = min((s + 2 * c.padding[d] - c.dilation[d] * (c.kernel_size[d] - 1) - 1) // c.stride[d] + 1
                    for d in (0, 1))
        if s >= 1:
            return size
        size *= 2
    return size


def _generator(device: torch.device) -> torch.Generator:
    """The global generator that ops on ``device`` draw from: the CPU one, or that CUDA device's
    (``torch.cuda.default_generators``). Nothing else is looked at, so a CPU block never touches CUDA."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise RuntimeError(f"the probe runs on CPU and CUDA devices only, not {device}")


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[Callable[[int], None]]:
    """Save the CPU generator and ``device``'s, yield a ``seed(n)`` that seeds both, restore both on exit.

    Exactly the generators a probe on ``device`` draws from are saved and restored (``fork_rng``
    and ``torch.manual_seed`` would touch every device of the process).
    """
    gens = [torch.default_generator] + ([_generator(device)] if device.type != "cpu" else [])
    states = [g.get_state() for g in gens]

    def seed(n: int) -> None:
        for g in gens:
            g.manual_seed(n)

    try:
        yield seed
    finally:
        for g, state in zip(gens, states):
            g.set_state(state)


def _devices(module: nn.Module) -> set[torch.device]:
    """The devices of ``module``'s parameters and buffers."""
    return {t.device for t in module.parameters()} | {t.device for t in module.buffers()}


def _probe_device(module: nn.Module) -> torch.device:
    """The one device of ``module``'s parameters and buffers (CPU for a module holding none).

    Raises:
        RuntimeError: they lie on more than one device.
    """
    devices = _devices(module)
    if len(devices) > 1:
        raise RuntimeError(f"parameters and buffers on several devices ({sorted(map(str, devices))})")
    return devices.pop() if devices else torch.device("cpu")


def _probe(original: nn.Module, build: Callable[[nn.Module], nn.Module], channels: int, size: int) -> Optional[str]:
    """Run a randomized float64 copy of ``original`` against ``build(copy)`` (backend "reference").

    Everything runs on ``original``'s own device (its parameters' and buffers'), on deep copies in
    float64 (1e-6 is meaningful there; a wrong shortcut reading differs by O(1)); the CPU generator
    and that device's generator are seeded for the probe and restored afterwards, and no other
    device is touched. Returns ``None`` when outputs, gradients and buffers agree in eval and
    training mode, else a short reason. Nothing of ``original`` is modified.
    """
    try:
        device = _probe_device(original)
        with _rng_preserved(device) as _seed:
            _seed(0)
            ref = copy.deepcopy(original)
            _randomize_(ref)
            ref = ref.double()
            cand = build(copy.deepcopy(ref))
            for train in (False, True):
                ref.train(train)
                cand.train(train)
                x = torch.randn(2, channels, size, size, dtype=torch.float64, device=device) + 0.3
                outs, grads = [], []
                for m in (ref, cand):
                    xi = x.clone().requires_grad_()
                    _seed(1)
                    y = m(xi)
                    _seed(2)
                    y.backward(torch.randn_like(y))
                    outs.append(y.detach())
                    grads.append(xi.grad)
                mode = "training" if train else "eval"
                if _rel(outs[1], outs[0]) > _PROBE_TOL:
                    return f"{mode}-mode output differs (rel. error {_rel(outs[1], outs[0]):.1e})"
                if _rel(grads[1], grads[0]) > _PROBE_TOL:
                    return f"{mode}-mode input gradient differs"
            for (name, a), (_, b) in zip(cand.named_parameters(), ref.named_parameters()):
                if (a.grad is None) != (b.grad is None) or (a.grad is not None and _rel(a.grad, b.grad) > _PROBE_TOL):
                    return f"gradient of {name} differs"
            for (name, a), (_, b) in zip(cand.named_buffers(), ref.named_buffers()):
                if _rel(a.double(), b.double()) > _PROBE_TOL:
                    return f"buffer {name} differs after a training step"
    except Exception as e:  # any failure of the probe means: do not convert
        return f"probe raised {type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------------------------
# block recognition


@dataclasses.dataclass(frozen=True)
class _BlockSpec:
    steps: tuple[tuple[str, str], ...]
    shortcut_name: str
    drop_path_name: Optional[str]
    modes: tuple[str, ...]
    proj_path: tuple[str, ...]


def _proj_conv_path(block: nn.Module, name: str) -> Optional[tuple[str, ...]]:
    """Path to a fusable 1×1-style projection conv: the shortcut itself, ``Sequential(conv)``, or a
    timm ``DownsampleConv``-like ``{conv, norm=Identity}`` module."""
    sc = block._modules.get(name)
    if type(sc) is nn.Conv2d:
        path: tuple[str, ...] = (name,)
    elif type(sc) is nn.Sequential and len(sc) == 1:
        path = (name, next(iter(sc._modules)))
    elif sc is not None and set(sc._modules) == {"conv", "norm"} and type(sc._modules["norm"]) is nn.Identity:
        path = (name, "conv")
    else:
        return None
    mod = block
    for part in path:
        mod = mod._modules[part]
        if _hook_problem("", mod):
            return None
    return path if _conv_problem("", mod) is None else None


def _match_block(block: nn.Module) -> Union[None, str, _BlockSpec]:
    """``None`` if ``block`` does not look like a pre-activation block; a reason string if it does but
    cannot be fused; else the :class:`_BlockSpec` to build it."""
    if isinstance(block, FusedSequential) or (
            isinstance(block, nn.Sequential) and type(block).forward is nn.Sequential.forward):
        return None
    names = set(block._modules)
    for norms, convs, sc_name, dp_name, kind in _LAYOUTS.values():
        if not {norms[0], convs[0], norms[1], convs[1]} <= names:
            continue
        depth = 3 if norms[2] in names or convs[2] in names else 2
        allowed = set(norms[:depth]) | set(convs[:depth]) | {sc_name} | ({dp_name} if dp_name else set())
        problems = [f"unrecognized child {n!r} ({type(block._modules[n]).__name__})" for n in block._modules
                    if n not in allowed]
        if (h := _hook_problem("the block", block)) is not None:
            problems.append(h)
        for norm_name, conv_name in zip(norms[:depth], convs[:depth]):
            norm, conv = block._modules.get(norm_name), block._modules.get(conv_name)
            problems += [p for p in (_norm_problem(norm_name, norm, kind), _conv_problem(conv_name, conv)) if p]
            parts = ((norm_name, norm), (conv_name, conv), (f"{norm_name}.act", getattr(norm, "act", None)),
                     (f"{norm_name}.drop", getattr(norm, "drop", None)))
            for part_name, part in parts:
                if (h := _hook_problem(part_name, part)) is not None:
                    problems.append(h)
        if problems:
            return "; ".join(problems)
        sc = block._modules.get(sc_name, getattr(block, sc_name, None))
        if not isinstance(sc, nn.Module) and sc is not None:
            return f"{sc_name} is a {type(sc).__name__}, not a module"
        if (h := _hook_problem(sc_name, sc)) is not None:
            return h
        proj_path: tuple[str, ...] = ()
        if sc is None or type(sc) is nn.Identity or (type(sc) is nn.Sequential and len(sc) == 0):
            modes: tuple[str, ...] = ("identity_raw", "identity_preact")
        elif (path := _proj_conv_path(block, sc_name)) is not None:
            modes, proj_path = ("proj_fused", "module_preact", "module_raw"), path
        else:
            modes = ("module_preact", "module_raw")
        steps = tuple(zip(norms[:depth], convs[:depth]))
        return _BlockSpec(steps, sc_name, dp_name if dp_name in names else None, modes, proj_path)
    return None


# ----------------------------------------------------------------------------------------------
# the converter


def _signature(module: nn.Module) -> str:
    """What a probe of ``module`` depends on besides parameter values: its class, its tree (``repr``
    lists every child with its hyperparameters) and the public plain attributes of every submodule."""
    attrs = [
        (name, type(m).__qualname__, k, repr(v))
        for name, m in module.named_modules()
        for k, v in sorted(vars(m).items())
        if not k.startswith("_") and k != "training"
    ]
    return f"{type(module).__module__}.{type(module).__qualname__}|{module!r}|{attrs}"


class _Converter:
    def __init__(self, backend: str, verify: bool):
        self.backend = backend
        self.verify = verify
        self.probed: dict[tuple[str, str], Optional[str]] = {}
        self.report = ConversionReport()
        self.explained: set[int] = set()

    def _probe(self, module: nn.Module, mode: str, build: Callable[[nn.Module], nn.Module], channels: int,
               size: int) -> Optional[str]:
        """:func:`_probe`, memoized on the module's signature and devices (blocks repeat within a stage)."""
        key = (_signature(module), mode, ','.join(sorted(map(str, _devices(module)))))
        if key not in self.probed:
            self.probed[key] = _probe(module, build, channels, size)
        return self.probed[key]

    def _explain(self, module: nn.Module) -> None:
        self.explained.update(id(m) for m in module.modules() if isinstance(m, nn.BatchNorm2d))

    def visit(self, module: nn.Module, name: str) -> nn.Module:
        if isinstance(module, _FUSED_TYPES):
            self.report.skipped.append(Skipped(name, type(module).__name__, "already fused"))
            self._explain(module)
            return module
        spec = _match_block(module)
        if isinstance(spec, str):
            self.report.skipped.append(Skipped(name, type(module).__name__, spec))
            self._explain(module)
        elif spec is not None:
            new = self._convert_block(module, name, spec)
            if new is not None:
                return new
        for child_name, child in list(module._modules.items()):
            if child is not None:
                new = self.visit(child, f"{name}.{child_name}" if name else child_name)
                if new is not child:
                    module._modules[child_name] = new
        if isinstance(module, nn.Sequential):
            self._convert_sequential(module, name)
        return module

    def _convert_block(self, block: nn.Module, name: str, spec: _BlockSpec) -> Optional[nn.Module]:
        def build(mode: str, backend: str) -> Callable[[nn.Module], nn.Module]:
            return lambda b: ConvertedPreActBlock(b, spec.steps, spec.shortcut_name, mode, spec.proj_path,
                                                  spec.drop_path_name, backend)

        mode = spec.modes[0]
        if self.verify:
            first_norm = block._modules[spec.steps[0][0]]
            size = _probe_size([block._modules[c] for _, c in spec.steps])
            failures = []
            for mode in spec.modes:
                why = self._probe(block, mode, build(mode, "reference"), first_norm.num_features, size)
                if why is None:
                    break
                failures.append(f"{_MODES[mode]}: {why}")
            else:
                reason = "numeric probe: no fused reading reproduces its forward (" + "; ".join(failures) + ")"
                self.report.skipped.append(Skipped(name, type(block).__name__, reason))
                self._explain(block)
                return None
        new = build(mode, self.backend)(block)
        self.report.replaced.append(Replaced(name, type(block).__name__, f"ConvertedPreActBlock ({_MODES[mode]})"))
        self._explain(new)
        return new

    def _run_candidate(self, items: list, i: int) -> tuple[int, Optional[str]]:
        """(run length, reason it cannot be fused) for the BatchNorm2d at ``items[i]``."""
        name, bn = items[i]
        nxt = items[i + 1] if i + 1 < len(items) else None
        if _has_act(bn):
            n, conv_item = 2, nxt
            problem = _norm_problem(name, bn, "bnact")
        else:
            n = 3
            problem = _norm_problem(name, bn, "bn")
            if problem is None and (nxt is None or type(nxt[1]) is not nn.ReLU):
                what = "nothing" if nxt is None else f"{type(nxt[1]).__name__} {nxt[0]!r}"
                return 0, f"followed by {what}, not nn.ReLU"
            conv_item = items[i + 2] if i + 2 < len(items) else None
        if problem is not None:
            return 0, problem
        if conv_item is None:
            return 0, "the activation is the last child of the Sequential (no conv reads it)"
        if not isinstance(conv_item[1], nn.Conv2d):
            return 0, f"the activation is read by {type(conv_item[1]).__name__} {conv_item[0]!r}, not a Conv2d"
        if (p := _conv_problem(conv_item[0], conv_item[1])) is not None:
            return 0, p
        for item_name, mod in items[i:i + n]:
            if (h := _hook_problem(item_name, mod)) is not None:
                return 0, h
            if mod is bn and _has_act(bn):
                for part in ("act", "drop"):
                    if (h := _hook_problem(f"{item_name}.{part}", getattr(bn, part))) is not None:
                        return 0, h
        return n, None

    def _convert_sequential(self, seq: nn.Sequential, name: str) -> None:
        items = list(seq._modules.items())
        in_runs = {n for run in getattr(seq, "fused_runs", {}).values() for n in run}
        overridden = type(seq).forward is not nn.Sequential.forward and not isinstance(seq, FusedSequential)
        new_runs: dict[str, tuple[str, ...]] = {}
        i = 0
        while i < len(items):
            child_name, child = items[i]
            qual = f"{name}.{child_name}" if name else child_name
            if child_name in in_runs:
                self.explained.add(id(child))
            if not isinstance(child, nn.BatchNorm2d) or child_name in in_runs:
                i += 1
                continue
            n, why = self._run_candidate(items, i)
            run = tuple(k for k, _ in items[i:i + n])
            run_name = f"{name}.{'+'.join(run)}" if name else "+".join(run)
            if why is None and overridden:
                why = (f"inside {type(seq).__name__}, an nn.Sequential subclass with its own forward "
                       "(it may read the intermediates)")
            elif why is None and type(seq) is not nn.Sequential and not isinstance(seq, FusedSequential):
                why = (f"inside {type(seq).__name__}, an nn.Sequential subclass "
                       "(only exact nn.Sequential is converted in place)")
            if why is None and self.verify:
                mods = [m for _, m in items[i:i + n]]
                probe_why = self._probe(
                    nn.Sequential(OrderedDict(zip(run, mods))),
                    "run",
                    lambda s, run=run: _as_fused_sequential(s, {run[0]: run}, "reference"),
                    mods[0].num_features,
                    _probe_size([mods[-1]]),
                )
                why = None if probe_why is None else f"numeric probe: {probe_why}"
            self.explained.add(id(child))
            if why is not None:
                self.report.skipped.append(Skipped(qual if n == 0 else run_name, type(child).__name__, why))
                i += 1
                continue
            new_runs[child_name] = run
            kinds = "→".join(type(m).__name__ for _, m in items[i:i + n])
            self.report.replaced.append(Replaced(run_name, kinds, "fused BN→ReLU→Conv run (FusedSequential)"))
            i += n
        if isinstance(seq, FusedSequential) and in_runs:
            self.report.skipped.append(Skipped(name, "FusedSequential", "already fused runs: " + ", ".join(
                "+".join(r) for r in seq.fused_runs.values())))
        if new_runs:
            if not isinstance(seq, FusedSequential):
                _as_fused_sequential(seq, {}, self.backend)
            seq.fused_runs.update(new_runs)

    def sweep(self, root: nn.Module) -> None:
        """Report every BatchNorm2d that no replacement or refusal accounts for."""
        for name, m in root.named_modules():
            if isinstance(m, nn.BatchNorm2d) and id(m) not in self.explained:
                self.explained.add(id(m))
                self.report.skipped.append(Skipped(name, type(m).__name__, (
                    "not part of a recognized structure (a pre-activation block, or BN→ReLU→Conv2d consecutive "
                    "in an nn.Sequential); e.g. it feeds a pooling/classifier head or its forward is custom code")))


def _as_fused_sequential(seq: nn.Sequential, runs: dict[str, tuple[str, ...]], backend: str) -> FusedSequential:
    """Turn the exact ``nn.Sequential`` ``seq`` into a :class:`FusedSequential` in place."""
    seq.__class__ = FusedSequential
    _init_fused_sequential(seq, backend)
    seq.fused_runs.update(runs)
    return seq


def convert(model: nn.Module, backend: str = "auto", verify: bool = True, report: bool = False,
            memory: str = "fastest") -> Union[nn.Module, tuple[nn.Module, ConversionReport]]:
    """Replace, in place, every recognized BatchNorm → ReLU → Conv structure of ``model`` with fused modules.

    Recognized: timm ``resnetv2`` pre-activation blocks (``PreActBasic``, ``PreActBottleneck`` with
    ``BatchNormAct2d`` norms and ``DownsampleConv`` / ``DownsampleAvg`` projections), CIFAR-style
    (kuangliu) ``PreActBlock`` / ``PreActBottleneck`` and :mod:`fused_preact.models` blocks, and
    ``BN → ReLU → Conv2d`` / ``BatchNormAct2d → Conv2d`` runs inside an ``nn.Sequential``. See the
    module docstring for the rules, the shortcut readings and the numeric verification.

    Parameters, buffers, their values and the state_dict keys (and order) are unchanged; the
    converted modules share the original parameter tensors. Blocks are replaced by
    :class:`ConvertedPreActBlock` objects adopting the original children; Sequentials change class
    in place to :class:`FusedSequential`. The model object itself is returned, except when the
    model is itself a recognized block: then the new :class:`ConvertedPreActBlock` is returned.
    Calling ``convert`` again replaces nothing.

    Args:
        model: any module tree, any device and dtype.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``, stored on every fused module (see
            :mod:`fused_preact.dispatch`).
        verify: probe every candidate numerically before replacing it (see module docstring); with
            ``False`` a block's shortcut is assumed to be read the usual way (projection on the
            pre-activation, identity on raw x), which silently miscomputes a block written otherwise.
        report: also return the :class:`ConversionReport`.
        memory: ``backend="auto"``'s policy: ``"fastest"`` (the default of new fused modules) or ``"lean"``
            (the fastest of the backends that keep only the BN inputs for backward, set on every fused
            module of the model; :mod:`fused_preact.ops.auto`).

    Returns:
        The converted model, or ``(model, report)`` when ``report=True``. The report is always
        logged at INFO level on the ``"fused_preact"`` logger.

    Raises:
        ValueError: unknown ``backend`` or ``memory``.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    from fused_preact.dispatch import set_memory_policy
    from fused_preact.ops.auto import check_memory

    check_memory(memory)
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"fused_preact: unknown backend {backend!r}; expected 'auto' or one of {list(BACKENDS)}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"fused_preact.convert expects an nn.Module, got {type(model).__name__}")
    converter = _Converter(backend, verify)
    out = converter.visit(model, "")
    converter.sweep(out)
    fused = next((m for m in out.modules() if hasattr(m, "_plans") and hasattr(m, "backend")), None)
    if fused is not None:
        converter.report.path = backend_path(fused)
    if memory != "fastest":  # the default leaves modules fused before (and their policy) alone
        set_memory_policy(out, memory)
    converter.report.model = weakref.ref(out)
    logger.info("%s", converter.report)
    return (out, converter.report) if report else out
