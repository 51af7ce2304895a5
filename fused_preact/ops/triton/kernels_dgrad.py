"""Triton kernel of the fused BN→ReLU→Conv2d's input gradient (dgrad) as an implicit GEMM (fp32
accumulation), with the BatchNorm backward's first half in its epilogue: the ReLU mask recomputed
from x, per-tile Σdz and Σdz·x̂, and dx itself where the statistics are constants.

The reduction — output channels × filter taps — is ONE flat loop, so Triton software-pipelines it
(``num_stages``). The filter's structure is ``tl.constexpr``; sizes are runtime values, the spatial
ones ``do_not_specialize`` (one compilation serves every layer of a filter structure). The kernel
(:func:`_dgrad_kernel`) sets up a tile and its phase and runs one of two main loops — one filter
row per step (SLOTS, few output channels; inline: as a jit helper, Triton 3.6 orders its constants
otherwise and ptxas gives its sm_80 loop 2–3 more instructions) or one tap per step
(:func:`_taps_loop`) — then the projection shortcut's dgrad (:func:`_proj_dgrad`) and the epilogue
(:func:`_dgrad_epilogue`).

Tensors (logical shapes, addressed through their (n, h, w, c) strides; the pack: :mod:`.pack`):
    x   (N, H, W, C)  BN input of the conv       w    (K, C/groups, R, S) weight, any strides
    dy  (N, P, Q, K)  the conv output's gradient psum (tiles, 2, C) fp32 per-tile (Σdz, Σdz·x̂)

ReLU's backward mask is ``threshold_backward``'s ``a <= 0 → 0``, so a NaN activation passes its
gradient, as in eager PyTorch. Source of the dataflow: docs/design.md; semantics: ``F.batch_norm`` →
``F.relu`` → ``F.conv2d``.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_grad import _round_to
from fused_preact.ops.triton.pack import _scale_shift

__all__ = ["_dgrad_kernel"]


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
    else:
        dy_row = dbase  # (unused: the strided path addresses dy per tap)
    if TAPBITS:
        taps = _tap_bits(hq, wq, m_mask, ph0, pw0, P, Q, R, S, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
                         PHASED, BLOCK_M)
    else:
        taps = m_mask  # (unused without tap bits)
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
        acc = _taps_loop(acc, dy_ptr, w_ptr, dy_row, taps, w_inv, w_mask_n, dy_k, arange_k, hq, wq, hi, wi, dbase, m_mask,
                         n_mask, Kg, NR, NS, NUM_KK, ph0, pw0, r0, s0, step_h, step_w, P, Q, sdh, sdw, sdc, swk, swr,
                         sws, R, S, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, PHASED, DIRECT, TAPBITS, EVEN_K,
                         EVEN_N, STEPS, BLOCK_K, DOT_DTYPE, INPUT_PRECISION)
    if HAS_PROJ:
        acc = _proj_dgrad(acc, dy2_ptr, w2_ptr, nb, hi, wi, m_mask, n_mask, w_mask_n, c_in, K2, sd2n, sd2h, sd2w, sd2c,
                          sw2k, sw2c, STRIDE2, EVEN_K2, EVEN_N, STEPS, BLOCK_K2, DOT_DTYPE, INPUT_PRECISION)
    _dgrad_epilogue(acc, x_ptr, sxn, sxh, sxw, sxc, pack_ptr, out_ptr, son, soh, sow, soc, res_ptr, srn, srh, srw, src,
                    psum_ptr, part_row, nb, hi, wi, c_in, m_mask, n_mask, C, WRITE_DX, HAS_RES, ASM)


@triton.jit
def _tap_bits(hq, wq, m_mask, ph0, pw0, P, Q, R: tl.constexpr, S: tl.constexpr, STRIDE_H: tl.constexpr,
              STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr,
              DIL_W: tl.constexpr, PHASED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per row of the tile (output-gradient pixel (hq, wq) of its phase), a word whose bit r·S + s says
    whether tap (r, s) reads inside dy (0 for a row past the tile, ``m_mask``), computed once: a step
    of the main loop then tests one bit per row."""
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
    return taps


@triton.jit
def _on_stride(v, STRIDE: tl.constexpr, LIMIT):
    """(v / STRIDE, whether v is a non-negative multiple of STRIDE below STRIDE·LIMIT): the output
    row (column) that input row (column) ``v`` of a tap reaches through a stride-STRIDE conv."""
    if STRIDE == 1:
        i = v
        ok = (v >= 0) & (v < LIMIT)
    else:
        vc = tl.where(v >= 0, v, 0)
        i = vc // STRIDE
        ok = (v >= 0) & (i * STRIDE == vc) & (i < LIMIT)
    return i, ok


@triton.jit
def _taps_loop(acc, dy_ptr, w_ptr, dy_row, taps, w_inv, w_mask_n, dy_k, arange_k, hq, wq, hi, wi, dbase, m_mask, n_mask,
               Kg, NR, NS, NUM_KK, ph0, pw0, r0, s0, step_h, step_w, P, Q, sdh, sdw, sdc, swk, swr, sws,
               R: tl.constexpr, S: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
               PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
               PHASED: tl.constexpr, DIRECT: tl.constexpr, TAPBITS: tl.constexpr, EVEN_K: tl.constexpr,
               EVEN_N: tl.constexpr, STEPS: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
               INPUT_PRECISION: tl.constexpr):
    """The main loop with one tap × BLOCK_K output channels per step: DIRECT (stride 1 or phases) reads
    dy at per-tap scalar offsets from each row's pixel; otherwise (a dilated strided conv) each row
    tests whether the tap lands on the stride grid (:func:`_on_stride`). Returns ``acc`` plus the
    tile's products."""
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
            p, ok_h = _on_stride(ph, STRIDE_H, P)
            qq, ok_w = _on_stride(pw, STRIDE_W, Q)
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
    return acc


@triton.jit
def _proj_dgrad(acc, dy2_ptr, w2_ptr, nb, hi, wi, m_mask, n_mask, w_mask_n, c_in, K2, sd2n, sd2h, sd2w, sd2c, sw2k,
                sw2c, STRIDE2: tl.constexpr, EVEN_K2: tl.constexpr, EVEN_N: tl.constexpr, STEPS: tl.constexpr,
                BLOCK_K2: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc`` plus the dgrad of the 1×1 projection shortcut (``dy2``, ``w2`` (K2, C)) at the tile's
    pixels: conv1 and the projection read the same pre-activation."""
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
    return acc


@triton.jit
def _dgrad_epilogue(acc, x_ptr, sxn, sxh, sxw, sxc, pack_ptr, out_ptr, son, soh, sow, soc, res_ptr, srn, srh, srw, src,
                    psum_ptr, part_row, nb, hi, wi, c_in, m_mask, n_mask, C, WRITE_DX: tl.constexpr,
                    HAS_RES: tl.constexpr, ASM: tl.constexpr):
    """The ReLU mask recomputed from x in fp32, ``dz = da·[x·scale + shift > 0]``, stored as dz or (WRITE_DX)
    as ``dx = (dz·invstd)·γ`` (+ the identity shortcut's ``res``, HAS_RES), and the tile's column sums
    Σdz, Σdz·x̂ into row ``part_row`` of ``psum``."""
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
