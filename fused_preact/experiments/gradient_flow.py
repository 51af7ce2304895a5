"""Gradient-flow diagnostics: per-residual-block gradient norms for one batch, a plot, and a CLI.

He, Zhang, Ren, Sun, "Identity Mappings in Deep Residual Networks" (ECCV 2016) argue from
Eq. (4)–(5) that with identity shortcuts and identity after-addition activation the gradient
``∂E/∂x_l = ∂E/∂x_L · (1 + ∂/∂x_l Σ F)`` reaches every unit undiminished, while the original
(post-activation) unit and the non-identity shortcuts of §3 (Eq. (6)–(8)) attenuate or amplify it
along depth. :func:`gradient_flow` measures that for one batch: for every residual block, the
norm of the loss gradient at the block's output (and input), and ‖∇W‖ and ‖∇W‖/‖W‖ over the block's
conv weights. :func:`plot_gradient_flow` draws the curves of several models into one PNG.

Command line (``python -m fused_preact.experiments.gradient_flow --help``)::

    python -m fused_preact.experiments.gradient_flow --depth 164 1001 --units original full_preact \\
        --batch 8 --out gradflow.png --json gradflow.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.cli_types import int_at_least, unwritable_file

__all__ = ["METRICS", "residual_blocks", "gradient_flow", "plot_gradient_flow", "parse_args", "run", "main"]

_LAYER = re.compile(r"layer(\d+)$")

#: The per-block fields :func:`gradient_flow` returns (besides name, stage, index, type).
METRICS = ("grad_output_norm", "grad_input_norm", "weight_grad_norm", "weight_norm", "grad_weight_ratio")


def residual_blocks(model: nn.Module) -> list[tuple[str, int, int, nn.Module]]:
    """The residual blocks of ``model``, in forward order: ``(name, stage, index, module)``.

    Blocks are the children of the model's ``layer1``, ``layer2``, … ``nn.Sequential`` attributes
    (the layout of every network in :mod:`fused_preact.models` and :mod:`fused_preact.experiments.variants`);
    ``name`` is the dotted module name (``"layer2.0"``), ``stage`` the 1-based stage number and
    ``index`` the 0-based position in the stage.

    Raises:
        ValueError: the model has no ``layerN`` Sequential child.
    """
    stages = []
    for name, child in model.named_children():
        m = _LAYER.match(name)
        if m and isinstance(child, nn.Sequential):
            stages.append((int(m.group(1)), name, child))
    if not stages:
        raise ValueError(f"{type(model).__name__} has no 'layerN' nn.Sequential children to take residual blocks from")
    return [(f"{name}.{j}", stage, j, block) for stage, name, seq in sorted(stages) for j, block in enumerate(seq)]


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def gradient_flow(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> list[dict]:
    """Per-block gradient statistics of ``loss_fn(model(x), y)`` for one batch.

    The model runs in its current mode (call ``model.train()`` for training-time gradients, the
    usual case: BN uses batch statistics). Gradients come from ``torch.autograd.grad``, so the
    parameters' ``.grad`` are left untouched, and the BatchNorm running statistics the forward
    updates are restored afterwards: the call has no side effect on the model (a stochastic
    shortcut such as dropout does consume the RNG).

    Args:
        model: a network with ``layer1``, ``layer2``, … Sequentials of residual blocks (any model of
            :mod:`fused_preact.models` or :mod:`fused_preact.experiments.variants`, fused or eager).
        x: (N, 3, H, W) floating input on the model's device and in its dtype.
        y: targets for ``loss_fn`` (class indices (N,) int64 for the default cross-entropy).
        loss_fn: ``loss_fn(logits, y)`` → scalar tensor.

    Returns:
        One dict per residual block, in forward order, with keys ``name`` (``"layer1.0"``),
        ``stage`` (1-based), ``index`` (0-based in its stage), ``type`` (class name) and the floats
        ``grad_output_norm`` ‖∂L/∂x_{l+1}‖ (gradient at the block's output), ``grad_input_norm``
        ‖∂L/∂x_l‖ (at its input; NaN if the input does not require grad), ``weight_grad_norm``
        ‖∇W‖ and ``weight_norm`` ‖W‖ over all the block's ``nn.Conv2d`` weights together (Frobenius
        norms, computed in float64), and ``grad_weight_ratio`` ‖∇W‖/‖W‖.

    Raises:
        ValueError: the model has no ``layerN`` blocks, or the loss is not a scalar.
        RuntimeError: from the forward pass (shape or dtype mismatch).
    """
    blocks = residual_blocks(model)
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def fn(module, args, output):
            captured[i] = (args[0], output)
        return fn

    convs = [[m.weight for m in b.modules() if isinstance(m, nn.Conv2d)] for _, _, _, b in blocks]
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    handles = [b.register_forward_hook(hook(i)) for i, (_, _, _, b) in enumerate(blocks)]
    try:
        with torch.enable_grad():
            loss = loss_fn(model(x), y)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
        acts = [captured[i][k] for k in (1, 0) for i in range(len(blocks))]
        targets = [t for t in acts if t.requires_grad] + [w for ws in convs for w in ws if w.requires_grad]
        grads = iter(torch.autograd.grad(loss, targets, allow_unused=True))
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    g_act = [next(grads) if t.requires_grad else None for t in acts]
    g_out, g_in = g_act[:len(blocks)], g_act[len(blocks):]
    g_w = {id(w): next(grads) for ws in convs for w in ws if w.requires_grad}
    results = []
    for i, (name, stage, index, block) in enumerate(blocks):
        wg = [g for g in (g_w.get(id(w)) for w in convs[i]) if g is not None]
        w_norm = _norm(convs[i])
        wg_norm = _norm(wg)
        results.append({
            "name": name,
            "stage": stage,
            "index": index,
            "type": type(block).__name__,
            "grad_output_norm": _norm([g_out[i]]) if g_out[i] is not None else 0.0,
            "grad_input_norm": _norm([g_in[i]]) if g_in[i] is not None else float("nan"),
            "weight_grad_norm": wg_norm,
            "weight_norm": w_norm,
            "grad_weight_ratio": wg_norm / w_norm if w_norm > 0 else float("nan"),
        })
    return results


def plot_gradient_flow(results: dict[str, list[dict]], path: str, title: Optional[str] = None) -> str:
    """Write a PNG comparing gradient flow across models.

    Two log-scale panels against block position (0 = first residual block; relative depth 0…1
    when the models have different numbers of blocks): the gradient norm at each block's output
    and ‖∇W‖/‖W‖ of its conv weights; one line per model, stage boundaries as light vertical
    lines. Uses matplotlib's Agg canvas directly (no pyplot, no global backend change);
    matplotlib is imported here only.

    Args:
        results: label → the list :func:`gradient_flow` returned for that model.
        path: the PNG file to write (parent folders must exist).
        title: figure title (default: "Gradient flow per residual block (He et al. 2016, Eq. (5))").

    Returns:
        ``path``.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_gradient_flow needs at least one model's results")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_gradient_flow needs matplotlib: pip install 'fused_preact[diagnostics]' (or 'matplotlib>=3.7')"
        ) from e
    fig = Figure(figsize=(12, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    relative = len({len(rows) for rows in results.values()}) > 1
    panels = (("grad_output_norm", "‖∂L/∂x‖ at block output"),
              ("grad_weight_ratio", "‖∇W‖ / ‖W‖ (conv weights)"))
    for ax, (key, ylabel) in zip(axes, panels):
        for label, rows in results.items():
            scale = 1.0 / max(len(rows) - 1, 1) if relative else 1.0
            ax.plot([j * scale for j in range(len(rows))], [r[key] for r in rows], label=label, linewidth=1.2)
            for j in range(1, len(rows)):
                if rows[j]["stage"] != rows[j - 1]["stage"]:
                    ax.axvline((j - 0.5) * scale, color="0.85", linewidth=0.6, zorder=0)
        if any(r[key] > 0 for rows in results.values() for r in rows):
            ax.set_yscale("log")
        ax.set_xlabel("relative depth (0 = first block, 1 = last)" if relative else "residual block (forward order)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Gradient flow per residual block (He et al. 2016, Eq. (5))")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line arguments of ``python -m fused_preact.experiments.gradient_flow``. Builds nothing:
    the Triton kernels are not imported here (``main`` sets ``TRITON_INTERPRET`` afterwards).

    Raises:
        SystemExit: ``--help`` (status 0), or an invalid argument (status 2, argparse's usage message):
            a depth that does not fit the unit form (``--bottleneck``), a count below 1.
    """
    from fused_preact.experiments.variants import SHORTCUTS, UNITS, _units_per_stage

    p = argparse.ArgumentParser(
        prog="python -m fused_preact.experiments.gradient_flow",
        description="Per-block gradient norms and ||grad W||/||W|| of CIFAR ResNet variants for one batch "
                    "(He et al. 2016), printed as a table and optionally plotted to a PNG.",
        epilog="Models are built eager (fused=False) unless --fused is given: the eager build computes the same "
               "math as the fused one, and without CUDA the fused Triton kernels would run through Triton's "
               "slow interpreter (TRITON_INTERPRET=1 is then set automatically).",
    )
    p.add_argument("--depth", type=int, nargs="+", default=[164], help="CIFAR depth(s): 6n+2 or 9n+2 (default 164)")
    p.add_argument("--units", nargs="+", default=["original", "full_preact"], choices=UNITS, metavar="UNIT",
                   help=f"residual units to compare, of: {', '.join(UNITS)} (default: original full_preact)")
    p.add_argument("--shortcuts", nargs="+", default=["identity"], choices=SHORTCUTS, metavar="SHORTCUT",
                   help=f"shortcuts, of: {', '.join(SHORTCUTS)} (default: identity)")
    p.add_argument("--bottleneck", choices=["auto", "yes", "no"], default="auto",
                   help="unit form (default auto: bottleneck exactly when depth >= 164)")
    p.add_argument("--batch", type=int_at_least(1), default=8, help="batch size (default 8)")
    p.add_argument("--image-size", type=int_at_least(1), default=32, help="input height and width (default 32)")
    p.add_argument("--data", choices=["random", "digits"], default="random",
                   help="random: seeded N(0,1) CIFAR-sized images and labels; digits: scikit-learn's bundled digits")
    p.add_argument("--num-classes", type=int_at_least(1), default=10)
    p.add_argument("--seed", type=int, default=0, help="seed for data and weights (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--fused", action="store_true",
                   help="build the fused model for full_preact+identity (default: eager, same math)")
    p.add_argument("--out", help="write the plot to this PNG (needs matplotlib)")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--rows", type=int_at_least(1), default=24, help="table rows per model (evenly spaced blocks; default 24)")
    args = p.parse_args(argv)
    for depth in args.depth:
        bottleneck = {"yes": True, "no": False}.get(args.bottleneck, depth >= 164)
        try:
            _units_per_stage(depth, bottleneck)
        except ValueError as e:
            examples = ("11, 20, 29, 56, 110, 164, 1001 (9n+2) with bottlenecks" if bottleneck
                        else "8, 14, 20, 56, 110 (6n+2) with basic blocks")
            p.error(f"argument --depth: {e} (e.g. {examples})")
    from fused_preact.experiments.main_job import _device_problem

    problem = _device_problem(args.device)
    if problem:
        p.error(f"argument --device: {problem}")
    for name in ("json", "out"):
        if getattr(args, name):
            problem = unwritable_file(getattr(args, name))
            if problem:
                p.error(f"argument --{name}: {problem}")
    return args


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    if args.data == "digits":
        from fused_preact.experiments.data import load_digits

        data = load_digits(args.image_size)
        idx = torch.randperm(data.train_x.shape[0], generator=gen)[:args.batch]
        return data.train_x[idx], data.train_y[idx] % args.num_classes
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen)
    return x, torch.randint(0, args.num_classes, (args.batch,), generator=gen)


def run(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Build every depth × unit × shortcut model, measure :func:`gradient_flow` on one batch.

    Every model is seeded with ``args.seed`` before construction and sees the same batch. Returns
    label (``"<unit>+<shortcut> d<depth>"``) → per-block results. Prints, for each fused build, the
    backends its modules ran (and any fallback reason).

    Raises:
        ValueError: an invalid depth. ImportError: ``--data digits`` without scikit-learn.
    """
    from fused_preact.experiments.variants import preact_resnet_cifar_variant

    device = torch.device(args.device)
    x, y = _batch(args)
    x, y = x.to(device), y.to(device)
    bottleneck = {"auto": None, "yes": True, "no": False}[args.bottleneck]
    results: dict[str, list[dict]] = {}
    for depth in args.depth:
        for unit in args.units:
            for shortcut in args.shortcuts:
                torch.manual_seed(args.seed)
                fused = None if args.fused else False
                model = preact_resnet_cifar_variant(depth, unit, shortcut, args.num_classes, bottleneck, fused=fused)
                model.to(device).train()
                label = f"{unit}+{shortcut} d{depth}"
                results[label] = gradient_flow(model, x, y)
                ran = sorted({(str(m.last_backend), m.fallback_reason or "") for m in model.modules()
                              if hasattr(m, "last_backend")})
                if ran:
                    print(f"{label}: fused modules ran " + "; ".join(b + (f" (fallback: {r})" if r else "") for b, r in ran))
    return results


def _table(results: dict[str, list[dict]], rows: int) -> str:
    lines = []
    for label, res in results.items():
        step = max(1, math.ceil(len(res) / max(rows, 1)))
        shown = sorted(set(range(0, len(res), step)) | {len(res) - 1})
        lines.append(f"\n{label}: {len(res)} residual blocks")
        lines.append(f"{'block':>12} {'stage':>5} {'|dL/dx_out|':>12} {'|dL/dx_in|':>12} {'|gradW|':>11} "
                     f"{'|W|':>9} {'|gradW|/|W|':>12}")
        for i in shown:
            r = res[i]
            lines.append(f"{r['name']:>12} {r['stage']:>5} {r['grad_output_norm']:12.4e} {r['grad_input_norm']:12.4e} "
                         f"{r['weight_grad_norm']:11.4e} {r['weight_norm']:9.3f} {r['grad_weight_ratio']:12.4e}")
        first, last = res[0]["grad_input_norm"], res[-1]["grad_output_norm"]
        if last > 0 and math.isfinite(first):
            lines.append(f"{'':>12} gradient at first block input / at last block output: {first / last:.4g}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m fused_preact.experiments.gradient_flow``; returns the exit status (0 on success)."""
    from fused_preact.experiments.main_job import enable_triton_interpreter

    args = parse_args(argv)
    if args.fused and not torch.cuda.is_available():
        warning = enable_triton_interpreter()  # before run(), which builds the kernels
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    results = run(args)
    build = "fused where available" if args.fused else "eager (fused=False)"
    print(f"gradient flow, one batch of {args.batch} ({args.data} data, {args.image_size}x{args.image_size}), "
          f"models built {build}, device {args.device}")
    print(_table(results, args.rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.out:
        plot_gradient_flow(results, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
