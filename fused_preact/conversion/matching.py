"""Recognizing convertible structures: block layouts, shortcut readings and the reasons a module is
left alone (hooks, conv subclasses, non-ReLU activations)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch.nn as nn

from fused_preact.modules import _norm_act
from fused_preact.ops.spec import projection_problem

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

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


def _hook_problem(name: str, module: Optional[nn.Module]) -> Optional[str]:
    """Why the fused reading may not skip calling ``module`` (hooks of its own, or a ``forward`` set on
    the instance — a monkeypatch, an offloading wrapper's), or None."""
    if module is None:
        return None
    for attr in _HOOK_DICTS:
        if getattr(module, attr, None):
            kind = attr.strip("_").replace("_", " ")
            return f"{name or 'the module'} has {kind} that the fused forward would bypass"
    if "forward" in vars(module):
        return f"{name or 'the module'} has a forward set on the instance that the fused forward would bypass"
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
    return bool(_norm_act(norm))


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
    return path if _conv_problem("", mod) is None and projection_problem(mod) is None else None


def _match_block(block: nn.Module) -> Union[None, str, _BlockSpec]:
    """``None`` if ``block`` does not look like a pre-activation block; a reason string if it does but
    cannot be fused; else the :class:`_BlockSpec` to build it."""
    if isinstance(block, nn.Sequential) and (type(block).forward is nn.Sequential.forward
                                             or hasattr(block, "fused_runs")):  # FusedSequential
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
