"""Tile rules of the Triton backend: default tiles per kernel, the pruned autotune spaces, the
wgrad split-K rule, the per-unit launch geometry (:class:`UnitPlan`) and layout helpers.

Every config here is one the static SASS report (``python -m tools.static_report``) compiles for
sm_90 and sm_80; CI fails when one of them spills. The figures behind each rule: docs/tiles.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional

import torch

from fused_preact.ops._common import interpreting, nhwc_strides_of, triton
from fused_preact.ops.dtypes import traits
from fused_preact.ops.spec import BNMode, ConvGeom
from fused_preact.ops.triton_compat import tile_override

__all__ = ["GemmConfig", "UnitPlan", "fprop_config", "fprop_unroll", "wgrad_unroll", "quad_channels", "dgrad_slots",
           "dgrad_config", "wgrad_config", "candidates", "wgrad_split", "split_for", "arch_of", "p2", "contig_nhwc",
           "out_strides", "nhwc_strides_of", "is_channels_last", "INTERP_SUM_ROWS", "FOLD_BLOCK",
           "one_step_tile", "LOOP_FREE", "halo_fprop", "halo_config", "halo_sync_config", "halo_rows", "halo_geometry",
           "HALO_CHANNELS", "HALO_MAX_STAGED", "for_this_triton"]

#: Rows per statistics tile under the interpreter: its sums are sequential in fp32, so tiles stay short.
INTERP_SUM_ROWS = 4096
#: Weight-gradient entries per program of the split-K fold.
FOLD_BLOCK = 1024
#: Loop-free one-step launches (:func:`one_step_tile`); ``FUSED_PREACT_LOOP_FREE=0`` (read at import)
#: keeps every reduction in its loop, to time the two against each other on a GPU.
LOOP_FREE = os.environ.get("FUSED_PREACT_LOOP_FREE", "1") != "0"


def p2(n: int, lo: int, hi: int) -> int:
    """The power of two ≥ ``n``, clamped to ``[lo, hi]``."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options of one implicit-GEMM kernel (blocks are powers of two ≥ 16; ``unroll``: fprop's or
    wgrad's main loop unrolled by that factor, see :func:`fprop_unroll` and :func:`wgrad_unroll`; ``slots``: dgrad's
    taps per reduction step, see :func:`dgrad_slots`; ``halo``: fprop through the staged halo of :mod:`.kernels_halo`,
    see :func:`halo_fprop`)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3
    unroll: int = 1
    slots: int = 1
    halo: bool = False

    def label(self) -> str:
        u = f"_u{self.unroll}" if self.unroll != 1 else ""
        t = f"_t{self.slots}" if self.slots != 1 else ""
        h = "_h" if self.halo else ""
        return f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}_w{self.num_warps}_s{self.num_stages}{u}{t}{h}"


def one_step_tile(cfg: GemmConfig) -> bool:
    """Whether a fprop or dgrad tile may drop its reduction loop where the layer's channels fit one iteration
    (``STEPS``): up to 128×64×32 MACs per step; any tile under the interpreter, none with :data:`LOOP_FREE` off.
    Loop-free, Triton loads operands via registers: larger tiles reach the 255-register limit and spill. Measurements:
    docs/tiles.md."""
    return LOOP_FREE and (interpreting() or cfg.BLOCK_M * cfg.BLOCK_N * cfg.BLOCK_K <= 128 * 64 * 32)


def fprop_unroll(cfg: GemmConfig, dtype: torch.dtype, arch: int, taps: int = 1, proj: bool = False) -> GemmConfig:
    """``cfg`` with fprop's main loop unrolled twice into two accumulators (``kernels_fprop``'s UNROLL) and one pipeline
    stage less (at least 2), for 16-bit compute: on sm_90 (``arch`` ≥ 90) output tiles of at most 64×64 or 16-deep
    reduction steps, on sm_80 output tiles at most 32 channels wide (larger ones spill unrolled); on sm_90 fp16's
    64×64×64 tile of several taps (``taps`` = R·S) beside a projection shortcut (``proj``) in 2 stages. Two accumulators
    keep each other's wgmma in flight and spread each step's fixed costs. Measurements: docs/tiles.md."""
    if interpreting() or not traits(dtype).mma16 or arch < 80:
        return cfg
    if arch >= 90:
        fits = cfg.BLOCK_M * cfg.BLOCK_N <= 64 * 64 or cfg.BLOCK_K == 16
        if dtype == torch.float16 and taps > 1 and proj and cfg.BLOCK_M * cfg.BLOCK_N * cfg.BLOCK_K == 64 * 64 * 64:
            return dataclasses.replace(cfg, unroll=2, num_stages=2)
    else:
        fits = cfg.BLOCK_N <= 32
    if fits:
        return dataclasses.replace(cfg, unroll=2, num_stages=max(2, cfg.num_stages - 1))
    return cfg


def quad_channels(x_dtype: torch.dtype, cdtype: torch.dtype, Cg: int) -> bool:
    """Whether fprop takes its input channels in quads (``kernels_fprop._quad_cols``; ``plan.mma_weight`` orders the
    filter alike): fp32 activations under 16-bit compute (autocast's first conv; fewer shared-memory loads per element)
    and ``Cg`` (channels per group) a multiple of 16 above 16. Measurements: docs/tiles.md."""
    return x_dtype == torch.float32 and traits(cdtype).mma16 and Cg % 16 == 0 and Cg > 16


