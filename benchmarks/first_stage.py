"""The first GPU stage: what one short lend of a GPU checks first, in order of value, within ~8 minutes.

``bash benchmarks/gpu_session.sh first`` runs ``python benchmarks/first_stage.py --out $OUT``. The
environment is read in-process; every other step runs in a process of its own under a time limit
(SIGINT, then SIGKILL 20 s later; a step that would start with less than :data:`MIN_STEP_S` left is
recorded as skipped), so a crash or hang in one is recorded and the others run:

    environment   GPU, driver, Python, torch, CUDA, cuDNN, Triton
    precompile    every Triton kernel the later steps launch (:func:`stage_jobs`: the fused chains of
                  the stage's blocks on their default tiles, and the recompute backend's kernels,
                  bf16), compiled for this GPU's arch into Triton's on-disk cache in parallel processes,
                  before anything is timed
    correctness   per block, bf16, batch 128, tiles untuned: fused (backend="triton") and eager against a
                  float64 copy, forward, input/weight/BN gradients and running statistics, under the
                  eager-relative rule (:mod:`fused_preact.ops.validate`); every block of PreActResNet-50
                  and the PreActResNet-164 blocks of :data:`R164_BLOCKS`
    blocks        block fwd+bwd time and peak memory: eager, triton, recompute, auto, torch.compile; the
                  fused kernels on their default tiles (``FUSED_PREACT_AUTOTUNE=0`` in every step)
                  (``python -m fused_preact.bench --level block``, its own budget; what does not fit is
                  recorded as skipped)
    kernels       each fused kernel of PreActResNet-50 layer1.1 against cuDNN doing the same convolution
                  (``--level kernel``)
    csrc          the CUDA extension's build and tests take ~5 minutes: their own stage
                  (``gpu_session.sh csrc``); recorded here as skipped

Outputs in ``--out`` (three files, rewritten after every step, so a run cut short keeps what it did):
``first.json`` (every step's status, seconds and results), ``first.md`` (the summary) and
``first.log`` (the end of every step's log); the steps' own files stay in a temporary folder.
``--dry-run`` (no GPU needed) writes ``first.json`` and ``first.md`` with the plan: the steps and their
time limits, and the number of distinct Triton compilations (for sm_90) that ``precompile`` would make.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: PreActResNet-164 blocks of the stage (the first of each stage and a repeated one): its kernel variants
#: (16/32/64-channel narrow 3×3s, staged halo, strided projections) without all of its repeats.
R164_BLOCKS = ("preact_resnet164/layer1.0", "preact_resnet164/layer1.1", "preact_resnet164/layer2.0",
               "preact_resnet164/layer3.0")
#: Block filters (substrings of block names) of the stage: every PreActResNet-50 block and those above.
LAYERS = ("preact_resnet50/",) + R164_BLOCKS
MODELS = ("preact_resnet50", "preact_resnet164")
BATCH = 128
#: (step, time limit in seconds): 440 s in all, inside the 8 minutes with Python's start and the copy of $OUT.
STEPS = (("environment", 10), ("precompile", 90), ("correctness", 80), ("blocks", 210), ("kernels", 50),
         ("csrc", 0))
#: Where the correctness check runs (tests run it on the CPU through Triton's interpreter).
_DEVICE = "cuda"
#: A step is skipped when less than this is left; SIGKILL follows a step's SIGINT after GRACE_S.
MIN_STEP_S, GRACE_S = 15, 20
#: Repetitions per timing in this stage (the bench's defaults are 3 / 30 / 1.5 s): more blocks measured.
TIMING_ARGS = ("--warmup", "2", "--reps", "10", "--max-s", "0.5")
BLOCK_PROVIDERS = ("eager", "triton", "recompute", "auto", "compile")


def stage_blocks(batch: int = BATCH):
    """The stage's :class:`~fused_preact.bench.shapes.BlockShape` list (:data:`LAYERS`)."""
    from fused_preact.bench.shapes import enumerate_blocks

    return [b for m in MODELS for b in enumerate_blocks(m, batch) if any(s in n for n in b.names for s in LAYERS)]


def stage_jobs(batch: int = BATCH):
    """Every Triton launch of the stage's blocks in bf16 on default tiles: the fused chains'
    (:func:`tools.static_report.jobs.chain_jobs`, its autotune candidates left out: the stage does not
    tune) and the recompute backend's (:func:`tools.static_report.recompute_jobs.recompute_jobs`)."""
    import torch

    from tools.static_report.jobs import chain_jobs
    from tools.static_report.recompute_jobs import recompute_jobs

    units = [u for b in stage_blocks(batch) for u in b.units]
    fused = [j for j in chain_jobs(units, [torch.bfloat16]) if j.role != "candidate"]
    return fused + recompute_jobs(units, [torch.bfloat16])


