"""The conversion walk: visit a module tree, match, probe and replace (see :mod:`fused_preact.conversion`)."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch.nn as nn

from fused_preact.conversion.blocks import (
    _FUSED_TYPES,
    ConvertedPreActBlock,
    FusedSequential,
    _init_fused_sequential,
    state_name_clashes,
)
from fused_preact.conversion.matching import (
    _MODES,
    _BlockSpec,
    _conv_problem,
    _has_act,
    _hook_problem,
    _match_block,
    _norm_problem,
)
from fused_preact.conversion.probing import _devices, _probe, _probe_size, _signature
from fused_preact.conversion.report import ConversionReport, Replaced, Skipped
from fused_preact.modules import backend_path
from fused_preact.ops.backends import check_backend_name

logger = logging.getLogger("fused_preact")

class _Converter:
    def __init__(self, backend: str, verify: bool):
        self.backend = backend
        self.verify = verify
        self.probed: dict[tuple[str, str], Optional[str]] = {}
        self.report = ConversionReport()
        self.explained: set[int] = set()
        # id(module) -> (module, what replaced it): a module used twice (shared weights, an alias)
        # stays one module (the original is held, so its id is not reused)
        self.visited: dict[int, tuple[nn.Module, nn.Module]] = {}

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
        if id(module) not in self.visited:
            self.visited[id(module)] = (module, self._visit(module, name))
        return self.visited[id(module)][1]

    def _visit(self, module: nn.Module, name: str) -> nn.Module:
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
        if clashes := state_name_clashes(block):
            reason = (f"its own parameters or buffers {clashes} have names ConvertedPreActBlock uses itself "
                      "(state_dict keys would change)")
            self.report.skipped.append(Skipped(name, type(block).__name__, reason))
            self._explain(block)
            return None
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
    Calling ``convert`` again replaces nothing. A converted block whose children are later replaced
    by modules of other types, added or removed runs its original class's forward, unfused, and says
    so (:class:`ConvertedPreActBlock`); a Sequential's edited runs run their children one by one.

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
    check_backend_name(backend)
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