def for_this_triton(kind: str, cfg: GemmConfig, dtype: torch.dtype, arch: int,
                    default: bool = True) -> Optional[GemmConfig]:
    """``cfg`` as the installed Triton compiles it without spills
    (:data:`fused_preact.ops.triton_compat.TILE_OVERRIDES`, read for ``arch``'s family: 90 from sm_90 on, else 80): a
    listed default takes its replacement; a listed candidate (``default`` False) is dropped (None) unless a replacement
    is listed."""
    if arch < 80 or interpreting():
        return cfg
    family = 90 if arch >= 90 else 80  # the table, like the tile rules, by family: sm_86/89 as sm_80
    listed, change = tile_override(kind, family, traits(dtype).name, cfg.label())
    if not listed:
        return cfg
    if change is None:
        return cfg if default else None
    return dataclasses.replace(cfg, **change)


def fprop_config(M: int, Kg: int, Cg: int, dtype: torch.dtype, stats: bool, arch: int = 0,
                 x32: bool = False, taps: int = 1, proj: bool = False, halo: bool = False) -> GemmConfig:
    """:func:`_fprop_config` for the installed Triton (:func:`for_this_triton`)."""
    return for_this_triton("fprop", _fprop_config(M, Kg, Cg, dtype, stats, arch, x32, taps, proj, halo), dtype, arch)


def _fprop_config(M: int, Kg: int, Cg: int, dtype: torch.dtype, stats: bool, arch: int = 0,
                  x32: bool = False, taps: int = 1, proj: bool = False, halo: bool = False) -> GemmConfig:
    """Default fprop tiles for an (M × Cg·R·S)·(… × Kg) implicit GEMM (M = N·P·Q output pixels). 16-bit: 4 warps (one
    warpgroup; 8 add a barrier per iteration), 128×64 up to Kg = 64 and 64×128 from Kg = 128 (64×256 spills), 64 rows
    for M < 1024 and on sm_90 for a 128×64×64 tile of several taps (``taps`` = R·S) reading fp32 activations (``x32``),
    which spills; more rows over ≤ 16 channels (:func:`_narrow_fprop_rows`), the staged halo where ``halo``
    (:func:`halo_geometry`) and :func:`halo_fprop` admit it, unrolled by :func:`fprop_unroll` (``proj``: a projection
    shortcut beside it). fp32 operands (TF32 MMA): 64×64 tiles. Measurements: docs/tiles.md."""
    if interpreting():
        return GemmConfig(p2(M, 16, INTERP_SUM_ROWS if stats else 4096), p2(Kg, 16, 256), p2(Cg, 16, 256))
    if not traits(dtype).mma16:
        return GemmConfig(64, p2(Kg, 16, 64), p2(Cg, 16, 32), 4, 4)
    block_n = 128 if Kg >= 128 else p2(Kg, 16, 64)
    block_m = 64 if block_n == 128 or M < 8 * 128 else 128
    block_k = p2(Cg, 16, 64)
    if x32 and taps > 1 and arch >= 90 and block_n == 64 and block_k == 64:
        block_m = 64
    if halo and halo_fprop(M, Kg, Cg, dtype, arch, taps, proj):
        return halo_config(Kg, Cg, arch)
    block_m = _narrow_fprop_rows(M, Kg, Cg, arch, x32) or block_m
    return fprop_unroll(GemmConfig(block_m, block_n, block_k, 4, 3 if block_k == 64 else 4), dtype, arch, taps, proj)


#: Input channels (per group) the staged-halo fprop takes: one chunk of the MMA's K.
HALO_CHANNELS = (16, 32)


def halo_fprop(M: int, Kg: int, Cg: int, dtype: torch.dtype, arch: int, taps: int = 1, proj: bool = False) -> bool:
    """Whether fprop runs through the staged halo (:mod:`.kernels_halo`) for a conv whose geometry admits it
    (:func:`halo_geometry`: :func:`fprop_config`'s ``halo``): 16-bit compute on sm_80 or later, several taps (``taps``),
    Cg in :data:`HALO_CHANNELS`, Kg ≤ 32, no projection shortcut (``proj``), M filling 8 tiles. The implicit GEMM there
    transforms each input element once per tap for only Kg MACs. Measurements: docs/tiles.md."""
    rows = halo_config(Kg, Cg, arch).BLOCK_M if arch >= 80 else 0
    return (traits(dtype).mma16 and arch >= 80 and taps > 1 and Cg in HALO_CHANNELS
            and Kg <= 32 and not proj and M >= 8 * rows)


#: Staged pixels a halo fprop may hold, per input pixel (all programs together): 3, so the buffer stays
#: within three times the input and a stride-1 tile transforms at most 3 pixels per output pixel.
HALO_MAX_STAGED = 3


def halo_geometry(g: ConvGeom, in_shape, out_shape, arch: int, rows: int = 0) -> bool:
    """Whether a conv's geometry admits the staged-halo fprop (:func:`fprop_config`'s ``halo``): groups 1, at most 3
    taps per filter row (a row's taps share the loop's shared memory), and a staging buffer of
    ``cdiv(M, rows)·halo_rows`` pixels at most :data:`HALO_MAX_STAGED` times the input's N·H·W (wide rows or dilation
    stage more than a tile outputs). ``rows``: output pixels per tile (0: :func:`halo_config`'s). Measurements:
    docs/tiles.md."""
    N, C, H, W = in_shape
    K = out_shape[1]
    if g.groups != 1 or g.kernel[1] > 3:
        return False
    rows = rows or halo_config(K, C, arch).BLOCK_M
    tiles = triton.cdiv(N * out_shape[2] * out_shape[3], rows)
    return tiles * halo_rows(in_shape, out_shape, g, rows) <= HALO_MAX_STAGED * N * H * W


