"""``python -m fused_preact.bench``: eager (cuDNN) vs torch.compile vs the fused kernels, side by side.

Levels (``--level``):
    unit    every distinct BN→ReLU→Conv unit of each model (projection shortcuts included), modes
            fwd, bwd, fwd+bwd (:class:`fused_preact.bench.timing.LayerHarness`)
    block   every distinct pre-activation block configuration, same modes
    model   one training step (forward, backward, SGD step) of each model; for the 32×32 CIFAR nets
            also captured in a CUDA graph (:class:`fused_preact.bench.timing.StepHarness`)
    kernel  every distinct unit's convolution kernels alone, modes fprop, dgrad, wgrad (``--kernel-modes``):
            the fused Triton kernel, the CUDA extension's op and cuDNN's runtime-fusion graph against
            cuDNN doing the same convolution on the pre-activated tensor (:mod:`fused_preact.bench.kernels`);
            not in the default levels (``--quick`` runs two shapes of it)
Providers (``--providers``): eager, compile, compile-max-autotune, triton, cuda (skipped with the
dispatcher's reason until a ``cuda`` backend is registered), recompute, auto and auto-lean (``backend="auto"``
measured and validated per block on its first, untimed call, ``memory="fastest"`` / ``"lean"``; each entry's
``auto`` field lists per fused module the chosen backend and the candidates' times), eager-cudagraph,
triton-cudagraph; at the
kernel level cudnn (always run: the reference of the ratios), triton, cuda, cudnn-fused (float16).
Mode ``enqueue`` (``--modes``; block and model levels, providers eager, triton, cuda): ``--enqueue-steps``
fwd+bwd calls (block) or training steps (model) back to back without synchronizing; ``median_ms`` is the
host time per step until the last call returns, ``wall_ms`` the time per step until the device is done
(:func:`fused_preact.bench.timing.time_enqueue`). ``--dtype`` takes several dtypes; every task runs in each.

Every result records the median time (ms) and the peak memory one call needs beyond its inputs
(bytes); unit and block results also FLOPs, minimum bytes, achieved TFLOP/s and effective GB/s,
the roofline floor (ms) from peaks *measured* at the start of the run, and percent of floor
(cost model: :mod:`fused_preact.bench.shapes`; timing method: :mod:`fused_preact.bench.timing`).

Budget: the run works through cheap providers first (eager, fused, CUDA graphs; all levels), then
``torch.compile`` for the first model (training step first, then units, then blocks), then for the
others, then max-autotune in the same order. Before each task it
compares a rough cost estimate (:data:`EST_S`) with what is left of ``--time-limit`` and records the
task as skipped when it would not fit. The results file is rewritten after every task, so a run
killed from outside keeps what it measured; ``--report FILE`` re-renders table, markdown and chart
from a results file without a GPU.

Outputs in ``--out`` (default ``benchmarks/results``): ``<device>-<date>.json`` (format:
:func:`validate_results`), ``.md`` (summary and full tables) and ``.png`` (speedups and memory).
Without CUDA the command refuses (exit code 2): no CPU timing is ever written as a result.
The compile-only kernel report (no GPU) is a repository tool: ``python -m tools.static_report`` from
the repository root (``--static`` only says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from fused_preact.bench.kernels import (
    FUSED_KERNEL_PROVIDERS,
    KERNEL_MODES,
    kernel_flops,
    kernel_min_bytes,
    kernel_tables,
    quick_kernel_units,
)
from fused_preact.bench.shapes import (
    MODEL_SPECS,
    MODES,
    achieved,
    block_flops,
    block_min_bytes,
    dtype_from_name,
    enumerate_blocks,
    enumerate_units,
    floor_ms,
    pct_of_floor,
    quick_blocks,
    quick_units,
    unit_flops,
    unit_min_bytes,
)

__all__ = [
    "LEVELS", "ENTRY_MODES", "ENQUEUE_PROVIDERS", "EST_S", "make_entry", "annotate", "validate_results",
    "results_path", "write_results", "environment", "format_table", "markdown_report", "write_chart",
    "cuda_refusal", "main"
]

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
    (> 0), ``peak_mem_bytes`` (int ≥ 0), for unit entries ``floor_ms`` (> 0) and for enqueue entries
    ``wall_ms`` (> 0). Other keys are allowed."""
    if not isinstance(obj, dict):
        return ["results object is not a JSON object"]
    problems = [f"top-level {k!r} missing or not {t.__name__}" for k, t in _TOP.items() if not isinstance(obj.get(k), t)]
    for i, e in enumerate(obj.get("results") or []):
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
        if isinstance(e.get("median_ms"), (int, float)) and not e["median_ms"] > 0:
            problems.append(f"{where}: median_ms must be > 0")
        if isinstance(e.get("peak_mem_bytes"), int) and e["peak_mem_bytes"] < 0:
            problems.append(f"{where}: peak_mem_bytes must be ≥ 0")
        if e.get("level") == "unit" and not (isinstance(e.get("floor_ms"), (int, float)) and e["floor_ms"] > 0):
            problems.append(f"{where}: unit entries need floor_ms > 0")
    return problems


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
def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _source_sha256() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(list((root / "fused_preact").rglob("*.py")) + list((root / "csrc").glob("*"))):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def environment(commit: Optional[str] = None) -> dict:
    """Run metadata: ``device`` (GPU name), ``driver`` (``nvidia-smi``), ``torch``, ``cuda``,
    ``cudnn``, ``triton``, ``python`` versions, ``commit`` (``commit`` argument, else
    ``$FUSED_PREACT_COMMIT``, else ``git rev-parse HEAD``, else ``"unknown"``), ``dirty`` (tracked
    files modified), ``source_sha256`` (package and csrc sources, to tie results to code without
    git), and the GPU's compute capability, SM count, L2 and memory sizes (bytes)."""
    import triton

    env: dict[str, Any] = {"device": "none", "driver": "unknown", "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   l2_bytes=int(getattr(props, "L2_cache_size", 0)), memory_bytes=int(props.total_memory),
                   cudnn=torch.backends.cudnn.version())
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0].strip() if smi else "unknown"
    root = Path(__file__).resolve().parents[1]
    git = _run(["git", "rev-parse", "HEAD"], root)
    env["commit"] = commit or os.environ.get("FUSED_PREACT_COMMIT") or git or "unknown"
    env["dirty"] = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], root)) if git else None
    env["source_sha256"] = _source_sha256()
    return env


