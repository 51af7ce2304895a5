"""The benchmark results schema: entry and file formats, the providers and modes an entry may name,
derived ratios (:func:`annotate`) and the validator (format in ``benchmarks/results/README.md``)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from fused_preact.bench.kernels import KERNEL_MODES
from fused_preact.bench.shapes import MODES, achieved, pct_of_floor

__all__ = ["LEVELS", "ENTRY_MODES", "ENQUEUE_PROVIDERS", "EST_S", "make_entry", "annotate", "validate_results",
           "results_path", "write_results"]

LEVELS: tuple[str, ...] = ("unit", "block", "model", "kernel")
#: Every entry mode: unit/block modes, the model's training step, host enqueue time, kernel modes.
ENTRY_MODES: tuple[str, ...] = MODES + ("step", "enqueue") + KERNEL_MODES
#: Providers whose enqueue time is measured (mode ``enqueue``).
ENQUEUE_PROVIDERS: tuple[str, ...] = ("eager", "triton", "cuda", "recompute", "auto")
_ALL_PROVIDERS = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "recompute", "auto", "auto-lean",
                  "eager-cudagraph", "triton-cudagraph", "cudnn", "cudnn-fused")
_FUSED = ("triton", "cuda", "recompute", "auto", "auto-lean", "triton-cudagraph")
_COMPILE = ("compile", "compile-max-autotune")
#: Rough first-run (cold cache) seconds per task on an H100, by level and provider; used only to
#: decide whether a task still fits in ``--time-limit``. Guesses until a GPU run replaces them.
EST_S: dict[str, dict[str, float]] = {
    "unit": {"eager": 3, "triton": 5, "cuda": 3, "recompute": 4, "auto": 12, "auto-lean": 12, "compile": 12,
             "compile-max-autotune": 60},
    "block": {"eager": 4, "triton": 8, "cuda": 4, "recompute": 5, "auto": 20, "auto-lean": 20, "compile": 25,
              "compile-max-autotune": 150},
    "model": {"eager": 20, "triton": 30, "cuda": 20, "recompute": 25, "auto": 90, "auto-lean": 90,
              "eager-cudagraph": 20, "triton-cudagraph": 30, "compile": 180, "compile-max-autotune": 900},
    "kernel": {"cudnn": 3, "triton": 8, "cuda": 3, "cudnn-fused": 5},
}
_TOP = {"device": str, "driver": str, "torch": str, "triton": str, "commit": str, "date": str, "command": str,
        "results": list}
_ENTRY = {"name": str, "level": str, "provider": str, "mode": str, "dtype": str, "batch": int,
          "median_ms": (int, float), "peak_mem_bytes": int}


# ------------------------------------------------------------------------------------ result entries
def make_entry(*, name: str, level: str, provider: str, mode: str, dtype: str, batch: int, times_ms: Sequence[float],
               peak_mem_bytes: int, flops: Optional[float] = None, min_bytes: Optional[float] = None,
               floor: Optional[float] = None, **extra: Any) -> dict:
    """One results entry from measured per-call times (ms) and peak memory (bytes).

    Adds ``median_ms``, ``min_ms``, ``reps``; with ``flops``/``min_bytes``: ``tflops`` (TFLOP/s) and
    ``gbps`` (effective GB/s, minimum bytes over time); with ``floor`` (ms): ``floor_ms`` and
    ``pct_of_floor`` (100·floor/median). ``extra`` keys are copied in unchanged.

    Raises:
        ValueError: no times, a non-positive time, an unknown level or mode, or a kernel mode outside
            the kernel level (or the reverse).
    """
    if not times_ms or min(times_ms) <= 0:
        raise ValueError(f"times_ms must be non-empty and positive, got {list(times_ms)!r}")
    if level not in LEVELS or mode not in ENTRY_MODES or (level == "kernel") != (mode in KERNEL_MODES):
        raise ValueError(f"bad level/mode {level!r}/{mode!r}")
    med = float(statistics.median(times_ms))
    e: dict[str, Any] = dict(name=name, level=level, provider=provider, mode=mode, dtype=dtype, batch=int(batch),
                             median_ms=med, min_ms=float(min(times_ms)), reps=len(times_ms),
                             peak_mem_bytes=int(peak_mem_bytes))
    if flops is not None:
        tflops, gbps = achieved(flops, min_bytes or 0, med)
        e["flops"], e["tflops"] = int(flops), tflops
        if min_bytes is not None:
            e["min_bytes"], e["gbps"] = int(min_bytes), gbps
    if floor is not None:
        e["floor_ms"], e["pct_of_floor"] = float(floor), pct_of_floor(floor, med)
    e.update(extra)
    return e


def _key(e: dict, provider: Optional[str] = None) -> tuple:
    return (e["name"], e["mode"], e.get("dtype"), provider or e["provider"])


def annotate(results: list[dict]) -> None:
    """Add ``speedup_vs_eager`` (eager ms / ms), ``speedup_vs_compile`` (default-compile ms / ms) and
    ``mem_vs_eager`` (peak bytes / eager peak bytes) to every entry that has a counterpart with the
    same name, mode and dtype; to kernel entries ``ratio_vs_cudnn`` (ms / cudnn's ms: above 1 is slower)."""
    by = {_key(e): e for e in results}
    for e in results:
        for ref, key in (("eager", "speedup_vs_eager"), ("compile", "speedup_vs_compile")):
            r = by.get(_key(e, ref))
            if r is not None and r is not e:
                e[key] = r["median_ms"] / e["median_ms"]
        r = by.get(_key(e, "eager"))
        if r is not None and r is not e and r["peak_mem_bytes"] > 0:
            e["mem_vs_eager"] = e["peak_mem_bytes"] / r["peak_mem_bytes"]
        r = by.get(_key(e, "cudnn"))
        if e["level"] == "kernel" and r is not None and r is not e:
            e["ratio_vs_cudnn"] = e["median_ms"] / r["median_ms"]


def validate_results(obj: Any) -> list[str]:
    """Problems with a results object (empty list: valid). Format: top-level ``device``, ``driver``,
    ``torch``, ``triton``, ``commit``, ``date``, ``command`` (str) and ``results`` (list); each entry
    ``name``, ``level`` (unit/block/model/kernel), ``provider``, ``mode`` (fwd/bwd/fwd+bwd/step/enqueue,
    fprop/dgrad/wgrad at the kernel level and only there), ``dtype`` (str), ``batch`` (int), ``median_ms``
    (finite, > 0), ``peak_mem_bytes`` (int ≥ 0), for unit entries ``floor_ms`` (> 0) and for enqueue
    entries ``wall_ms`` (> 0). Optional fields the report reads must have its shape where present:
    ``skipped`` (list of objects with str ``level``, ``name``, ``provider``, ``reason``), ``peaks`` (object
    of numbers or None, ``matmul_tflops`` an object of numbers), an entry's ``auto`` (list of objects with
    str ``runs`` and ``source`` and an object ``candidates``). Other keys are allowed."""
    if not isinstance(obj, dict):
        return ["results object is not a JSON object"]
    problems = [f"top-level {k!r} missing or not {t.__name__}" for k, t in _TOP.items() if not isinstance(obj.get(k), t)]
    results = obj.get("results")
    for i, e in enumerate(results if isinstance(results, list) else []):
        where = f"results[{i}] ({e.get('name', '?') if isinstance(e, dict) else '?'})"
        if not isinstance(e, dict):
            problems.append(f"{where} is not an object")
            continue
        problems += [f"{where}: {k!r} missing or of the wrong type" for k, t in _ENTRY.items()
                     if not isinstance(e.get(k), t) or isinstance(e.get(k), bool)]
        if e.get("level") not in LEVELS:
            problems.append(f"{where}: level {e.get('level')!r} not in {LEVELS}")
        if e.get("mode") not in ENTRY_MODES:
            problems.append(f"{where}: mode {e.get('mode')!r} unknown")
        elif e.get("level") in LEVELS and (e.get("level") == "kernel") != (e.get("mode") in KERNEL_MODES):
            problems.append(f"{where}: mode {e.get('mode')!r} does not belong to level {e.get('level')!r}")
        if e.get("mode") == "enqueue" and not (isinstance(e.get("wall_ms"), (int, float)) and e["wall_ms"] > 0):
            problems.append(f"{where}: enqueue entries need wall_ms > 0")
        if isinstance(e.get("median_ms"), (int, float)) and not 0 < e["median_ms"] < math.inf:
            problems.append(f"{where}: median_ms must be finite and > 0")
        auto = e.get("auto")
        if auto is not None and not (isinstance(auto, list) and all(
                isinstance(c, dict) and isinstance(c.get("runs"), str) and isinstance(c.get("source"), str)
                and isinstance(c.get("candidates"), dict) for c in auto)):
            problems.append(f"{where}: auto must be a list of {{runs, source, candidates}} objects")
        if isinstance(e.get("peak_mem_bytes"), int) and e["peak_mem_bytes"] < 0:
            problems.append(f"{where}: peak_mem_bytes must be ≥ 0")
        if e.get("level") == "unit" and not (isinstance(e.get("floor_ms"), (int, float)) and e["floor_ms"] > 0):
            problems.append(f"{where}: unit entries need floor_ms > 0")
    problems += _optional_problems(obj)
    return problems


def _optional_problems(obj: dict) -> list[str]:
    """Problems with the optional top-level fields the report reads (``skipped``, ``peaks``)."""
    out = []
    skipped = obj.get("skipped")
    if skipped is not None and not (isinstance(skipped, list) and all(
            isinstance(s, dict) and all(isinstance(s.get(k), str) for k in ("level", "name", "provider", "reason"))
            for s in skipped)):
        out.append("top-level 'skipped' must be a list of {level, name, provider, reason} objects")
    peaks = obj.get("peaks")
    number = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    if peaks is not None and not (isinstance(peaks, dict) and all(
            number(v) for k, v in peaks.items() if k not in ("matmul_tflops", "fp32_math"))
            and (peaks.get("matmul_tflops") is None or (isinstance(peaks["matmul_tflops"], dict)
                                                        and all(number(v) for v in peaks["matmul_tflops"].values())))
            and isinstance(peaks.get("fp32_math", ""), str)):
        out.append("top-level 'peaks' must be an object of finite numbers (matmul_tflops: per dtype)")
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def results_path(out_dir: os.PathLike, device: str, date: str) -> Path:
    """``<out_dir>/<device slug>-<YYYY-MM-DD-HHMMSS>.json`` for an ISO ``date`` (``2026-11-20T15:30:00Z``)."""
    return Path(out_dir) / f"{_slug(device)}-{re.sub(r'[^0-9]+', '-', date).strip('-')}.json"


def write_results(obj: dict, path: os.PathLike) -> Path:
    """Validate ``obj`` (:func:`validate_results`) and write it as JSON to ``path`` atomically.

    Raises:
        ValueError: the object is not a valid results object.
    """
    problems = validate_results(obj)
    if problems:
        raise ValueError("invalid results object: " + "; ".join(problems[:5]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------------- environment