def halo_config(Kg: int, Cg: int, arch: int) -> GemmConfig:
    """The staged-halo fprop's tile: all Kg ≤ 32 output channels, BLOCK_K = Cg; 256 rows for 16 × 16 channels, else 128
    (256 × 32 spills); 3 stages on sm_90, 2 on sm_80 (a third slows its loop). Measurements: docs/tiles.md."""
    n = p2(Kg, 16, 32)
    return GemmConfig(256 if n * Cg <= 16 * 16 else 128, n, Cg, 4, 3 if arch >= 90 else 2, halo=True)


def halo_sync_config(Kg: int, Cg: int, arch: int) -> Optional[GemmConfig]:
    """The staged-halo fprop's mma.sync tile, an autotune candidate beside :func:`halo_config`'s wgmma tile on sm_90 for
    16 × 16 channels (None elsewhere): 128 rows over 2 warps, 2 stages. Which loop is shorter depends on Hopper's
    unpublished mma.sync rate, so the tuner times both; the wgmma tile stays the default. Measurements: docs/tiles.md."""
    if arch >= 90 and p2(Kg, 16, 32) == 16 and Cg == 16:
        return GemmConfig(128, 16, 16, 2, 2, halo=True)
    return None


def halo_rows(in_shape, out_shape, g: ConvGeom, block_m: int) -> int:
    """Staged rows per program of the halo fprop: an upper bound, over its tiles of ``block_m`` consecutive output
    pixels (tile i from pixel i·block_m), of the span of padded input pixels (index ``(n·Hp + hp)·Wp + wp``, Hp = H +
    2·pad_h, Wp = W + 2·pad_w) from a tile's first output pixel's top-left tap to its last pixel's bottom-right one,
    inclusive: each step to the next output pixel adds stride_w, each output row the tile crosses
    ``stride_h·Wp − Q·stride_w`` more, each image ``(Hp − P·stride_h)·Wp`` more (counted where positive), and a tile
    starting at pixel m0 crosses at most ``(block_m − 1 + (m0 mod Q)) // Q`` rows, m0 mod Q being a multiple of
    gcd(block_m, Q) — likewise for images of P·Q pixels."""
    _, _, H, W = in_shape
    _, _, P, Q = out_shape
    (R, S), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.stride, g.padding, g.dilation
    Hp, Wp = H + 2 * ph, W + 2 * pw
    span = block_m - 1
    rows = (span + Q - math.gcd(block_m, Q)) // Q
    images = (span + P * Q - math.gcd(block_m, P * Q)) // (P * Q)
    return (span * sw + rows * max(0, sh * Wp - Q * sw) + images * max(0, (Hp - P * sh) * Wp)
            + (R - 1) * dh * Wp + (S - 1) * dw + 1)


def halo_wgrad(Kg: int, Cg: int, dtype: torch.dtype, arch: int, taps: int = 1) -> bool:
    """Whether wgrad runs through the staged halo (:func:`.kernels_halo._wgrad_halo_kernel`) where the geometry admits
    it (:func:`halo_wgrad_rows`: the plan's ``halo``): 16-bit compute on sm_80 or later, several taps, Cg in
    :data:`HALO_CHANNELS`, Kg ≤ 32. The implicit GEMM transforms each input element once per tap there, for only Kg
    MACs. Measurements: docs/tiles.md."""
    return (traits(dtype).mma16 and arch >= 80 and taps > 1 and Cg in HALO_CHANNELS
            and Kg <= 32)


#: Iterations a halo wgrad program runs at least (each RPI image rows), where the plan picks the split.
HALO_WGRAD_MIN_ITERS = 4