def environment() -> dict:
    import torch
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
           "commit": os.environ.get("FUSED_PREACT_COMMIT"), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def precompile_step(arch: int, processes: int, out: Path) -> None:
    from tools.static_report.compile import precompile

    path = out / "precompile.json"
    path.write_text(json.dumps({"status": "started"}))
    try:
        result = precompile(stage_jobs(), arch, processes, log=lambda s: print(s, flush=True))
    except KeyboardInterrupt:  # the step's time limit: what was compiled stays in Triton's cache
        result = {"status": "interrupted by the step's time limit"}
    path.write_text(json.dumps(result, indent=1))


def _tensors(m, x, dy=None):
    """Output, input gradient, every parameter gradient and BN running statistic of block ``m`` after
    one training-mode forward and backward of ``x`` with output gradient ``dy`` (drawn when None), and dy."""
    import torch

    x = x.detach().requires_grad_()
    y = m(x)
    if dy is None:
        dy = torch.randn(y.shape, device=y.device).contiguous(memory_format=torch.channels_last)
    y.backward(dy.to(y.dtype))
    out = {"out": y, "dx": x.grad}
    out.update({f"d.{n}": p.grad for n, p in m.named_parameters() if p.grad is not None})
    out.update({f"buf.{n}": b for n, b in m.named_buffers() if "running" in n})
    return out, dy


def check_block(b, dtype) -> dict:
    """One block: fused (``backend="triton"``) and eager in ``dtype`` against a float64 copy of eager."""
    import copy

    import torch

    from fused_preact.bench.timing import block_module
    from fused_preact.ops.validate import ErrorPool, eager_floor, rule_violations

    fused = block_module("triton", b, dtype)
    eager = block_module("eager", b, dtype)
    eager.load_state_dict(fused.state_dict())
    ref = copy.deepcopy(eager).double()
    torch.manual_seed(1)
    x = torch.randn(b.N, b.in_planes, b.H, b.W, device=_DEVICE).contiguous(memory_format=torch.channels_last)
    got = {}
    got["fused"], dy = _tensors(fused, x.to(dtype))
    got["eager"], _ = _tensors(eager, x.to(dtype), dy)
    got["ref"], _ = _tensors(ref, x.double(), dy)
    pools = {k: ErrorPool() for k in ("fused", "eager")}
    for k, pool in pools.items():
        for name, ref_t in got["ref"].items():
            pool.add(name, got[k][name], ref_t)
    rels = {k: p.rels() for k, p in pools.items()}
    bad = rule_violations(rels["fused"], rels["eager"], eager_floor(dtype))
    backends = sorted({str(getattr(m, "last_backend", None)) for m in fused.modules()
                       if getattr(m, "last_backend", None) is not None})
    if backends != ["triton"]:
        bad.append(f"the fused modules ran {backends}, not triton alone")
    worst = max(rels["fused"], key=lambda n: rels["fused"][n] / (rels["eager"][n] + 1e-12))
    return {"block": b.name, "ok": not bad, "violations": bad, "backends": backends,
            "worst": {"tensor": worst, "fused": rels["fused"][worst], "eager": rels["eager"][worst]}}


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "/")[:400]


