"""Which backend runs, and why the others do not: the public report over :mod:`fused_preact.ops.backends`.

``fused_preact.backends()`` answers, per backend and per device/dtype, "ok" or the reasons it refuses
(including what to do about it: set ``TRITON_INTERPRET=1`` to run the kernels on CPU, build the CUDA
extension). ``fused_preact.dispatch_report(model)`` answers, per fused module and input signature, what
``backend="auto"`` decided and why (candidates, their times, validation errors, the winner;
:mod:`fused_preact.ops.auto`); ``set_memory_policy(model, "lean")`` changes the policy it decides by.
The backend classes themselves (``TritonBackend``, ``CudaBackend``, ``RecomputeBackend``,
``ReferenceBackend``) and ``select_backend`` live in the op layer and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch
import torch.nn as nn

from fused_preact.ops._common import triton_mode
from fused_preact.ops.auto import check_memory
from fused_preact.ops.backends import (
    BACKENDS,
    PRIORITY,
    Backend,
    BackendChoice,
    CudaBackend,
    PlanCache,
    RecomputeBackend,
    ReferenceBackend,
    TritonBackend,
    register,
    select_backend,
    static_order,
    unregister,
)

__all__ = ["Backend", "BackendChoice", "BACKENDS", "PRIORITY", "register", "unregister", "static_order", "TritonBackend",
           "CudaBackend", "RecomputeBackend", "ReferenceBackend", "backends", "select_backend", "triton_mode",
           "dispatch_report", "DispatchReport", "set_memory_policy"]

_ALL_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def backends(devices: Optional[Sequence[str]] = None) -> dict[str, dict[str, object]]:
    """Report every backend's availability per device and dtype.

    Args:
        devices: device strings to probe (default: ``"cpu"`` and, if available, ``"cuda"``).

    Returns:
        ``{backend: {"priority": int or None, "dtypes": [...], "devices": [...] or None (any), "lean": bool,
        "traceable": bool, "min_compute_capability": ...,
        "triton_mode": ..., "TRITON_INTERPRET": ..., "<device>/<dtype>": "ok" or the refusal reasons}}``.
        Probes are stride-0 (N=1, C=8, H=W=1) stand-ins; nothing is launched or allocated beyond one
        element.
    """
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report: dict[str, dict[str, object]] = {}
    for name, backend in BACKENDS.items():
        entry: dict[str, object] = {
            "priority": static_order().index(name) if name in static_order() else None,
            "dtypes": [str(d) for d in backend.dtypes],
            "devices": list(backend.devices) if backend.devices is not None else None,
            "lean": backend.lean,
            "traceable": backend.traceable,
            "min_compute_capability": backend.min_compute_capability,
            "triton_mode": backend.runtime_mode(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        }
        for dev in devices:
            for dtype in _ALL_FLOATS:
                probe = torch.empty(1, device=dev, dtype=dtype).expand(1, 8, 1, 1)
                reasons = backend.not_supported_reasons(probe)
                entry[f"{dev}/{str(dtype).replace('torch.', '')}"] = "; ".join(reasons) if reasons else "ok"
        report[name] = entry
    return report


class DispatchReport(list):
    """What every fused module of a model ran, per input signature it has seen: a list of dicts

    ``{"module": qualified name, "type": class name, "requested": backend, "memory": policy,
    "runs": backend that ran, "reason": fallback reason or None, "source": where the choice came from,
    "signature": the decision's signature or None, "timed": what was timed, "note": ...,
    "candidates": [{"name", "ms", "valid", "errors", "error", "refused", "lean"}, ...]}``

    ``source`` is a :class:`fused_preact.ops.auto.Decision`'s source (``measured``, ``disk cache``,
    ``process``, ``capture``, ``compile``, ``static``), ``priority`` for an ``auto`` choice
    made by the static order (nothing measured: ``FUSED_PREACT_DISPATCH=priority``, a device that is not
    measured, one candidate), ``forced`` for a named backend, ``last call`` for a module's latest call
    when it ran something no cached entry says (an eager fallback decided before the plan cache —
    hooks, child types, a shortcut the chains do not take — or a cached choice overruled for one call,
    e.g. by forward-mode AD), ``traced`` for a module whose latest call was traced by
    ``torch.compile`` and that has no plan-cache entry (a traced call leaves none; the entry is the
    module's ``last_backend`` and ``fallback_reason``, which record what its compiled graph runs,
    shown while its backend, memory policy, device and dtype are still those of that call).
    ``requested``/``memory`` are those the entry was decided under.
    ``str()`` gives one line per entry.
    """

    def __str__(self) -> str:
        if not self:
            return "fused_preact.dispatch_report: no fused module has run yet"
        n = sum(e["source"] not in ("last call", "traced") for e in self)
        lines = [f"fused_preact.dispatch_report: {n} signature(s)" + (f", {len(self) - n} other latest call(s)"
                                                                     if n < len(self) else "")]
        for e in self:
            head = f"  {e['module'] or '<model>'} ({e['type']}): {e['runs']} [{e['source']}]"
            parts = []
            for c in e["candidates"]:
                if c["refused"]:
                    continue
                if c["valid"] is False:
                    parts.append(f"{c['name']} INVALID: {c['error']}")
                elif c["ms"] is not None:
                    parts.append(f"{c['name']} {c['ms']:.3f} ms")
            lines.append(head + (": " + ", ".join(parts) if parts else "")
                         + (f" — {e['reason']}" if e["reason"] else ""))
        return "\n".join(lines)


def _requested_of(key: tuple) -> tuple:
    """(backend, memory policy) a plan-cache signature was decided under (see ``ops.run._signature``)."""
    return key[0] if isinstance(key[0], tuple) else (key[0], "fastest")


def dispatch_report(model: nn.Module) -> DispatchReport:
    """Per fused module of ``model`` (any module holding a plan cache: the fused modules, converted
    blocks and Sequentials) and per input signature it has run: the backend that ran and, for
    ``backend="auto"``, the decision behind it (see :class:`DispatchReport`). Modules that have not run
    yet have no entry. Reads only what the modules recorded: nothing is run or measured."""
    report = DispatchReport()
    for name, m in model.named_modules():
        plans = getattr(m, "_plans", None)
        if not isinstance(plans, PlanCache):
            continue
        for key, (choice, _) in list(plans.items()):
            requested, memory = _requested_of(key)
            d = getattr(choice, "decision", None)
            source = d.source if d is not None else ("priority" if requested == "auto" else "forced")
            report.append(dict(
                module=name, type=type(m).__name__, requested=requested, memory=memory,
                runs=choice.name, reason=choice.reason, source=source,
                signature=d.signature if d is not None else None, timed=d.timed if d is not None else None,
                note=d.note if d is not None else None,
                candidates=[dataclasses.asdict(c) for c in d.candidates] if d is not None else []))
        last = plans.last
        if last is not None:
            cached = plans.get(last.key) if last.key is not None else None
            if cached is None or (cached[0].name, cached[0].reason) != (last.runs, last.reason):
                report.append(dict(module=name, type=type(m).__name__, requested=last.requested, memory=last.memory,
                                   runs=last.runs, reason=last.reason, source="last call", signature=None, timed=None,
                                   note=None, candidates=[]))
        elif (not plans and m.last_backend is not None and getattr(m, "_traced", None)
              == (getattr(m, "backend", None), getattr(m, "memory", "fastest"))):
            report.append(dict(module=name, type=type(m).__name__, requested=m._traced[0], memory=m._traced[1],
                               runs=m.last_backend, reason=m.fallback_reason, source="traced", signature=None,
                               timed=None, note=None, candidates=[]))
    return report


def set_memory_policy(model: nn.Module, memory: str) -> nn.Module:
    """Set ``backend="auto"``'s memory policy on every fused module of ``model`` (``"fastest"``: the
    fastest valid backend; ``"lean"``: the fastest of those that keep only the BN inputs for backward)
    and clear their plan caches, so the next call decides again. Returns ``model``.

    Raises:
        ValueError: an unknown policy.
    """
    check_memory(memory)
    for m in model.modules():
        if isinstance(getattr(m, "_plans", None), PlanCache) and hasattr(m, "backend"):
            m.memory = memory
            m._plans.clear()
    return model
