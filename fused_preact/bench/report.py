"""Tables, markdown and charts of a benchmark results file (:mod:`fused_preact.bench.results`);
no GPU needed (``python -m fused_preact.bench --report FILE``)."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Optional

from fused_preact.bench.kernels import kernel_tables
from fused_preact.bench.results import _ALL_PROVIDERS, _FUSED, ENTRY_MODES, LEVELS, _key, annotate

__all__ = ["format_table", "markdown_report", "write_chart", "chart_series", "matmul_peaks"]


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


def matmul_peaks(peaks: dict) -> str:
    """The measured matmul rates of a results file's ``peaks``, one per dtype: ``"990 TFLOP/s bf16, 495
    TFLOP/s fp32 (TF32)"``. Files from before per-dtype peaks hold the bf16 rate only."""
    rates = peaks.get("matmul_tflops") or {"bf16": peaks.get("tflops")}
    fp32 = f" ({peaks.get('fp32_math', 'ieee').upper()})"
    return ", ".join(f"{_fmt(v, '.0f')} TFLOP/s {d}{fp32 if d == 'fp32' else ''}" for d, v in rates.items())


def _header(obj: dict) -> str:
    """One line: device, versions, commit, date, the measured peaks (each dtype's roofline floor uses its
    own matmul rate; a dtype without one, in files from before per-dtype peaks, used bf16's), dtypes, batch."""
    peaks = obj.get("peaks") or {}
    rates = peaks.get("matmul_tflops") or {"bf16": None}
    borrowed = [d for d in str(obj.get("dtype", "")).split() if d not in rates]
    note = f" (the {' '.join(borrowed)} floors use the bf16 rate)" if borrowed else ""
    return (f"{obj['device']} · driver {obj['driver']} · torch {obj['torch']} (CUDA {obj.get('cuda')}) · "
            f"triton {obj['triton']} · commit {obj['commit'][:12]}{' (dirty)' if obj.get('dirty') else ''} · "
            f"{obj['date']} · measured peaks {matmul_peaks(peaks)}{note}, "
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


def chart_series(entries: list[dict], key: str, skip_eager: bool = True) -> tuple[list[str], dict[str, list[float]]]:
    """One bar chart's data: the row labels (the entries' names in order of appearance, each with
    `` [dtype]`` when the entries hold more than one dtype, so no dtype's value hides another's) and,
    per provider (table order; ``eager`` left out with ``skip_eager``), ``entry[key]`` per row (0.0
    where that provider has no entry or no value)."""
    multi = len({e.get("dtype") for e in entries}) > 1
    label = (lambda e: f"{e['name']} [{e.get('dtype')}]") if multi else (lambda e: e["name"])
    labels = list(dict.fromkeys(label(e) for e in entries))
    present = {e["provider"] for e in entries}
    provs = [p for p in _ALL_PROVIDERS + tuple(sorted(present - set(_ALL_PROVIDERS)))
             if p in present and not (skip_eager and p == "eager")]
    by = {(label(e), e["provider"]): e.get(key) or 0.0 for e in entries}
    return labels, {p: [by.get((n, p), 0.0) for n in labels] for p in provs}


def write_chart(obj: dict, path: os.PathLike) -> Path:
    """PNG chart of a results object: per-layer speedup vs eager (unit and block, fwd+bwd, or the
    first mode present), per-model training-step speedup vs eager, and per-model step peak memory
    (GiB); one row per name and dtype (:func:`chart_series`). Needs matplotlib (imported here, Agg
    backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    annotate(obj["results"])
    layer = [e for e in obj["results"] if e["level"] in ("unit", "block")]
    mode = "fwd+bwd" if any(e["mode"] == "fwd+bwd" for e in layer) else (layer[0]["mode"] if layer else None)
    layer = [e for e in layer if e["mode"] == mode and e.get("speedup_vs_eager")]
    names, layer_series = chart_series(layer, "speedup_vs_eager")
    model = [e for e in obj["results"] if e["level"] == "model" and e["mode"] == "step"]
    models, model_series = chart_series([e for e in model if e.get("speedup_vs_eager")], "speedup_vs_eager")
    mem_models, mem_series = chart_series([dict(e, gib=e["peak_mem_bytes"] / 2**30) for e in model], "gib",
                                          skip_eager=False)
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

    bars(axes[0], names, layer_series, f"speedup vs eager, {mode} (×)", 1.0)
    bars(axes[1], models, model_series, "training step speedup vs eager (×)", 1.0)
    bars(axes[2], mem_models, mem_series, "training step peak memory beyond weights (GiB)")
    fig.suptitle(_header(obj), fontsize=7)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ running
