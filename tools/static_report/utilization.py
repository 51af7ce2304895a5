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
rows, a 3×3 wgrad's border rows whose tap falls into the padding) is taken as full. A compilation's
*replication* (:func:`dot_replication`, read from Triton's TTGIR) divides it further: where a dot's
result is smaller than the tile its warps' MMA layout covers, several warps compute the same
elements — Triton's mma.sync layouts (``warpsPerTileV2``) place warps beyond a result's 16×8 blocks
alike, and in a loop with several dots all of them along its larger dimension (M on a tie), so a
16×16 accumulator in 4 warps is computed 4 times (twice as a loop's only dot).

The *roofline excess* sets the useful bound against the memory traffic the launch cannot avoid:
``memory ratio`` m = (compulsory bytes / memory bandwidth) / (real MACs / tensor-core MAC rate), the
launch's memory time in units of its tensor time at the published peaks of :data:`PEAKS`; its roofline
time is ``max(1, m)`` of them, and ``max(useful bound, m) / max(1, m)`` is how far the SASS alone keeps
it above that (1: the loop's issue rate costs nothing over the roofline; both are lower bounds on
time, neither a measurement). Compulsory bytes: each activation tensor of the launch read or written
once (fprop: x, y and a residual; dgrad: dy, x — its ReLU mask —, the gradient it writes and the
residual's gradient it adds; wgrad: x and dy), of x only the pixels a strided 1×1 reads; weights,
per-channel vectors and fp32 partials (split-K's, dgrad's scratch) left out. Informational, as the
useful bound.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Optional, Sequence

from tools.static_report.loop_limits import variant_key

__all__ = ["mma_utilization", "dot_replication", "useful_bound", "useful_figures", "PEAKS", "memory_ratio",
           "roofline_figures"]

#: Published dense peaks per arch: (16-bit tensor-core MAC/s, TF32 MAC/s, memory bytes/s). sm_90: H100
#: SXM5 (989.4 bf16/fp16 TFLOP/s, 494.7 TF32, HBM3 3.35 TB/s); sm_80: A100 SXM4 80 GB (312, 156,
#: HBM2e 2.039 TB/s); NVIDIA's H100 and A100 datasheets. A MAC is two FLOPs.
PEAKS: dict[str, tuple[float, float, float]] = {
    "sm_90": (989.4e12 / 2, 494.7e12 / 2, 3.35e12),
    "sm_80": (312e12 / 2, 156e12 / 2, 2.039e12),
}


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
    # the staged-halo wgrad (RPI) has no BLOCK_N: its tile takes all of x's channels
    bm, bn, bk = int(kw["BLOCK_M"]), int(kw["BLOCK_N"] if "RPI" not in kw else kw["C"]), int(kw.get("BLOCK_K", 0) or 0)
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


_MMA_ALIAS = re.compile(r"^(#[\w.]+) = (#ttg\.nvidia_mma<\{[^}]*\}>)", re.M)
_DOT = re.compile(r"= (tt\.dot|ttng\.warp_group_dot) .*?-> tensor<((?:\d+x)+)\w+, (#[\w.]+)")


def dot_replication(ttgir: str) -> dict:
    """The MMA dots of a compilation's TTGIR (``CompiledKernel.asm["ttgir"]``) and how many warps compute
    each of their elements.

    A dot ``tt.dot`` (mma.sync, ``versionMajor = 2``) or ``ttng.warp_group_dot`` (wgmma, 3) with an
    ``M × N`` result (the last two dimensions) in an ``#ttg.nvidia_mma`` layout of ``warpsPerCTA = […,
    wm, wn]`` and ``instrShape = [16, n, …]`` covers ``wm·16`` rows and ``wn·n`` columns per repetition
    (16 rows per warp for both versions: a wgmma warpgroup is 4 warps of 16 rows); a result smaller
    than that is held, and multiplied, by ``wm·16/M`` (``wn·n/N``) warps alike. Returns ``{"dots":
    [{"op", "shape", "warps", "instr", "replication"}, …] (one per distinct dot), "replication": the
    largest (1 without dots), "unparsed": dots whose layout was not read}`` (a layout written inline
    rather than as an alias; Triton 3.9 writes aliases)."""
    layouts = dict(_MMA_ALIAS.findall(ttgir))
    dots, unparsed = [], 0
    for m in _DOT.finditer(ttgir):
        dims = [int(v) for v in m.group(2).rstrip("x").split("x")]
        lay = layouts.get(m.group(3), "")
        w = re.search(r"warpsPerCTA = \[([\d, ]+)\]", lay)
        i = re.search(r"instrShape = \[(\d+), (\d+)", lay)
        if len(dims) < 2 or not w or not i:
            unparsed += 1
            continue
        M, N = dims[-2:]
        wm, wn = (int(v) for v in w.group(1).split(",")[-2:])
        n = int(i.group(2))
        rep = max(1.0, wm * 16 / M) * max(1.0, wn * n / N)
        d = {"op": m.group(1), "shape": [M, N], "warps": [wm, wn], "instr": [int(i.group(1)), n], "replication": rep}
        if d not in dots:
            dots.append(d)
    return {"dots": dots, "replication": max([d["replication"] for d in dots], default=1.0), "unparsed": unparsed}


def memory_ratio(kernel: str, kw: Mapping, nbytes: Mapping[str, int], arch: str) -> Optional[float]:
    """A launch's compulsory memory time over its real MMA work's tensor time at ``arch``'s
    :data:`PEAKS` (module docstring); None for other kernels, a fused projection (fprop/dgrad
    ``HAS_PROJ``: its second GEMM is not counted here), an fp32 MMA without TF32, or an unknown arch.

    Args:
        kernel, kw: as :func:`mma_utilization` (``H``, ``W``, ``C``, ``P``, ``Q``, ``K``, ``R``, ``S``,
            ``GROUPS``, ``DOT_DTYPE``, ``INPUT_PRECISION``, ``HAS_RES``, ``HAS_PROJ``).
        nbytes: element size in bytes of the launch's tensor arguments by parameter name (``x_ptr``,
            ``y_ptr``, ``xin_ptr`` — fprop's residual —, ``dy_ptr``, ``out_ptr``, ``res_ptr`` — dgrad's
            residual gradient).
        arch: ``sm_90`` or ``sm_80``.
    """
    if kernel not in ("fprop", "dgrad", "wgrad", "wgrad_proj") or arch not in PEAKS or "H" not in kw or "P" not in kw:
        return None
    if kw.get("HAS_PROJ"):
        return None
    dot = str(kw.get("DOT_DTYPE", ""))
    sixteen = dot.endswith(("bfloat16", "float16")) or dot in ("bf16", "fp16")
    if not sixteen and str(kw.get("INPUT_PRECISION", "ieee")) == "ieee":
        return None
    mac16, mac32, bw = PEAKS[arch]
    H, W, C, P, Q, K = (int(kw[k]) for k in ("H", "W", "C", "P", "Q", "K"))
    macs = P * Q * K * C // int(kw.get("GROUPS", 1)) * int(kw.get("R", 1)) * int(kw.get("S", 1))
    R, S = int(kw.get("R", 1)), int(kw.get("S", 1))
    x_in, y_out = (P * Q * C if R == S == 1 else H * W * C), P * Q * K  # a strided 1×1 reads P·Q pixels
    if kernel == "fprop":
        traffic = x_in * nbytes["x_ptr"] + y_out * nbytes["y_ptr"]
        if kw.get("HAS_RES"):
            traffic += y_out * nbytes["xin_ptr"]
    elif kernel == "dgrad":
        traffic = y_out * nbytes["dy_ptr"] + x_in * nbytes["x_ptr"] + H * W * C * nbytes["out_ptr"]
        if kw.get("HAS_RES"):
            traffic += H * W * C * nbytes["res_ptr"]
    else:
        traffic = y_out * nbytes["dy_ptr"] + x_in * nbytes["x_ptr"]
    return (traffic / bw) / (macs / (mac16 if sixteen else mac32))


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


def roofline_figures(entries: Sequence[dict]) -> dict[str, dict]:
    """Per launch variant, the worst roofline excess ``max(b, m) / max(1, m)`` (module docstring) of
    its default configs over the layers where they are the default (b the useful bound, m the entry's
    ``mem_ratio`` at the layer), as ``{"excess": x, "layer": shape, "useful_bound": b, "memory_ratio":
    m}``, sorted worst first; variants without a memory ratio are left out."""
    worst: dict[str, dict] = {}
    for e in entries:
        lp, util, mem = e.get("loop"), e.get("mma_util"), e.get("mem_ratio")
        if "error" in e or not lp or not util or not mem:
            continue
        defaults = e.get("default_shapes", list(util))
        for shape, u in util.items():
            b, m = useful_bound(lp["issue_ratio"], u), mem.get(shape)
            if shape not in defaults or b is None or m is None:
                continue
            x = max(b, m) / max(1.0, m)
            key = variant_key(e)
            if key not in worst or x > worst[key]["excess"]:
                worst[key] = {"excess": round(x, 3), "layer": shape, "useful_bound": round(b, 3),
                              "memory_ratio": round(m, 3)}
    return dict(sorted(worst.items(), key=lambda kv: -kv[1]["excess"]))