def correctness_step(out: Path) -> None:
    """:func:`check_block` for every block of the stage, bf16, untuned tiles, into
    ``<out>/correctness.json`` after every block; an exception is recorded as that block's failure and the
    next block runs; the step's time limit (SIGINT) ends it with what it has."""
    import torch

    results: list = []
    path = out / "correctness.json"

    def save(status: str) -> None:
        path.write_text(json.dumps({"status": status, "blocks": results, "passed": sum(r["ok"] for r in results),
                                    "failed": sum(not r["ok"] for r in results)}, indent=1))

    try:
        for b in stage_blocks():
            t0 = time.perf_counter()
            try:
                r = check_block(b, torch.bfloat16)
            except Exception as e:
                r = {"block": b.name, "ok": False, "violations": [_one_line(f"{type(e).__name__}: {e}")]}
            r["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            print(json.dumps(r), flush=True)
            save("running")
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        save(f"interrupted by the step's time limit after {len(results)} blocks")
        return
    save("done")


def _bench_cmd(level: str, out: Path, limit: float) -> list[str]:
    common = ["--out", str(out), "--no-chart", "--time-limit", str(int(limit)), "--dtype", "bf16", *TIMING_ARGS]
    if os.environ.get("FUSED_PREACT_COMMIT"):
        common += ["--commit", os.environ["FUSED_PREACT_COMMIT"]]
    if level == "block":
        return [sys.executable, "-m", "fused_preact.bench", "--level", "block", "--modes", "fwd+bwd", "--models",
                *MODELS, "--layers", *LAYERS, "--providers", *BLOCK_PROVIDERS, *common]
    return [sys.executable, "-m", "fused_preact.bench", "--level", "kernel", "--models", "preact_resnet50",
            "--layers", "preact_resnet50/layer1.1", "--providers", "triton", *common]


_FIELDS = ("name", "provider", "mode", "median_ms", "peak_mem_bytes", "speedup_vs_eager", "speedup_vs_compile",
           "mem_vs_eager", "ratio_vs_cudnn")


def _bench_summary(folder: Path) -> dict:
    """The entries of the bench's results file in ``folder`` (:data:`_FIELDS`; ratios as
    :func:`fused_preact.bench.results.annotate` computes them) and what its budget skipped."""
    files = sorted(folder.glob("*-20*.json"))
    if not files:
        return {"entries": [], "skipped": []}
    obj = json.loads(files[-1].read_text())
    rows = [{k: e[k] for k in _FIELDS if k in e} for e in obj.get("results", [])]
    return {"file": files[-1].name, "entries": rows, "skipped": obj.get("skipped", [])}


# ------------------------------------------------------------------------------------------ driver
#: Every step runs the default tiles (``FUSED_PREACT_AUTOTUNE=0``): what ``precompile`` compiled is
#: exactly what runs (the tuner's one-unit timing launches would compile more, serially, mid-step);
#: ``gpu_session.sh bench`` measures tuned tiles.
_STEP_ENV = dict(os.environ, FUSED_PREACT_AUTOTUNE="0")


def _step(name: str, limit: float, work: Path, cmd: list[str]) -> dict:
    """Run ``cmd`` under ``limit`` seconds (SIGINT, then SIGKILL :data:`GRACE_S` later), its output in
    ``<work>/<name>.log``; skipped when ``limit`` < :data:`MIN_STEP_S`."""
    if limit < MIN_STEP_S:
        return {"status": f"skipped: {max(0, int(limit))} s left", "seconds": 0.0, "limit_s": int(limit)}
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(["timeout", "-s", "INT", "-k", str(GRACE_S), str(int(limit)), *cmd], cwd=ROOT,
                                  stdout=log, stderr=subprocess.STDOUT, env=_STEP_ENV)
            rc = proc.returncode
        except OSError as e:
            log.write(f"cannot run: {e}\n")
            rc = 127
    return {"status": "ok" if rc == 0 else "timed out" if rc in (124, 137) else f"exit {rc}",
            "seconds": round(time.perf_counter() - t0, 1), "limit_s": int(limit)}


def _json_step(name: str, limit: float, work: Path, args: list[str]) -> dict:
    """A step of this script in a process of its own, writing ``<work>/<name>.json``."""
    r = _step(name, limit, work, [sys.executable, str(Path(__file__).resolve()), "--work", str(work), *args])
    path = work / f"{name}.json"
    try:
        if path.is_file():
            r["result"] = json.loads(path.read_text())
    except ValueError as e:  # cut mid-write
        r["result"] = {"status": f"unreadable: {e}"}
    return r


def plan(budget: float) -> list[dict]:
    """The steps and their time limits, scaled down to fit ``budget`` seconds."""
    total = sum(s for _, s in STEPS)
    scale = min(1.0, budget / total)
    return [{"step": n, "limit_s": int(s * scale)} for n, s in STEPS]


def _write(out: Path, work: Path, obj: dict) -> None:
    """``first.json``, ``first.md`` and ``first.log`` (the last 60 lines of each step's log) in ``out``."""
    (out / "first.json").write_text(json.dumps(obj, indent=1, default=str))
    (out / "first.md").write_text(markdown(obj))
    parts = []
    for log in sorted(work.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        parts.append(f"=== {log.stem} ({len(lines)} lines, last 60)\n" + "\n".join(lines[-60:]))
    (out / "first.log").write_text("\n".join(parts) + "\n")


def run_stage(out: Path, budget: float, processes: int) -> dict:
    """Every step in order, within ``budget`` seconds; ``out`` rewritten after each (:func:`_write`)."""
    import torch

    start = time.perf_counter()
    left = lambda: budget - (time.perf_counter() - start) - GRACE_S
    limits = {p["step"]: p["limit_s"] for p in plan(budget)}
    work = Path(tempfile.mkdtemp(prefix="first-stage-"))
    obj = {"stage": "first", "budget_s": budget, "environment": environment(), "steps": {}}
    steps = obj["steps"]
    cc = torch.cuda.get_device_capability(0)
    arch = cc[0] * 10 + cc[1]
    steps["precompile"] = _json_step("precompile", min(limits["precompile"], left()), work,
                                     ["--step", "precompile", "--arch", str(arch), "--processes", str(processes)])
    _write(out, work, obj)
    steps["correctness"] = _json_step("correctness", min(limits["correctness"], left()), work,
                                      ["--step", "correctness"])
    _write(out, work, obj)
    for level, name in (("block", "blocks"), ("kernel", "kernels")):
        limit = min(limits[name], left())
        folder = work / f"bench-{name}"
        folder.mkdir(exist_ok=True)
        steps[name] = _step(name, limit, work, _bench_cmd(level, folder, max(10, limit - 40)))
        steps[name]["result"] = _bench_summary(folder)
        _write(out, work, obj)
    steps["csrc"] = {"status": "skipped: its own stage (bash benchmarks/gpu_session.sh csrc, ~5 min)"}
    obj["elapsed_s"] = round(time.perf_counter() - start, 1)
    _write(out, work, obj)
    return obj


def dry_run(budget: float, processes: int) -> dict:
    """The plan without a GPU: steps, limits, blocks, and the precompile step's compilations for sm_90."""
    from tools.static_report.compile import distinct_specs

    t0 = time.perf_counter()
    jobs = stage_jobs()
    n = len(distinct_specs(jobs, 90))
    return {"stage": "first", "dry_run": True, "budget_s": budget, "environment": environment(),
            "plan": plan(budget), "blocks": [b.name for b in stage_blocks()], "launches": len(jobs),
            "compilations_sm90": n, "processes": processes, "plan_seconds": round(time.perf_counter() - t0, 1)}


def markdown(obj: dict) -> str:
    env = obj["environment"]
    lines = [f"# GPU stage `first`{' (dry run)' if obj.get('dry_run') else ''}", "",
             " · ".join(f"{k} {v}" for k, v in env.items() if v is not None), ""]
    if obj.get("dry_run"):
        lines += ["| step | limit (s) |", "|---|---|"] + [f"| {p['step']} | {p['limit_s']} |" for p in obj["plan"]]
        lines += ["", f"{len(obj['blocks'])} blocks; {obj['launches']} launches → {obj['compilations_sm90']} distinct "
                      f"Triton compilations for sm_90 (precompiled in {obj['processes']} processes)."]
        return "\n".join(lines) + "\n"
    lines += ["| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s['status']} | {s.get('seconds', '')} |" for n, s in obj["steps"].items()]
    corr = obj["steps"].get("correctness", {}).get("result", {})
    if corr.get("blocks") is not None:
        lines += ["", f"## Correctness (bf16 vs float64, eager-relative rule): {corr['passed']} passed, "
                      f"{corr['failed']} failed ({corr.get('status', '')})", "",
                  "| block | ok | worst tensor | fused | eager |", "|---|---|---|---|---|"]
        for r in corr.get("blocks", []):
            w = r.get("worst") or {}
            err = lambda k: f"{w[k]:.2e}" if k in w else "–"
            verdict = "yes" if r["ok"] else "NO: " + _one_line("; ".join(r["violations"]))[:200]
            lines.append(f"| {r['block']} | {verdict} | {w.get('tensor', '–')} | {err('fused')} | {err('eager')} |")
    for name, key in (("blocks", "speedup_vs_eager"), ("kernels", "ratio_vs_cudnn")):
        res = obj["steps"].get(name, {}).get("result", {})
        if res.get("entries"):
            lines += ["", f"## {name}: median ms, {key}, peak memory vs eager", "",
                      "| name | provider | ms | " + key + " | mem vs eager |", "|---|---|---|---|---|"]
            for e in res["entries"]:
                lines.append(f"| {e['name']} | {e['provider']} | {e['median_ms']:.3f} | {e.get(key, '')} | "
                             f"{e.get('mem_vs_eager', '')} |")
            if res.get("skipped"):
                lines.append(f"\n{len(res['skipped'])} tasks skipped by the budget.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--budget", type=float, default=440.0, help="seconds for all steps (default 440)")
    p.add_argument("--processes", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--dry-run", action="store_true", help="the plan and compilation count, no GPU needed")
    p.add_argument("--step", choices=["precompile", "correctness"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--arch", type=int, default=90, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.step:
        work = Path(a.work)
        precompile_step(a.arch, a.processes, work) if a.step == "precompile" else correctness_step(work)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        obj = dry_run(a.budget, a.processes)
        (out / "first.json").write_text(json.dumps(obj, indent=1, default=str))
        (out / "first.md").write_text(markdown(obj))
    else:
        import torch

        if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print("first_stage: needs a CUDA device and TRITON_INTERPRET unset (use --dry-run)", file=sys.stderr)
            return 2
        obj = run_stage(out, a.budget, a.processes)
    print(markdown(obj))
    return 0


if __name__ == "__main__":
    sys.exit(main())
