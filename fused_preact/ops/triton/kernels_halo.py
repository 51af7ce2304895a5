"""Triton fprop and wgrad kernels for narrow layers under 16-bit compute: the BN+ReLU prologue applied
once per input pixel of a program's halo, not once per filter tap.

The implicit GEMM of :mod:`.kernels_fprop` transforms every x tile it loads, so a 3×3 filter
transforms each input element 9 times. Over 16 channels one transformed element feeds 16 MACs, and the
transform (three packed instructions per pair of elements) issues more instructions than the tensor
cores take clocks. This kernel stages instead: each program transforms the input pixels its output
tile reads — the tile's rows of the zero-padded image, ``(n·Hp + hp)·Wp + wp`` from the tile's first
output pixel's top-left tap onwards (``HALO`` of them, :func:`~.configs.halo_rows`) — once, stores
them in the operand dtype into its own region of a staging buffer in global memory (padding as zeros),
and after a CTA barrier runs a plain implicit GEMM over that region: a tap (r, s) of output row m reads
staged row ``loc(m) + r·DIL_H·Wp + s·DIL_W``, with no padding mask and no transform in the main loop.
The main loop walks the filter rows (a runtime trip count, so Triton pipelines it) and unrolls the S
taps of a row into three accumulators (each dot's only use in the loop is the next iteration: wgmma
stays in flight; with S > 3 taps s and s + 3 share one); the taps of a row sit at constant offsets
from the row's pointers.

Staging is per program (no program reads another's rows), written with plain stores and read after
``tl.debug_barrier()`` (``bar.sync``, which orders a CTA's global-memory accesses); it is read from
L2. The transform is :mod:`.kernels_fprop`'s, with the same roundings: for a 16-bit x
:func:`.prologue16._preact16` with the vectors of :func:`.prologue16._vectors16`, for an fp32 x
(autocast's first unit) one fp32 fma and :func:`.prologue16._relu_round`; fp16's exponent as there.

Semantics: ``F.batch_norm`` → ``F.relu`` (``relu(NaN) = NaN``, ``relu(−inf) = 0``, a padded tap 0)
→ ``F.conv2d`` (groups 1), then the bias, the identity residual and the output statistics of
:mod:`.kernels_fprop`.

The wgrad kernel (:func:`_wgrad_halo_kernel`) stages the same way for a run of output image rows per
program and reduces over them with one accumulator per tap, reading each tap's rows from the staging
at a constant offset; its products are eager's exactly (a padded tap multiplies a staged zero).
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_fprop import _epilogue, _scale_exponent
from fused_preact.ops.triton.kernels_grad import _dw_piece, _fold_sums
from fused_preact.ops.triton.prologue16 import _pow2, _preact16, _relu_round, _vectors16


@triton.jit
def _stage_halo(x_ptr, sxn, sxh, sxw, sxc, st, i0, HALO, Nimg, H, W, Hp, Wp, v0, v1, v2,
                PAD_H: tl.constexpr, PAD_W: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
                X16: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, STAGE_ROWS: tl.constexpr):
    """Rows ``[i0, i0 + HALO)`` of the zero-padded, transformed input (padded pixel index
    ``(n·Hp + hp)·Wp + wp``) into ``st`` (HALO × BLOCK_K, the operand dtype), 0 in the padding and past
    the last image; inside it, for a 16-bit x (X16) ``relu((x/2 − h̃)·s̃ + b̃)`` (``v0, v1, v2`` = −h̃, s̃,
    b̃ of :func:`.prologue16._vectors16`), for an fp32 x ``relu(x·scale + shift)`` in fp32 rounded to
    DOT_DTYPE (``v0, v1`` = scale, shift, scaled as fp16's e requires; :func:`.prologue16._relu_round`)."""
    kk = tl.arange(0, BLOCK_K)
    for j0 in range(0, HALO, STAGE_ROWS):
        j = j0 + tl.arange(0, STAGE_ROWS)
        idx = i0 + j
        wp = idx % Wp
        t = idx // Wp
        ih = t % Hp - PAD_H
        iw = wp - PAD_W
        nn = t // Hp
        inside = (ih.to(tl.uint32) < tl.cast(H, tl.uint32)) & (iw.to(tl.uint32) < tl.cast(W, tl.uint32)) & (nn < Nimg)
        if IDX64:
            nn = nn.to(tl.int64)
        xo = nn * sxn + ih * sxh + iw * sxw  # outside the image: masked off, never read
        xv = tl.load(x_ptr + xo[:, None] + kk[None, :] * sxc, mask=inside[:, None], other=0.0)
        if X16:
            a = _preact16(xv, v0, v1, v2, tl.where(inside, -1, 0), True, PRO16 == 2)
        else:
            z = tl.where(inside[:, None], tl.fma(xv.to(tl.float32), v0[None, :], v1[None, :]), 0.0)
            a = _relu_round(z, DOT_DTYPE, PRO16 == 2)
        tl.store(st + j[:, None] * BLOCK_K + kk[None, :], a.to(st.dtype.element_ty), mask=(j < HALO)[:, None])


@triton.jit
def _halo_vectors(pack_ptr, C, DT: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The vectors :func:`_stage_halo` takes for an x of dtype DT over C = BLOCK_K channels. fp16 compute:
    one e per call (every channel), as :mod:`.kernels_fprop` — scaled up only for a 16-bit x (an fp32
    x's |x| is not bounded by fp16's range); the caller scales its accumulator back by 2^e."""
    X16: tl.constexpr = DT == tl.float16 or DT == tl.bfloat16
    down = 1.0
    if DOT_DTYPE == tl.float16:
        down = _pow2(-_scale_exponent(pack_ptr, C, pack_ptr, C, False, DOT_DTYPE, X16))
    kk = tl.arange(0, BLOCK_K)
    mean, scale, shift = tl.load(pack_ptr + kk), tl.load(pack_ptr + 3 * C + kk), tl.load(pack_ptr + 4 * C + kk)
    if X16:
        v0, v1, v2 = _vectors16(mean, scale, shift, down, DT)
    else:
        v0, v1, v2 = scale * down, shift * down, mean
    return v0, v1, v2


@triton.jit(do_not_specialize=("M", "H", "W", "P", "Q", "HALO", "R_LOOP"))
def _fprop_halo_kernel(
    x_ptr, sxn, sxh, sxw, sxc,
    w_ptr, swk, swc, swr, sws,
    pack_ptr, bias_ptr,
    xin_ptr, sin_n, sin_h, sin_w, sin_c,
    st_ptr,
    y_ptr, syn, syh, syw, syc,
    part_ptr,
    M, H, W, C, P, Q, K, HALO, R_LOOP,
    R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STATS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGE_ROWS: tl.constexpr,
):
    """``y[m, k] = Σ_{r,s,c} relu(x[pix(m,r,s), c]·scale[c] + shift[c]) · w[k, c, r, s]`` (+ bias[k])
    (+ ``xin`` with HAS_RES; STATS: the tile's mean and M2 of the stored y into row ``pid_m`` of
    ``part``), for an x of C = BLOCK_K channels (one chunk), groups 1, under 16-bit compute.

    Tensors as :func:`.kernels_fprop._fprop_kernel`'s (x, y, xin through their (n, h, w, c) strides;
    ``pack`` (8, C) fp32, read only here). ``st``: the staging buffer, ``cdiv(M, BLOCK_M)·HALO·BLOCK_K``
    elements of DOT_DTYPE, overwritten. x: 16-bit (the packed transform) or fp32 (an fp32 input under
    16-bit compute, autocast's: the fp32 transform, as :mod:`.kernels_fprop`'s). ``R_LOOP`` = R (the
    main loop's trip count at run time). PRO16: 1 — the interpreter form of the 16-bit transform; 2 —
    packed PTX. Rows past M compute row M−1 (never stored). Grid: (cdiv(M, BLOCK_M), cdiv(K, BLOCK_N)).
    """
    tl.static_assert(PRO16 != 0, "the halo kernel takes 16-bit operands")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    Hp = H + 2 * PAD_H
    Wp = W + 2 * PAD_W
    PQ = P * Q
    m0 = pid_m * BLOCK_M
    # the padded pixel of the tile's first output pixel's top-left tap
    i0 = ((m0 // PQ) * Hp + ((m0 // Q) % P) * STRIDE_H) * Wp + (m0 % Q) * STRIDE_W
    DT: tl.constexpr = x_ptr.dtype.element_ty
    X16: tl.constexpr = DT == tl.float16 or DT == tl.bfloat16
    SCALED: tl.constexpr = DOT_DTYPE == tl.float16
    kk = tl.arange(0, BLOCK_K)
    v0, v1, v2 = _halo_vectors(pack_ptr, C, DT, DOT_DTYPE, BLOCK_K)
    st = st_ptr + pid_m.to(tl.int64) * HALO * BLOCK_K
    _stage_halo(x_ptr, sxn, sxh, sxw, sxc, st, i0, HALO, M // PQ, H, W, Hp, Wp, v0, v1, v2,
                PAD_H, PAD_W, IDX64, PRO16, X16, DOT_DTYPE, BLOCK_K, STAGE_ROWS)
    tl.debug_barrier()  # the staged rows, stored by every thread of the CTA, visible to its loads

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < K
    mc = tl.minimum(offs_m, M - 1)
    q = mc % Q
    p = (mc // Q) % P
    nb = mc // PQ
    loc = (nb * Hp + p * STRIDE_H) * Wp + q * STRIDE_W - i0  # the row's top-left tap, staged
    a_row = st + loc[:, None] * BLOCK_K + kk[None, :]
    w_row = w_ptr + offs_n[None, :] * swk + kk[:, None] * swc
    wn_mask = None if EVEN_N else n_mask[None, :]
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    tl.assume(R_LOOP > 0)
    for _ in range(R_LOOP):
        for s in tl.static_range(S):
            a = tl.load(a_row + s * DIL_W * BLOCK_K).to(DOT_DTYPE)
            if wn_mask is None:
                wt = tl.load(w_row + s * sws)
            else:
                wt = tl.load(w_row + s * sws, mask=wn_mask, other=0.0)
            if s % 3 == 0:
                acc0 = tl.dot(a, wt.to(DOT_DTYPE), acc0, input_precision=INPUT_PRECISION)
            elif s % 3 == 1:
                acc1 = tl.dot(a, wt.to(DOT_DTYPE), acc1, input_precision=INPUT_PRECISION)
            else:
                acc2 = tl.dot(a, wt.to(DOT_DTYPE), acc2, input_precision=INPUT_PRECISION)
        a_row += DIL_H * Wp * BLOCK_K
        w_row += swr
    acc = acc0
    if S > 1:
        acc += acc1
    if S > 2:
        acc += acc2
    if SCALED:
        acc = acc * _pow2(_scale_exponent(pack_ptr, C, pack_ptr, C, False, DOT_DTYPE, X16))
    if IDX64:
        nb = nb.to(tl.int64)
    _epilogue(acc, m_mask, n_mask, offs_n, nb, p, q, bias_ptr, xin_ptr, sin_n, sin_h, sin_w, sin_c,
              y_ptr, syn, syh, syw, syc, part_ptr, pid_m, M, K, HAS_BIAS, HAS_RES, STATS, BLOCK_M)


@triton.jit
def _tap_dot(a_ptrs, off: tl.constexpr, dyt, acc, C: tl.constexpr, DOT_DTYPE: tl.constexpr,
             INPUT_PRECISION: tl.constexpr):
    """``acc += aᵀ·dy`` for one filter tap: the staged rows ``off`` (a constant: an immediate offset of
    the loads) past the iteration's ``a_ptrs`` (each lane's row and channel), dy's rows ``dyt``."""
    at = tl.load(a_ptrs + off * C)
    return tl.dot(at.to(DOT_DTYPE), dyt, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _tap_store(dw_ptr, acc, up, r: tl.constexpr, s: tl.constexpr, pid, K, swk, swc, swr, sws,
               R: tl.constexpr, S: tl.constexpr, SPLIT_K: tl.constexpr, SCALED: tl.constexpr, C: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Tap (r, s)'s dWᵀ accumulator (C × BLOCK_M) into dW or, with SPLIT_K, row ``pid`` of the partials
    (:func:`.kernels_grad._dw_piece`); SCALED: times ``up`` = 2^e first."""
    if r < R and s < S:
        if SCALED:
            acc = acc * up
        cc = tl.arange(0, C)
        _dw_piece(dw_ptr, acc, 0, 0, K, C, K, 0, cc, cc < C, r, s, r * S + s, pid, swk, swc, swr, sws, R, S,
                  SPLIT_K, BLOCK_M, BLOCK_M)


@triton.jit(do_not_specialize=("num_parts", "H", "P", "Q", "NP", "HALO", "ROWS", "NUM_WGRAD"))
def _wgrad_halo_kernel(
    dy_ptr, sdn, sdh, sdw, sdc,
    x_ptr, sxn, sxh, sxw, sxc,
    pack_ptr, st_ptr,
    dw_ptr, swk, swc, swr, sws,
    psum_ptr, num_parts, gbeta_ptr, ggamma_ptr, coef_ptr, inv_count,
    NP, HALO, ROWS, NUM_WGRAD, H, P, Q, K,
    W: tl.constexpr, C: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
    DIL_H: tl.constexpr, DIL_W: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    SUM_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, RPI: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    STAGE_ROWS: tl.constexpr,
):
    """The weight gradient through the staged halo, and the fold of the dgrad tiles' sums: the roles of
    :func:`.kernels_wgrad._wgrad_kernel` for an x of C (16 or 32) channels, K ≤ BLOCK_M output channels,
    groups 1, an R × S filter of at most 3 × 3, 16-bit compute.

    Programs ``[0, NUM_WGRAD)`` take ``ROWS`` output image rows each (program i the global rows
    ``[i·ROWS, (i + 1)·ROWS)`` of the N·P = ``NP``): one staging of the padded input pixels their taps
    read (:func:`_stage_halo`, ``HALO`` pixels into the program's own region of ``st``, as the fprop
    kernel's), then ``dWᵀ[c, k, r, s] = Σ_m a[loc(m) + r·DIL_H·Wp + s·DIL_W, c] · dy[m, k]`` over its
    rows, RPI image rows (BLOCK_R = RPI·Q pixels, RPI dividing P: an iteration stays in one image) per
    iteration: dy's rows loaded once for all R·S taps, one accumulator per tap, the taps' rows at
    constant offsets from the iteration's base (W is a constexpr, so they are immediates), no division,
    mask or transform in the loop. A lane's row (``lane // Q``, ``lane mod Q``) is fixed; the base
    moves by RPI image rows per iteration and by the padding rows between images. Stored in dW's dtype
    and strides, or with SPLIT_K as fp32 partials ``[pid, r, s, k, c]`` (NUM_WGRAD of them: a program
    past the rows writes zeros). Only real output pixels enter the sums, and a padded tap reads a
    staged zero: eager's products exactly (a NaN or inf input pixel reaches the taps that read it).

    The other programs fold the sums (:func:`.kernels_grad._fold_sums`). PRO16: as
    :func:`_fprop_halo_kernel`'s; fp16 compute scales the staged rows by 2^−e (:func:`_halo_vectors`)
    and the accumulators back.
    """
    tl.static_assert(PRO16 != 0, "the halo kernel takes 16-bit operands")
    tl.static_assert(R <= 3 and S <= 3, "the halo wgrad holds at most 3 × 3 taps")
    pid = tl.program_id(0)
    if pid < NUM_WGRAD:
        Hp = H + 2 * PAD_H
        Wp: tl.constexpr = W + 2 * PAD_W
        rho0 = pid * ROWS
        n0 = rho0 // P
        p0 = rho0 - n0 * P
        i0 = (n0 * Hp + p0 * STRIDE_H) * Wp
        DT: tl.constexpr = x_ptr.dtype.element_ty
        SCALED: tl.constexpr = DOT_DTYPE == tl.float16
        v0, v1, v2 = _halo_vectors(pack_ptr, C, DT, DOT_DTYPE, C)
        st = st_ptr + pid.to(tl.int64) * HALO * C
        _stage_halo(x_ptr, sxn, sxh, sxw, sxc, st, i0, HALO, NP // P, H, W, Hp, Wp, v0, v1, v2,
                    PAD_H, PAD_W, IDX64, PRO16, DT == tl.float16 or DT == tl.bfloat16, DOT_DTYPE, C, STAGE_ROWS)
        tl.debug_barrier()  # the staged rows, stored by every thread of the CTA, visible to its loads

        kk = tl.arange(0, C)
        lanes = tl.arange(0, BLOCK_R)
        lrow = lanes // Q
        lcol = lanes - lrow * Q
        # the iteration's pointers: staged rows of its taps' top-left ([C, BLOCK_R]), dy's rows ([BLOCK_R,
        # BLOCK_M]); each moves by a scalar per iteration, the taps sit at constant offsets from them
        a_ptrs = st + ((lrow * (STRIDE_H * Wp) + lcol * STRIDE_W)[None, :] * C + kk[:, None])
        ko = tl.arange(0, BLOCK_M)
        dy_lane = (lrow * sdh + lcol * sdw)[:, None] + (ko * sdc)[None, :]
        k_mask = (ko < K)[None, :]
        acc00 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc01 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc02 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc10 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc11 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc12 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc20 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc21 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        acc22 = tl.zeros([C, BLOCK_M], dtype=tl.float32)
        rows = tl.minimum(ROWS, NP - rho0)
        if IDX64:
            dy_ptrs = dy_ptr + n0.to(tl.int64) * sdn + p0 * sdh + dy_lane
        else:
            dy_ptrs = dy_ptr + (n0 * sdn + p0 * sdh) + dy_lane
        p = p0
        DH: tl.constexpr = DIL_H * Wp
        for _ in range(0, rows, RPI):
            if EVEN_K:
                dyt = tl.load(dy_ptrs).to(DOT_DTYPE)
            else:
                dyt = tl.load(dy_ptrs, mask=k_mask, other=0.0).to(DOT_DTYPE)
            acc00 = _tap_dot(a_ptrs, 0, dyt, acc00, C, DOT_DTYPE, INPUT_PRECISION)
            if S > 1:
                acc01 = _tap_dot(a_ptrs, DIL_W, dyt, acc01, C, DOT_DTYPE, INPUT_PRECISION)
            if S > 2:
                acc02 = _tap_dot(a_ptrs, 2 * DIL_W, dyt, acc02, C, DOT_DTYPE, INPUT_PRECISION)
            if R > 1:
                acc10 = _tap_dot(a_ptrs, DH, dyt, acc10, C, DOT_DTYPE, INPUT_PRECISION)
                if S > 1:
                    acc11 = _tap_dot(a_ptrs, DH + DIL_W, dyt, acc11, C, DOT_DTYPE, INPUT_PRECISION)
                if S > 2:
                    acc12 = _tap_dot(a_ptrs, DH + 2 * DIL_W, dyt, acc12, C, DOT_DTYPE, INPUT_PRECISION)
            if R > 2:
                acc20 = _tap_dot(a_ptrs, 2 * DH, dyt, acc20, C, DOT_DTYPE, INPUT_PRECISION)
                if S > 1:
                    acc21 = _tap_dot(a_ptrs, 2 * DH + DIL_W, dyt, acc21, C, DOT_DTYPE, INPUT_PRECISION)
                if S > 2:
                    acc22 = _tap_dot(a_ptrs, 2 * DH + 2 * DIL_W, dyt, acc22, C, DOT_DTYPE,
                                     INPUT_PRECISION)
            # the next RPI image rows; past the image's last, the next image's first
            p += RPI
            wrap = p == P
            p = tl.where(wrap, 0, p)
            a_ptrs += (RPI * STRIDE_H * Wp + tl.where(wrap, (Hp - P * STRIDE_H) * Wp, 0)) * C
            dy_ptrs += RPI * sdh + tl.where(wrap, sdn - P * sdh, 0)
        up = 1.0
        if SCALED:
            up = _pow2(_scale_exponent(pack_ptr, C, pack_ptr, C, False, DOT_DTYPE, DT == tl.float16 or DT == tl.bfloat16))
        _tap_store(dw_ptr, acc00, up, 0, 0, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc01, up, 0, 1, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc02, up, 0, 2, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc10, up, 1, 0, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc11, up, 1, 1, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc12, up, 1, 2, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc20, up, 2, 0, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc21, up, 2, 1, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
        _tap_store(dw_ptr, acc22, up, 2, 2, pid, K, swk, swc, swr, sws, R, S, SPLIT_K, SCALED, C, BLOCK_M)
    elif SUM_MODE != 0:
        _fold_sums(pack_ptr, psum_ptr, num_parts, gbeta_ptr, ggamma_ptr, coef_ptr, inv_count, C, pid - NUM_WGRAD,
                   SUM_MODE, HAS_GAMMA, BLOCK_C, BLOCK_P)