# --------------------------------------------------------------------------------- table and report
def _fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec) + suffix


def _geomean(xs: list[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _timed(obj: dict) -> list[dict]:
    """The unit, block and model entries of the speedup tables (kernel and enqueue entries have their own)."""
    return [e for e in obj["results"] if e["level"] != "kernel" and e["mode"] != "enqueue"]


def _label(e: dict, dtypes: set) -> str:
    return e["name"] + (f" [{e.get('dtype')}]" if len(dtypes) > 1 else "")


def _rows(obj: dict) -> tuple[list[str], list[tuple]]:
    results = _timed(obj)
    dtypes = {e.get("dtype") for e in results}
    providers = [p for p in _ALL_PROVIDERS if any(e["provider"] == p for e in results)]
    providers += sorted({e["provider"] for e in results} - set(providers))
    fused = [p for p in _FUSED if p in providers]
    by = {_key(e): e for e in results}
    keys = list(dict.fromkeys((e["level"], e["name"], e["mode"], e.get("dtype")) for e in results))
    keys.sort(key=lambda k: LEVELS.index(k[0]))
    head = ["level", "name", "mode"] + [f"{p} ms" for p in providers]
    for f in fused:
        head += [f"{f} ×eager", f"{f} ×compile", f"{f} %floor", f"{f} mem×eager"]
    rows = []
    for level, name, mode, dtype in keys:
        label = _label(dict(name=name, dtype=dtype), dtypes)
        row = [level, label, mode] + [_fmt(by.get((name, mode, dtype, p), {}).get("median_ms"), ".3f")
                                      for p in providers]
        for f in fused:
            e = by.get((name, mode, dtype, f), {})
            row += [_fmt(e.get("speedup_vs_eager"), ".2f", "×"), _fmt(e.get("speedup_vs_compile"), ".2f", "×"),
                    _fmt(e.get("pct_of_floor"), ".0f", "%"), _fmt(e.get("mem_vs_eager"), ".2f", "×")]
        rows.append(tuple(row))
    return head, rows


def _summary(obj: dict) -> tuple[list[str], list[tuple]]:
    head = ["level", "mode", "provider", "n", "geomean ×eager", "geomean ×compile", "median %floor", "median mem×eager"]
    groups: dict[tuple, list[dict]] = {}
    timed = _timed(obj)
    dtypes = {e.get("dtype") for e in timed}
    for e in timed:
        if e["provider"] != "eager":
            groups.setdefault((e["level"], e["mode"], e["provider"], e.get("dtype")), []).append(e)
    rows = []
    order = {p: i for i, p in enumerate(_ALL_PROVIDERS)}
    modes = ENTRY_MODES
    for (level, mode, prov, dtype), es in sorted(groups.items(), key=lambda kv: (
            LEVELS.index(kv[0][0]), modes.index(kv[0][1]), order.get(kv[0][2], len(order)), kv[0][2], str(kv[0][3]))):
        prov = prov + (f" [{dtype}]" if len(dtypes) > 1 else "")
        def col(key):
            return [e[key] for e in es if e.get(key) is not None]
        pct, mem = col("pct_of_floor"), col("mem_vs_eager")
        rows.append((level, mode, prov, str(len(es)), _fmt(_geomean(col("speedup_vs_eager")), ".2f", "×"),
                     _fmt(_geomean(col("speedup_vs_compile")), ".2f", "×"),
                     _fmt(statistics.median(pct) if pct else None, ".0f", "%"),
                     _fmt(statistics.median(mem) if mem else None, ".2f", "×")))
    return head, rows


def _text_table(head: list[str], rows: list[tuple]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    line = lambda r: "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _md_table(head: list[str], rows: list[tuple]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])


def _header(obj: dict) -> str:
    peaks = obj.get("peaks") or {}
    return (f"{obj['device']} · driver {obj['driver']} · torch {obj['torch']} (CUDA {obj.get('cuda')}) · "
            f"triton {obj['triton']} · commit {obj['commit'][:12]}{' (dirty)' if obj.get('dirty') else ''} · "
            f"{obj['date']} · measured peaks {_fmt(peaks.get('tflops'), '.0f')} TFLOP/s bf16, "
            f"{_fmt(peaks.get('gbps'), '.0f')} GB/s · {obj.get('dtype', '')} batch {obj.get('batch', '')}")


def _enqueue(obj: dict) -> list[tuple[str, list[str], list[tuple]]]:
    """The enqueue table (empty without enqueue entries): per block/model, dtype and provider the host
    time to enqueue one step, the step's wall time when the host never waits, their ratio, the step's
    device time where it was measured too (the ``fwd+bwd`` / ``step`` entry: event-timed, one call at a
    time) and the enqueue speedup vs eager. Enqueue below the device time: the host runs ahead. Enqueue
    ≈ wall ≈ device time: the device bounds the step and the host waited on a full launch queue;
    enqueue ≈ wall above the device time: the host (or a synchronization in the step) bounds it."""
    es = [e for e in obj["results"] if e["mode"] == "enqueue"]
    if not es:
        return []
    by = {_key(e): e for e in obj["results"]}
    order = {p: i for i, p in enumerate(_ALL_PROVIDERS)}
    es = sorted(es, key=lambda e: (LEVELS.index(e["level"]), e["name"], str(e.get("dtype")),
                                   order.get(e["provider"], 99)))
    head = ["level", "name", "dtype", "provider", "steps", "enqueue ms/step", "wall ms/step", "enqueue/wall",
            "device ms/step", "enqueue ×eager"]
    rows = []
    for e in es:
        dev = by.get((e["name"], "step" if e["level"] == "model" else "fwd+bwd", e.get("dtype"), e["provider"]), {})
        rows.append((e["level"], e["name"], str(e.get("dtype")), e["provider"], str(e.get("steps", "")),
                     _fmt(e["median_ms"], ".3f"), _fmt(e.get("wall_ms"), ".3f"),
                     _fmt(e["median_ms"] / e["wall_ms"] if e.get("wall_ms") else None, ".2f"),
                     _fmt(dev.get("median_ms"), ".3f"), _fmt(e.get("speedup_vs_eager"), ".2f", "×")))
    return [("enqueue: host time per fwd+bwd (block) or training step (model), issued back to back without "
             "synchronizing, vs the step's wall and device time (enqueue < device: the host runs ahead; "
             "enqueue ≈ wall > device: the host or a synchronization bounds the step)", head, rows)]


def _auto(obj: dict) -> list[tuple[str, list[str], list[tuple]]]:
    """The ``auto`` table (empty without auto entries): per entry of an auto provider, how many fused
    modules run each backend, where the decisions came from, and the candidates rejected by validation."""
    rows = []
    for e in obj["results"]:
        choices = e.get("auto")
        if not choices or e["mode"] not in ("fwd+bwd", "step"):
            continue
        runs: dict[str, int] = {}
        sources: dict[str, int] = {}
        invalid = set()
        for c in choices:
            runs[c["runs"]] = runs.get(c["runs"], 0) + 1
            sources[c["source"]] = sources.get(c["source"], 0) + 1
            invalid |= {n for n, v in c["candidates"].items() if isinstance(v, str)}
        rows.append((e["level"], e["name"], str(e.get("dtype")), e["provider"],
                     " ".join(f"{k}×{v}" for k, v in sorted(runs.items())),
                     " ".join(f"{k}×{v}" for k, v in sorted(sources.items())), " ".join(sorted(invalid)) or "–"))
    if not rows:
        return []
    return [("auto: backends chosen per fused module (count), where the decisions came from, candidates that "
             "failed validation", ["level", "name", "dtype", "provider", "runs", "source", "invalid"], rows)]


def _extra_tables(obj: dict) -> list[tuple[str, list[str], list[tuple]]]:
    return kernel_tables(obj["results"]) + _enqueue(obj) + _auto(obj)


def format_table(obj: dict) -> str:
    """Plain-text report of a results object: one row per (name, mode) with every provider's median
    ms and, for the fused providers, speedup vs eager and vs compile, percent of floor and peak
    memory vs eager; the skipped tasks; last (where a log's tail shows it) the header, the summary
    (geometric-mean speedups per level, mode and provider), the kernel level's and the enqueue
    tables (:func:`fused_preact.bench.kernels.kernel_tables`) and the training-step rows again."""
    annotate(obj["results"])
    timed = bool(_timed(obj))
    out = [_text_table(*_rows(obj))] if timed else []
    if obj.get("skipped"):
        out += ["", f"skipped ({len(obj['skipped'])}):"]
        out += [f"  {s['level']} {s['name']} {s['provider']}: {s['reason']}" for s in obj["skipped"]]
    head, rows = _rows(obj)
    models = [r for r in rows if r[0] == "model"]
    extra = [x for title, h, r in reversed(_extra_tables(obj)) for x in ("", title, _text_table(h, r))]
    return "\n".join(out + ["", _header(obj)] + ([_text_table(*_summary(obj))] if timed else []) + extra
                     + (["", _text_table(head, models)] if models else []))


def markdown_report(obj: dict) -> str:
    """The report of :func:`format_table` as Markdown (for the README's latest-results section)."""
    annotate(obj["results"])
    timed = bool(_timed(obj))
    parts = [f"**{_header(obj)}**", "", f"`{obj['command']}`", ""] + ([_md_table(*_summary(obj)), ""] if timed else [])
    for title, head, rows in _extra_tables(obj):
        parts += [f"**{title}**", "", _md_table(head, rows), ""]
    if timed:
        parts += ["<details><summary>every result</summary>", "", _md_table(*_rows(obj)), "", "</details>"]
    if obj.get("skipped"):
        parts += ["", "Skipped: " + "; ".join(f"{s['name']} {s['provider']} ({s['reason']})" for s in obj["skipped"][:40])]
    return "\n".join(parts) + "\n"


def write_chart(obj: dict, path: os.PathLike) -> Path:
    """PNG chart of a results object: per-layer speedup vs eager (unit and block, fwd+bwd, or the
    first mode present), per-model training-step speedup vs eager, and per-model step peak memory
    (GiB). Needs matplotlib (imported here, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    annotate(obj["results"])
    layer = [e for e in obj["results"] if e["level"] in ("unit", "block")]
    mode = "fwd+bwd" if any(e["mode"] == "fwd+bwd" for e in layer) else (layer[0]["mode"] if layer else None)
    layer = [e for e in layer if e["mode"] == mode and e.get("speedup_vs_eager")]
    names = list(dict.fromkeys(e["name"] for e in layer))
    model = [e for e in obj["results"] if e["level"] == "model" and e["mode"] == "step"]
    models = list(dict.fromkeys(e["name"] for e in model))
    fig, axes = plt.subplots(3, 1, figsize=(11, 4 + 0.22 * len(names) + 2 * 3), layout="constrained",
                             gridspec_kw={"height_ratios": [max(2, 0.22 * len(names)), 2.5, 2.5]})
    palette = plt.get_cmap("tab10").colors
    colors = {p: palette[i % len(palette)] for i, p in enumerate(_ALL_PROVIDERS)}

    def bars(ax, labels, series, xlabel, ref=None):
        if not labels or not series:
            ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            return
        h = 0.8 / max(1, len(series))
        for j, (prov, vals) in enumerate(series.items()):
            ax.barh([i + j * h for i in range(len(labels))], vals, height=h, label=prov, color=colors.get(prov))
        ax.set_yticks([i + 0.4 - h / 2 for i in range(len(labels))], labels, fontsize=7)
        ax.invert_yaxis()
        if ref is not None:
            ax.axvline(ref, color="k", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7, loc="lower right")

    def series(entries, labels, key, skip_eager=True):
        present = {e["provider"] for e in entries}
        provs = [p for p in _ALL_PROVIDERS + tuple(sorted(present - set(_ALL_PROVIDERS)))
                 if p in present and not (skip_eager and p == "eager")]
        by = {(e["name"], e["provider"]): e.get(key) or 0.0 for e in entries}
        return {p: [by.get((n, p), 0.0) for n in labels] for p in provs}

    bars(axes[0], names, series(layer, names, "speedup_vs_eager"), f"speedup vs eager, {mode} (×)", 1.0)
    bars(axes[1], models, series([e for e in model if e.get("speedup_vs_eager")], models, "speedup_vs_eager"),
         "training step speedup vs eager (×)", 1.0)
    mem = [dict(e, gib=e["peak_mem_bytes"] / 2**30) for e in model]
    bars(axes[2], models, series(mem, models, "gib", skip_eager=False), "training step peak memory beyond weights (GiB)")
    fig.suptitle(_header(obj), fontsize=7)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ running
@dataclasses.dataclass
class _Task:
    level: str
    model: str
    item: Any
    provider: str
    group: int
    order: int
    dtype: str = "bf16"

    @property
    def name(self) -> str:
        return f"{self.model}/train_step" if self.level == "model" else self.item.name


def _plan(levels, models, providers, batch, quick, dtypes: Sequence[str] = ("bf16",),
          modes: Sequence[str] = MODES) -> list[_Task]:
    """The tasks of a run, in running order. Per dtype (outermost), model, level, item and provider;
    unit and block levels take the providers of ``timing.LAYER_PROVIDERS``, the model level those of
    ``timing.MODEL_PROVIDERS`` (``*-cudagraph`` for the CIFAR nets only), the kernel level ``cudnn``
    (always: the reference) and the fused kernel providers chosen (``cudnn-fused`` in fp16 only).
    ``modes`` with ``enqueue`` alone keeps only the enqueue providers at the block and model levels
    and drops the unit level."""
    from fused_preact.bench.timing import LAYER_PROVIDERS, MODEL_PROVIDERS

    layer_modes = [m for m in modes if m in MODES]
    enqueue = "enqueue" in modes
    step = bool(layer_modes) or not enqueue  # the model's training step, unless only enqueue was asked for
    allowed = {"unit": [p for p in providers if p in LAYER_PROVIDERS],
               "block": [p for p in providers if p in LAYER_PROVIDERS],
               "model": [p for p in providers if p in MODEL_PROVIDERS],
               "kernel": ["cudnn"] + [p for p in FUSED_KERNEL_PROVIDERS if p in providers]}
    tasks = []
    for dtype in dtypes:
        for mi, m in enumerate(models):
            spec = MODEL_SPECS[m]
            units, blocks, kernel_units = ((quick_units, quick_blocks, quick_kernel_units) if quick
                                           else (enumerate_units, enumerate_blocks, enumerate_units))
            items = {"unit": units(m, batch) if "unit" in levels and layer_modes else [],
                     "block": blocks(m, batch) if "block" in levels else [],
                     "model": [spec] if "model" in levels else [],
                     "kernel": kernel_units(m, batch) if "kernel" in levels else []}
            for level in LEVELS:
                for item in items[level]:
                    for p in allowed[level]:
                        if p.endswith("-cudagraph") and (level != "model" or not spec.cifar):
                            continue
                        if p == "cudnn-fused" and dtype != "fp16":  # its fusion graph is built for float16 only
                            continue
                        if level in ("block", "model") and not (layer_modes if level == "block" else step) and not (
                                enqueue and p in ENQUEUE_PROVIDERS):
                            continue
                        group = 0 if p not in _COMPILE else (1 if mi == 0 else 2) + (2 if p == "compile-max-autotune" else 0)
                        tasks.append(_Task(level, m, item, p, group, len(tasks), dtype))
    # cheap groups: unit, block, model, kernel; compile groups: the model's training step first (the
    # single most expensive compilation and the comparison the targets weigh most), then units, blocks
    level_order = {0: ("unit", "block", "model", "kernel")}
    return sorted(tasks, key=lambda t: (t.group, level_order.get(t.group, ("model", "unit", "block")).index(t.level),
                                        t.order))


class _Run:
    def __init__(self, args, command: str):
        self.a = args
        self.t0 = time.perf_counter()
        self.obj: dict[str, Any] = dict(environment(args.commit), command=command,
                                        date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                        dtype=" ".join(args.dtype), batch=args.batch, quick=args.quick, complete=False,
                                        settings=dict(time_limit_s=args.time_limit, warmup=args.warmup, reps=args.reps,
                                                      model_reps=args.model_reps, cudnn_benchmark=True,
                                                      memory_format="channels_last", levels=args.level,
                                                      modes=args.modes, kernel_modes=args.kernel_modes,
                                                      enqueue_steps=args.enqueue_steps),
                                        results=[], skipped=[])
        self.path = results_path(args.out, self.obj["device"], self.obj["date"])

    def left(self) -> float:
        return self.a.time_limit - (time.perf_counter() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.0f}s] {msg}", flush=True)

    def save(self) -> None:
        annotate(self.obj["results"])
        self.obj["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        write_results(self.obj, self.path)

    def skip(self, t: _Task, reason: str) -> None:
        self.obj["skipped"].append(dict(name=t.name, level=t.level, provider=t.provider, reason=reason))
        self.log(f"skip {t.level} {t.name} {t.provider}: {reason}")

    def layer(self, t: _Task) -> list[dict]:
        from fused_preact.bench import timing as BT

        unit = t.level == "unit"
        dtype = dtype_from_name(t.dtype)
        mod = (BT.unit_module if unit else BT.block_module)(t.provider, t.item, dtype)
        shape = (t.item.N, t.item.C, t.item.H, t.item.W) if unit else (t.item.N, t.item.in_planes, t.item.H, t.item.W)
        h = BT.LayerHarness(mod, shape, dtype, self.peaks.l2_bytes, provider=t.provider)
        elem = torch.finfo(dtype).bits // 8
        out = []
        for mode in self.a.modes:
            if mode == "enqueue":  # block level, enqueue providers: fwd+bwd calls back to back
                if not unit and t.provider in ENQUEUE_PROVIDERS:
                    setup, run = h.fns("fwd+bwd")
                    out.append(self._enqueue(t, run, setup, 2 if self.a.quick else 5, BT.peak_memory(run, setup),
                                             shape=t.item.describe(), count=t.item.count, pool=h.n))
                    if h.provider:
                        out[-1]["backend"] = BT.check_backend(h.module, h.provider)
                continue
            m = h.measure(mode, self.a.warmup, self.a.reps, self.a.max_s)
            fl = unit_flops(t.item, mode) if unit else block_flops(t.item, mode)
            nb = unit_min_bytes(t.item, mode, elem) if unit else block_min_bytes(t.item, mode, elem)
            out.append(make_entry(name=t.name, level=t.level, provider=t.provider, mode=mode, dtype=t.dtype,
                                  batch=self.a.batch, times_ms=m.times_ms, peak_mem_bytes=m.peak_mem_bytes, flops=fl,
                                  min_bytes=nb, floor=floor_ms(fl, nb, self.peaks.tflops, self.peaks.gbps),
                                  shape=t.item.describe(), count=t.item.count, **m.extra))
        return out

    def model(self, t: _Task) -> list[dict]:
        from fused_preact.bench import timing as BT

        h = BT.StepHarness(t.item, t.provider, self.a.batch, dtype_from_name(t.dtype), self.peaks.l2_bytes)
        out = []
        if any(m in MODES for m in self.a.modes) or "enqueue" not in self.a.modes:
            m = h.measure(self.a.warmup, self.a.model_reps, 4 * self.a.max_s)
            units = enumerate_units(t.model, self.a.batch)
            fl = sum(unit_flops(u, "fwd+bwd") * u.count for u in units)
            out.append(make_entry(name=t.name, level="model", provider=t.provider, mode="step", dtype=t.dtype,
                                  batch=self.a.batch, times_ms=m.times_ms, peak_mem_bytes=m.peak_mem_bytes, flops=fl,
                                  flops_note="block convolutions, fwd+bwd", **m.extra))
        if "enqueue" in self.a.modes and t.provider in ENQUEUE_PROVIDERS and h.graph is None:
            setup, run = h.fns()
            peak = out[0]["peak_mem_bytes"] if out else BT.peak_memory(run, setup)
            out.append(self._enqueue(t, run, setup, 1 if self.a.quick else 2, peak, pool=h.n))
            out[-1]["backend"] = BT.check_backend(h.model, t.provider)
        return out

    def _enqueue(self, t: _Task, run, setup, repeats: int, peak: int, **extra) -> dict:
        """The ``enqueue`` entry of ``run(setup(i))`` (:func:`fused_preact.bench.timing.time_enqueue`):
        ``median_ms`` the host ms per step until the last of ``--enqueue-steps`` calls returns, ``wall_ms``
        the ms per step until the device finished (medians over ``repeats``)."""
        from fused_preact.bench import timing as BT

        steps = self.a.enqueue_steps
        enq, wall = BT.time_enqueue(run, setup, steps=steps, repeats=repeats, warmup=1)
        return make_entry(name=t.name, level=t.level, provider=t.provider, mode="enqueue", dtype=t.dtype,
                          batch=self.a.batch, times_ms=enq, peak_mem_bytes=peak, wall_ms=float(statistics.median(wall)),
                          wall_times_ms=wall, steps=steps, **extra)

    def kernel(self, t: _Task) -> list[dict]:
        """The kernel level's entries of one unit, provider and dtype (:mod:`fused_preact.bench.kernels`)."""
        from fused_preact.bench import kernels as BK
        from fused_preact.bench import timing as BT

        dtype = dtype_from_name(t.dtype)
        bench = BK.KernelBench(t.item, dtype, self.peaks.l2_bytes)
        elem = torch.finfo(dtype).bits // 8
        fl = kernel_flops(t.item)
        out, failed = [], []
        for mode in [m for m in self.a.kernel_modes if m in bench.modes(t.provider)]:
            try:  # a failing mode must not lose the modes measured before it
                m = BK.measure(bench, t.provider, mode, self.a.warmup, self.a.reps, self.a.max_s)
            except BT.Skip as e:
                failed.append(f"{mode}: {e}")
                continue
            except Exception as e:
                traceback.print_exc(limit=4)
                failed.append(f"{mode}: error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                continue
            nb = kernel_min_bytes(t.item, mode, elem)
            out.append(make_entry(name=t.name, level="kernel", provider=t.provider, mode=mode, dtype=t.dtype,
                                  batch=self.a.batch, times_ms=m.times_ms, peak_mem_bytes=m.peak_mem_bytes, flops=fl,
                                  min_bytes=nb, floor=floor_ms(fl, nb, self.peaks.tflops, self.peaks.gbps),
                                  shape=t.item.describe(), count=t.item.count, **m.extra))
        if failed and out:
            self.skip(t, "; ".join(failed))  # the other modes' entries are kept
        if not out:
            raise BT.Skip("; ".join(failed) or f"{t.provider} has no call for the modes "
                          f"{' '.join(self.a.kernel_modes)} (it has {' '.join(bench.modes(t.provider))})")
        return out

    def execute(self, tasks: list[_Task]) -> None:
        from fused_preact.bench import timing as BT

        torch.backends.cudnn.benchmark = True
        self.log(f"measuring peaks; then {len(tasks)} tasks, time limit {self.a.time_limit:.0f} s → {self.path}")
        self.peaks = BT.measure_peaks(reps=5 if self.a.quick else 10)
        self.obj["peaks"] = self.peaks.as_dict()
        self.log(f"peaks: {self.peaks.tflops:.0f} TFLOP/s bf16 matmul, {self.peaks.gbps:.0f} GB/s copy, "
                 f"L2 {self.peaks.l2_bytes >> 20} MiB")
        for i, t in enumerate(tasks):
            est = EST_S[t.level].get(t.provider, 30) * (0.5 if self.a.quick else 1.0)
            if self.left() < est:
                self.skip(t, f"time limit: ~{est:.0f} s estimated, {max(0.0, self.left()):.0f} s left of "
                             f"--time-limit {self.a.time_limit:.0f}")
                continue
            try:
                entries = {"model": self.model, "kernel": self.kernel}.get(t.level, self.layer)(t)
            except BT.Skip as e:
                self.skip(t, str(e))
            except Exception as e:  # one failing provider must not lose the run; the reason is recorded
                traceback.print_exc(limit=4)
                self.skip(t, f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            else:
                self.obj["results"] += entries
                desc = "  ".join(f"{e['mode']} {e['median_ms']:.3f} ms" + (f" ({e['pct_of_floor']:.0f}% floor)"
                                 if e.get("pct_of_floor") else "") for e in entries)
                self.log(f"{i + 1}/{len(tasks)} {t.level} {t.name} {t.provider}: {desc}")
            finally:
                gc.collect()
                if t.provider in _COMPILE:
                    torch._dynamo.reset()
            lost = self._context_lost()
            if lost:
                for rest in tasks[i + 1:]:
                    self.skip(rest, f"not run: the CUDA context was lost ({lost})")
                self.save()
                return
            self.save()
        self.obj["complete"] = True
        self.save()

    @staticmethod
    def _context_lost() -> Optional[str]:
        """None while the device still works; the error text after a sticky CUDA error (e.g. an
        illegal memory access), after which every later launch in this process would fail too."""
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError as e:
            return str(e).splitlines()[0][:200]
        return None


def _report(obj: dict, json_path: Path, chart: bool) -> None:
    print(format_table(obj), flush=True)
    md = json_path.with_suffix(".md")
    md.write_text(markdown_report(obj))
    print(f"\nwrote {json_path}\nwrote {md}", flush=True)
    if chart:
        try:
            print(f"wrote {write_chart(obj, json_path.with_suffix('.png'))}", flush=True)
        except ImportError as e:
            print(f"no chart: {e} (pip install matplotlib)", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fused_preact.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", nargs="+", choices=LEVELS,
                   help="levels to run (default: unit block model; --quick: all four)")
    p.add_argument("--models", nargs="+", choices=sorted(MODEL_SPECS), default=["preact_resnet50", "preact_resnet164"],
                   help="the first model's compile benchmarks run before the others'")
    p.add_argument("--providers", nargs="+", choices=_ALL_PROVIDERS, default=list(_ALL_PROVIDERS))
    p.add_argument("--modes", nargs="+", choices=MODES + ("enqueue",),
                   help="unit/block modes, and enqueue (block and model levels; alone: only enqueue there) "
                        "(default: fwd bwd fwd+bwd; --quick: those and enqueue)")
    p.add_argument("--kernel-modes", nargs="+", choices=KERNEL_MODES, default=list(KERNEL_MODES),
                   help="kernel-level modes (default: all)")
    p.add_argument("--enqueue-steps", type=int, default=20, help="calls back to back per enqueue measurement (default 20)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"],
                   help="one or more dtypes; every task runs in each (default: bf16)")
    p.add_argument("--quick", action="store_true", help="a few shapes, few repetitions (~2 minutes): an end-to-end check; "
                                                           "all levels (two kernel shapes) and the enqueue mode")
    p.add_argument("--out", default="benchmarks/results", help="folder for <device>-<date>.json/.md/.png")
    p.add_argument("--time-limit", type=float, help="seconds of benchmarking (default 480; --quick 120)")
    p.add_argument("--warmup", type=int, help="untimed calls per measurement (default 3; --quick 2)")
    p.add_argument("--reps", type=int, help="timed calls per unit/block/kernel measurement (default 30; --quick 5)")
    p.add_argument("--model-reps", type=int, help="timed training steps per model measurement (default 10; --quick 3)")
    p.add_argument("--max-s", type=float, help="wall seconds after which a measurement stops repeating (default 1.5)")
    p.add_argument("--commit", help="commit to record (default: $FUSED_PREACT_COMMIT or git rev-parse HEAD)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    p.add_argument("--report", metavar="JSON", help="only re-render table/markdown/chart of an existing results file (no GPU)")
    p.add_argument("--static", action="store_true",
                   help="the static kernel report is `python -m tools.static_report` from the repository root; "
                        "this flag only prints that and exits with 2")
    return p


#: What ``--static`` prints: the compile-only report is a developer tool of the repository, not installed.
STATIC_MOVED = ("the static kernel report is not part of the installed package: from the repository root, run "
                "`python -m tools.static_report ...` (same arguments; docs/static-report.md)")


def cuda_refusal() -> Optional[str]:
    """Why this process must not benchmark (no CUDA device, or Triton's interpreter active), or None."""
    if not torch.cuda.is_available():
        return ("no CUDA device (torch.cuda.is_available() is False). The benchmarks time GPU kernels; CPU "
                "timings would say nothing about them, so nothing was measured or written. Run this on a CUDA "
                "machine (or use --report FILE to re-render an existing results file).")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return ("TRITON_INTERPRET is set: the fused kernels would run in Triton's interpreter and their timings "
                "would be meaningless. Unset it.")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (see the module docstring). Returns the exit code: 0 done, 2 refused (no
    CUDA, Triton interpreter active, invalid --report file, or ``--static``: the static report is
    ``python -m tools.static_report``, run from the repository root)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--static" in argv:
        print(f"fused_preact.bench: {STATIC_MOVED}", file=sys.stderr)
        return 2
    a = _parser().parse_args(argv)
    if a.report:
        obj = json.loads(Path(a.report).read_text())
        problems = validate_results(obj)
        if problems:
            print("fused_preact.bench: not a valid results file: " + "; ".join(problems[:5]), file=sys.stderr)
            return 2
        _report(obj, Path(a.report), not a.no_chart)
        return 0
    refusal = cuda_refusal()
    if refusal:
        print(f"fused_preact.bench: {refusal}", file=sys.stderr)
        return 2
    defaults = dict(time_limit=(120.0, 480.0), warmup=(2, 3), reps=(5, 30), model_reps=(3, 10), max_s=(1.5, 1.5))
    defaults.update(level=(list(LEVELS), ["unit", "block", "model"]), modes=(list(MODES) + ["enqueue"], list(MODES)))
    for k, (quick, full) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, quick if a.quick else full)
    a.dtype = list(dict.fromkeys(a.dtype))
    run = _Run(a, "python -m fused_preact.bench " + shlex.join(argv))
    tasks = _plan(a.level, a.models, a.providers, a.batch, a.quick, a.dtype, a.modes)
    try:
        run.execute(tasks)
    finally:
        if run.obj["results"] or run.obj["skipped"]:
            run.save()
            _report(run.obj, run.path, not a.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
