"""Triton kernel of the fused BN→ReLU→Conv2d's weight gradient (wgrad) as an implicit GEMM (fp32
accumulation), with BN+ReLU recomputed from x in its prologue and, in the same launch, the fold of
dgrad's per-tile BatchNorm sums.

The reduction over output pixels is ONE loop, so Triton software-pipelines it (``num_stages``).
:func:`_wgrad_kernel`'s programs are either wgrad tiles (:func:`_wgrad_tile`: its loop, one row block
per step into up to four accumulator pieces, :func:`_dots`, then :func:`_store_tile`) or the fold's
(:func:`.kernels_grad._fold_sums`).

Tensors (logical shapes, addressed through their (n, h, w, c) strides; the pack: :mod:`.pack`):
    x   (N, H, W, C)  BN input of the conv       dw  (K, C/groups, R, S), or fp32 split-K partials
    dy  (N, P, Q, K)  the conv output's gradient psum (tiles, 2, C) fp32 per-tile (Σdz, Σdz·x̂)

16-bit x take the forward's packed transform (:mod:`.prologue16`), so wgrad reads the activation the
forward's conv read. Source of the dataflow: docs/design.md.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_grad import (
    _both_below,
    _cdiv_signed,
    _dw_piece,
    _dy_piece,
    _fold_sums,
    _frac_range,
    _udiv,
)
from fused_preact.ops.triton.pack import _load_row, _scale_shift
from fused_preact.ops.triton.prologue16 import _channel_exponent, _pow2, _preact16_t, _relu_round, _vectors16_of

__all__ = ["_wgrad_kernel"]


@triton.jit
def _preact_t(xt, sc, sh, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """``relu(x·scale + shift)`` of a transposed x tile (channels × rows; ``sc``/``sh`` per row) in
    DOT_DTYPE: one fp32 fma (a single rounding), then the ReLU and the rounding to DOT_DTYPE
    (:func:`.prologue16._relu_round`; PTX: packed). wgrad's fp32 x (an fp32 compute dtype, or an fp32
    chain input under autocast); 16-bit x take :mod:`.prologue16`'s packed transform."""
    return _relu_round(tl.fma(xt.to(tl.float32), sc[:, None], sh[:, None]), DOT_DTYPE, PTX)


