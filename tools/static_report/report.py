"""Static kernel report: compile every Triton kernel launch offline for sm_90 and sm_80 and read its SASS.

``python -m tools.static_report`` (from the repository root) needs no GPU.
For each :class:`StaticJob` — exactly what a launcher passes to a kernel, ``fn[grid](*args, **kwargs)``
— it specializes the arguments the way a real launch does, compiles with ``triton.compile`` for
``GPUTarget("cuda", arch, 32)``, and reads the cubin with the ``cuobjdump``/``nvdisasm`` Triton ships. Reported per
kernel and config (units in brackets; sources: ``cuobjdump -res-usage``, SASS from ``nvdisasm``):

    regs          registers per thread (REG)
    stack_bytes   per-thread stack frame [bytes] (STACK): register spills or local arrays
    shared_bytes  shared memory per block [bytes]: Triton's dynamic request (``metadata.shared``)
                  plus the static SHARED of the cubin (for CUDA C++ cubins: static only)
    mma           tensor-core instructions: HGMMA (wgmma) on sm_90, HMMA (mma.sync) on sm_80;
                  ``mma_by_op`` counts every tensor-core opcode found; ``hgmma_a_regs``: HGMMAs
                  whose A operand comes from registers (wgmma RS form), not shared memory
    async_copies  {LDGSTS: cp.async global→shared, UTMALDG: TMA tensor loads}
    ldg_by_width  global loads by width [bits], from the LDG suffix: ``.128`` 128, ``.64`` 64, none 32
                  (``LDG.E``), ``.U16``/``.S16`` 16, ``.U8``/``.S8`` 8; likewise ``ldgsts_by_width``
                  (cp.async) and ``stg_by_width`` (global stores)
    spill_stores, spill_loads   STL / LDL instructions (local-memory traffic)
    compile_s     seconds the compilation took (for a cached entry: when it was compiled)
    loop, mma_loops   the main loop per iteration (instructions, MMAs, tensor clocks, issue ratio,
                  wgmma waits, barriers, divisions, loads by kind): :func:`tools.static_report.sass.loop_stats`
    mma_util      convolutions: per layer, the fraction of the main loop's MMA work on real channels
                  (not a tile's padding): :mod:`tools.static_report.utilization`
    mem_ratio     convolutions: per layer, the compulsory memory time over the real MMA work's tensor
                  time at the arch's published peaks (:func:`tools.static_report.utilization.memory_ratio`)

A *job provider* maps ``(units: list[UnitShape], dtypes: list[torch.dtype])`` to StaticJobs. The
report uses :func:`tools.static_report.jobs.chain_jobs` (the launches the fused chains record
on the meta device), or ``--provider module:function``; compiling and caching: :mod:`tools.static_report.compile`.

Output: ``<out>/static-<triton version>-<date>.json`` (top level: ``triton``, ``date``, ``command``,
``commit``, ``archs``, ``provider``, counts, ``elapsed_s``, ``loop_figures``, ``useful_bounds``
(:func:`tools.static_report.utilization.useful_figures`), ``roofline_bounds``
(:func:`tools.static_report.utilization.roofline_figures`), ``entries``; each entry:
``kind`` (``triton``/``csrc``/``anchor``), ``kernel``, ``config``, ``variant``, ``dtype``, ``arch``, the
metrics above, ``conv``, ``shapes`` (layers that launch it), ``roles``, ``signature``/``constexprs``
(the specialization)) and a table on stdout. ``--check`` exits 1 listing every entry that spills
(stack_bytes > 0), exceeds the arch's shared memory per block, failed to compile, or is a convolution
(``conv``) without tensor-core instructions, without async copies, or with 16-bit scalar operand
loads (:mod:`tools.static_report.limits`), and every main loop over its limits beyond the loop
baseline (:mod:`tools.static_report.loop_limits`); ``--cubins DIR`` adds every ``*.cubin`` there
(CUDA C++ builds) as ``kind: "csrc"``, ``--anchors`` the reference loops of
:mod:`tools.static_report.anchors` as ``kind: "anchor"``. Fields, model and limits:
``docs/static-report.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path
from typing import Callable, Optional, Sequence

from tools.static_report.anchors import ANCHOR_NAMES, anchor_entries
from tools.static_report.compile import csrc_entries, import_attr, triton_entries
from tools.static_report.jobs import chain_jobs
from tools.static_report.limits import check_entries
from tools.static_report.loop_limits import (
    check_loops,
    default_baseline,
    load_baseline,
    loop_figures,
    one_step,
    update_baseline,
    write_baseline,
)
from tools.static_report.sass import WIDTHS
from tools.static_report.utilization import roofline_figures, useful_figures

__all__ = ["default_provider", "format_table", "main", "ARCHS"]

#: Archs reported by default (compute capability × 10).
ARCHS: tuple[int, ...] = (90, 80)


# ------------------------------------------------------------------------------------ providers
def default_provider() -> tuple[Callable, str]:
    """:func:`tools.static_report.jobs.chain_jobs` (every launch of the fused chains), with its
    dotted name."""
    return chain_jobs, "tools.static_report.jobs.chain_jobs"


def _load_provider(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--provider wants module:function, got {spec!r}")
    return import_attr(module, name)


# ---------------------------------------------------------------------------------------- table
def _rng(vals: Sequence[int]) -> str:
    lo, hi = min(vals), max(vals)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _widths(ds: Sequence[dict]) -> str:
    parts = []
    for w in WIDTHS:
        vals = [d.get(w, 0) for d in ds]
        if any(vals):
            parts.append(f"{w}:{_rng(vals)}")
    return " ".join(parts) or "-"


def _loop_cells(es: Sequence[dict]) -> list[str]:
    """Main-loop columns of a table row: ranges over the compilations that have a main loop."""
    loops = [e["loop"] for e in es if e.get("loop")]
    if not loops:
        return ["1 step" if es and all(one_step(e) for e in es) else "-"] + ["-"] * 6
    ratios = [lp["issue_ratio"] for lp in loops if lp["issue_ratio"] is not None]
    waits = [min(lp["wgmma_waits"]) for lp in loops if lp["wgmma_waits"]]
    utils = [min(e["mma_util"].values()) for e in es if e.get("loop") and e.get("mma_util")]
    return [_rng([lp["instructions"] for lp in loops]), _rng([lp["mma"] for lp in loops]),
            _rng([round(r, 2) for r in ratios]) if ratios else "?", _rng([round(u, 2) for u in utils]) if utils else "-",
            _rng(waits) if waits else "-", _rng([lp["bar_sync"] for lp in loops]), _rng([lp["int_div"] for lp in loops])]


def format_table(entries: Sequence[dict], full: bool = False) -> str:
    """Text table: one row per (kind, kernel, config, dtype, arch) with ranges over its
    compilations (``n``; every compilation with ``full``), sorted by kernel and dtype (in order of
    appearance), config, arch. Columns: regs, stack [B], smem [KiB], mma (tensor-core instructions of
    any kind: HGMMA, and the HMMA of sm_90's narrow mma.sync tiles), LDGSTS, TMA, STL/LDL, LDG
    and LDGSTS widths as ``bits:count``, and the main loop's per-iteration figures (``loop``, see
    :func:`tools.static_report.sass.loop_stats`): instructions, MMAs, issue ratio, the smallest MMA
    utilization over its layers (:mod:`tools.static_report.utilization`), the smallest wgmma wait depth,
    BAR.SYNC count, integer divisions; ``-`` where a compilation has no MMA loop (``1 step`` in the first
    where it is a one-step launch, :func:`~tools.static_report.loop_limits.one_step`)."""
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for e in entries:
        k = (e["kind"], e["kernel"], e["config"], e["dtype"], e["arch"])
        rows[k + ((e.get("variant", ""), e.get("key", e.get("symbol", ""))) if full else ())].append(e)
    head = ["kernel", "config"] + (["variant"] if full else []) + ["dtype", "arch", "n", "regs", "stack",
                                                                   "smem KiB", "mma", "LDGSTS", "TMA", "STL/LDL",
                                                                   "LDG bits:count", "LDGSTS bits:count",
                                                                   "it:instr", "mma", "ratio", "util", "wait", "BAR",
                                                                   "div"]
    first = {}
    for e in entries:
        first.setdefault(e["kernel"], len(first))
        first.setdefault(e["dtype"], len(first))
    nums = lambda text: [int(x) for x in re.findall(r"\d+", text)]
    order = lambda k: (k[0], first[k[1]], first[k[3]], nums(k[2]), -int(nums(k[4])[0]) if nums(k[4]) else 0, k[5:])
    lines = []
    for k, es in sorted(rows.items(), key=lambda kv: order(kv[0])):
        ok = [e for e in es if "error" not in e]
        if not ok:
            lines.append([k[1], k[2]] + ([k[5]] if full else []) + [k[3], k[4], str(len(es)), "compile failed"])
            continue
        lines.append([k[1], k[2]] + ([k[5]] if full else []) + [
            k[3], k[4], str(len(es)), _rng([e["regs"] for e in ok]), _rng([e["stack_bytes"] for e in ok]),
            _rng([round(e["shared_bytes"] / 1024, 1) for e in ok]), _rng([sum((e.get("mma_by_op") or {}).values()) for e in ok]),
            _rng([e["async_copies"]["LDGSTS"] for e in ok]), _rng([e["async_copies"]["UTMALDG"] for e in ok]),
            f"{_rng([e['spill_stores'] for e in ok])}/{_rng([e['spill_loads'] for e in ok])}",
            _widths([e["ldg_by_width"] for e in ok]), _widths([e["ldgsts_by_width"] for e in ok])] + _loop_cells(ok))
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in lines + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines])


# -------------------------------------------------------------------------------------- summary
def _worst(figures: dict, model_variants: set, kernel: str, arch: str) -> str:
    vals = [f["issue_ratio"]["default"] for k, f in figures.items()
            if k in model_variants and k.split()[1] == kernel and k.endswith(arch)
            and f.get("issue_ratio", {}).get("default") is not None and k.split()[-2] in ("bf16", "fp16")]
    return f"{max(vals):.2f}" if vals else "–"


def summary_rows(obj: dict, model: str) -> list[str]:
    """One markdown table row of a report ``obj`` for ``model`` (its entries: those one of whose
    ``shapes`` names it): Triton version, compilations, spilling or failing ones, the worst default
    issue ratio of the 16-bit fprop/dgrad/wgrad loops on sm_90 and sm_80, and the loop limits broken
    (variant × limit, default or candidate)."""
    es = [dict(e, shapes=[sh for sh in e["shapes"] if sh.startswith(model + "/")]) for e in obj["entries"]
          if e.get("kind") == "triton" and any(sh.startswith(model + "/") for sh in e["shapes"])]
    bad = sum(1 for e in es if "error" in e or e.get("stack_bytes", 0) > 0 or e.get("shared_bytes", 0) > 166912)
    figs, _ = loop_figures(es)  # this model's layers only
    variants = set(figs)
    over = sum(1 for k, f in figs.items() if k in variants for lim in f.values()
               for side in ("default", "candidate") if lim.get(side) is not None and lim[side] > lim["limit"])
    cells = [obj["triton"], str(len(es)), str(bad)] + [_worst(figs, variants, k, a) for a in ("sm_90", "sm_80")
                                                        for k in ("fprop", "dgrad", "wgrad")] + [str(over)]
    return ["| " + " | ".join(cells) + " |"]


def summary_table(objs: Sequence[dict], models: Sequence[str]) -> str:
    """Markdown: per model, one row per report (:func:`summary_rows`)."""
    head = ("| Triton | compilations | spilling or failed | fprop sm_90 | dgrad sm_90 | wgrad sm_90 | fprop sm_80 | "
            "dgrad sm_80 | wgrad sm_80 | loop limits over |")
    out = []
    for m in models:
        out += [f"**{m}**", "", head, "|" + "---|" * 10]
        for obj in sorted(objs, key=lambda o: [int(x) for x in re.findall(r"\d+", o["triton"])[:3]], reverse=True):
            out += summary_rows(obj, m)
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    from fused_preact.bench.shapes import MODEL_SPECS

    p = argparse.ArgumentParser(prog="python -m tools.static_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", type=int, default=list(ARCHS), help="compute capabilities (default: 90 80)")
    p.add_argument("--kernels", nargs="+", help="only jobs with these kernel names (default: all)")
    p.add_argument("--models", nargs="+", choices=sorted(MODEL_SPECS), default=["preact_resnet50", "preact_resnet164"])
    p.add_argument("--layers", nargs="+", help="only units one of whose layer names contains one of these strings")
    p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16", "fp32"], default=["bf16", "fp16", "fp32"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--provider", help="job provider module:function (default: "
                                      "tools.static_report.jobs:chain_jobs)")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernels (with --cubins)")
    p.add_argument("--cubins", metavar="DIR", help="also report every *.cubin in DIR (CUDA C++ builds)")
    p.add_argument("--check", action="store_true", help="exit 1 if any entry spills, exceeds shared memory or "
                                                        "failed, or a convolution lacks tensor-core instructions or "
                                                        "async copies or loads 16-bit operands element-wise, or a "
                                                        "main loop breaks its limits beyond the loop baseline")
    p.add_argument("--loop-baseline", metavar="JSON", default=str(default_baseline()),
                   help="the ratchet baseline of the main-loop limits (default: the running Triton's, "
                        "tools/static_report/loop_baseline.json for 3.9, loop_baseline.triton3.6.json beside it for "
                        "3.6, …; the basic-block models': loop_baseline_basic.json)")
    p.add_argument("--update-loop-baseline", action="store_true",
                   help="rewrite the loop baseline with this run's offenders (the variants it covers; the Triton "
                        "part must be unrestricted: default models — others only with a --loop-baseline of their "
                        "own —, archs, dtypes, batch, provider, no --layers/--kernels)")
    p.add_argument("--anchors", nargs="*", metavar="NAME",
                   help="also compile the reference GEMM loops (kind 'anchor'; all, or these names): "
                        + ", ".join(ANCHOR_NAMES))
    p.add_argument("--out", default="benchmarks/results", help="folder for static-<triton>-<date>.json")
    p.add_argument("--processes", type=int, default=2, help="compile processes (at most 2)")
    p.add_argument("--cache-dir", default=os.environ.get("FUSED_PREACT_STATIC_CACHE",
                                                         os.path.join(os.path.expanduser("~"), ".cache", "fused_preact",
                                                                      "static")),
                   help="metrics cache (default $FUSED_PREACT_STATIC_CACHE or ~/.cache/fused_preact/static)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the metrics cache")
    p.add_argument("--sass-dir", metavar="DIR", help="write each compilation's SASS there (bypasses the cache)")
    p.add_argument("--full-table", action="store_true", help="one table row per compilation")
    p.add_argument("--summary", nargs="+", metavar="JSON",
                   help="only print the markdown summary per model and Triton version of these report files "
                        "(static-<triton>-<date>.json) for --models, and exit")
    return p


def _dumps(obj: dict) -> str:
    """JSON with one line per top-level key and per entry (small, and diffs line up by entry)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in obj.items() if k != "entries"]
    entries = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in obj["entries"])
    return "{\n" + ",\n".join(head + [f' "entries": [\n{entries}\n ]']) + "\n}\n"


