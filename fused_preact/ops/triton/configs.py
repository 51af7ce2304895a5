"""Tile rules of the Triton backend: default tiles per kernel, the pruned autotune spaces, the
wgrad split-K rule, the per-unit launch geometry (:class:`UnitPlan`) and layout helpers.

Every config here is one the static SASS report (``python -m tools.static_report``) compiles for
sm_90 and sm_80; CI fails when one of them spills.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional

import torch

from fused_preact.ops._common import interpreting, nhwc_strides_of, triton
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
    """Tile shape and launch options of one implicit-GEMM kernel (blocks are powers of two ≥ 16;
    ``unroll``: fprop's or wgrad's main loop unrolled by that factor, see :func:`fprop_unroll` and
    :func:`wgrad_unroll`; ``slots``: dgrad's taps per reduction step, see :func:`dgrad_slots`;
    ``halo``: fprop through the staged halo of :mod:`.kernels_halo`, see :func:`halo_fprop`)."""

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
    """Whether a fprop or dgrad tile may run its reduction without a loop where the layer's channels
    fit one iteration of it (the kernels' ``STEPS``: one step, or fprop's two unrolled ones): up to
    128×64×32 MACs per step. Without the
    loop Triton loads the operands through registers, not async copies into shared memory, and larger
    tiles reach the 255-register limit (static, sm_80: a 128×64×64 fprop beside a projection takes
    255 and spills, 218 as a loop; a 64×128×64 dgrad with the residual spills on sm_90); smaller ones
    need fewer registers and a third of the shared memory (PreActResNet-164's 128×64×16 fprop beside
    its projection on sm_90: 208 → 127 registers, 29 → 9 KiB). The interpreter takes any tile.
    False for every tile with :data:`LOOP_FREE` off."""
    return LOOP_FREE and (interpreting() or cfg.BLOCK_M * cfg.BLOCK_N * cfg.BLOCK_K <= 128 * 64 * 32)


def fprop_unroll(cfg: GemmConfig, dtype: torch.dtype, arch: int, taps: int = 1, proj: bool = False) -> GemmConfig:
    """``cfg`` with fprop's main loop unrolled twice, into two accumulators (``kernels_fprop``'s UNROLL),
    where that keeps the wgmma pipeline and compiles without spills: 16-bit compute, and on sm_90
    (``arch`` ≥ 90) an output tile of at most 64×64 or 16-deep reduction steps, on sm_80 an output
    tile at most 32 channels wide (a 64×64×64 tile spills at sm_80's 168-register cap; static issue
    ratio, PreActResNet-164's 3×3 16→16 3.25 → 2.61, 3×3 32→32 1.27 → 1.06, 1×1 64→16 1.07 → 0.93,
    fewer fixed costs per step, no wgmma there). A loop around one
    register-sourced dot that Triton cannot split (a 16-deep step) waits for it at depth 0 every
    iteration; two dots into two accumulators leave each other in flight (one accumulator chained
    through both makes the first wait at depth 0), and their register operands take different
    registers, so ptxas copies none away from an in-flight wgmma. Static issue ratio on sm_90:
    PreActResNet-164's 1×1 beside a projection or residual 1.06–1.14 → 0.88, its 3×3 32→32 2.6 → 2.4.
    A second 128×64 or 64×128 accumulator spills beside a 3×3's operands and the epilogues' (and those
    loops already meet the limits rolled). One pipeline stage less: a stage holds two steps' operands,
    so the prefetch distance in steps stays and shared memory grows by a third, not twice. fp16's
    64×64×64 tile of a filter of several taps (``taps`` = R·S) whose launch adds a projection shortcut
    (``proj``) unrolls in two stages on sm_90: in three it spills 8 bytes (static, PreActResNet-20/110's
    3×3 32→64 block)."""
    if interpreting() or dtype == torch.float32 or arch < 80:
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
    """Whether fprop takes its input channels in quads (``kernels_fprop._quad_cols``; the plan hands it
    the filter's channels in the same order, ``plan.mma_weight``): fp32 activations under 16-bit
    compute (autocast's first conv, whose fp32 tile otherwise takes two 64-bit shared-memory loads per
    four elements, and its scale and shift two more; static, sm_90: PreActResNet-50's 1×1 256→64
    1.07 → 0.99) and ``Cg`` (channels per group) a multiple of 16 above 16 (a 16-channel tile's loop
    grows with it)."""
    return x_dtype == torch.float32 and cdtype != torch.float32 and Cg % 16 == 0 and Cg > 16


_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def for_this_triton(kind: str, cfg: GemmConfig, dtype: torch.dtype, arch: int,
                    default: bool = True) -> Optional[GemmConfig]:
    """``cfg`` as the installed Triton compiles it without spills
    (:data:`fused_preact.ops.triton_compat.TILE_OVERRIDES`, read for ``arch``'s family: 90 from sm_90 on,
    else 80): a listed default takes its replacement; a listed candidate (``default`` False) is dropped
    (None) unless a replacement is listed."""
    if arch < 80 or interpreting():
        return cfg
    family = 90 if arch >= 90 else 80  # the table, like the tile rules, by family: sm_86/89 as sm_80
    listed, change = tile_override(kind, family, _DTYPE_NAMES.get(dtype, str(dtype)), cfg.label())
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
    """Default fprop tiles for an (M × Cg·R·S)·(… × Kg) implicit GEMM (M = N·P·Q output pixels).

    16-bit: one warpgroup (4 warps; with 8, Triton's loop has a third barrier per iteration) and 128
    MMA rows per warpgroup where the output channels are few: 128×64 tiles up to Kg = 64, 64×128 from
    Kg = 128 (64×256 sits at the 255-register limit and spills); 64-row tiles for M < 1024; ≤ 16
    input and output channels per group more rows (:func:`_narrow_fprop_rows`; ``x32``: the chain
    reads fp32 activations under 16-bit compute). On sm_90 a 128-row tile reading fp32 activations
    (``x32``) of a filter of more than one tap (``taps`` = R·S) takes 64 rows: 128×64×64 spills
    8–24 bytes there (static, PreActResNet-20/110's 3×3 64→64 beside the residual); ``proj``: the launch
    adds a projection shortcut (:func:`fprop_unroll`); ``halo``: the conv's geometry admits the staged
    halo (:func:`halo_geometry`), which :func:`halo_fprop` decides. fp32 operands (TF32 MMA) need
    twice the registers: 64×64 tiles."""
    if interpreting():
        return GemmConfig(p2(M, 16, INTERP_SUM_ROWS if stats else 4096), p2(Kg, 16, 256), p2(Cg, 16, 256))
    if dtype == torch.float32:
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
    """Whether fprop runs through the staged halo (:mod:`.kernels_halo`) for an (M × Cg·R·S)·(… × Kg)
    conv whose geometry admits it (:func:`halo_geometry`: the caller's ``halo`` of :func:`fprop_config`): 16-bit
    compute on sm_80 or later, a filter of several taps (``taps``), Cg in :data:`HALO_CHANNELS`, at
    most 32 output channels, no projection shortcut beside it (``proj``), and M filling 8 tiles. There
    the implicit GEMM transforms each input element once per tap, and one element feeds only Kg MACs;
    an fp32 input (autocast's) costs the halo nothing in its loop. Static issue ratio (bf16):
    PreActResNet-164's 3×3 16→16 4.52 → 1.45 on sm_90, 2.01 → 0.47 on sm_80; its 3×3 32→32 stride 2
    2.36 → 0.71 and 1.06 → 0.37."""
    rows = halo_config(Kg, Cg, arch).BLOCK_M if arch >= 80 else 0
    return (dtype in (torch.float16, torch.bfloat16) and arch >= 80 and taps > 1 and Cg in HALO_CHANNELS
            and Kg <= 32 and not proj and M >= 8 * rows)


#: Staged pixels a halo fprop may hold, per input pixel (all programs together): 3, so the buffer stays
#: within three times the input and a stride-1 tile transforms at most 3 pixels per output pixel.
HALO_MAX_STAGED = 3


def halo_geometry(g: ConvGeom, in_shape, out_shape, arch: int, rows: int = 0) -> bool:
    """Whether a conv's geometry admits the staged-halo fprop (the plan's ``halo`` for
    :func:`fprop_config`): groups 1; at most 3 taps per filter row (the loop holds a filter row's
    taps in shared memory at once: a 1×8 32→32 takes 245,760 bytes on sm_90, over its 232,448); and
    the staging buffer, ``cdiv(M, rows)·halo_rows`` pixels, at most :data:`HALO_MAX_STAGED` times the
    input's N·H·W pixels — image rows much wider than a tile, or a dilated filter, stage far more
    pixels than the tile outputs (a 3×3 over 1024-wide rows: 9 per output pixel, no gain). ``rows``:
    output pixels per tile (0: :func:`halo_config`'s)."""
    N, C, H, W = in_shape
    K = out_shape[1]
    if g.groups != 1 or g.kernel[1] > 3:
        return False
    rows = rows or halo_config(K, C, arch).BLOCK_M
    tiles = triton.cdiv(N * out_shape[2] * out_shape[3], rows)
    return tiles * halo_rows(in_shape, out_shape, g, rows) <= HALO_MAX_STAGED * N * H * W


def halo_config(Kg: int, Cg: int, arch: int) -> GemmConfig:
    """The staged-halo fprop's tile: all Kg output channels (≤ 32), BLOCK_K = Cg; 256 rows for 16 × 16
    channels, else 128 (three 256 × 32 accumulators, one per tap of a filter row, spill: 56–80 bytes);
    3 stages on sm_90, 2 on sm_80 (static, 3×3 16→16: 0.47 against 0.49–0.53 with 3)."""
    n = p2(Kg, 16, 32)
    return GemmConfig(256 if n * Cg <= 16 * 16 else 128, n, Cg, 4, 3 if arch >= 90 else 2, halo=True)


def halo_sync_config(Kg: int, Cg: int, arch: int) -> Optional[GemmConfig]:
    """The staged-halo fprop's mma.sync tile, an autotune candidate beside :func:`halo_config`'s wgmma
    tile on sm_90 for 16 × 16 channels (None elsewhere): 128 rows over 2 warps (fewer than a
    warpgroup, so Triton emits mma.sync), 2 stages. Static, PreActResNet-164's 3×3 16→16: its loop
    issues 85–88 instructions (bf16; fp16 78–81) for 24 ``HMMA.16816``, 0.81–0.92 of their tensor
    time counted at wgmma's rate, where the wgmma tile issues 139 for 12 ``HGMMA.64x16x16`` (1.41–1.49).
    Its loop is the shorter one if Hopper's mma.sync rate is above about 69% of wgmma's, which no data
    sheet states; the layer's memory traffic (4.1 tensor times) covers either loop unless that rate is
    below 24%. The tuner times both on the GPU; the wgmma tile stays the default."""
    if arch >= 90 and p2(Kg, 16, 32) == 16 and Cg == 16:
        return GemmConfig(128, 16, 16, 2, 2, halo=True)
    return None


def halo_rows(in_shape, out_shape, g: ConvGeom, block_m: int) -> int:
    """Staged rows per program of the halo fprop: an upper bound, over its tiles of ``block_m``
    consecutive output pixels (tile i from pixel i·block_m), of the span of padded input pixels (index
    ``(n·Hp + hp)·Wp + wp``, Hp = H + 2·pad_h, Wp = W + 2·pad_w) from a tile's first output pixel's
    top-left tap to its last pixel's bottom-right one, inclusive: each step to the next output pixel
    adds stride_w, each output row the tile crosses ``stride_h·Wp − Q·stride_w`` more, each image
    ``(Hp − P·stride_h)·Wp`` more (counted where positive), and a tile starting at pixel m0 crosses
    at most ``(block_m − 1 + (m0 mod Q)) // Q`` rows, m0 mod Q being a multiple of gcd(block_m, Q) —
    likewise for images of P·Q pixels."""
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
    """Whether wgrad runs through the staged halo (:func:`.kernels_halo._wgrad_halo_kernel`) for a conv
    whose geometry admits it (:func:`halo_wgrad_rows`, the plan's ``halo``): 16-bit compute on sm_80 or
    later, several taps, Cg in :data:`HALO_CHANNELS`, at most 32 output channels. There the implicit
    GEMM transforms each input element once per tap (a 3×3: 9 times) for only Kg MACs each. Static
    issue ratio (bf16), PreActResNet-164: 3×3 16→16 3.51 → 0.67 on sm_90 and 1.79 → 0.32 on sm_80;
    3×3 32→32 1.99 → 0.49 and 1.00 → 0.23."""
    return (dtype in (torch.float16, torch.bfloat16) and arch >= 80 and taps > 1 and Cg in HALO_CHANNELS
            and Kg <= 32)


#: Iterations a halo wgrad program runs at least (each RPI image rows), where the plan picks the split.
HALO_WGRAD_MIN_ITERS = 4


def halo_wgrad_rows(g: ConvGeom, in_shape, out_shape) -> int:
    """BLOCK_R (output pixels per iteration) of the staged-halo wgrad for conv ``g``, 0 where its geometry
    does not admit it: groups 1, a filter of at most 3 × 3 (one accumulator per tap), and whole output
    image rows per iteration — the largest power of two, 128 over 16 input channels or 64 over 32 down
    to 16, that is a multiple of Q and whose RPI = BLOCK_R / Q image rows divide P (so an iteration
    stays in one image and each lane's row in the image is fixed); and the staging buffer, for every
    number of programs :func:`halo_wgrad_split` may pick, at most :data:`HALO_MAX_STAGED` times the
    input's N·H·W pixels."""
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
    """The staged-halo wgrad's tile: all Kg ≤ 32 output channels (BLOCK_M), BLOCK_N = Cg, ``rows`` output
    pixels per iteration (:func:`halo_wgrad_rows`), max(BLOCK_M, Cg) / 16 warps (Triton's mma.sync layout
    takes 16 × 8 per warp along the larger side of the result: more warps would compute it twice), 2
    stages."""
    bm = p2(Kg, 16, 32)
    return GemmConfig(bm, Cg, rows, max(bm, Cg) // 16, 2, halo=True)


def halo_wgrad_span(in_shape, out_shape, g: ConvGeom, chunk: int) -> int:
    """Staged pixels per program of the halo wgrad, whose programs take ``chunk`` consecutive output
    image rows of the N·P (program i from row i·chunk): the largest span of padded input pixels (index
    ``(n·Hp + hp)·Wp + wp``) from a program's first row's top-left tap to its last row's last tap. A
    program starting at image row p0 crosses ``d = (p0 + chunk − 1) // P`` images, each adding
    ``(Hp − P·stride_h)·Wp``; p0 is a multiple of gcd(chunk, P), so d is largest at
    ``p0 = P − gcd(chunk, P)`` and smallest at 0."""
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
    """Programs of the halo wgrad over ``rows_total`` = N·P output image rows, RPI per iteration: about
    two per SM (``sms``; 3 where it is 0: the interpreter, so its tests run several), each at least
    :data:`HALO_WGRAD_MIN_ITERS` iterations — the K-split of its fp32 partials."""
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
    """Rows of a 16-bit fprop tile over ≤ 16 output and input channels per group (``Kg``, ``Cg``; 0: the
    usual rows), where M = N·P·Q output pixels fill 8 such tiles: 256 (512 on sm_80-class GPUs, ``arch``
    80–89, unless ``x32``: a chain reading fp32 activations — an fp32 x or residual tile spills there,
    and needs 146 KiB of shared memory). A step of such a tile is one 16-deep MMA per 64 rows (8 tensor
    clocks on sm_90), and each step's fixed costs — its addresses, the barrier, the wgmma fences, the
    pipeline's counters — spread over more rows of the per-element transform: static issue ratio,
    PreActResNet-164's 3×3 16→16 (bf16) on sm_90 6.28 with 128 rows → 4.56 with 256 (512 spills there,
    3.9–4.2), on sm_80 2.61 → 2.27 → 2.02 with 512; its roofline (HBM traffic at the published peaks,
    ``tools/static_report/utilization.py``) is 4.10 and 2.13."""
    if Kg > 16 or Cg > 16 or arch < 80:
        return 0
    rows = 512 if arch < 90 and not x32 else 256
    return rows if M >= 8 * rows else 0


def dgrad_slots(g: ConvGeom, Kg: int, dtype: torch.dtype) -> int:
    """Taps per dgrad reduction step (the kernel's SLOTS): with at most 32 output channels per group
    (``Kg``) in 16-bit, a step covers a whole filter row — the row's taps side by side, padded to a
    power of two ≤ 4 — where the kernel walks taps by their padding bits (stride 1 or phases, more than
    one and at most 32 taps); else 1 (one tap per step). A 16-channel step of one tap is one 8-clock
    MMA on sm_90, under the loop's fixed cost (static issue ratio 8.9 for PreActResNet-164's 3×3
    16→16); a row of 3 taps pads to 4, so a quarter of those MMAs multiply zeros. Under the interpreter
    fp32 too (CI runs the path in every dtype)."""
    R, S = g.kernel
    phased = max(g.stride) > 1 and g.dilation == (1, 1)
    if (dtype == torch.float32 and not interpreting()) or Kg > 32 or not 1 < R * S <= 32:
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
    """Default dgrad tiles (M = N·H·W input pixels, N = Cg, reduction over taps × Kg). 64-row tiles:
    the epilogue holds the accumulator, x, the mask and x̂ at once, and 128-row tiles sit at the
    255-register limit (they spill on sm_80 in bf16 and on sm_90 in fp32); 128 channels wide only with
    64-deep reduction steps (64×128×32 spills one value on sm_90 with the residual epilogue); output
    tiles of ≤ 32 channels take more rows (:func:`_narrow_rows`, by ``arch``). ``slots``
    (:func:`dgrad_slots`) > 1: a step of ``slots`` taps of ``p2(Kg)`` channels each. ``res``: the launch
    adds the identity shortcut's gradient to dx (eval mode or given statistics): with a filter of several
    taps (``taps`` = R·S) at most 64 channels wide on sm_90 (64×128×64 spills 8 bytes there, static,
    PreActResNet-18's 3×3 128→128). Pipeline stages: :func:`_dgrad_stages`."""
    if interpreting():
        return GemmConfig(p2(M, 16, INTERP_SUM_ROWS), p2(Cg, 16, 256), slots * p2(Kg, 16, 256), slots=slots)
    fp32 = dtype == torch.float32
    block_k = slots * p2(Kg, 16, 32) if slots > 1 else p2(Kg, 16, 32 if fp32 else 64)
    block_n = p2(Cg, 16, 64 if fp32 or block_k < 64 or _res_narrow(arch, taps, res) else 128)
    return GemmConfig(64 if fp32 else _narrow_rows(M, block_n, block_k, arch), block_n, block_k, 4,
                      _dgrad_stages(arch, slots, block_n), slots=slots)


def _dgrad_stages(arch: int, slots: int, block_n: int) -> int:
    """Pipeline stages of a dgrad tile: 2 for sm_80-class GPUs' (``arch`` 80–89) filter-row steps
    (``slots`` > 1) over a 16-channel output tile — the third stage's bookkeeping is 15 of the loop's
    136 instructions (static, PreActResNet-164's 3×3 16→16, 128×16×64 with 4 slots: issue ratio 1.06
    → 0.95, 116 → 112 registers); else 3."""
    return 2 if 80 <= arch < 90 and slots > 1 and block_n <= 16 else 3


def _res_narrow(arch: int, taps: int, res: bool) -> bool:
    """Whether a dgrad tile stays at most 64 channels wide for its residual epilogue (:func:`dgrad_config`)."""
    return res and taps > 1 and arch >= 90


def _narrow_rows(M: int, block_n: int, block_k: int, arch: int, rows: int = 64) -> int:
    """dgrad's rows per tile where the output tile is at most 32 channels wide (16-bit): on sm_90
    (``arch`` ≥ 90) 256 rows (128 for 32 channels with 128-deep steps, which spill at 256), elsewhere
    128 (256 spill on sm_80), as many as M has 8 tiles of — the accumulator is small, and the loop's fixed
    cost then spreads over more MMAs (static, sm_90: PreActResNet-164's 3×3 32→32 dgrad 1.30 → 0.99,
    1×1 64→32 1.47 → 0.86, 16→16 3.16 → 1.82); else ``rows``."""
    if block_n <= 32:
        for wide in (256, 128):
            if M >= 8 * wide and (wide == 128 or (arch >= 90 and (block_n == 16 or block_k <= 64))):
                return wide
    return rows


def _wide_wgrad_rows(arch: int, dtype: torch.dtype, x32: bool, strided: bool, Kg: int = 64) -> bool:
    """Whether wgrad tiles of ≤ 64 output channels may take 256 rows: on sm_90 (compute capability
    ``arch`` ≥ 90) with 16-bit activations of a stride-1 conv. Elsewhere they spill at 255 registers
    (sm_80; autocast's fp32 activations, ``x32``; strided convs' row arithmetic), and so does fp16's
    32-wide tile (``Kg``: output channels per group, 17–32) storing an fp32 dW (mixed-precision
    training's fp32 parameters; the plan does not know the weights' dtype)."""
    if dtype == torch.float16 and p2(Kg, 16, 128) == 32:
        return False
    return arch >= 90 and dtype in (torch.float16, torch.bfloat16) and not x32 and not strided


def _narrow_wgrad(arch: int, Cg: int) -> bool:
    """Whether wgrad tiles fit ``Cg`` ≤ 32 input channels per group in BLOCK_N (their MMA's M) on an
    sm_80 or later GPU (``arch`` ≥ 80): such a tile's dot runs on mma.sync, which takes 16 rows at a
    time, where sm_90's wgmma takes 64 per warpgroup — a 64-wide tile over 16 channels multiplies
    three quarters zeros (``tools/static_report/utilization.py``). On sm_90 the narrow tiles give up
    wgmma's rate: Hopper's mma.sync rate is not published, and they take less time than the wgmma
    tiles unless it is below a quarter of wgmma's (16 channels; a half with 32). The wgmma tiles
    stay autotune candidates there (:func:`candidates`), so a GPU's measurement decides."""
    return 80 <= arch and Cg <= 32


def _narrow_wgrad_tiles(Kg: int, Cg: int, dtype: torch.dtype, arch: int, x32: bool,
                        strided: bool = False, proj: bool = False, taps: int = 1) -> list[GemmConfig]:
    """The wgrad tiles :func:`_narrow_wgrad` allows, the default first: BLOCK_N the input channels (16 or
    32), BLOCK_M up to four pieces of them (the kernel's limit) and at most 128 output channels, in
    BLOCK_N / 16 warps: Triton puts every warp of a loop with several dots along the larger dimension of
    their result, M on a tie (its mma.sync layout, ``warpsPerTileV2``), so 4 warps over a 16×16 dot
    computed each result four times (32×32: twice; the static report's ``mma_replication``). One
    output-channel piece (BLOCK_M ≤ BLOCK_N) runs two row blocks of 128 rows per iteration
    (:func:`wgrad_unroll`); several pieces run 128 rows (≤ 96 KiB of shared memory in 3 stages, so
    sm_86/89's 99 KiB hold it too; bf16's 256 and, with 16 channels, 512 rows are candidates — 512
    spills with 32 — fp16's spilled with 16 channels in 4 warps), fp32 activations (``x32``) 256 over 16
    channels (over 32 they exceed shared memory); a strided conv (``strided``) 128 (bf16's 256 with 16
    channels a candidate), with fp32 activations 64 (more spill in a strided 3×3). Two stages on sm_90
    (with 4 warps, fp16's 64×16×128 spilled in 3). Static, PreActResNet-164, bf16 (issue ratio, MMA
    utilization → issue ratio, utilization 1; the useful bound is the second ratio): sm_80 3×3 16→16
    1.08 at 0.25 (four warps per result) → 1.79, 3×3 32→32 0.80 at 0.5 → 1.00, its stride 2 0.85 at 0.5
    → 1.08, projection beside the 1×1 16→64 0.47 at 0.25 → 0.54; sm_90 (the wgmma tiles before, over 64
    input channels) 3×3 16→16 3.56 at 0.25 → 3.51, 3×3 32→32 1.94 at 0.5 → 1.99, the projection 0.66 at
    0.25 → 1.03. A projection shortcut's wgrad (``proj``) over 16 input channels takes 256 rows on sm_90
    (bf16 and fp16 alike: no transform beside its loads, where fp16's 256-row tile of the conv beside
    it spills 8–24 bytes): 1.03 → 0.98. A 1×1 (``taps`` = R·S = 1) of ≤ 16 output channels over 16
    16-bit input channels takes 512 rows per iteration (rolled, 2 stages, 32 KiB of shared memory; the
    two-block unrolled 128-row tile a candidate): its loop's fixed costs over 512 rows of 16 MACs each
    (static, PreActResNet-164's 1×1 16→16, bf16 and fp16: sm_80 1.00 → 0.96, sm_90 2.06 → 1.92)."""
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
    """Whether the wgrad of ≤ 16 output channels over more than 32 input channels (per group) may take the
    2-warp tile :func:`_thin_wgrad_tile`: 16-bit compute on sm_80 or later (compute capability ``arch``).
    It is the default on sm_80 and, for fp32 activations (autocast's), on sm_90 too: there the wgmma
    tile's loop issues 3.90 instructions per wgmma tensor clock against the thin tile's 2.90 (static,
    PreActResNet-164's 1×1 64→16), so the thin tile takes less time unless Hopper's mma.sync rate (not
    published) is below 26% of wgmma's — its time is at least max(2.90, 1 / rate) wgmma tensor times.
    With 16-bit activations (2.34 against 1.81) the break-even is 43%: a candidate there, measured by
    the autotuner."""
    return arch >= 80 and dtype in (torch.float16, torch.bfloat16) and Kg <= 16 and Cg > 32


def _thin_wgrad_tile(dtype: torch.dtype, arch: int, x32: bool) -> GemmConfig:
    """16 output channels × 64 input channels × 2 row blocks of 128 per iteration in 2 warps (unrolled,
    :func:`wgrad_unroll`; 40 KiB of shared memory): Triton spreads the warps of dWᵀ's 64 × 16 dot over
    its 64 rows, so each warp's MMAs cover 32 input channels where the 4-warp tile's cover 16, and the
    loop's per-warp fixed costs (barrier, waits, address bases, loop control) spread over twice the
    MMAs. mma.sync on sm_90 too (a warpgroup's wgmma needs 4 warps). Static, PreActResNet-164's 1×1
    64→16, bf16 and fp16: sm_80 1.03 → 0.92 (fp32 activations 1.62 → 1.45), sm_90 (against the wgmma
    tile 16×64×256) 2.34 → 1.81, with fp32 activations (against the wgmma tile 16×64×2·128) 3.90 →
    2.90. One warp would cover all 64 (sm_80 0.85) but leave one warp per scheduler at 4 CTAs per
    SM."""
    return wgrad_unroll(GemmConfig(16, 64, 128, 2, 3), dtype, arch, x32)


def wgrad_config(Kg: int, Cg: int, M: int, dtype: torch.dtype, arch: int = 0, x32: bool = False,
                 strided: bool = False, taps: int = 1, halo: int = 0, proj: bool = False) -> GemmConfig:
    """:func:`_wgrad_config` for the installed Triton (:func:`for_this_triton`)."""
    return for_this_triton("wgrad", _wgrad_config(Kg, Cg, M, dtype, arch, x32, strided, taps, halo, proj), dtype, arch)


def _wgrad_config(Kg: int, Cg: int, M: int, dtype: torch.dtype, arch: int = 0, x32: bool = False,
                  strided: bool = False, taps: int = 1, halo: int = 0, proj: bool = False) -> GemmConfig:
    """Default wgrad tiles: BLOCK_M over output channels, BLOCK_N over input channels, BLOCK_K over
    the reduction (N·P·Q rows). The kernel computes dWᵀ: BLOCK_N is the MMA's M (64 per warpgroup on
    sm_90, so 64 with 4 warps: one warpgroup, one register A fragment), BLOCK_M its N (up to 128 in
    pieces of 64; 256 spills on sm_80). With 64 or fewer output channels a row carries half the MMA
    work or less, so the tile takes more rows: the per-row costs (transform, addresses, padding tests)
    stay the same while the per-iteration ones shrink (static issue ratio, PreActResNet-50's 3×3
    64→64 on sm_90: 1.22 with 64 rows, 1.03 with 128, 0.96 with 256 in 2 stages). 256 rows where
    :func:`_wide_wgrad_rows` allows them (``arch``: compute capability as 10·major + minor, 0 unknown;
    ``x32``: the activations are fp32 under a 16-bit ``dtype``; ``strided``: a conv stride > 1), else 128;
    ``taps``: the filter's R·S (64 rows where fp32 activations meet several taps, :func:`wgrad_unroll`).
    On sm_80 and later GPUs ≤ 32 input channels per group take tiles fitted to them
    (:func:`_narrow_wgrad_tiles`; ``proj``: the conv is a projection shortcut), and where ``halo``
    (the staged-halo tile's BLOCK_R, :func:`halo_wgrad_rows`; 0: the geometry does not admit it) and
    :func:`halo_wgrad` allow, the staged-halo tile (:func:`halo_wgrad_config`). On sm_80 ≤ 16 output
    channels over more input channels take a 2-warp tile (:func:`_thin_wgrad`; on sm_90 the default
    for fp32 activations, for 16-bit ones a candidate beside the wgmma tile, whose rate against
    mma.sync's a GPU's autotuning measures).
    """
    if halo and halo_wgrad(Kg, Cg, dtype, arch, taps):
        return halo_wgrad_config(Kg, Cg, halo)
    if interpreting():  # the kernel holds at most 4 pieces of output channels: BLOCK_M ≤ 4·BLOCK_N
        bm = p2(Kg, 16, 256)
        return GemmConfig(bm, max(p2(Cg, 16, 256), bm // 4), p2(M, 16, 4096))
    if dtype == torch.float32:  # fp32 operands (TF32 MMA): half the rows per block
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
    (``kernels_conv._wgrad_tile``'s UNROLL), where that compiles without spills and pays: sm_80 or
    later (``arch`` ≥ 80), 16-bit compute, one output-channel piece (BLOCK_M ≤ BLOCK_N: the second
    accumulator is the free second piece's), row blocks of at most 128 (256-row tiles already amortize
    the loop's fixed costs, and two of them overflow shared memory), and at most 32 output channels or
    fp32 activations (``x32``; a 64-channel tile of 16-bit activations spills in a strided 3×3) — on
    sm_80 not fp16's 32-channel tiles over 64 input channels (a 3×3's spill at its 168-register cap;
    over ≤ 32 input channels, :func:`_narrow_wgrad_tiles`, they fit). On sm_90 both dots stay
    in flight (wgmma waits at depth 3, was 1); on both the per-iteration costs halve: static, sm_90,
    PreActResNet-164's 32-channel 1×1 (fp16) 1.45 → 1.33, 3×3 stride 2 2.55 → 2.40, x32 1×1
    1.17 → 1.09, its 16-channel x32 1×1 4.47 → 3.91; sm_80, its 16-channel 1×1 1.29 → 1.12, 32-channel
    x32 1×1 1.51 → 0.98, 3×3 stride 2 (bf16) 1.45 → 1.17. One pipeline stage less, as :func:`fprop_unroll`.
    With fp32 activations over 32 output channels, a filter of several taps (``taps`` = R·S) unrolls
    row blocks of at most 64 (:func:`wgrad_config` gives it those): its 64×64×128 tile spills 64 (sm_80)
    to 208 (sm_90) bytes unrolled (static, PreActResNet-20/110's 3×3 64→64; 64×64×64 unrolled: 1.02 on
    sm_80, 1.90 on sm_90, where 64×64×128 rolled is 1.26 and 1.84)."""
    if interpreting() or dtype == torch.float32 or arch < 80 or cfg.BLOCK_M > cfg.BLOCK_N or cfg.BLOCK_K > 128:
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
    """The pruned tile space of a conv kernel for an (m × k)·(k × n) GEMM (``kind``: fprop, dgrad
    or wgrad; for wgrad m is the output channels, n the input channels, k the rows): blocks clamped to
    the problem (powers of two ≥ 16), duplicates removed. ``arch``: as :func:`fprop_unroll` and
    :func:`wgrad_config`; ``x32``, ``strided``: as :func:`wgrad_config` (its 256-row tiles);
    ``slots``: dgrad's taps per step, :func:`dgrad_slots`; ``taps`` (R·S), ``proj``, ``res``: as
    :func:`fprop_config`, :func:`wgrad_config`, :func:`wgrad_unroll` and :func:`dgrad_config`. wgrad
    on sm_80 and later over ≤ 32 input channels also takes tiles fitted to them (:func:`_narrow_wgrad`),
    with ≤ 16 output channels over more input channels the 2-warp tile (:func:`_thin_wgrad`),
    fprop over ≤ 16 channels more
    rows (:func:`_narrow_fprop_rows`) and, where ``halo`` (as :func:`fprop_config`, and for wgrad
    :func:`wgrad_config`) and :func:`halo_fprop` or :func:`halo_wgrad` admit it, the staged-halo tile."""
    half = 2 if dtype == torch.float32 else 1
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
    """K-split of a wgrad reduction over ``M`` rows with ``tiles`` output tiles and ``block_r`` rows per
    main-loop iteration (BLOCK_K·unroll): about two programs per SM on a GPU, at least 8 iterations
    each; one under the interpreter or on a meta/CPU device."""
    if interpreting() or device.type != "cuda":
        return 1
    return split_for(M, tiles, block_r, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))


def split_for(M: int, tiles: int, block_r: int, sms: int) -> int:
    """:func:`wgrad_split` on a GPU of ``sms`` SMs (also the static report's model of one): the number
    of K-splits in [1, 64] of a reduction over ``M`` rows with ``tiles`` output tiles and ``block_r``
    rows per main-loop iteration — about two programs per SM, each running at least 8 iterations."""
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
    """One conv of a chain as its launches see it: geometry, shapes, (n, h, w, c) strides of its input
    and output, BN mode, tiles per kernel, the wgrad K-split and whether its epilogue writes the
    statistics of its output (for the next BatchNorm)."""

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