@triton.jit
def _pair_rows(t, N: tl.constexpr, R: tl.constexpr):
    """Rows of an (N × R) tile (R = 0: a vector of N) reordered in groups of 16: row g·16 + h·8 + q
    takes row g·16 + 2q + h, so the two rows a thread holds in a wgmma A fragment (q and q + 8 of a
    16-row slice) are adjacent channels (one 64-bit shared-memory load of an fp32 pair, not two)."""
    if R == 0:
        return tl.reshape(tl.permute(tl.reshape(t, [N // 16, 8, 2]), [0, 2, 1]), [N])
    else:
        return tl.reshape(tl.permute(tl.reshape(t, [N // 16, 8, 2, R]), [0, 2, 1, 3]), [N, R])


@triton.jit
def _wgrad_tile(
    dy_ptr, sdn, sdh, sdw, sdc, x_ptr, sxn, sxh, sxw, sxc, pack_ptr, dw_ptr, swk, swc, swr, sws,
    pid, M, CHUNK,
    H, W, C, P, Q, K, Q_MUL, Q_SHR, PQ_MUL, PQ_SHR, CQ, CPQ,
    GROUPS, R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr, SPLIT_K: tl.constexpr, LINEAR: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_C: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
    PTX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UNROLL: tl.constexpr,
    XW: tl.constexpr, DW: tl.constexpr, WHOLE: tl.constexpr,
):
    """One (k-block, c-block, tap, group, split) tile of ``dW[k, c, r, s] = Σ_m dy[m, k] ·
    relu(x[pix(m,r,s), c]·scale[c] + shift[c])`` over rows ``[split·CHUNK, (split+1)·CHUNK)``: stored in
    the weight's dtype and strides without SPLIT_K, else (split-K) as fp32 partials ``dw[split, r, s, k, c]``
    (the number of splits is the grid's; a runtime value, so it costs no compilation of its own).

    Computed transposed, ``dWᵀ[c, k] = Σ_m aᵀ[c, m] · dy[m, k]``: the transformed activation is the
    MMA's first operand, which the tensor cores read from registers (no shared-memory round trip).
    PRO16 (16-bit x): ``a`` in the forward's packed 16-bit form (:mod:`.prologue16`), fp16 vectors
    scaled per channel by 2^−e (e covering |shift| too, so a masked x transforms to a finite value)
    and the accumulator rows back by 2^e; otherwise one fp32 fma per element (:func:`_preact_t`). The
    BLOCK_M output channels go in pieces of ``KP = min(BLOCK_M, BLOCK_N)`` (one accumulator each), so a
    dy piece and the x tile spread their rows over the threads alike and share the row arithmetic.
    A row whose tap falls into the padding (or past the chunk) has both its x and its dy masked to 0,
    so it adds ``relu(shift)·0 = 0``: the padded taps contribute nothing, as zeros of the
    pre-activation would (for a finite shift).

    Rows: with LINEAR (both tensors pixel-linear, H = STRIDE_H·P, W = STRIDE_W·Q) the pointers advance by
    a constant per row block and the padding test is two fixed-point range tests (``CQ``/``CPQ``, see
    :func:`_frac_range`) making one predicate per row (:func:`_both_below`, in inline PTX with PTX);
    otherwise (n, p, q) come from multiply-shift divisions (``Q_MUL``/``Q_SHR`` by Q, ``PQ_MUL``/``PQ_SHR``
    by P·Q). With LINEAR, WHOLE: a row block holds whole output images (BLOCK_R a multiple of P·Q, and
    every block starts at a multiple of BLOCK_R), so a lane's pixel is the same in every block — its
    padding test and a strided conv's step back to its row are computed once, outside the loop. XW,
    DW (> 0): x's and dy's pixel strides as constexprs (LINEAR tiles of ≤ 16 output channels over a
    stride-1 conv; x's channel block then goes into the scalar base pointer), so that a lane's loads
    sit at immediate offsets from one pointer. EVEN_M: every row block is full (no row mask without
    padding; with UNROLL, every pair of row blocks); EVEN_K/EVEN_C: the channel blocks tile Kg/Cg
    exactly (no channel masks). UNROLL 2
    (one output-channel piece, ``configs.wgrad_unroll``): two row blocks per iteration, the second into
    the free second piece's accumulator, summed after the loop, so Triton leaves both dots in flight
    (one accumulator chained through both would wait at depth 0)."""
    if XW > 0:
        sxw = XW
    if DW > 0:
        sdw = DW
    KP: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_M else BLOCK_M
    NKP: tl.constexpr = BLOCK_M // KP
    tl.static_assert(NKP <= 4, "wgrad tiles: BLOCK_M may be at most 4·BLOCK_N (four accumulator pieces)")
    tl.static_assert(UNROLL == 1 or NKP == 1, "wgrad unrolled: one output-channel piece (its second accumulator)")
    Cg = C // GROUPS
    Kg = K // GROUPS
    NKB = tl.cdiv(Kg, BLOCK_M)
    NCB = tl.cdiv(Cg, BLOCK_N)
    kb = pid % NKB
    rest = pid // NKB
    cb = rest % NCB
    rest = rest // NCB
    rs = rest % (R * S)
    rest = rest // (R * S)
    g = rest % GROUPS
    split = rest // GROUPS
    r = rs // S
    s = rs - r * S
    offs_c = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = offs_c < Cg
    c_in = g * Cg + offs_c
    # fixed channels: the transform's vectors are derived once, outside the loop
    sc, sh = _scale_shift(pack_ptr, c_in, c_mask, C)
    X16: tl.constexpr = PRO16 != 0 and (x_ptr.dtype.element_ty == tl.float16
                                         or x_ptr.dtype.element_ty == tl.bfloat16)
    SCALED: tl.constexpr = X16 and x_ptr.dtype.element_ty == tl.float16
    if X16:
        nm16, s16, b16 = _vectors16_of(_load_row(pack_ptr + c_in, c_mask), sc, sh, x_ptr.dtype.element_ty)
    PAIRS: tl.constexpr = not X16 and x_ptr.dtype.element_ty == tl.float32 and DOT_DTYPE != tl.float32 \
        and BLOCK_N % 16 == 0
    if PAIRS:
        sc = _pair_rows(sc, BLOCK_N, 0)
        sh = _pair_rows(sh, BLOCK_N, 0)
    dh = r * DIL_H - PAD_H
    dw_ = s * DIL_W - PAD_W
    PADDED: tl.constexpr = R * S > 1 or PAD_H > 0 or PAD_W > 0
    USE_ROWS: tl.constexpr = PADDED or not EVEN_M
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, M)
    lanes = tl.arange(0, BLOCK_R)
    if LINEAR:
        # Output row m reads input pixel STRIDE_H·STRIDE_W·m − STRIDE_W·(STRIDE_H − 1)·(m mod Q) + dh·W + dw,
        # and the tap is inside the image iff m mod P·Q ∈ [pa·Q, pb·Q) and m mod Q ∈ [qa, qb).
        lu = (start + lanes).to(tl.uint32, bitcast=True)
        if XW > 0:
            # the channel base in the scalar pointer: a lane's offsets in the tile are then constants
            # apart, which its loads take as immediates (the pixel stride XW is a constexpr)
            x_inv = tl.arange(0, BLOCK_N)[:, None] * sxc + (lanes * (STRIDE_H * STRIDE_W * sxw))[None, :]
            x_first = x_ptr + ((g * Cg + cb * BLOCK_N) * sxc + dh * sxh + dw_ * sxw)
        else:
            x_inv = c_in[:, None] * sxc + (lanes * (STRIDE_H * STRIDE_W * sxw))[None, :]
            x_first = x_ptr + (dh * sxh + dw_ * sxw)
        x_first += start.to(tl.int64) * (STRIDE_H * STRIDE_W * sxw)
        dy_first = dy_ptr + start.to(tl.int64) * sdw
        cq = CQ.to(tl.uint32, bitcast=True)
        if PADDED:
            pa = tl.maximum(_cdiv_signed(-dh, STRIDE_H), 0)
            pb = tl.minimum(_cdiv_signed(H - dh, STRIDE_H), P)
            qa = tl.maximum(_cdiv_signed(-dw_, STRIDE_W), 0)
            qb = tl.minimum(_cdiv_signed(W - dw_, STRIDE_W), Q)
            c_p, off_p, span_p = _frac_range(CPQ.to(tl.uint32, bitcast=True), pa * Q, pb * Q, P * Q)
            c_q, off_q, span_q = _frac_range(cq, qa, qb, Q)
            lp = lu * c_p + off_p
            lq = lu * c_q + off_q
            if WHOLE:  # a lane's pixel is the same in every row block: its padding test too
                inside0 = _both_below(lp, span_p, lq, span_q, PTX)
        if WHOLE and STRIDE_H > 1:  # ... and its column, and so the step back to it
            q0 = tl.umulhi(lu * cq, Q.to(tl.uint32)).to(tl.int32, bitcast=True)
            x_inv -= (q0 * (STRIDE_W * (STRIDE_H - 1) * sxw))[None, :]
    else:
        qmul = Q_MUL.to(tl.uint32, bitcast=True)
        qshr = Q_SHR.to(tl.uint32, bitcast=True)
        pqmul = PQ_MUL.to(tl.uint32, bitcast=True)
        pqshr = PQ_SHR.to(tl.uint32, bitcast=True)
        x_base = x_ptr + c_in[:, None] * sxc
    # A split past the rows still writes its (zero) partials; every other program runs the loop at least
    # once, which keeps ptxas from serializing the wgmma pipeline over a zero-trip path (advisory C7515).
    if start < end:
        acc0 = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        for m00 in range(start, end, UNROLL * BLOCK_R):
            for j in tl.static_range(UNROLL):
                m0 = m00 + j * BLOCK_R
                offs_m = m0 + lanes
                valid = offs_m < end
                if LINEAR:
                    it = (m0 - start).to(tl.uint32, bitcast=True)
                    if PADDED:
                        if WHOLE:
                            inside = inside0
                        else:
                            inside = _both_below(lp + it * c_p, span_p, lq + it * c_q, span_q, PTX)
                        valid = inside if EVEN_M else valid & inside
                    rel = m0 - start
                    if IDX64:
                        rel = rel.to(tl.int64)
                    if STRIDE_H > 1 and not WHOLE:
                        q = tl.umulhi(lu * cq + it * cq, Q.to(tl.uint32)).to(tl.int32, bitcast=True)
                        back = q * (STRIDE_W * (STRIDE_H - 1) * sxw)
                        xp = x_first + rel * (STRIDE_H * STRIDE_W * sxw) + (x_inv - back[None, :])
                    else:
                        xp = x_first + rel * (STRIDE_H * STRIDE_W * sxw) + x_inv
                    dy_rows = dy_first + rel * sdw
                    dy_off = (lanes * sdw)[:, None]
                else:
                    nb = _udiv(offs_m, pqmul, pqshr)
                    idx = offs_m - nb * (P * Q)
                    p = _udiv(idx, qmul, qshr)
                    q = idx - p * Q
                    if IDX64:
                        nb = nb.to(tl.int64)
                    ih = p * STRIDE_H + dh
                    iw = q * STRIDE_W + dw_
                    if PADDED:
                        inside = _both_below(ih.to(tl.uint32, bitcast=True), H, iw.to(tl.uint32, bitcast=True), W, PTX)
                        valid = inside if EVEN_M else valid & inside
                    xp = x_base + (nb * sxn + ih * sxh + iw * sxw)[None, :]
                    dy_rows = dy_ptr
                    dy_off = (nb * sdn + p * sdh + q * sdw)[:, None]
                if USE_ROWS:
                    if EVEN_C:
                        xt = tl.load(xp, mask=valid[None, :], other=0.0)
                    else:
                        xt = tl.load(xp, mask=c_mask[:, None] & valid[None, :], other=0.0)
                else:
                    if EVEN_C:
                        xt = tl.load(xp)
                    else:
                        xt = tl.load(xp, mask=c_mask[:, None], other=0.0)
                if PAIRS:
                    xt = _pair_rows(xt, BLOCK_N, BLOCK_R)
                if X16:
                    at = _preact16_t(xt, nm16, s16, b16, PRO16 == 2).to(DOT_DTYPE)
                else:
                    at = _preact_t(xt, sc, sh, DOT_DTYPE, PRO16 == 2)
                acc0, acc1, acc2, acc3 = _dots(acc0, acc1, acc2, acc3, at, dy_rows, dy_off, kb, Kg, g, sdc, valid, j,
                                               USE_ROWS, EVEN_K, NKP, KP, BLOCK_M, DOT_DTYPE, INPUT_PRECISION)
        _store_tile(dw_ptr, acc0, acc1, acc2, acc3, pack_ptr, x_ptr, sc, sh, offs_c, c_mask, c_in, kb, Kg, Cg, K, g, r, s,
                    rs, split, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, PAIRS, UNROLL, NKP, KP, BLOCK_M, BLOCK_N)
    elif SPLIT_K:
        zero = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        for j in tl.static_range(NKP):
            _dw_piece(dw_ptr, zero, kb, j, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws, R, S,
                      SPLIT_K, KP, BLOCK_M)


@triton.jit(do_not_specialize=("num_parts", "M", "CHUNK", "NUM_WGRAD", "H", "W", "P", "Q", "Q_MUL", "Q_SHR", "PQ_MUL",
                                "PQ_SHR", "CQ", "CPQ"))
def _wgrad_kernel(
    dy_ptr, sdn, sdh, sdw, sdc,
    x_ptr, sxn, sxh, sxw, sxc,
    pack_ptr,
    dw_ptr, swk, swc, swr, sws,
    psum_ptr, num_parts, gbeta_ptr, ggamma_ptr, coef_ptr, inv_count,
    M, CHUNK, NUM_WGRAD,
    H, W, C, P, Q, K, Q_MUL, Q_SHR, PQ_MUL, PQ_SHR, CQ, CPQ,
    GROUPS, R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr, SPLIT_K: tl.constexpr, LINEAR: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_C: tl.constexpr,
    SUM_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
    PTX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr, UNROLL: tl.constexpr, XW: tl.constexpr = 0, DW: tl.constexpr = 0,
    WHOLE: tl.constexpr = False,
):
    """Two roles in one launch (1-D grid), each needing only what the dgrad launch before it wrote.

    Programs ``[0, NUM_WGRAD)``: :func:`_wgrad_tile` of the conv (x, dy, its geometry).
    The remaining programs fold the dgrad tiles' partial Σdz, Σdz·x̂ for BLOCK_C channels each
    (:func:`.kernels_grad._fold_sums`; SUM_MODE 1: batch statistics, 2: statistics given from outside,
    0: no sums, a projection shortcut's own wgrad launch).
    """
    pid = tl.program_id(0)
    if pid < NUM_WGRAD:
        _wgrad_tile(dy_ptr, sdn, sdh, sdw, sdc, x_ptr, sxn, sxh, sxw, sxc, pack_ptr, dw_ptr, swk, swc, swr, sws,
                    pid, M, CHUNK, H, W, C, P, Q, K, Q_MUL, Q_SHR, PQ_MUL, PQ_SHR, CQ, CPQ, GROUPS, R, S,
                    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SPLIT_K, LINEAR, EVEN_M, EVEN_K, EVEN_C,
                    DOT_DTYPE, INPUT_PRECISION, IDX64, PRO16, PTX, BLOCK_M, BLOCK_N, BLOCK_R, UNROLL, XW, DW, WHOLE)
    elif SUM_MODE != 0:
        _fold_sums(pack_ptr, psum_ptr, num_parts, gbeta_ptr, ggamma_ptr, coef_ptr, inv_count, C, pid - NUM_WGRAD,
                   SUM_MODE, HAS_GAMMA, BLOCK_C, BLOCK_P)


@triton.jit
def _dots(acc0, acc1, acc2, acc3, at, dy_rows, dy_off, kb, Kg, g, sdc, valid, j: tl.constexpr, USE_ROWS: tl.constexpr,
          EVEN_K: tl.constexpr, NKP: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, DOT_DTYPE: tl.constexpr,
          INPUT_PRECISION: tl.constexpr):
    """One row block of :func:`_wgrad_tile`'s loop: the transformed activation ``at`` times each of the
    tile's NKP output-channel pieces of dy, into acc0..acc3 (row block ``j`` of an UNROLL 2 iteration:
    its second one into acc1)."""
    dyt = _dy_piece(dy_rows, dy_off, kb, 0, Kg, g, sdc, valid, USE_ROWS, EVEN_K, KP, BLOCK_M)
    if j == 0:
        acc0 = tl.dot(at, dyt.to(DOT_DTYPE), acc0, input_precision=INPUT_PRECISION)
    else:  # UNROLL 2 (one output-channel piece): the second row block into acc1
        acc1 = tl.dot(at, dyt.to(DOT_DTYPE), acc1, input_precision=INPUT_PRECISION)
    if NKP > 1:
        dyt = _dy_piece(dy_rows, dy_off, kb, 1, Kg, g, sdc, valid, USE_ROWS, EVEN_K, KP, BLOCK_M)
        acc1 = tl.dot(at, dyt.to(DOT_DTYPE), acc1, input_precision=INPUT_PRECISION)
    if NKP > 2:
        dyt = _dy_piece(dy_rows, dy_off, kb, 2, Kg, g, sdc, valid, USE_ROWS, EVEN_K, KP, BLOCK_M)
        acc2 = tl.dot(at, dyt.to(DOT_DTYPE), acc2, input_precision=INPUT_PRECISION)
        dyt = _dy_piece(dy_rows, dy_off, kb, 3, Kg, g, sdc, valid, USE_ROWS, EVEN_K, KP, BLOCK_M)
        acc3 = tl.dot(at, dyt.to(DOT_DTYPE), acc3, input_precision=INPUT_PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_tile(dw_ptr, acc0, acc1, acc2, acc3, pack_ptr, x_ptr, sc, sh, offs_c, c_mask, c_in, kb, Kg, Cg, K, g, r, s, rs,
                split, swk, swc, swr, sws, R: tl.constexpr, S: tl.constexpr, SPLIT_K: tl.constexpr,
                SCALED: tl.constexpr, PAIRS: tl.constexpr, UNROLL: tl.constexpr, NKP: tl.constexpr, KP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_wgrad_tile`'s epilogue: the UNROLL 2 accumulators summed, fp16's per-channel 2^e scale
    undone (SCALED), the channel order of PAIRS restored, and the NKP pieces stored
    (:func:`.kernels_grad._dw_piece`)."""
    if UNROLL == 2:
        acc0 += acc1
    if SCALED:  # 2^e per input channel (a row of dWᵀ): exact; e again (not held through the loop)
        mean = _load_row(pack_ptr + c_in, c_mask)
        up = _pow2(_channel_exponent(mean, sc, sh, x_ptr.dtype.element_ty))[:, None]
        acc0 *= up
        acc1 *= up
        acc2 *= up
        acc3 *= up
    if PAIRS:
        offs_c = _pair_rows(offs_c, BLOCK_N, 0)
        c_mask = _pair_rows(c_mask, BLOCK_N, 0)
    _dw_piece(dw_ptr, acc0, kb, 0, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws, R, S, SPLIT_K,
              KP, BLOCK_M)
    if NKP > 1:
        _dw_piece(dw_ptr, acc1, kb, 1, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws, R, S,
                  SPLIT_K, KP, BLOCK_M)
    if NKP > 2:
        _dw_piece(dw_ptr, acc2, kb, 2, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws, R, S,
                  SPLIT_K, KP, BLOCK_M)
        _dw_piece(dw_ptr, acc3, kb, 3, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws, R, S,
                  SPLIT_K, KP, BLOCK_M)