def _commit() -> Optional[str]:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (module docstring). Returns 0, 1 (``--check`` found offenders) or 2 (refused:
    TRITON_INTERPRET set, bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    a = parser.parse_args(argv)
    if a.summary:
        print(summary_table([json.loads(Path(f).read_text()) for f in a.summary], a.models))
        return 0
    if a.update_loop_baseline and not a.no_triton and _restricted(a, parser):
        print("tools.static_report: --update-loop-baseline needs the whole Triton report (a restricted run's figures "
              "are lower bounds of the full run's); drop --layers/--kernels/--arch/--dtypes/--batch/--provider and "
              "--models (or give other models a --loop-baseline of their own), or add --no-triton to update the "
              "CUDA C++ variants alone.", file=sys.stderr)
        return 2
    unknown = sorted(set(a.anchors or ()) - set(ANCHOR_NAMES))
    if unknown:
        print(f"tools.static_report: unknown anchors {unknown}; known: {', '.join(ANCHOR_NAMES)}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("tools.static_report: TRITON_INTERPRET is set, so the kernels are interpreter objects and "
              "cannot be compiled; unset it.", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (True), without its warning
    import triton

    t0 = time.perf_counter()
    entries: list[dict] = []
    counts: dict = {}
    provider_name = None
    if not a.no_triton:
        from fused_preact.bench.shapes import dtype_from_name, enumerate_units

        provider, provider_name = (_load_provider(a.provider), a.provider) if a.provider else default_provider()
        units = [u for m in a.models for u in enumerate_units(m, a.batch)]
        if a.layers:
            units = [u for u in units if any(s in n for n in u.names for s in a.layers)]
        dtypes = [dtype_from_name(d) for d in a.dtypes]
        jobs = [j for j in provider(units, dtypes) if not a.kernels or j.kernel in a.kernels]
        cache = None if a.no_cache else Path(a.cache_dir)
        sass_dir = Path(a.sass_dir) if a.sass_dir else None
        if sass_dir is not None:
            sass_dir.mkdir(parents=True, exist_ok=True)
        log = lambda s: print(s, file=sys.stderr, flush=True)
        entries, counts = triton_entries(jobs, a.arch, max(1, min(2, a.processes)), cache, sass_dir, log)
    if a.anchors is not None:
        log = lambda s: print(s, file=sys.stderr, flush=True)
        entries += anchor_entries(a.anchors or ANCHOR_NAMES, a.arch, None if a.no_cache else Path(a.cache_dir), log)
    if a.cubins:
        entries += csrc_entries(a.cubins)
    figures, _ = loop_figures(entries)
    useful = useful_figures(entries)
    elapsed = round(time.perf_counter() - t0, 1)
    obj = {"triton": triton.__version__, "date": date.today().isoformat(),
           "command": "python -m tools.static_report " + shlex.join(argv), "commit": _commit(),
           "archs": [f"sm_{x}" for x in a.arch], "provider": provider_name, **counts, "elapsed_s": elapsed,
           "loop_figures": figures, "useful_bounds": useful, "roofline_bounds": roofline_figures(entries),
           "entries": entries}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"static-{triton.__version__}-{obj['date']}.json"
    path.write_text(_dumps(obj))
    print(format_table(entries, a.full_table))
    above = [(k, v) for k, v in obj["roofline_bounds"].items() if v["excess"] > 1.0]
    if above:
        print(f"\nroofline: {len(above)} variants whose default loop keeps them above their roofline (excess = "
              "max(useful bound, memory ratio) / max(1, memory ratio); static bounds):\n  "
              + "\n  ".join(f"{k}: {v['excess']} at {v['layer']} (useful bound {v['useful_bound']}, memory ratio "
                             f"{v['memory_ratio']})" for k, v in above[:12])
              + (f"\n  … {len(above) - 12} more in the JSON" if len(above) > 12 else ""))
    print(f"\n{len(entries)} entries in {elapsed} s → {path}")
    baseline_path = Path(a.loop_baseline)
    if a.update_loop_baseline:
        baseline, changes = update_baseline(entries, load_baseline(baseline_path))
        write_baseline(baseline_path, baseline)
        print(f"\nloop baseline {baseline_path}: {len(baseline['offenders'])} variants"
              + ("".join(f"\n  {c}" for c in changes) if changes else " (unchanged)"))
    if a.check:
        problems = check_entries(entries)
        loop_problems, notes = check_loops(entries, load_baseline(baseline_path))
        if notes:
            print(f"\nloop baseline: {len(notes)} figures improved (--update-loop-baseline shrinks it):\n  "
                  + "\n  ".join(notes))
        if problems or loop_problems:
            if problems:
                print(f"\n--check: {len(problems)} entries fail:\n  " + "\n  ".join(problems))
            if loop_problems:
                print(f"\n--check: {len(loop_problems)} main-loop limits broken beyond the baseline "
                      f"({baseline_path}):\n  " + "\n  ".join(loop_problems))
            return 1
        print("--check: all entries pass (no spills; tensor cores, async copies and vector operand loads in every "
              f"convolution; main loops within their limits or the baseline, {len(figures)} variants judged)")
    return 0


def _restricted(a: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """Whether the Triton part of the run covers less than the default report (its models: less than
    the models given, where the baseline is not the default one — a baseline of other models)."""
    d = parser.parse_args([])
    keys = ("arch", "dtypes") if Path(a.loop_baseline).resolve() != default_baseline() else ("models", "arch", "dtypes")
    return bool(a.layers or a.kernels or a.provider) or any(
        sorted(getattr(a, k)) != sorted(getattr(d, k)) for k in keys) or a.batch != d.batch


if __name__ == "__main__":
    sys.exit(main())
