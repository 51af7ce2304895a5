"""The main job: train a PreActResNet built eagerly and fused, from the same weights on the same data.

``python -m fused_preact [--data-dir CIFAR_PY_DIR] [--depth D] [--steps S] ...`` (``--help`` lists all,
with defaults). Data: scikit-learn's bundled digits, or with ``--data-dir`` the python version of
CIFAR-10 (``cifar-10-batches-py``, extracted from cs.toronto.edu/~kriz/cifar-10-python.tar.gz).

Both builds start from identical weights and see identical batches; the job prints each step's
loss for both, the largest divergence, median step time and peak step memory of each. fp32 math is
IEEE (TF32 off). Training is chaotic: fp32 rounding alone makes an eager fp32 run drift away from the
same run in float64 (ties at ReLU/BN boundaries flip, then the trajectories separate). So the job
also trains an eager float64 twin and measures that drift (the noise floor); it exits with status 1
if the fused–eager divergence (largest relative loss difference over the steps, or of the final
eval-mode test loss) exceeds both ``--tolerance`` and twice the noise floor.

``--soak`` (a long run, e.g. ``--steps 2000 --no-fp64-reference`` on a GPU) replaces that rule with
one fit for thousands of steps: the mean training loss over the last 10% of steps must agree with
eager's within ``--tolerance-soak`` and, on CUDA, the allocated device memory must not grow after
the warm-up steps (by more than 1 MiB).

Without CUDA the fused build runs the Triton kernels through Triton's interpreter
(``TRITON_INTERPRET=1`` is set before fused_preact's kernels are built; called in a process that built
them compiled, :func:`main` warns, and the fused modules fall back, as the printed paths say) with a
small default depth and few steps; that is a real end-to-end test of the kernels, but its timings are
CPU timings and say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from fused_preact.cli_types import unwritable_file

__all__ = ["CPU_DEFAULTS", "CUDA_DEFAULTS", "main", "parse_args", "run", "verdict", "max_rel_divergence",
           "enable_triton_interpreter"]

#: Defaults without CUDA: the fused build runs the Triton kernels in Triton's interpreter, about
#: 1000× slower than a GPU, so the run is small (1 block per stage, the digits at their native 8×8,
#: few steps, a small eval set). ``python -m fused_preact`` took 5 min 25 s with these on 2 busy CPU
#: cores (docs/cpu.md); change them here (or on the command line) to trade time for coverage.
CPU_DEFAULTS = dict(depth=8, steps=8, batch_size=32, image_size=8, eval_size=128)
#: Defaults with CUDA (compiled kernels).
CUDA_DEFAULTS = dict(depth=20, steps=50, batch_size=128, image_size=32, eval_size=512)


def _depth(text: str) -> int:
    """argparse type of ``--depth``: an int that :func:`fused_preact.models.preact_resnet_cifar`
    accepts (checked by building the eager network on the meta device, so the rule lives in one place)."""
    import torch

    from fused_preact.models import preact_resnet_cifar

    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    try:
        with torch.device("meta"):
            preact_resnet_cifar(depth, fused=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (e.g. 8, 14, 20, 56, 110, or 164, 1001 with bottlenecks)") from None
    return depth


def enable_triton_interpreter() -> Optional[str]:
    """For a run without CUDA: set ``TRITON_INTERPRET=1`` (unless set already) so the fused build runs
    the Triton kernels in Triton's interpreter. That works only before fused_preact's kernels are built
    (``fused_preact.ops`` imported: :func:`fused_preact.ops._common.triton_mode` is fixed then).

    Returns:
        None when the kernels will run in the interpreter; otherwise a warning saying why they cannot
        (triton is not installed, they were built compiled, or ``TRITON_INTERPRET`` is set to a value
        Triton reads as off). Decided by building the kernels' mode probe, as the kernels will be.
    """
    built_before = "fused_preact.ops._common" in sys.modules
    if not built_before:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from fused_preact.ops._common import triton_mode

    mode = triton_mode()
    if mode == "interpreter":
        return None
    if mode == "missing":
        cause = "the triton package is not installed"
    elif built_before:
        cause = ("fused_preact's Triton kernels were built compiled (fused_preact.ops was imported before "
                 "TRITON_INTERPRET=1 was set)")
    else:
        cause = f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} is set, which Triton reads as off"
    return (f"{cause}, so without CUDA the fused modules cannot run the Triton kernels (the backends that ran are "
            "printed with the results); set TRITON_INTERPRET=1 before fused_preact is first imported")


def max_rel_divergence(losses: Sequence[float], reference: Sequence[float]) -> float:
    """Largest ``|a − b| / max(|b|, 1e-8)`` over paired steps (0.0 for none); NaN if any step's is NaN
    (a NaN loss in either run), so that no comparison with a limit can pass."""
    rel = [abs(a - b) / max(abs(b), 1e-8) for a, b in zip(losses, reference)]
    return math.nan if any(math.isnan(r) for r in rel) else max(rel, default=0.0)


def _data_dir(text: str) -> str:
    """argparse type of ``--data-dir``: a folder holding the CIFAR-10 python batches."""
    from fused_preact.experiments.data import CIFAR10_SOURCE, cifar10_missing

    missing = cifar10_missing(text)
    if missing:
        what = "no such folder" if not os.path.isdir(text) else "missing " + ", ".join(missing)
        raise argparse.ArgumentTypeError(f"{text!r} is not a CIFAR-10 python folder ({what}); it comes from "
                                         f"{CIFAR10_SOURCE}")
    return text


def parse_args(argv: Optional[list[str]] = None, cuda: bool = False) -> argparse.Namespace:
    """Command-line arguments; defaults are :data:`CUDA_DEFAULTS` with CUDA (``cuda``), else :data:`CPU_DEFAULTS`.

    Raises:
        SystemExit: ``--help`` (status 0), or an invalid argument (status 2, with argparse's message:
            e.g. a depth that is not 6n+2, a ``--data-dir`` without the CIFAR-10 batches).
    """
    from fused_preact.dispatch import BACKENDS

    d = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    p = argparse.ArgumentParser(prog="python -m fused_preact", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=_data_dir, default=None,
                   help="CIFAR-10 python-version folder (cifar-10-batches-py, from "
                        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz); "
                        "without it (%(default)s): scikit-learn's bundled 8×8 digits")
    p.add_argument("--depth", type=_depth, default=d["depth"],
                   help="CIFAR PreActResNet depth: 6n+2 below 164 (basic blocks), 9n+2 from 164 on (bottlenecks)")
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="images per step (at most the training split: a larger value is capped, and the run says so)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--image-size", type=int, default=d["image_size"],
                   help="the digits are resized to this (CIFAR-10 is always 32)")
    p.add_argument("--eval-size", type=int, default=d["eval_size"],
                   help="test images of the eval-mode comparison (at most the test split)")
    p.add_argument("--channels-last", action="store_true", help="NHWC activations")
    p.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help="backend of the fused build")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device of all builds")
    p.add_argument("--tolerance", type=float, default=1e-2,
                   help="relative loss divergence always accepted (more is accepted up to 2x the fp64 noise floor)")
    p.add_argument("--no-fp64-reference", action="store_true", help="skip the float64 eager twin (noise floor)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batch order")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--soak", action="store_true",
                   help="long-run pass rule: mean loss over the last 10%% of steps within --tolerance-soak of "
                        "eager's (per-step trajectories separate chaotically over thousands of steps), and on "
                        "CUDA no growth of allocated memory after the warm-up steps")
    p.add_argument("--tolerance-soak", type=float, default=0.05,
                   help="relative tolerance of the tail-mean loss with --soak")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "image_size", "eval_size"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    for name, low, strict in (("lr", 0.0, True), ("momentum", 0.0, False), ("weight_decay", 0.0, False),
                              ("tolerance", 0.0, True), ("tolerance_soak", 0.0, True)):
        value = getattr(args, name)
        if not (value > low if strict else value >= low) or not math.isfinite(value):
            p.error(f"argument --{name.replace('_', '-')}: must be {'>' if strict else '≥'} {low:g}, got {value}")
    last = -(-(-(-args.image_size // 2)) // 2)  # the last stage's side: two stride-2 stages
    if args.data_dir is None and args.batch_size * last * last < 2:
        p.error(f"arguments --batch-size {args.batch_size} --image-size {args.image_size}: the last stage's "
                f"BatchNorm would see one value per channel ({args.batch_size} image of {last}×{last}); "
                "training needs more than one")
    problem = _device_problem(args.device)
    if problem:
        p.error(f"argument --device: {problem}")
    if args.backend != "auto":  # a forced backend that cannot serve the run's fp32 input: one line, up front
        import torch

        probe = torch.empty(2, 3, args.image_size, args.image_size, device=args.device)
        reasons = BACKENDS[args.backend].not_supported_reasons(probe)
        if reasons:
            p.error(f"argument --backend: {args.backend!r} cannot run here: {reasons[0].split(' (')[0]}"
                    + (f" (and {len(reasons) - 1} more reasons)" if len(reasons) > 1 else ""))
    if args.json:
        problem = unwritable_file(args.json)
        if problem:
            p.error(f"argument --json: {problem}")
    return args


def soak_passes(tail_rel_divergence: float, tolerance: float, growth_bytes: Optional[int]) -> bool:
    """The ``--soak`` pass rule: tail-mean loss divergence ≤ ``tolerance`` and, where measured (CUDA),
    device-memory growth after the warm-up ≤ 1 MiB."""
    return tail_rel_divergence <= tolerance and (growth_bytes is None or growth_bytes <= 2**20)


def _device_problem(text: str) -> Optional[str]:
    """Why ``--device`` cannot be used in this process (None if it can)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        return f"not a torch device ({e})"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"{text!r} needs CUDA, which this torch ({torch.__version__}) does not have"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"{text!r}: only {torch.cuda.device_count()} CUDA device(s)"
    elif device.type != "cpu":
        return f"device type {device.type!r} is not supported by the main job (cpu or cuda)"
    return None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device) -> Optional[int]:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _step(model, opt, x, y, device):
    """One SGD step; returns (loss, seconds, peak bytes above the step's starting allocation or None)."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    _sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return loss.item(), dt, peak


def run(args: argparse.Namespace) -> dict:
    """Train the builds in lockstep and compare them.

    Returns a dict: ``losses`` (per build, per-step fp32 training loss), ``max_rel_divergence``
    (largest |fused − eager|/|eager| over the steps, NaN if a step's loss is NaN:
    :func:`max_rel_divergence`), ``fp64_noise_floor`` (the same for eager fp32 vs the float64 twin, or
    None), ``eval`` / ``eval_rel_divergence`` / ``eval_fp64_noise_floor`` (test loss and accuracy in eval
    mode on the first ``eval_size`` test images), ``limit`` / ``eval_limit`` (the largest divergence
    accepted: ``max(tolerance, 2 × floor)``), ``median_step_ms`` (wall ms per step after 3 warm-up steps),
    ``peak_step_mem_bytes`` (CUDA: peak allocation above the step's start, bytes; None on CPU),
    ``fused_paths`` (backend that ran and any fallback reason), ``triton_interpret`` (the Triton kernels
    were built for Triton's interpreter), ``ok`` (the pass rule of the module docstring; a NaN divergence
    fails it), and the run's settings: ``batch_size`` is the batch used (``--batch-size`` capped at the
    training split; ``batch_size_requested`` the argument), ``eval_size`` likewise (capped at the test split).

    Raises:
        FileNotFoundError / ImportError: from the data loaders.
    """
    import torch
    import torch.nn.functional as F

    from fused_preact.experiments.data import load_cifar10, load_digits
    from fused_preact.models import preact_resnet_cifar
    from fused_preact.ops._common import triton_mode

    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        tqdm = None
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # a log file or pipe: plain lines, no bar between them
        tqdm = None

    device = torch.device(args.device)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    data = load_cifar10(args.data_dir) if args.data_dir else load_digits(args.image_size)
    torch.manual_seed(args.seed)
    eager = preact_resnet_cifar(args.depth, data.num_classes, fused=False).to(device)
    fused = preact_resnet_cifar(args.depth, data.num_classes, fused=True, backend=args.backend).to(device)
    fused.load_state_dict(eager.state_dict())
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    builds = {"eager": eager.to(memory_format=fmt), "fused": fused.to(memory_format=fmt)}
    if not args.no_fp64_reference:
        exact = preact_resnet_cifar(args.depth, data.num_classes, fused=False).to(device, torch.float64)
        exact.load_state_dict(eager.state_dict())
        builds["eager_fp64"] = exact.to(memory_format=fmt)
    opts = {
        name: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
        for name, m in builds.items()
    }
    gen = torch.Generator().manual_seed(args.seed)
    n = data.train_x.shape[0]
    order = torch.randperm(n, generator=gen)
    batch = min(args.batch_size, n)
    capped = f" (--batch-size {args.batch_size} capped at the {n}-image training split)" if batch < args.batch_size else ""
    print(f"data: {data.name}; model: PreActResNet-{args.depth} (CIFAR); batch {batch}{capped}; "
          f"{args.steps} steps; device {device}")

    losses = {name: [] for name in builds}
    times = {name: [] for name in builds}
    peaks = {name: [] for name in builds}
    allocated = []  # bytes allocated on the device after each step (all builds), CUDA only
    steps = range(args.steps)
    bar = tqdm(steps, desc="training", unit="step") if tqdm is not None else steps
    write = tqdm.write if tqdm is not None else print
    pos = 0
    for step in bar:
        if pos + batch > n:
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos:pos + batch]
        pos += batch
        x = data.train_x[idx].to(device).contiguous(memory_format=fmt)
        y = data.train_y[idx].to(device)
        for name, model in builds.items():
            xb = x.double() if name == "eager_fp64" else x
            loss, dt, peak = _step(model, opts[name], xb, y, device)
            losses[name].append(loss)
            times[name].append(dt)
            peaks[name].append(peak)
        allocated.append(_allocated(device))
        d = abs(losses["eager"][-1] - losses["fused"][-1])
        exact = f"  eager_fp64 {losses['eager_fp64'][-1]:.6f}" if "eager_fp64" in losses else ""
        write(f"step {step + 1:4d}/{args.steps}  loss eager {losses['eager'][-1]:.6f}  "
              f"fused {losses['fused'][-1]:.6f}  |diff| {d:.2e}{exact}")

    eval_loss = {}
    with torch.no_grad():
        tx = data.test_x[:args.eval_size].to(device).contiguous(memory_format=fmt)
        ty = data.test_y[:args.eval_size].to(device)
        for name, model in builds.items():
            model.eval()
            logits = model(tx.double() if name == "eager_fp64" else tx)
            eval_loss[name] = (F.cross_entropy(logits, ty).item(), (logits.argmax(1) == ty).float().mean().item())

    paths = sorted({(m.last_backend, m.fallback_reason) for m in fused.modules() if hasattr(m, "last_backend")},
                   key=str)
    def divergence(a: str, b: str) -> tuple[float, float]:
        return max_rel_divergence(losses[a], losses[b]), max_rel_divergence([eval_loss[a][0]], [eval_loss[b][0]])

    div, eval_div = divergence("fused", "eager")
    floor, eval_floor = divergence("eager", "eager_fp64") if "eager_fp64" in builds else (0.0, 0.0)
    warm = slice(min(3, max(args.steps - 1, 0)), None)
    result = {
        "data": data.name,
        "depth": args.depth,
        "steps": args.steps,
        "batch_size": batch,
        "batch_size_requested": args.batch_size,
        "device": str(device),
        "triton_interpret": triton_mode() == "interpreter",
        "fused_paths": [{"backend": b, "fallback_reason": r} for b, r in paths],
        "losses": losses,
        "max_rel_divergence": div,
        "eval": {k: {"loss": v[0], "accuracy": v[1]} for k, v in eval_loss.items()},
        "eval_rel_divergence": eval_div,
        "fp64_noise_floor": floor if "eager_fp64" in builds else None,
        "eval_fp64_noise_floor": eval_floor if "eager_fp64" in builds else None,
        "median_step_ms": {k: 1e3 * statistics.median(v[warm]) for k, v in times.items() if v},
        "peak_step_mem_bytes": {k: (max(v) if v and v[0] is not None else None) for k, v in peaks.items()},
        "tolerance": args.tolerance,
        "limit": max(args.tolerance, 2 * floor),
        "eval_limit": max(args.tolerance, 2 * eval_floor),
        "eval_size": int(tx.shape[0]),
    }
    tail = slice(-max(1, args.steps // 10), None)
    tail_mean = {k: statistics.fmean(v[tail]) for k, v in losses.items() if v}
    growth = (allocated[-1] - allocated[warm.start]) if allocated and allocated[-1] is not None else None
    result.update(
        tail_mean_loss=tail_mean,
        tail_rel_divergence=abs(tail_mean["fused"] - tail_mean["eager"]) / max(abs(tail_mean["eager"]), 1e-8),
        mem_growth_bytes=growth,
        soak=args.soak,
        tolerance_soak=args.tolerance_soak,
    )
    if args.soak:
        result["ok"] = soak_passes(result["tail_rel_divergence"], args.tolerance_soak, growth)
    else:
        result["ok"] = div <= result["limit"] and eval_div <= result["eval_limit"]
    return result


def _report(r: dict) -> None:
    print()
    for p in r["fused_paths"]:
        why = f" (fallback: {p['fallback_reason']})" if p["fallback_reason"] else ""
        mode = " through Triton's interpreter on CPU" if r["triton_interpret"] and p["backend"] == "triton" else ""
        print(f"fused build ran the {p['backend']} path{mode}{why}")
    floor = r["fp64_noise_floor"]
    floor_s = f"; eager fp32 vs float64 (noise floor): {floor:.3e}" if floor is not None else ""
    print(f"largest relative loss divergence fused vs eager over {r['steps']} steps: "
          f"{r['max_rel_divergence']:.3e}{floor_s}")
    for k, v in r["eval"].items():
        print(f"eval {k:10s}: test loss {v['loss']:.6f}  accuracy {100 * v['accuracy']:.1f}% ({r['eval_size']} images)")
    print(f"eval-mode test loss relative divergence fused vs eager: {r['eval_rel_divergence']:.3e}")
    for k in ("eager", "fused"):
        ms = r["median_step_ms"].get(k)
        mem = r["peak_step_mem_bytes"].get(k)
        mem_s = f"{mem / 2**20:.1f} MiB" if mem is not None else "n/a (CPU)"
        print(f"{k:5s}: median step {ms:.1f} ms, peak step memory {mem_s}")
    print(f"mean loss over the last 10% of steps: eager {r['tail_mean_loss']['eager']:.6f}, fused "
          f"{r['tail_mean_loss']['fused']:.6f} (relative {r['tail_rel_divergence']:.3e})")
    if r["mem_growth_bytes"] is not None:
        print(f"device memory allocated after the warm-up steps grew by {r['mem_growth_bytes']} bytes")
    if not r["device"].startswith("cuda"):
        ran = sorted({str(p["backend"]) for p in r["fused_paths"]})
        ran = [b + (" in Triton's interpreter" if b == "triton" and r["triton_interpret"] else "") for b in ran]
        print(f"note: these are CPU timings (the fused build ran {' and '.join(ran) or 'no fused module'}); "
              "they say nothing about GPU speed — run on a CUDA machine for timings.")
    for line in verdict(r):
        print(line)


def verdict(r: dict) -> list[str]:
    """The verdict of a :func:`run` result and, beside it, the pass rule with this run's numbers.

    Accuracies are printed above it but are not part of the rule: a few steps from random weights
    leave both builds near chance, and a small loss difference can move a test accuracy by points.
    """
    head = "OK: eager and fused trajectories match" if r["ok"] else "FAIL: eager and fused trajectories diverge"
    if r["soak"]:
        growth = r.get("mem_growth_bytes")
        memory = (f"device memory growth after the warm-up ≤ 1 MiB (this run: {growth} bytes)" if growth is not None
                  else "device memory not measured (CPU)")
        return [head, f"pass rule (--soak): tail-mean loss divergence {r['tail_rel_divergence']:.2e} ≤ "
                      f"{r['tolerance_soak']:.1e}; {memory}"]

    def rule(what: str, div: float, floor: Optional[float], limit: float) -> str:
        sign = "≤" if div <= limit else ">"
        floor_s = f"2 × float64 noise floor {floor:.2e}" if floor is not None else "no float64 twin"
        return f"  {what} {div:.2e} {sign} {limit:.2e} = max(tolerance {r['tolerance']:.1e}, {floor_s})"

    return [
        head,
        "pass rule: relative loss divergence fused vs eager ≤ max(--tolerance, 2 × noise floor), where the noise "
        "floor is eager fp32's divergence from its float64 twin; accuracies are not judged",
        rule("largest per-step training-loss divergence", r["max_rel_divergence"], r["fp64_noise_floor"], r["limit"]),
        rule("eval-mode test-loss divergence", r["eval_rel_divergence"], r["eval_fp64_noise_floor"], r["eval_limit"]),
    ]


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m fused_preact``; returns the process exit status (0 ok, 1 diverged).

    Raises:
        SystemExit: ``--help`` (status 0) or an invalid argument (status 2, argparse's usage message).
    """
    import torch

    cuda = torch.cuda.is_available()
    warning = None if cuda else enable_triton_interpreter()  # before parse_args, which builds the kernels
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    args = parse_args(argv, cuda)
    result = run(args)
    _report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1
