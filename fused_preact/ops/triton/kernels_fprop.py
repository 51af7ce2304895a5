"""Triton fprop kernel of the fused BN→ReLU→Conv2d: ``y = conv(relu(x·scale + shift), w)`` as an
implicit GEMM (fp32 accumulation), with the statistics / residual / projection epilogues.

Main loop (one flat loop, channel chunks outer and filter taps inner, software-pipelined by Triton):
every step loads an x tile (``BLOCK_M`` output pixels × ``BLOCK_K`` channels of one tap) and a
weight tile, transforms the x tile and feeds the tensor cores. Counters replace divisions; the row
addresses are loop-invariant and a step adds one scalar offset. UNROLL 2 (``configs.fprop_unroll``):
two steps per iteration into two accumulators, summed after the loop; each dot's only use in the loop
is the next iteration, so Triton leaves both in flight (waits at depth ≥ 1), where one accumulator
chained through two dots, or one unsplit 16-deep dot per iteration, waits at depth 0.

The transform of 16-bit inputs (:func:`.prologue16._preact16`, the form and its roundings described
there) runs in packed 16-bit arithmetic, two elements per instruction, on the tile in the MMA operand
layout (Triton reads the tile from shared memory straight into the wgmma/mma registers; no layout
round trip). The exponent e of fp16's scaling is one per call, from the largest |s|, |b| of the
call's channels (:func:`.prologue16._pow2_exponent`). The vectors are derived once per program from
the fp32 pack into the pack's scratch rows (identical values from every program). fp32 inputs keep
the fp32 transform: one fp32 fma per element, then the ReLU and the rounding to the operand dtype
(:func:`.prologue16._relu_round`, one packed conversion per pair of elements when the operands are
16-bit).

Padding: a padded tap reads a clamped in-bounds element (one unsigned min per row with 32-bit
offsets) and the transform zeroes it (a padded ``a`` is 0, not ``relu(shift)``); the row mask reaches
the transform as loaded data (a −1 word loaded with the padding as its mask, kept as a 32-bit word),
which is what lets Triton keep the transform in the operand layout: a mask computed in registers
takes a layout conversion through shared memory every iteration.

Semantics: ``F.batch_norm`` → ``F.relu`` (``relu(NaN) = NaN``, ``relu(−inf) = 0``) → ``F.conv2d``.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_bn import tile_mean_m2
from fused_preact.ops.triton.pack import PACK_ROWS16, _load_row, _scale_shift
from fused_preact.ops.triton.prologue16 import _centre16, _pack16_absmax, _pow2, _pow2_exponent, _preact16, _relu_round


@triton.jit
def _tap_inside(ih0, iw0, dh, dw, H, W):
    """Whether the rows' tap at offset (dh, dw) from their first input pixel (ih0, iw0) lies inside the
    H × W image (one unsigned compare per axis: a negative coordinate wraps above the bound)."""
    return ((ih0 + dh).to(tl.uint32) < H.to(tl.uint32)) & ((iw0 + dw).to(tl.uint32) < W.to(tl.uint32))


@triton.jit
def _load_tile(ptrs, mask_a, mask_b):
    """``tl.load(ptrs)`` masked by ``mask_a & mask_b`` (0 elsewhere), either of which may be None."""
    if mask_a is None:
        if mask_b is None:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=mask_b, other=0.0)
    else:
        if mask_b is None:
            v = tl.load(ptrs, mask=mask_a, other=0.0)
        else:
            v = tl.load(ptrs, mask=mask_a & mask_b, other=0.0)
    return v


@triton.jit
def _pack16_ptrs(pack_ptr, C, DT: tl.constexpr):
    """(16-bit vectors, the −1 word) in a pack's scratch rows: −h̃, s̃, b̃ (C values of ``DT`` each,
    contiguous), then one int32 word −1 (the row mask of the padded transform)."""
    v16 = (pack_ptr + PACK_ROWS16 * C).to(tl.pointer_type(DT), bitcast=True)
    ones = (pack_ptr + PACK_ROWS16 * C + (3 * C + 1) // 2).to(tl.pointer_type(tl.int32), bitcast=True)
    return v16, ones


@triton.jit
def _scale_exponent(pack_ptr, C, pack2_ptr, C2, HAS_PROJ: tl.constexpr, DT: tl.constexpr, UP: tl.constexpr):
    """The call's e (:func:`_pow2_exponent`; UP: every transformed tile is 16-bit, so e may scale up)
    over every channel of ``pack`` and, with HAS_PROJ, ``pack2``: one e for all programs and groups,
    so every program writes the same scratch values."""
    mx = _pack16_absmax(pack_ptr, 0, C, C, DT, 256)
    if HAS_PROJ:
        mx = tl.maximum(mx, _pack16_absmax(pack2_ptr, 0, C2, C2, DT, 256))
    return _pow2_exponent(mx, UP)


@triton.jit
def _write_pack16(pack_ptr, c_lo, n_ch, C, down, DT: tl.constexpr, BLOCK: tl.constexpr):
    """Write the 16-bit transform vectors of channels ``[c_lo, c_lo + n_ch)`` into the pack's scratch
    rows (:func:`_pack16_ptrs`): −h̃, s̃·2^−e and b̃·2^−e (``down`` = 2^−e, exact), each rounded once
    from fp32; and the −1 word. Every program writes the same values; a CTA barrier after the call
    makes them visible to the program's own loads."""
    v16, ones = _pack16_ptrs(pack_ptr, C, DT)
    for c0 in range(c_lo, c_lo + n_ch, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cm = cols < c_lo + n_ch
        mean = tl.load(pack_ptr + cols, mask=cm, other=0.0)
        scale = tl.load(pack_ptr + 3 * C + cols, mask=cm, other=0.0)
        shift = tl.load(pack_ptr + 4 * C + cols, mask=cm, other=0.0)
        # The values of prologue16._vectors16, written out: calling it reorders these stores, and ptxas
        # then schedules the fp16 loops of 16-channel tiles worse (static: 9.25 → 10.75 for a 3×3).
        if DT == tl.float16:  # halved: x/2 − h̃ cannot overflow
            tl.store(v16 + cols, (mean * -0.5).to(DT), mask=cm)
            tl.store(v16 + C + cols, (scale * (2.0 * down)).to(DT), mask=cm)
        else:
            tl.store(v16 + cols, (-mean).to(DT), mask=cm)
            tl.store(v16 + C + cols, (scale * down).to(DT), mask=cm)
        tl.store(v16 + 2 * C + cols, (tl.fma(_centre16(mean, DT), scale, shift) * down).to(DT), mask=cm)
    tl.store(ones, -1)


@triton.jit
def _write_scaled32(pack_ptr, c_lo, n_ch, C, down, BLOCK: tl.constexpr, PAIRED: tl.constexpr):
    """Write scale·2^−e and shift·2^−e (fp32; exact above fp32's subnormals; ``down`` = 2^−e, 1 for
    bf16) of channels ``[c_lo, c_lo + n_ch)`` into the pack's scratch rows 5 and 6 — with PAIRED
    interleaved (word 2c: scale, 2c + 1: shift), loaded by the loop as one (channels × 2) tile: the fp32
    transform's vectors when the operands are 16-bit (an fp32 input under autocast), scaled once per
    program instead of once per loop iteration (which also took the registers of 128×64 tiles past the
    limit). Every program writes the same values; a CTA barrier follows."""
    for c0 in range(c_lo, c_lo + n_ch, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cm = cols < c_lo + n_ch
        sc = tl.load(pack_ptr + 3 * C + cols, mask=cm, other=0.0) * down
        sh = tl.load(pack_ptr + 4 * C + cols, mask=cm, other=0.0) * down
        if PAIRED:
            tl.store(pack_ptr + PACK_ROWS16 * C + 2 * cols, sc, mask=cm)
            tl.store(pack_ptr + PACK_ROWS16 * C + 2 * cols + 1, sh, mask=cm)
        else:
            tl.store(pack_ptr + PACK_ROWS16 * C + cols, sc, mask=cm)
            tl.store(pack_ptr + (PACK_ROWS16 + 1) * C + cols, sh, mask=cm)


@triton.jit
def _vectors32(pack_ptr, chans, cmask, C, SCRATCH: tl.constexpr, PAIRED: tl.constexpr):
    """The fp32 transform's scale and shift at ``chans``: the pack's rows 3 and 4, or with SCRATCH the
    scaled copies :func:`_write_scaled32` put in rows 5 and 6 (PAIRED: interleaved, one tile)."""
    if SCRATCH and PAIRED:
        pair = PACK_ROWS16 * C + 2 * chans[:, None] + tl.arange(0, 2)[None, :]
        if cmask is None:
            v = tl.load(pack_ptr + pair)
        else:
            v = tl.load(pack_ptr + pair, mask=cmask[:, None], other=0.0)
        sc, sh = tl.split(v)
    elif SCRATCH:
        sc = _load_row(pack_ptr + PACK_ROWS16 * C + chans, cmask)
        sh = _load_row(pack_ptr + (PACK_ROWS16 + 1) * C + chans, cmask)
    else:
        sc, sh = _scale_shift(pack_ptr, chans, cmask, C)
    return sc, sh


@triton.jit
def _quad_cols(t, R: tl.constexpr, N: tl.constexpr):
    """Columns of an (R × N) tile (R = 0: a vector of N) reordered in groups of 16: column
    g·16 + h·8 + 2q + e takes column g·16 + 4q + 2h + e, so the four columns a thread holds in a
    wgmma/mma A fragment (2q, 2q + 1, 2q + 8, 2q + 9 of a 16-column slice) are four adjacent channels:
    one 128-bit shared-memory load of an fp32 quad, not two 64-bit ones."""
    if R == 0:
        return tl.reshape(tl.permute(tl.reshape(t, [N // 16, 4, 2, 2]), [0, 2, 1, 3]), [N])
    else:
        return tl.reshape(tl.permute(tl.reshape(t, [R, N // 16, 4, 2, 2]), [0, 1, 3, 2, 4]), [R, N])


@triton.jit
def _tap_operands(x_ptr, x_col, x_tile, row_x, row_max, sxh, sxw, sxc, w_tile, swc, swr, sws, wn_mask,
                  kk, Cg, c_off, r, s, vbits, vbits2, ih0, iw0, H, W, pack_ptr, g, C,
                  v_row, ones_r, nm, s16, b16,
                  S: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, PADDED: tl.constexpr,
                  MANY_TAPS: tl.constexpr, X16: tl.constexpr, X32S: tl.constexpr, QUAD: tl.constexpr,
                  ONE_CK: tl.constexpr, EVEN_C: tl.constexpr, EVEN_N: tl.constexpr, IDX64: tl.constexpr,
                  PRO16: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One main-loop step's MMA operands: the transformed x tile ``a`` (BLOCK_M × BLOCK_K, DOT_DTYPE)
    of tap (r, s), channel chunk ``c_off``, and its weight tile ``wt`` (BLOCK_K × BLOCK_N)."""
    tap = r * S + s
    c_mask = None if EVEN_C else c_off + kk < Cg
    tap_off = (r * DIL_H) * sxh + (s * DIL_W) * sxw
    if PADDED and X16:
        # A padded tap reads a clamped in-bounds element (no load mask); the transform zeroes it.
        cs = c_off * sxc
        if IDX64:
            x_at = (x_col + cs)[None, :] + tl.minimum(tl.maximum(row_x + tap_off, 0), row_max)[:, None]
        else:
            # One unsigned min per row: a negative offset wraps above the bound. Every offset in
            # [0, row_max + cs] + col_x lies inside the tensor's span, and all of them are < 2**31.
            off = tl.minimum((row_x + (tap_off + cs)).to(tl.uint32), (row_max + cs).to(tl.uint32))
            x_at = x_col[None, :] + off[:, None]
        xt = _load_tile(x_at, None, None if EVEN_C else c_mask[None, :])
    elif PADDED:
        if MANY_TAPS:
            keep = _tap_inside(ih0, iw0, r * DIL_H, s * DIL_W, H, W)
        else:
            keep = ((vbits >> tap) & 1) != 0
        xt = _load_tile(x_tile + (c_off * sxc + tap_off), keep[:, None], None if EVEN_C else c_mask[None, :])
    else:
        xt = _load_tile(x_tile + (c_off * sxc + tap_off), None, None if EVEN_C else c_mask[None, :])
    wt = _load_tile(w_tile + (c_off * swc + r * swr + s * sws), None if EVEN_C else c_mask[:, None],
                    None if EVEN_N else wn_mask)
    if X16:
        if not ONE_CK:
            nm = _load_row(v_row + c_off, c_mask)
            s16 = _load_row(v_row + (C + c_off), c_mask)
            b16 = _load_row(v_row + (2 * C + c_off), c_mask)
        if PADDED:
            # the −1 word where the tap is inside the image, 0 (masked off) where padded
            if MANY_TAPS:
                k32 = tl.load(ones_r, mask=_tap_inside(ih0, iw0, r * DIL_H, s * DIL_W, H, W), other=0)
            else:
                k32 = tl.load(ones_r, mask=(vbits2 & (1 << tap)) != 0, other=0)
            a = _preact16(xt, nm, s16, b16, k32, True, PRO16 == 2)
        else:
            a = _preact16(xt, nm, s16, b16, None, False, PRO16 == 2)
    else:
        sc, sh = _vectors32(pack_ptr, g * Cg + c_off + kk, c_mask, C, X32S, QUAD)
        xt = xt.to(tl.float32)
        if QUAD:
            xt = _quad_cols(xt, BLOCK_M, BLOCK_K)
            sc = _quad_cols(sc, 0, BLOCK_K)
            sh = _quad_cols(sh, 0, BLOCK_K)
        z = tl.fma(xt, sc[None, :], sh[None, :])
        if PADDED:
            z = tl.where(keep[:, None], z, 0.0)  # a padded tap: 0 (not relu(shift))
        a = _relu_round(z, DOT_DTYPE, PRO16 == 2)
    return a.to(DOT_DTYPE), wt.to(DOT_DTYPE)


@triton.jit
def _next_tap(r, s, c_off, R: tl.constexpr, S: tl.constexpr, TAPS_ONLY: tl.constexpr, BLOCK_K: tl.constexpr):
    """The next main-loop step: the next tap (r, s) of the filter, then the next channel chunk."""
    if R * S == 1:
        c_off += BLOCK_K
    else:
        s += 1
        if S > 1:
            wrap_s = s == S
            s = tl.where(wrap_s, 0, s)
            r += wrap_s.to(tl.int32)
        else:
            r += s
            s = 0
        if not TAPS_ONLY:
            wrap_r = r == R
            r = tl.where(wrap_r, 0, r)
            c_off += tl.where(wrap_r, BLOCK_K, 0)
    return r, s, c_off



@triton.jit
def _epilogue(acc, m_mask, n_mask, k_out, nb, p, q, bias_ptr, xin_ptr, sin_n, sin_h, sin_w, sin_c,
              y_ptr, syn, syh, syw, syc, part_ptr, pid_m, M, K,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STATS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The fprop tile's epilogue on its fp32 accumulator ``acc`` (rows ``m_mask``, output channels
    ``k_out`` where ``n_mask``; rows at image ``nb``, pixel (p, q)): + bias, + the identity shortcut
    ``xin`` (HAS_RES), y stored in its dtype, and with STATS the tile's mean and M2 of the stored
    (rounded) values — what the next BatchNorm reads — into row ``pid_m`` of ``part``."""
    y_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + k_out, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        rrow = nb * sin_n + p * sin_h + q * sin_w
        acc += tl.load(xin_ptr + rrow[:, None] + k_out[None, :] * sin_c, mask=y_mask, other=0.0).to(tl.float32)
    yrow = nb * syn + p * syh + q * syw
    yv = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + yrow[:, None] + k_out[None, :] * syc, yv, mask=y_mask)
    if STATS:
        tile_mean_m2(yv.to(tl.float32), y_mask, tl.minimum(M - pid_m * BLOCK_M, BLOCK_M),
                     part_ptr + pid_m.to(tl.int64) * (2 * K) + k_out, n_mask, K)


@triton.jit(do_not_specialize=("M", "H", "W", "P", "Q", "H2", "W2"))
def _fprop_kernel(
    x_ptr, sxn, sxh, sxw, sxc,
    w_ptr, swk, swc, swr, sws,
    pack_ptr, bias_ptr,
    xin_ptr, sin_n, sin_h, sin_w, sin_c,
    w2_ptr, sw2k, sw2c, pack2_ptr,
    y_ptr, syn, syh, syw, syc,
    part_ptr,
    M,
    H, W, C, P, Q, K,
    GROUPS, R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    H2, W2, C2, STRIDE2: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_PROJ: tl.constexpr, HAS_RES: tl.constexpr, STATS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr,
    PRO16: tl.constexpr, EVEN_C: tl.constexpr, EVEN_N: tl.constexpr, ONE_CK: tl.constexpr, QUAD: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K2: tl.constexpr, UNROLL: tl.constexpr,
):
    """``y[m, k] = Σ_{r,s,c} relu(x[pix(m,r,s), c]·scale[c] + shift[c]) · w[k, c, r, s]`` (+ bias[k]).

    Tensors as in :mod:`fused_preact.ops.triton.kernels_dgrad` (activations through their (n, h, w, c)
    strides; ``pack``/``pack2`` (8, C) fp32 of which this kernel writes the scratch rows 5-7).
    Options: HAS_PROJ adds a second GEMM into the same accumulator — a 1×1, stride-``STRIDE2``
    projection shortcut ``w2`` (K, C2) over the pre-activation of the chain input ``xin`` (its own
    ``pack2``), so the shortcut's output is never stored; HAS_RES adds ``xin`` itself (identity
    shortcut) in the epilogue; STATS writes the tile's per-channel mean and M2 of the stored (rounded)
    y into row ``pid_m`` of ``part`` — the partial statistics of the next BatchNorm.
    PRO16: 0 — every transform in fp32 (fp32 compute dtype); 1 — 16-bit tiles (x, xin) transformed by
    :func:`_preact16` in its interpreter form; 2 — the same in packed PTX (GPU); fp32 tiles (an fp32
    input under autocast) keep the fp32 transform. EVEN_C: the channels per group (and C2) are
    multiples of BLOCK_K (BLOCK_K2), so channel chunks need no mask; EVEN_N: K/GROUPS is a multiple of
    BLOCK_N; ONE_CK: the channels per group fit one chunk (≤ BLOCK_K), so the 16-bit transform's
    vectors are loaded once, before the loop, and the loop runs over the taps alone. STEPS: 0, or a 1×1
    whose channels per group take STEPS ≤ UNROLL chunks (one iteration of the loop) and whose
    projection's (C2) fit one BLOCK_K2 chunk: the trip counts are constants, so Triton folds the loops
    away (no pipeline, one stage of shared memory). QUAD (an fp32 x
    under 16-bit operands, ``configs.quad_channels``): the x tile's columns and the vectors reordered by
    :func:`_quad_cols`, the filter's input channels given in the same order (``plan.mma_weight``),
    and the vectors read interleaved. Rows past M compute row M−1 (never stored).
    Grid: (cdiv(M, BLOCK_M), cdiv(K/GROUPS, BLOCK_N), GROUPS).
    """
    Cg = C // GROUPS
    Kg = K // GROUPS
    NUM_CK = tl.cdiv(Cg, BLOCK_K)
    RS: tl.constexpr = R * S
    PADDED: tl.constexpr = PAD_H > 0 or PAD_W > 0
    X16: tl.constexpr = PRO16 != 0 and (x_ptr.dtype.element_ty == tl.float16
                                         or x_ptr.dtype.element_ty == tl.bfloat16)
    XIN16: tl.constexpr = PRO16 != 0 and HAS_PROJ and (xin_ptr.dtype.element_ty == tl.float16
                                                        or xin_ptr.dtype.element_ty == tl.bfloat16)
    # fp16 operands: the transform vectors scaled into fp16's range, the accumulator back (exact).
    SCALED: tl.constexpr = PRO16 != 0 and DOT_DTYPE == tl.float16
    # fp32 tiles under fp16 operands: their scaled fp32 vectors in the pack's scratch rows; with QUAD
    # (also bf16) the main loop's vectors there interleaved
    X32S: tl.constexpr = (SCALED or QUAD) and not X16
    XIN32S: tl.constexpr = SCALED and HAS_PROJ and not XIN16
    # fp16's exponent may scale the vectors up only where every transformed tile is 16-bit (an fp32
    # tile's |x| is not bounded by fp16's range)
    UP16: tl.constexpr = X16 and (XIN16 or not HAS_PROJ)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < Kg
    k_out = g * Kg + offs_n
    mc = tl.minimum(offs_m, M - 1)
    q = mc % Q
    p = (mc // Q) % P
    nb = mc // (P * Q)
    if IDX64:
        nb = nb.to(tl.int64)
    ih0 = p * STRIDE_H - PAD_H
    iw0 = q * STRIDE_W - PAD_W
    row_x = nb * sxn + ih0 * sxh + iw0 * sxw
    # Bit t of vbits: tap t = r·S + s of the row reads inside the image (padding otherwise). vbits2
    # holds the same bits for the 16-bit transform's row mask, computed another way: one shared
    # value would be converted between the two loads' layouts inside the loop. More than 32 taps
    # (MANY_TAPS) do not fit a word: the loop tests the tap's row and column instead.
    MANY_TAPS: tl.constexpr = RS > 32
    vbits = tl.zeros([BLOCK_M], dtype=tl.int32)
    vbits2 = tl.zeros([BLOCK_M], dtype=tl.int32)
    if PADDED and not MANY_TAPS:
        for rr in tl.static_range(R):
            ok_h = (ih0 + rr * DIL_H >= 0) & (ih0 + rr * DIL_H < H)
            ok_h2 = (ih0 + rr * DIL_H).to(tl.uint32) < H.to(tl.uint32)
            for ss in tl.static_range(S):
                ok = ok_h & (iw0 + ss * DIL_W >= 0) & (iw0 + ss * DIL_W < W)
                vbits = vbits | (ok.to(tl.int32) << (rr * S + ss))
                ok2 = ok_h2 & ((iw0 + ss * DIL_W).to(tl.uint32) < W.to(tl.uint32))
                vbits2 = vbits2 | tl.where(ok2, 1 << (rr * S + ss), 0)
    wn_mask = n_mask[None, :]
    kk = tl.arange(0, BLOCK_K)
    col_x = (g * Cg + kk) * sxc
    x_tile = x_ptr + row_x[:, None] + col_x[None, :]
    x_col = x_ptr + col_x
    n_last = M // (P * Q) - 1
    if IDX64:
        n_last = n_last.to(tl.int64)
    row_max = n_last * sxn + (H - 1) * sxh + (W - 1) * sxw  # the last pixel's offset: clamp for padded taps
    w_tile = w_ptr + k_out[None, :] * swk + kk[:, None] * swc
    down = 1.0
    if SCALED:
        down = _pow2(-_scale_exponent(pack_ptr, C, pack2_ptr, C2, HAS_PROJ, DOT_DTYPE, UP16))
    if X16:
        _write_pack16(pack_ptr, g * Cg, Cg, C, down, x_ptr.dtype.element_ty, 256)
    if XIN16:
        _write_pack16(pack2_ptr, 0, C2, C2, down, xin_ptr.dtype.element_ty, 256)
    if X32S:
        _write_scaled32(pack_ptr, g * Cg, Cg, C, down, 256, QUAD)
    if XIN32S:
        _write_scaled32(pack2_ptr, 0, C2, C2, down, 256, QUAD)  # pack2 may be pack: one layout
    if X16 or XIN16 or X32S or XIN32S:
        tl.debug_barrier()
    v_row = pack_ptr
    ones_r = None
    nm = None
    s16 = None
    b16 = None
    if X16:
        v16, ones = _pack16_ptrs(pack_ptr, C, x_ptr.dtype.element_ty)
        v_row = v16 + g * Cg + kk
        ones_r = ones + tl.zeros([BLOCK_M], dtype=tl.int32)
        if ONE_CK:  # one channel chunk: the vectors are loop-invariant
            c_mask0 = None if EVEN_C else kk < Cg
            nm = _load_row(v_row, c_mask0)
            s16 = _load_row(v_row + C, c_mask0)
            b16 = _load_row(v_row + 2 * C, c_mask0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # One channel chunk with several taps: the chunk offset stays 0 and the taps never wrap.
    TAPS_ONLY: tl.constexpr = ONE_CK and RS > 1
    tl.static_assert(STEPS <= UNROLL and (STEPS == 0 or RS == 1), "STEPS: a 1x1 of one loop iteration")
    if STEPS:
        n_iter = STEPS  # a constant trip count: the loop below is folded into its one iteration
    else:
        n_iter = RS * NUM_CK
        tl.assume(n_iter > 0)
    c_off = 0
    r = 0
    s = 0
    # UNROLL 2: two steps per iteration into two accumulators (see the module docstring), the odd
    # step after the loop
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(n_iter // UNROLL):
        for j in tl.static_range(UNROLL):
            a, wt = _tap_operands(
                x_ptr, x_col, x_tile, row_x, row_max, sxh, sxw, sxc, w_tile, swc, swr, sws, wn_mask, kk, Cg, c_off, r, s,
                vbits, vbits2, ih0, iw0, H, W, pack_ptr, g, C, v_row, ones_r, nm, s16, b16, S, DIL_H, DIL_W, PADDED,
                MANY_TAPS, X16, X32S, QUAD, ONE_CK, EVEN_C, EVEN_N, IDX64, PRO16, DOT_DTYPE, BLOCK_M, BLOCK_K)
            if j == 0:
                acc = tl.dot(a, wt, acc, input_precision=INPUT_PRECISION)
            else:
                acc2 = tl.dot(a, wt, acc2, input_precision=INPUT_PRECISION)
            r, s, c_off = _next_tap(r, s, c_off, R, S, TAPS_ONLY, BLOCK_K)
    if UNROLL == 2:
        if n_iter % 2 != 0:
            a, wt = _tap_operands(
                x_ptr, x_col, x_tile, row_x, row_max, sxh, sxw, sxc, w_tile, swc, swr, sws, wn_mask, kk, Cg, c_off, r, s,
                vbits, vbits2, ih0, iw0, H, W, pack_ptr, g, C, v_row, ones_r, nm, s16, b16, S, DIL_H, DIL_W, PADDED,
                MANY_TAPS, X16, X32S, QUAD, ONE_CK, EVEN_C, EVEN_N, IDX64, PRO16, DOT_DTYPE, BLOCK_M, BLOCK_K)
            acc = tl.dot(a, wt, acc, input_precision=INPUT_PRECISION)
        if STEPS != 1:  # (one step: the step after the folded loop, acc2 never written)
            acc += acc2
    if HAS_PROJ:
        # Projection shortcut: 1×1, stride STRIDE2, no padding, on the chain input (groups == 1).
        row2 = nb * sin_n + (p * STRIDE2) * sin_h + (q * STRIDE2) * sin_w
        kk2 = tl.arange(0, BLOCK_K2)
        if XIN16:
            v16b, _ = _pack16_ptrs(pack2_ptr, C2, xin_ptr.dtype.element_ty)
        tl.assume(C2 > 0)
        for c0 in range(0, BLOCK_K2 if STEPS else C2, BLOCK_K2):
            offs_c = c0 + kk2
            c_mask = None if EVEN_C else offs_c < C2
            xt2 = _load_tile(xin_ptr + row2[:, None] + offs_c[None, :] * sin_c, None,
                             None if EVEN_C else c_mask[None, :])
            wt2 = _load_tile(w2_ptr + k_out[None, :] * sw2k + offs_c[:, None] * sw2c,
                             None if EVEN_C else c_mask[:, None], None if EVEN_N else wn_mask)
            if XIN16:
                nm2 = _load_row(v16b + offs_c, c_mask)
                s162 = _load_row(v16b + C2 + offs_c, c_mask)
                b162 = _load_row(v16b + 2 * C2 + offs_c, c_mask)
                a2 = _preact16(xt2, nm2, s162, b162, None, False, PRO16 == 2)
            else:
                sc, sh = _vectors32(pack2_ptr, offs_c, c_mask, C2, XIN32S, QUAD)
                a2 = _relu_round(tl.fma(xt2.to(tl.float32), sc[None, :], sh[None, :]), DOT_DTYPE, PRO16 == 2)
            acc = tl.dot(a2.to(DOT_DTYPE), wt2.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    if SCALED:  # e again (not held through the loop: registers)
        acc = acc * _pow2(_scale_exponent(pack_ptr, C, pack2_ptr, C2, HAS_PROJ, DOT_DTYPE, UP16))
    _epilogue(acc, m_mask, n_mask, k_out, nb, p, q, bias_ptr, xin_ptr, sin_n, sin_h, sin_w, sin_c,
              y_ptr, syn, syh, syw, syc, part_ptr, pid_m, M, K, HAS_BIAS, HAS_RES, STATS, BLOCK_M)
