"""Triton kernels of the fused BN→ReLU→Conv2d: dgrad and wgrad as implicit GEMMs (fp32 accumulation), and
the transform helpers they share with the fprop kernel (:mod:`.kernels_fprop`).

Every kernel walks its whole reduction — filter taps × channel chunks — as ONE flat loop, so Triton
software-pipelines it (``num_stages``): the loads of iteration i+1.. are in flight while iteration i
transforms its tile and feeds the tensor cores. The filter's structure (R, S, stride, padding,
dilation) is ``tl.constexpr``, so tap arithmetic folds; sizes (channels, spatial extents, batch) are
runtime values, so one compiled kernel serves every layer of the same filter structure (a ResNet has
four: 3×3 and 1×1, stride 1 and 2) instead of one compile per layer. Triton specializes a runtime int
equal to 1 and 16-divisible ints and strides, which is what turns channels_last loads into 16-byte
vector loads; that matters for channel counts and strides only, so the spatial sizes and row counts
(M, H, W, P, Q, …) are ``do_not_specialize``: a 56² and a 28² layer share one compilation (the
split-K count is a runtime value too).

Tensors (logical shapes; every activation is addressed through its (n, h, w, c) strides, so NCHW and
channels_last inputs and expanded gradients are read in place):
    x         (N, H, W, C)   BN input of the conv            w   (K, C/groups, R, S) weight, any strides
    y, dy     (N, P, Q, K)   conv output / its gradient      pack (9, C) fp32: mean, var, invstd, scale, shift, scratch, γ
    part      (tiles, 2, K)  fp32 per-tile (mean, M2) of y   psum (tiles, 2, C) fp32 per-tile (Σdz, Σdz·x̂)

The pre-activation is ``a = relu(x·scale + shift)`` with PyTorch's NaN semantics (``relu(NaN) = NaN``,
``relu(-inf) = 0``), and the conv's padded taps are zeros of ``a`` — masked after the transform
(a padded ``a`` is 0, not ``relu(shift)``). wgrad computes ``a`` of 16-bit inputs as the forward does
(:mod:`.prologue16`); dgrad decides the ReLU mask in fp32. ReLU's backward mask is
``threshold_backward``'s ``a <= 0 → 0``, so a NaN activation passes its gradient, as in eager PyTorch.

Source of the dataflow: docs/design.md; semantics: ``F.batch_norm`` → ``F.relu`` → ``F.conv2d``.
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
    _round_to,
    _udiv,
)
from fused_preact.ops.triton.prologue16 import _channel_exponent, _pow2, _preact16_t, _relu_round, _vectors16_of

# Rows of a pack: per-channel fp32 vectors of one BatchNorm, written by the finalize kernel (rows 0-4
# and PACK_GAMMA: γ, 1 without affine parameters).
PACK_MEAN, PACK_VAR, PACK_INVSTD, PACK_SCALE, PACK_SHIFT = 0, 1, 2, 3, 4
#: Rows PACK_ROWS16.. (three rows of C fp32 words) are the fprop kernel's scratch: the 16-bit prologue
#: vectors it derives from rows 0-4 (``kernels_fprop._write_pack16``), or for an fp32 input under fp16
#: operands the scaled fp32 scale and shift (``kernels_fprop._write_scaled32``).
PACK_ROWS16 = tl.constexpr(5)
PACK_GAMMA = 8
PACK_ROWS = 9


@triton.jit
def _relu_nan(z):
    """``relu`` keeping NaN (``tl.maximum(z, 0)`` would return 0 for NaN)."""
    return tl.where(z < 0.0, 0.0, z)


@triton.jit
def _load_row(ptrs, mask):
    """``tl.load(ptrs)`` where ``mask`` is None, else masked with 0 for the masked-off entries."""
    if mask is None:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _scale_shift(pack_ptr, chans, cmask, C):
    """The pack's scale and shift rows at channels ``chans`` (0 where ``cmask`` is False; ``cmask`` None:
    every channel exists). Masked loads of contiguous channels (not clamped indices), so the compiler
    can prove contiguity: vector loads."""
    sc = _load_row(pack_ptr + 3 * C + chans, cmask)
    sh = _load_row(pack_ptr + 4 * C + chans, cmask)
    return sc, sh


@triton.jit
def _preact(xt, sc, sh, mask):
    """``relu(x·scale + shift)`` of a loaded x tile in fp32 (one fused multiply-add: a single rounding,
    as eager's ``x·alpha + beta`` batch norm), zero where ``mask`` is False (padding, tails): the padded
    taps of the conv input are zeros of the pre-activation."""
    a = _relu_nan(tl.fma(xt.to(tl.float32), sc[None, :], sh[None, :]))
    return tl.where(mask, a, 0.0)


@triton.jit(do_not_specialize=("M", "H", "W", "P", "Q", "P2", "Q2"))
def _dgrad_kernel(
    dy_ptr, sdn, sdh, sdw, sdc,
    w_ptr, swk, swc, swr, sws,
    dy2_ptr, sd2n, sd2h, sd2w, sd2c,
    w2_ptr, sw2k, sw2c,
    x_ptr, sxn, sxh, sxw, sxc,
    pack_ptr,
    out_ptr, son, soh, sow, soc,
    res_ptr, srn, srh, srw, src,
    psum_ptr,
    M,
    H, W, C, P, Q, K,
    GROUPS, R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    P2, Q2, K2, STRIDE2: tl.constexpr,
    HAS_PROJ: tl.constexpr, WRITE_DX: tl.constexpr, HAS_RES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K2: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr, ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K2: tl.constexpr,
    SLOTS: tl.constexpr, STEPS: tl.constexpr,
):
    """``da[m, c] = Σ_{r,s,k} dy[pix⁻¹(m,r,s), k] · w[k, c, r, s]``; epilogue: the ReLU mask recomputed
    from x, ``dz = da·[x·scale + shift > 0]`` (threshold_backward: a NaN activation passes), and the
    tile's column sums Σdz, Σdz·x̂ into row ``pid_m`` of ``psum``.

    Stores ``dz`` (training: the dx pass finishes BN's backward) or, with WRITE_DX (eval mode or
    externally given statistics), ``dx = (dz·invstd)·γ`` plus, with HAS_RES, the gradient ``res`` that
    reaches x through an identity shortcut. HAS_PROJ adds the dgrad of a 1×1, stride-``STRIDE2``
    projection shortcut (``dy2``, ``w2`` (K2, C)) to ``da`` before the mask: conv1 and the projection
    read the same pre-activation. Grid: (cdiv(M, BLOCK_M), cdiv(C/GROUPS, BLOCK_N), GROUPS), or with a
    stride > 1 and no dilation (phases, see below) (cdiv(N·⌈H/STRIDE_H⌉·⌈W/STRIDE_W⌉, BLOCK_M), …,
    GROUPS·STRIDE_H·STRIDE_W); the sums then go to row ``phase·grid[0] + pid_m``.

    SLOTS > 1 (few output channels, ``K/GROUPS ≤ BLOCK_K / SLOTS``, stride 1 or phases, at most 32 taps):
    a reduction step covers one filter row, SLOTS taps side by side (column j of the dy tile: tap
    ``s = j // (BLOCK_K / SLOTS)`` of the row, output channel ``j % (BLOCK_K / SLOTS)``; slots past the
    row's taps masked), so the loop runs once per filter row instead of once per tap: a 16-channel
    step alone is one 8-clock MMA, under the loop's fixed cost.

    STEPS: 0, or 1 for a 1×1, stride 1, whose output channels per group fit one BLOCK_K step and whose
    projection's K2 fits one BLOCK_K2 step: constant trip counts, so Triton folds the loops into their
    one step (no pipeline, one stage of shared memory).
    """
    Cg = C // GROUPS
    Kg = K // GROUPS
    NUM_KK = tl.cdiv(Kg, BLOCK_K)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PHASED: tl.constexpr = (STRIDE_H > 1 or STRIDE_W > 1) and DIL_H == 1 and DIL_W == 1
    if PHASED:
        # Strided dgrad by phases (as CUTLASS's strided dgrad): the programs of phase (ph, pw) cover the
        # pixels with h ≡ ph (mod STRIDE_H), w ≡ pw (mod STRIDE_W), and loop only over the taps that
        # reach them — r ≡ ph + PAD_H (mod STRIDE_H) — instead of masking 1 − 1/stride² of the MMAs.
        g = tl.program_id(2) % GROUPS
        phase = tl.program_id(2) // GROUPS
        ph0 = phase // STRIDE_W
        pw0 = phase % STRIDE_W
        Hp = tl.cdiv(H - ph0, STRIDE_H)
        Wp = tl.cdiv(W - pw0, STRIDE_W)
        r0 = (ph0 + PAD_H) % STRIDE_H
        s0 = (pw0 + PAD_W) % STRIDE_W
        NR = tl.cdiv(R - r0, STRIDE_H)
        NS = tl.cdiv(S - s0, STRIDE_W)
        step_h = STRIDE_H
        step_w = STRIDE_W
        part_row = phase * tl.num_programs(0) + pid_m
    else:
        g = tl.program_id(2)
        ph0 = 0
        pw0 = 0
        r0 = 0
        s0 = 0
        Hp = H
        Wp = W
        NR = R
        NS = S
        step_h = 1
        step_w = 1
        part_row = pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M // (H * W) * (Hp * Wp)
    n_mask = offs_n < Cg
    c_in = g * Cg + offs_n
    wq = offs_m % Wp
    hq = (offs_m // Wp) % Hp
    nb = offs_m // (Hp * Wp)
    wi = pw0 + wq * step_w
    hi = ph0 + hq * step_h
    if IDX64:
        nb = nb.to(tl.int64)
    dbase = nb * sdn
    # Loop-invariant parts of the operand offsets: a step of the loop adds scalars only.
    arange_k = tl.arange(0, BLOCK_K)
    dy_k = ((g * Kg + arange_k) * sdc)[None, :]
    w_inv = ((g * Kg + arange_k) * swk)[:, None] + (offs_n * swc)[None, :]
    if EVEN_N:
        w_mask_n = None
    else:
        w_mask_n = n_mask[None, :]
    # Row and column of the output pixel a tap reads are (hq + oh, wq + ow) with per-tap scalars
    # oh, ow: stride 1 (oh = PAD_H - r·DIL_H) or phases (oh = (ph0 + PAD_H - r) / STRIDE_H, exact).
    DIRECT: tl.constexpr = PHASED or (STRIDE_H == 1 and STRIDE_W == 1)
    # TAPBITS: bit r·S + s of a row's ``taps`` says whether tap (r, s) reads inside dy (and the row is
    # inside the tile), computed once; a step of the loop then tests one bit per row.
    TAPBITS: tl.constexpr = DIRECT and R * S > 1 and R * S <= 32
    if DIRECT:
        dy_row = dbase + hq * sdh + wq * sdw
    if TAPBITS:
        hbits = tl.zeros([BLOCK_M], dtype=tl.int32)
        for rb in tl.static_range(R):
            if PHASED:
                ohb = (ph0 + PAD_H - rb) // STRIDE_H
            else:
                ohb = PAD_H - rb * DIL_H
            hbits |= ((hq + ohb).to(tl.uint32, bitcast=True) < P).to(tl.int32) << rb
        taps = tl.zeros([BLOCK_M], dtype=tl.int32)
        for sb in tl.static_range(S):
            if PHASED:
                owb = (pw0 + PAD_W - sb) // STRIDE_W
            else:
                owb = PAD_W - sb * DIL_W
            okw = (wq + owb).to(tl.uint32, bitcast=True) < Q
            for rb in tl.static_range(R):
                taps |= (okw & (((hbits >> rb) & 1) != 0)).to(tl.int32) << (rb * S + sb)
        taps = tl.where(m_mask, taps, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SLOTS > 1:
        # One filter row per step (see the docstring): the slots' columns, offsets and tap bits are
        # loop-invariant; a step adds the row's scalar offsets and shifts the rows' tap words.
        KC: tl.constexpr = BLOCK_K // SLOTS
        slot = arange_k // KC
        ch = arange_k % KC
        s_col = s0 + slot * step_w
        if PHASED:
            ow_col = (pw0 + PAD_W - s_col) // STRIDE_W
        else:
            ow_col = PAD_W - s_col * DIL_W
        if EVEN_K:
            col_ok = slot < NS
        else:
            col_ok = (slot < NS) & (ch < Kg)
        dy_cols = ((g * Kg + ch) * sdc + ow_col * sdw)[None, :]
        w_cols = ((g * Kg + ch) * swk + s_col * sws)[:, None] + (offs_n * swc)[None, :]
        w_ok = col_ok[:, None] & n_mask[None, :]
        # a column's bit of the rows' tap words in filter row 0 (0 for a masked column): a step shifts
        # it by the row (one shift per column, not per row) and each row tests it with one AND
        col_bit = tl.where(col_ok, 1 << s_col, 0)
        # the filter row's dy row offset, tap-bit shift and weight offset, advanced by a step each
        if PHASED:
            oh = (ph0 + PAD_H - r0) // STRIDE_H
            oh_step = 1
        else:
            oh = PAD_H
            oh_step = DIL_H
        shift = r0 * S
        w_r = r0 * swr
        # 64-bit row pointers built once: a step adds one scalar (a wide multiply-add per vector load,
        # where offsets rebuilt a pointer from a 32-bit sum each step)
        dy_slots = dy_ptr + (dy_row[:, None] + dy_cols)
        for it in range(NR * NUM_KK):  # NUM_KK is 1 here (a runtime 1: the loop stays a loop)
            valid = (taps[:, None] & (col_bit << shift)[None, :]) != 0
            dyt = tl.load(dy_slots + oh * sdh, mask=valid, other=0.0)
            wt = tl.load(w_ptr + (w_cols + w_r), mask=w_ok, other=0.0)
            acc = tl.dot(dyt.to(DOT_DTYPE), wt.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
            oh -= oh_step
            shift += step_h * S
            w_r += step_h * swr
    else:
        kk = 0
        ss = 0
        rr = 0
        tl.static_assert(STEPS == 0 or (STEPS == 1 and R * S == 1 and not PHASED), "STEPS: a 1x1 of stride 1")
        if DIRECT:
            dy_rows = dy_ptr + (dy_row[:, None] + dy_k)  # as dy_slots above
        for t in range(1 if STEPS else NR * NS * NUM_KK):
            if R * S == 1:
                k0 = t * BLOCK_K
                r = r0
                s = s0
            else:
                k0 = kk * BLOCK_K
                r = r0 + rr * step_h
                s = s0 + ss * step_w
                kk += 1
                wrap = kk == NUM_KK
                kk = tl.where(wrap, 0, kk)
                ss = tl.where(wrap, ss + 1, ss)
                wrap2 = ss == NS
                ss = tl.where(wrap2, 0, ss)
                rr = tl.where(wrap2, rr + 1, rr)
            if DIRECT:
                if PHASED:
                    oh = (ph0 + PAD_H - r) // STRIDE_H
                    ow = (pw0 + PAD_W - s) // STRIDE_W
                else:
                    oh = PAD_H - r * DIL_H
                    ow = PAD_W - s * DIL_W
                if TAPBITS:
                    valid = (taps & (1 << (r * S + s))) != 0
                else:
                    valid = m_mask & ((hq + oh).to(tl.uint32, bitcast=True) < P) & \
                        ((wq + ow).to(tl.uint32, bitcast=True) < Q)
                dy_src = dy_rows + (oh * sdh + ow * sdw + k0 * sdc)
            else:
                ph = hi + PAD_H - r * DIL_H
                pw = wi + PAD_W - s * DIL_W
                if STRIDE_H == 1:
                    p = ph
                    ok_h = (ph >= 0) & (ph < P)
                else:
                    phc = tl.where(ph >= 0, ph, 0)
                    p = phc // STRIDE_H
                    ok_h = (ph >= 0) & (p * STRIDE_H == phc) & (p < P)
                if STRIDE_W == 1:
                    qq = pw
                    ok_w = (pw >= 0) & (pw < Q)
                else:
                    pwc = tl.where(pw >= 0, pw, 0)
                    qq = pwc // STRIDE_W
                    ok_w = (pw >= 0) & (qq * STRIDE_W == pwc) & (qq < Q)
                valid = m_mask & ok_h & ok_w
                dy_src = dy_ptr + (dbase + p * sdh + qq * sdw + k0 * sdc)[:, None] + dy_k
            if EVEN_K:
                dyt = tl.load(dy_src, mask=valid[:, None], other=0.0)
                if EVEN_N:
                    wt = tl.load(w_ptr + (w_inv + (k0 * swk + r * swr + s * sws)))
                else:
                    wt = tl.load(w_ptr + (w_inv + (k0 * swk + r * swr + s * sws)), mask=w_mask_n, other=0.0)
            else:
                k_ok = (k0 + arange_k) < Kg
                dyt = tl.load(dy_src, mask=valid[:, None] & k_ok[None, :], other=0.0)
                wt = tl.load(w_ptr + (w_inv + (k0 * swk + r * swr + s * sws)), mask=k_ok[:, None] & n_mask[None, :],
                             other=0.0)
            acc = tl.dot(dyt.to(DOT_DTYPE), wt.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    if HAS_PROJ:
        # 1×1, stride STRIDE2, no padding, groups == 1: only pixels on the stride grid receive gradient.
        on_grid = m_mask & (hi % STRIDE2 == 0) & (wi % STRIDE2 == 0)
        row2 = nb * sd2n + (hi // STRIDE2) * sd2h + (wi // STRIDE2) * sd2w
        arange_k2 = tl.arange(0, BLOCK_K2)
        dy2_ptrs = dy2_ptr + row2[:, None] + (arange_k2 * sd2c)[None, :]
        w2_ptrs = w2_ptr + (arange_k2 * sw2k)[:, None] + (c_in * sw2c)[None, :]  # groups=1: the global channel
        for k0 in range(0, BLOCK_K2 if STEPS else K2, BLOCK_K2):
            if EVEN_K2:
                dyt2 = tl.load(dy2_ptrs + k0 * sd2c, mask=on_grid[:, None], other=0.0)
                if EVEN_N:
                    wt2 = tl.load(w2_ptrs + k0 * sw2k)
                else:
                    wt2 = tl.load(w2_ptrs + k0 * sw2k, mask=w_mask_n, other=0.0)
            else:
                k_ok = (k0 + arange_k2) < K2
                dyt2 = tl.load(dy2_ptrs + k0 * sd2c, mask=on_grid[:, None] & k_ok[None, :], other=0.0)
                wt2 = tl.load(w2_ptrs + k0 * sw2k, mask=k_ok[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(dyt2.to(DOT_DTYPE), wt2.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    tile_mask = m_mask[:, None] & n_mask[None, :]
    xrow = nb * sxn + hi * sxh + wi * sxw
    xt = tl.load(x_ptr + xrow[:, None] + c_in[None, :] * sxc, mask=tile_mask, other=0.0).to(tl.float32)
    mu = tl.load(pack_ptr + c_in, mask=n_mask, other=0.0)
    istd = tl.load(pack_ptr + 2 * C + c_in, mask=n_mask, other=0.0)
    sc, sh = _scale_shift(pack_ptr, c_in, n_mask, C)
    # The mask is decided in fp32 (one rounding), also for 16-bit inputs: a decision taken on the
    # forward's 16-bit transform follows its rounded kink, and each flip moves a gradient element by
    # its whole value (tried: dx of a bf16 eval-mode test 0.28 off float64, 7x its tolerance).
    z = tl.fma(xt, sc[None, :], sh[None, :])
    dz = tl.where(tile_mask & ~(z <= 0.0), acc, 0.0)
    orow = nb * son + hi * soh + wi * sow
    optr = out_ptr + orow[:, None] + c_in[None, :] * soc
    if WRITE_DX:  # dz·invstd·γ, γ last (as eager: a γ near fp32's range does not overflow invstd·γ)
        gam = tl.load(pack_ptr + 8 * C + c_in, mask=n_mask, other=0.0)
        dx = (dz * istd[None, :]) * gam[None, :]
        if HAS_RES:
            rrow = nb * srn + hi * srh + wi * srw
            dx += tl.load(res_ptr + rrow[:, None] + c_in[None, :] * src, mask=tile_mask, other=0.0).to(tl.float32)
        tl.store(optr, dx.to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        dzr = _round_to(dz, out_ptr.dtype.element_ty, ASM)
        tl.store(optr, dzr, mask=tile_mask)
        dz = dzr.to(tl.float32)  # the sums see exactly what the dx pass will read
    xhat = tl.where(tile_mask, (xt - mu[None, :]) * istd[None, :], 0.0)
    prow = psum_ptr + part_row.to(tl.int64) * (2 * C) + c_in
    tl.store(prow, tl.sum(dz, axis=0), mask=n_mask)
    tl.store(prow + C, tl.sum(dz * xhat, axis=0), mask=n_mask)


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
