"""The conversion report: what :func:`fused_preact.convert` replaced, what it left alone and why."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch.nn as nn


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
