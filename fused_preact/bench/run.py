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
the roofline floor (ms) from peaks *measured* at the start of the run (the matmul rate of the entry's
dtype; fp32 with TF32 when ``torch.backends.cudnn.allow_tf32`` is on, as cuDNN's and the Triton
kernels' fp32 convolutions then run), and percent of floor
(cost model: :mod:`fused_preact.bench.shapes`; timing method: :mod:`fused_preact.bench.timing`).

Budget: the run works through cheap providers first (eager, fused, CUDA graphs; all levels), then
``torch.compile`` for the first model (training step first, then units, then blocks), then for the
others, then max-autotune in the same order. Before each task it
compares a rough cost estimate (:data:`EST_S`) with what is left of ``--time-limit`` and records the
task as skipped when it would not fit. The results file is rewritten after every task, so a run
killed from outside keeps what it measured; ``--report FILE`` re-renders table, markdown and chart
from a results file without a GPU.

Outputs in ``--out`` (default ``benchmarks/results``): ``<device>-<date>.json`` (format:
:mod:`fused_preact.bench.results`), ``.md`` (summary and full tables) and ``.png`` (speedups and memory;
:mod:`fused_preact.bench.report`).
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
import os
import platform
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
    quick_kernel_units,
)
from fused_preact.bench.report import format_table, markdown_report, matmul_peaks, write_chart
from fused_preact.bench.results import (
    _ALL_PROVIDERS,
    _COMPILE,
    ENQUEUE_PROVIDERS,
    ENTRY_MODES,
    EST_S,
    LEVELS,
    annotate,
    make_entry,
    results_path,
    validate_results,
    write_results,
)
from fused_preact.bench.shapes import (
    MODEL_SPECS,
    MODES,
    block_flops,
    block_min_bytes,
    dtype_from_name,
    enumerate_blocks,
    enumerate_units,
    floor_ms,
    quick_blocks,
    quick_units,
    unit_flops,
    unit_min_bytes,
)
from fused_preact.cli_types import int_at_least, positive_float, unwritable_folder

__all__ = [
    "LEVELS", "ENTRY_MODES", "ENQUEUE_PROVIDERS", "EST_S", "make_entry", "annotate", "validate_results",
    "results_path", "write_results", "environment", "format_table", "markdown_report", "write_chart",
    "cuda_refusal", "main"
]

