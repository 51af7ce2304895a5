"""MMA utilization of a convolution launch: the fraction of its main loop's tensor-core work that
multiplies real operands, not the zeros that pad a tile's channels to the tile's size.

The issue ratio (:mod:`tools.static_report.loop_limits`) divides a loop's instructions by the tensor
clocks of *all* its MMAs, padding included: a wgrad tile of 64 input channels over a 16-channel layer
(wgmma's M is 64 per warpgroup) counts four times the tensor clocks it needs, so its ratio looks four
times better than the work it does. The *useful bound* puts the two together: ``max(issue ratio, 1) /
utilization`` is a lower bound on the loop's time in units of the tensor-core time of its real MMA work
(1 for a tensor-bound loop without padding; the issue-bound time ``instructions`` over the useful
tensor clocks when the ratio is above 1). Informational: ``--check`` does not read it.

Counted per launch from its tile (``BLOCK_*``, dgrad's ``SLOTS``) and its layer (``C``, ``K``,
``GROUPS``, ``S``, strides), along the MMA's channel dimensions; the pixel dimension (the last tile of
rows, a 3×3 wgrad's border rows whose tap falls into the padding) is taken as full.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from tools.static_report.loop_limits import variant_key

__all__ = ["mma_utilization", "useful_bound", "useful_figures"]


def _fill(n: int, block: int) -> float:
    """The fraction of ``ceil(n / block)`` blocks of ``block`` that ``n`` fills."""
    return n / (math.ceil(n / block) * block)


def _phase_taps(S: int, stride: int, pad: int) -> float:
    """dgrad by phases (stride > 1, no dilation): the taps along a filter row that reach a phase's
    pixels, averaged over the ``stride`` phases (``(pw + pad) % stride`` is the phase's first tap)."""
    return sum(math.ceil((S - (pw + pad) % stride) / stride) for pw in range(stride)) / stride


def mma_utilization(kernel: str, kw: Mapping) -> Optional[float]:
    """The real fraction of the main loop's MMA work of a launch of ``kernel`` (``fprop``, ``dgrad``,
    ``wgrad``, ``wgrad_proj``; its launch keywords ``kw``: the layer's geometry and the tile), in (0, 1];
    None for other kernels or keywords without a geometry.

    - fprop: output channels per group over BLOCK_N times input channels per group over BLOCK_K (one
      tap per step).
    - dgrad: input channels per group over BLOCK_N times the reduction step's real width: output
      channels per group over BLOCK_K, or with SLOTS > 1 a filter row's taps (for phases: averaged over
      the phases) of them over the step's SLOTS slots.
    - wgrad: input channels per group over BLOCK_N (the MMA's M) times output channels per group over
      BLOCK_M (its N).
    """
    if kernel not in ("fprop", "dgrad", "wgrad", "wgrad_proj") or "C" not in kw or "K" not in kw:
        return None
    groups = int(kw.get("GROUPS", 1))
    Cg, Kg = int(kw["C"]) // groups, int(kw["K"]) // groups
    bm, bn, bk = int(kw["BLOCK_M"]), int(kw["BLOCK_N"]), int(kw.get("BLOCK_K", 0) or 0)
    if kernel == "fprop":
        return _fill(Kg, bn) * _fill(Cg, bk)
    if kernel == "dgrad":
        slots = int(kw.get("SLOTS", 1))
        if slots <= 1:
            return _fill(Cg, bn) * _fill(Kg, bk)
        S, stride_w = int(kw["S"]), int(kw["STRIDE_W"])
        phased = (int(kw["STRIDE_H"]) > 1 or stride_w > 1) and int(kw["DIL_H"]) == 1 and int(kw["DIL_W"]) == 1
        taps = _phase_taps(S, stride_w, int(kw["PAD_W"])) if phased else S
        return _fill(Cg, bn) * min(taps, slots) * min(Kg, bk // slots) / bk
    return _fill(Cg, bn) * _fill(Kg, bm)


def useful_bound(issue_ratio: Optional[float], utilization: Optional[float]) -> Optional[float]:
    """``max(issue_ratio, 1) / utilization`` (module docstring); None where either is unknown."""
    if issue_ratio is None or not utilization:
        return None
    return max(issue_ratio, 1.0) / utilization


def useful_figures(entries: Sequence[dict]) -> dict[str, dict]:
    """Per launch variant (:func:`~tools.static_report.loop_limits.variant_key`) of the entries with a
    main loop and ``mma_util``: the worst useful bound of its default configs over the layers — each
    compilation at the layers where it is the default (``default_shapes``; all of ``mma_util``'s
    without it) — as ``{"default": bound, "layer": shape, "utilization": u, "issue_ratio": r}``,
    sorted worst first."""
    worst: dict[str, dict] = {}
    for e in entries:
        lp, util = e.get("loop"), e.get("mma_util")
        if "error" in e or not lp or not util:
            continue
        defaults = e.get("default_shapes", list(util))
        for shape, u in util.items():
            if shape not in defaults:
                continue
            b = useful_bound(lp["issue_ratio"], u)
            key = variant_key(e)
            if b is not None and (key not in worst or b > worst[key]["default"]):
                worst[key] = {"default": round(b, 3), "layer": shape, "utilization": u,
                              "issue_ratio": lp["issue_ratio"]}
    return dict(sorted(worst.items(), key=lambda kv: -kv[1]["default"]))