def halo_wgrad_rows(g: ConvGeom, in_shape, out_shape) -> int:
    """BLOCK_R (output pixels per iteration) of the staged-halo wgrad for conv ``g``, 0 where its geometry does not
    admit it: groups 1, a filter of at most 3 × 3 (one accumulator per tap), and whole output image rows per iteration —
    the largest power of two, 128 over 16 input channels or 64 over 32 down to 16, that is a multiple of Q and whose RPI
    = BLOCK_R / Q image rows divide P (so an iteration stays in one image and each lane's row in the image is fixed);
    and the staging buffer, for every number of programs :func:`halo_wgrad_split` may pick, at most
    :data:`HALO_MAX_STAGED` times the input's N·H·W pixels."""
    N, C, H, W = in_shape
    _, _, P, Q = out_shape
    if g.groups != 1 or g.kernel[0] > 3 or g.kernel[1] > 3:
        return 0
    rows = 128 if C // g.groups <= 16 else 64
    while rows >= 16 and (rows % Q or P % (rows // Q)):
        rows //= 2
    if rows < 16:
        return 0
    # the staging buffer of every split the plan may pick (halo_wgrad_split: 1 to iterations / 4)
    rpi = rows // Q
    splits = range(1, max(1, N * P // rpi // HALO_WGRAD_MIN_ITERS) + 1)
    staged = max(s * halo_wgrad_span(in_shape, out_shape, g, halo_chunk(N * P, rpi, s)) for s in splits)
    return rows if staged <= HALO_MAX_STAGED * N * H * W else 0


def halo_wgrad_config(Kg: int, Cg: int, rows: int) -> GemmConfig:
    """The staged-halo wgrad's tile: all Kg ≤ 32 output channels (BLOCK_M), BLOCK_N = Cg, ``rows`` output pixels per
    iteration (:func:`halo_wgrad_rows`), max(BLOCK_M, Cg) / 16 warps (Triton's mma.sync layout takes 16 × 8 per warp
    along the larger side of the result: more warps would compute it twice), 2 stages."""
    bm = p2(Kg, 16, 32)
    return GemmConfig(bm, Cg, rows, max(bm, Cg) // 16, 2, halo=True)


def halo_wgrad_span(in_shape, out_shape, g: ConvGeom, chunk: int) -> int:
    """Staged pixels per program of the halo wgrad, whose programs take ``chunk`` consecutive output image rows of the
    N·P (program i from row i·chunk): the largest span of padded input pixels (index ``(n·Hp + hp)·Wp + wp``) from a
    program's first row's top-left tap to its last row's last tap. A program starting at image row p0 crosses
    ``d = (p0 + chunk − 1) // P`` images, each adding ``(Hp − P·stride_h)·Wp``; p0 is a multiple of gcd(chunk, P), so d
    is largest at ``p0 = P − gcd(chunk, P)`` and smallest at 0."""
    _, _, H, W = in_shape
    _, _, P, Q = out_shape
    (R, S), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.stride, g.padding, g.dilation
    Hp, Wp = H + 2 * ph, W + 2 * pw
    spans = []
    for p0 in (0, P - math.gcd(chunk, P)):
        d = (p0 + chunk - 1) // P
        spans.append((d * (Hp - P * sh) + (chunk - 1) * sh + (R - 1) * dh) * Wp + (Q - 1) * sw + (S - 1) * dw + 1)
    return max(spans)


def halo_wgrad_split(rows_total: int, rpi: int, sms: int) -> int:
    """Programs of the halo wgrad over ``rows_total`` = N·P output image rows, RPI per iteration: about two per SM
    (``sms``; 3 where it is 0: the interpreter, so its tests run several), each at least :data:`HALO_WGRAD_MIN_ITERS`
    iterations — the K-split of its fp32 partials."""
    iters = rows_total // rpi
    return max(1, min(2 * sms if sms else 3, iters // HALO_WGRAD_MIN_ITERS))


def halo_wgrad_programs(rows_total: int, rpi: int, device: torch.device) -> int:
    """:func:`halo_wgrad_split` on ``device``: its SM count on a GPU, 0 (3 programs) under the
    interpreter or on a meta/CPU device."""
    sms = 0
    if not interpreting() and device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return halo_wgrad_split(rows_total, rpi, sms)


def halo_chunk(rows_total: int, rpi: int, split: int) -> int:
    """Output image rows per program of a halo wgrad of ``split`` programs: a multiple of ``rpi``, at
    least ``rows_total / split`` (so ``split`` programs cover the rows; trailing ones may have none)."""
    return rpi * triton.cdiv(triton.cdiv(rows_total, split), rpi)


def _narrow_fprop_rows(M: int, Kg: int, Cg: int, arch: int, x32: bool = False) -> int:
    """Rows of a 16-bit fprop tile over ≤ 16 output and input channels per group (``Kg``, ``Cg``) where M fills 8 such
    tiles: 256, or 512 on sm_80–89 (``arch``) unless ``x32`` (fp32 activations; 512 rows spill with them, and on sm_90);
    else 0 (the usual rows). More rows spread each step's fixed costs over more MMAs. Measurements: docs/tiles.md."""
    if Kg > 16 or Cg > 16 or arch < 80:
        return 0
    rows = 512 if arch < 90 and not x32 else 256
    return rows if M >= 8 * rows else 0


def dgrad_slots(g: ConvGeom, Kg: int, dtype: torch.dtype) -> int:
    """Taps per dgrad reduction step (the kernel's SLOTS): with at most 32 output channels per group (``Kg``) in 16-bit,
    or any dtype under the interpreter (so CI runs the path), a whole filter row — its taps side by side, padded to a
    power of two ≤ 4 — where the kernel walks taps by their padding bits (stride 1 or phases, 2 to 32 taps); else 1. One
    tap of 16 channels is a single 8-clock MMA on sm_90, under the loop's fixed cost. Measurements: docs/tiles.md."""
    R, S = g.kernel
    phased = max(g.stride) > 1 and g.dilation == (1, 1)
    if (not traits(dtype).mma16 and not interpreting()) or Kg > 32 or not 1 < R * S <= 32:
        return 1
    if not (phased or g.stride == (1, 1)):
        return 1
    slots = p2(-(-S // g.stride[1]) if phased else S, 1, 8)
    return slots if slots <= 4 else 1


def dgrad_config(M: int, Cg: int, Kg: int, dtype: torch.dtype, slots: int = 1, arch: int = 0, taps: int = 1,
                 res: bool = False) -> GemmConfig:
    """:func:`_dgrad_config` for the installed Triton (:func:`for_this_triton`)."""
    return for_this_triton("dgrad", _dgrad_config(M, Cg, Kg, dtype, slots, arch, taps, res), dtype, arch)


def _dgrad_config(M: int, Cg: int, Kg: int, dtype: torch.dtype, slots: int = 1, arch: int = 0, taps: int = 1,
                  res: bool = False) -> GemmConfig:
    """Default dgrad tiles (M = N·H·W input pixels, N = Cg, reduction over taps × Kg): 64 rows (the epilogue holds the
    accumulator, x, the mask and x̂: 128 rows spill), more over ≤ 32 output channels (:func:`_narrow_rows`, by
    ``arch``); 128 channels wide only with 64-deep steps and not on sm_90 where ``res`` (the launch adds the identity
    shortcut's gradient to dx) meets several taps (``taps`` = R·S): those spill. ``slots`` > 1 (:func:`dgrad_slots`):
    ``slots`` taps of ``p2(Kg)`` channels per step. Stages: :func:`_dgrad_stages`. Measurements: docs/tiles.md."""
    if interpreting():
        return GemmConfig(p2(M, 16, INTERP_SUM_ROWS), p2(Cg, 16, 256), slots * p2(Kg, 16, 256), slots=slots)
    fp32 = not traits(dtype).mma16
    block_k = slots * p2(Kg, 16, 32) if slots > 1 else p2(Kg, 16, 32 if fp32 else 64)
    block_n = p2(Cg, 16, 64 if fp32 or block_k < 64 or _res_narrow(arch, taps, res) else 128)
    return GemmConfig(64 if fp32 else _narrow_rows(M, block_n, block_k, arch), block_n, block_k, 4,
                      _dgrad_stages(arch, slots, block_n), slots=slots)


def _dgrad_stages(arch: int, slots: int, block_n: int) -> int:
    """dgrad's pipeline stages: 2 for filter-row steps (``slots`` > 1) over a 16-channel output tile on sm_80–89
    (``arch``), where a third costs more than it hides; else 3. Measurements: docs/tiles.md."""
    return 2 if 80 <= arch < 90 and slots > 1 and block_n <= 16 else 3


def _res_narrow(arch: int, taps: int, res: bool) -> bool:
    """Whether a dgrad tile stays at most 64 channels wide for its residual epilogue (:func:`dgrad_config`)."""
    return res and taps > 1 and arch >= 90


def _narrow_rows(M: int, block_n: int, block_k: int, arch: int, rows: int = 64) -> int:
    """dgrad's rows per tile where the output tile is at most 32 channels wide (16-bit), as many as M has 8 tiles of: on
    sm_90 (``arch`` ≥ 90) 256 (128 for 32 channels with 128-deep steps), elsewhere 128 (more spill), so the loop's fixed
    cost spreads over more MMAs; else ``rows``. Measurements: docs/tiles.md."""
    if block_n <= 32:
        for wide in (256, 128):
            if M >= 8 * wide and (wide == 128 or (arch >= 90 and (block_n == 16 or block_k <= 64))):
                return wide
    return rows


def _wide_wgrad_rows(arch: int, dtype: torch.dtype, x32: bool, strided: bool, Kg: int = 64) -> bool:
    """Whether wgrad tiles of ≤ 64 output channels may take 256 rows: on sm_90 (compute capability ``arch`` ≥ 90) with
    16-bit activations of a stride-1 conv. Elsewhere they spill at 255 registers (sm_80; autocast's fp32 activations,
    ``x32``; strided convs' row arithmetic), and so does fp16's 32-wide tile (``Kg``: output channels per group, 17–32)
    storing an fp32 dW (mixed-precision training's fp32 parameters; the plan does not know the weights' dtype)."""
    if dtype == torch.float16 and p2(Kg, 16, 128) == 32:
        return False
    return arch >= 90 and traits(dtype).mma16 and not x32 and not strided


def _narrow_wgrad(arch: int, Cg: int) -> bool:
    """Whether wgrad tiles fit ``Cg`` ≤ 32 input channels per group in BLOCK_N (their MMA's M) on sm_80 or later
    (``arch`` ≥ 80): mma.sync takes 16 rows at a time, where sm_90's wgmma takes 64 per warpgroup and a 64-wide tile
    over 16 channels multiplies three quarters zeros. On sm_90 the wgmma tiles stay autotune candidates
    (:func:`candidates`): Hopper's mma.sync rate is unpublished. Measurements: docs/tiles.md."""
    return 80 <= arch and Cg <= 32


def _narrow_wgrad_tiles(Kg: int, Cg: int, dtype: torch.dtype, arch: int, x32: bool,
                        strided: bool = False, proj: bool = False, taps: int = 1) -> list[GemmConfig]:
    """The wgrad tiles :func:`_narrow_wgrad` allows, default first: BLOCK_N the input channels (16 or 32), BLOCK_M up to
    four pieces of them and at most 128, in BLOCK_N / 16 warps (more would duplicate results). Rows: one output-channel
    piece (BLOCK_M ≤ BLOCK_N) 2 × 128 unrolled (:func:`wgrad_unroll`), after 512 rolled for a 1×1 (``taps`` = 1) of
    16-bit activations over 16 channels; several pieces 128, bf16 also 256 and over 16 channels 512; fp32 activations
    (``x32``) 256 over 16 channels, 128 over 32, 64 strided; a strided conv (``strided``) 128, bf16 over 16 channels
    also 256; a projection's (``proj``) over 16 channels on sm_90 256, then 128 (bf16 also 512); others spill or
    overflow shared memory. 2 stages on sm_90 and for 512 rows, else 3. Measurements: docs/tiles.md."""
    bn = p2(Cg, 16, 32)
    bm = min(p2(Kg, 16, 128), 4 * bn)
    bf16_16 = dtype == torch.bfloat16 and bn == 16
    if bm <= bn:
        rows = [512, 128] if bn == 16 and taps == 1 and not x32 else [128]
    elif x32:  # fp32 activations: a 32-channel tile of 256 rows exceeds shared memory
        rows = [64] if strided else [256] if bn == 16 else [128]
    elif strided:
        rows = [128, 256] if bf16_16 else [128]
    elif proj and arch >= 90 and bn == 16:  # a projection's 1×1 (no transform): 256 rows, see the docstring
        rows = [256, 128, 512] if dtype == torch.bfloat16 else [256, 128]
    elif dtype == torch.bfloat16:
        rows = [128, 256, 512] if bn == 16 else [128, 256]
    else:
        rows = [128]
    out = []
    for r in rows:
        cfg = wgrad_unroll(GemmConfig(bm, bn, r, bn // 16, 2 if r >= 512 or arch >= 90 else 3), dtype, arch, x32)
        if cfg not in out:
            out.append(cfg)
    return out


def _thin_wgrad(Kg: int, Cg: int, dtype: torch.dtype, arch: int) -> bool:
    """Whether the wgrad of ≤ 16 output channels over more than 32 input channels (per group) may take the 2-warp tile
    :func:`_thin_wgrad_tile`: 16-bit compute on sm_80 or later (``arch``). The default on sm_80 and, for fp32
    activations, on sm_90, where it wins unless Hopper's unpublished mma.sync rate is far below wgmma's; for 16-bit
    activations on sm_90 a candidate the autotuner measures. Measurements: docs/tiles.md."""
    return arch >= 80 and traits(dtype).mma16 and Kg <= 16 and Cg > 32


def _thin_wgrad_tile(dtype: torch.dtype, arch: int, x32: bool) -> GemmConfig:
    """16 output × 64 input channels × 2 row blocks of 128 per iteration (:func:`wgrad_unroll`) in 2 warps, mma.sync on
    sm_90 too: each warp's MMAs cover 32 input channels, not 16 as in 4 warps, so the per-warp fixed costs spread over
    twice the MMAs. Measurements: docs/tiles.md."""
    return wgrad_unroll(GemmConfig(16, 64, 128, 2, 3), dtype, arch, x32)


def wgrad_config(Kg: int, Cg: int, M: int, dtype: torch.dtype, arch: int = 0, x32: bool = False,
                 strided: bool = False, taps: int = 1, halo: int = 0, proj: bool = False) -> GemmConfig:
    """:func:`_wgrad_config` for the installed Triton (:func:`for_this_triton`)."""
    return for_this_triton("wgrad", _wgrad_config(Kg, Cg, M, dtype, arch, x32, strided, taps, halo, proj), dtype, arch)


def _wgrad_config(Kg: int, Cg: int, M: int, dtype: torch.dtype, arch: int = 0, x32: bool = False,
                  strided: bool = False, taps: int = 1, halo: int = 0, proj: bool = False) -> GemmConfig:
    """Default wgrad tiles of dWᵀ: BLOCK_M over output channels (the MMA's N, up to 128 in pieces of 64; 256 spill on
    sm_80), BLOCK_N over input channels (its M: 64, one warpgroup), BLOCK_K over the N·P·Q rows: 64 over 64 output
    channels or over 32 of fp32 activations (``x32``, under a 16-bit ``dtype``) with several taps (``taps`` = R·S), else
    128, or 256 where :func:`_wide_wgrad_rows` allows (``strided``: stride > 1) — fewer output channels leave less work
    per row. From ``arch`` (10·major + minor, 0 unknown) 80 on: ≤ 32 input channels take :func:`_narrow_wgrad_tiles`
    (``proj``: a projection shortcut), ≤ 16 output channels over more the 2-warp tile (:func:`_thin_wgrad`; on sm_90
    only for fp32 activations), and where ``halo`` (:func:`halo_wgrad_rows`' BLOCK_R, 0: not admitted) and
    :func:`halo_wgrad` allow, :func:`halo_wgrad_config`. Measurements: docs/tiles.md."""
    if halo and halo_wgrad(Kg, Cg, dtype, arch, taps):
        return halo_wgrad_config(Kg, Cg, halo)
    if interpreting():  # the kernel holds at most 4 pieces of output channels: BLOCK_M ≤ 4·BLOCK_N
        bm = p2(Kg, 16, 256)
        return GemmConfig(bm, max(p2(Cg, 16, 256), bm // 4), p2(M, 16, 4096))
    if not traits(dtype).mma16:  # fp32 operands (TF32 MMA): half the rows per block
        return GemmConfig(p2(Kg, 16, 64), 64, 32, 4, 4)
    bm = p2(Kg, 16, 128)
    if _narrow_wgrad(arch, Cg):
        return _narrow_wgrad_tiles(Kg, Cg, dtype, arch, x32, strided, proj, taps)[0]
    if _thin_wgrad(Kg, Cg, dtype, arch) and (arch < 90 or x32):
        return _thin_wgrad_tile(dtype, arch, x32)
    if bm <= 64 and _wide_wgrad_rows(arch, dtype, x32, strided, Kg):
        return wgrad_unroll(GemmConfig(bm, 64, 256, 4, 2), dtype, arch, x32, taps)
    rows = 64 if bm > 64 or (bm > 32 and x32 and taps > 1) else 128
    return wgrad_unroll(GemmConfig(bm, 64, rows, 4, 3), dtype, arch, x32, taps)


def wgrad_unroll(cfg: GemmConfig, dtype: torch.dtype, arch: int, x32: bool, taps: int = 1) -> GemmConfig:
    """``cfg`` with wgrad's main loop unrolled twice, two row blocks per iteration into two accumulators
    (``kernels_wgrad._wgrad_tile``'s UNROLL), and one stage less, where that compiles without spills and pays: 16-bit
    compute on sm_80 or later (``arch``), one output-channel piece (BLOCK_M ≤ BLOCK_N), row blocks ≤ 128, at most 32
    output channels or fp32 activations (``x32``; over several taps, ``taps`` = R·S, row blocks ≤ 64), on sm_80 not
    fp16's 32-channel tiles over 64 input channels of 16-bit activations. Per-iteration costs halve; on sm_90 both dots
    stay in flight. Measurements: docs/tiles.md."""
    if interpreting() or not traits(dtype).mma16 or arch < 80 or cfg.BLOCK_M > cfg.BLOCK_N or cfg.BLOCK_K > 128:
        return cfg
    if cfg.BLOCK_M > 32 and not (x32 and (taps == 1 or cfg.BLOCK_K <= 64)):
        return cfg
    if arch < 90 and cfg.BLOCK_M > 16 and cfg.BLOCK_N > 32 and dtype == torch.float16 and not x32:
        return cfg
    return dataclasses.replace(cfg, unroll=2, num_stages=max(2, cfg.num_stages - 1))


#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of fprop; BLOCK_K halves for fp32 operands. One warpgroup
#: each (see :func:`fprop_config`); no spills on sm_90 or sm_80 in any epilogue variant.
_FPROP_SPACE = ((128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 32, 4, 4), (64, 64, 64, 4, 4))
#: dgrad: 64-row tiles (its epilogue holds accumulator, x, mask and x̂ at once; 128-row tiles spill);
#: 64-deep reduction steps (32-deep ones spend more than the tensor-core time on the loop's fixed cost).
_DGRAD_SPACE = ((64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4))
#: wgrad: (output channels, input channels, rows) per tile; one warpgroup (8 warps put a third
#: barrier in the loop on sm_90), 256 output channels spill on sm_80.
_WGRAD_SPACE = ((128, 64, 64, 4, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 3))
#: wgrad where :func:`_wide_wgrad_rows` allows 256-row tiles (≤ 64 output channels).
_WGRAD_WIDE = ((64, 64, 256, 4, 2),)


def candidates(kind: str, m: int, n: int, k: int, dtype: torch.dtype, arch: int = 0, x32: bool = False,
               strided: bool = False, slots: int = 1, taps: int = 1, proj: bool = False,
               res: bool = False, halo: int = 0) -> list[GemmConfig]:
    """The pruned tile space of a conv kernel (``kind``: fprop, dgrad or wgrad) for an (m × k)·(k × n) GEMM (for wgrad m
    is the output channels, n the input channels, k the rows): the kind's space with blocks clamped to the problem
    (powers of two ≥ 16) and each tile adjusted as the defaults are, plus wgrad's 256-row, narrow
    (:func:`_narrow_wgrad`) and 2-warp (:func:`_thin_wgrad`) tiles, fprop's narrow rows (:func:`_narrow_fprop_rows`) and
    the staged-halo tiles where ``halo`` admits them, each as :func:`for_this_triton` keeps it; duplicates removed.
    ``slots``: dgrad's taps per step (:func:`dgrad_slots`); the other arguments as in :func:`fprop_config`,
    :func:`dgrad_config` and :func:`wgrad_config`."""
    half = 1 if traits(dtype).mma16 else 2
    space = {"fprop": _FPROP_SPACE, "dgrad": _DGRAD_SPACE, "wgrad": _WGRAD_SPACE}[kind]
    if kind == "wgrad" and m <= 64 and _wide_wgrad_rows(arch, dtype, x32, strided, m):
        space = space + _WGRAD_WIDE
    out: list[GemmConfig] = []
    for bm, bn, bk, warps, stages in space:
        if half == 2 and (bm > 64 or bn > 64):  # fp32 operands: 64×64 tiles at most
            continue
        if kind == "wgrad":  # BLOCK_N is the MMA's M (64 per warpgroup), BLOCK_M its N (≥ 16)
            bm = min(bm, p2(m, 16, bm))
        else:
            bm, bn = min(bm, p2(m, 64, bm)), min(bn, p2(n, 16, bn))
        # A tile clamped below 128×64 has too few operand elements for 8 warps (16-bit scalar loads,
        # e.g. a 16×16 weight tile over 256 threads), so it runs with 4.
        bk = min(bk // half, p2(k, 16, bk // half))
        if kind == "dgrad" and slots > 1:
            bk = slots * p2(k, 16, 32)
        if kind == "dgrad" and half == 1:
            bm = _narrow_rows(m, bn, bk, arch, bm)
        if kind == "dgrad" and (bk < 64 or _res_narrow(arch, taps, res)):  # see dgrad_config
            bn = min(bn, 64)
        cfg = GemmConfig(bm, bn, bk, 4 if bm * bn < 128 * 64 else warps, stages, slots=slots if kind == "dgrad" else 1)
        if kind == "fprop":
            cfg = fprop_unroll(cfg, dtype, arch, taps, proj)
        if kind == "wgrad":
            cfg = wgrad_unroll(cfg, dtype, arch, x32, taps)
        if cfg not in out:
            out.append(cfg)
    if kind == "wgrad" and half == 1 and _narrow_wgrad(arch, n):
        out += [cfg for cfg in _narrow_wgrad_tiles(m, n, dtype, arch, x32, strided, proj, taps) if cfg not in out]
    if kind == "wgrad" and _thin_wgrad(m, n, dtype, arch) and _thin_wgrad_tile(dtype, arch, x32) not in out:
        out.append(_thin_wgrad_tile(dtype, arch, x32))
    if kind == "fprop" and half == 1 and _narrow_fprop_rows(m, n, k, arch, x32):
        cfg = fprop_config(m, n, k, dtype, False, arch, x32, taps, proj)  # the default's rows
        out += [cfg] if cfg not in out else []
    if kind == "fprop" and halo and halo_fprop(m, n, k, dtype, arch, taps, proj):
        out.append(halo_config(n, k, arch))
    if kind == "wgrad" and halo and halo_wgrad(m, n, dtype, arch, taps):
        out.append(halo_wgrad_config(m, n, halo))
    if kind == "dgrad" and half == 1 and slots > 1 and not interpreting():
        cfg = dgrad_config(m, n, k, dtype, slots, arch, taps, res)
        out += [cfg] if cfg.num_stages == 2 and cfg not in out else []
    fitted = [for_this_triton(kind, cfg, dtype, arch, default=False) for cfg in out]
    return list(dict.fromkeys(cfg for cfg in fitted if cfg is not None))


def arch_of(device: torch.device) -> int:
    """Compute capability of a CUDA ``device`` as 10·major + minor (90 for an H100); 0 for other devices."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def wgrad_split(M: int, tiles: int, block_r: int, device: torch.device) -> int:
    """K-split of a wgrad reduction over ``M`` rows with ``tiles`` output tiles and ``block_r`` rows per main-loop
    iteration (BLOCK_K·unroll): about two programs per SM on a GPU, at least 8 iterations each; one under the
    interpreter or on a meta/CPU device."""
    if interpreting() or device.type != "cuda":
        return 1
    return split_for(M, tiles, block_r, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))


def split_for(M: int, tiles: int, block_r: int, sms: int) -> int:
    """:func:`wgrad_split` on a GPU of ``sms`` SMs (also the static report's model of one): the number of K-splits in
    [1, 64] of a reduction over ``M`` rows with ``tiles`` output tiles and ``block_r`` rows per main-loop iteration —
    about two programs per SM, each running at least 8 iterations."""
    return max(1, min(64, 2 * sms // max(tiles, 1), M // (8 * block_r)))


# ------------------------------------------------------------------------------------- layouts
def contig_nhwc(shape) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides of an NHWC-contiguous tensor of logical (N, C, H, W) ``shape``."""
    _, C, H, W = shape
    return (H * W * C, W * C, C, 1)


def out_strides(shape, channels_last: bool) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides of a new (N, C, H, W) tensor in channels_last or NCHW-contiguous format."""
    N, C, H, W = shape
    return contig_nhwc(shape) if channels_last else (C * H * W, W, 1, H * W)


def is_channels_last(shape, strides) -> bool:
    """Whether a tensor of ``shape``/``strides`` is channels_last and not NCHW-contiguous (the output
    rule of :func:`fused_preact.ops._common.wants_channels_last`)."""
    t = torch.empty_strided(shape, strides, device="meta")
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


# ------------------------------------------------------------------------------------ per unit
@dataclasses.dataclass
class UnitPlan:
    """One conv of a chain as its launches see it: geometry, shapes, (n, h, w, c) strides of its input and output, BN
    mode, tiles per kernel, the wgrad K-split and whether its epilogue writes the statistics of its output (for the next
    BatchNorm)."""

    geom: ConvGeom
    in_shape: tuple
    out_shape: tuple
    in_strides: tuple
    out_strides: tuple
    mode: BNMode
    fcfg: GemmConfig
    dcfg: GemmConfig
    wcfg: GemmConfig
    split: int
    stats_out: bool

    @property
    def M_in(self) -> int:
        N, _, H, W = self.in_shape
        return N * H * W

    @property
    def M_out(self) -> int:
        N, _, P, Q = self.out_shape
        return N * P * Q

    def dgrad_tiles(self) -> tuple[int, int]:
        """(row tiles per phase, phases) of the dgrad grid: a strided, undilated conv runs by phases."""
        g = self.geom
        N, _, H, W = self.in_shape
        sh, sw = g.stride
        if max(sh, sw) > 1 and g.dilation == (1, 1):
            return triton.cdiv(N * triton.cdiv(H, sh) * triton.cdiv(W, sw), self.dcfg.BLOCK_M), sh * sw
        return triton.cdiv(self.M_in, self.dcfg.BLOCK_M), 1

    def wgrad_tiles(self) -> int:
        """Output tiles of the wgrad grid without split-K (k-blocks × c-blocks × taps × groups)."""
        g = self.geom
        Cg, Kg = self.in_shape[1] // g.groups, self.out_shape[1] // g.groups
        return (triton.cdiv(Kg, self.wcfg.BLOCK_M) * triton.cdiv(Cg, self.wcfg.BLOCK_N) * g.kernel[0] * g.kernel[1]
                * g.groups)