def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _source_sha256(package: Optional[Path] = None) -> str:
    """First 16 hex digits of the SHA-256 over the package's ``*.py`` files and, where the package sits
    in a checkout beside it, every file under ``csrc/`` (path relative to the package's parent, NUL,
    content; sorted by path; caches skipped). ``package``: the ``fused_preact`` folder (default: this one)."""
    package = Path(package) if package is not None else Path(__file__).resolve().parents[1]
    root = package.parent
    files = list(package.rglob("*.py")) + list((root / "csrc").rglob("*"))
    h = hashlib.sha256()
    for p in sorted(files):
        if p.is_file() and "__pycache__" not in p.parts:
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
          modes: Sequence[str] = MODES, layers: Sequence[str] = ()) -> list[_Task]:
    """The tasks of a run, in running order. Per dtype (outermost), model, level, item and provider;
    with ``layers``, only units, blocks and kernels one of whose names (``preact_resnet50/layer1.1``)
    contains one of those strings;
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
            if layers:
                for level in ("unit", "block", "kernel"):
                    items[level] = [it for it in items[level] if any(s in n for n in it.names for s in layers)]
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
                                  min_bytes=nb, floor=floor_ms(fl, nb, self.peaks.tflops_for(t.dtype), self.peaks.gbps),
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
                                  min_bytes=nb, floor=floor_ms(fl, nb, self.peaks.tflops_for(t.dtype), self.peaks.gbps),
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
        self.peaks = BT.measure_peaks(reps=5 if self.a.quick else 10, dtypes=self.a.dtype)
        self.obj["peaks"] = self.peaks.as_dict()
        self.log(f"peaks: {matmul_peaks(self.obj['peaks'])} matmul, {self.peaks.gbps:.0f} GB/s copy, "
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
    p.add_argument("--enqueue-steps", type=int_at_least(1), default=20,
                   help="calls back to back per enqueue measurement (default 20)")
    p.add_argument("--layers", nargs="+", default=[],
                   help="only units, blocks and kernels one of whose names (e.g. preact_resnet50/layer1.1) contains "
                        "one of these strings (the model level is unaffected)")
    p.add_argument("--batch", type=int_at_least(1), default=128)
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"],
                   help="one or more dtypes; every task runs in each (default: bf16)")
    p.add_argument("--quick", action="store_true", help="a few shapes, few repetitions (~2 minutes): an end-to-end check; "
                                                           "all levels (two kernel shapes) and the enqueue mode")
    p.add_argument("--out", default="benchmarks/results", help="folder for <device>-<date>.json/.md/.png")
    p.add_argument("--time-limit", type=positive_float, help="seconds of benchmarking (default 480; --quick 120)")
    p.add_argument("--warmup", type=int_at_least(0), help="untimed calls per measurement (default 3; --quick 2)")
    p.add_argument("--reps", type=int_at_least(1),
                   help="timed calls per unit/block/kernel measurement (default 30; --quick 5)")
    p.add_argument("--model-reps", type=int_at_least(1),
                   help="timed training steps per model measurement (default 10; --quick 3)")
    p.add_argument("--max-s", type=positive_float,
                   help="wall seconds after which a measurement stops repeating (default 1.5)")
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


def _no_tasks(a: argparse.Namespace) -> str:
    """Why the plan of ``a`` is empty: which providers each chosen level runs."""
    from fused_preact.bench.timing import LAYER_PROVIDERS, MODEL_PROVIDERS

    takes = {"unit": LAYER_PROVIDERS, "block": LAYER_PROVIDERS, "model": MODEL_PROVIDERS,
             "kernel": ("cudnn",) + FUSED_KERNEL_PROVIDERS}
    what = [f"{level} runs {' '.join(takes[level])}" for level in a.level]
    if "unit" in a.level and not any(m in MODES for m in a.modes):
        what.append("the unit level has no enqueue mode")
    return (f"nothing to run: no task for --providers {' '.join(a.providers)} at --level {' '.join(a.level)} "
            f"with --modes {' '.join(a.modes)} ({'; '.join(what)})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (see the module docstring). Returns the exit code: 0 done, 2 refused (no
    CUDA, Triton interpreter active, invalid --report file, or ``--static``: the static report is
    ``python -m tools.static_report``, run from the repository root).

    Raises:
        SystemExit: status 2 with argparse's usage message for an invalid argument (a count below 1,
            a combination of levels, providers and modes that plans no task); status 0 for ``--help``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if parser.parse_known_args(argv)[0].static:  # before the full parse: the static report's own arguments may follow
        print(f"fused_preact.bench: {STATIC_MOVED}", file=sys.stderr)
        return 2
    a = parser.parse_args(argv)
    if a.report:
        try:
            obj = json.loads(Path(a.report).read_text())
        except (OSError, ValueError) as e:  # missing, a folder, unreadable, not UTF-8 or not JSON
            print(f"fused_preact.bench: cannot read --report {a.report}: {e}", file=sys.stderr)
            return 2
        problems = validate_results(obj)
        if problems:
            print("fused_preact.bench: not a valid results file: " + "; ".join(problems[:5]), file=sys.stderr)
            return 2
        _report(obj, Path(a.report), not a.no_chart)
        return 0
    defaults = dict(time_limit=(120.0, 480.0), warmup=(2, 3), reps=(5, 30), model_reps=(3, 10), max_s=(1.5, 1.5))
    defaults.update(level=(list(LEVELS), ["unit", "block", "model"]), modes=(list(MODES) + ["enqueue"], list(MODES)))
    for k, (quick, full) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, quick if a.quick else full)
    a.dtype = list(dict.fromkeys(a.dtype))
    tasks = _plan(a.level, a.models, a.providers, a.batch, a.quick, a.dtype, a.modes, a.layers)
    if not tasks:
        parser.error(_no_tasks(a))
    problem = unwritable_folder(a.out)  # before any GPU work: a run's results must have somewhere to go
    if problem:
        parser.error(f"argument --out: {problem}")
    refusal = cuda_refusal()
    if refusal:
        print(f"fused_preact.bench: {refusal}", file=sys.stderr)
        return 2
    run = _Run(a, "python -m fused_preact.bench " + shlex.join(argv))
    try:
        run.execute(tasks)
    finally:
        if run.obj["results"] or run.obj["skipped"]:
            run.save()
            _report(run.obj, run.path, not a.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
