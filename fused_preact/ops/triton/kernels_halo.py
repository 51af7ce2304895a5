"""Triton fprop kernel for narrow layers under 16-bit compute: the BN+ReLU prologue applied once per
input pixel of a tile's halo, not once per filter tap.

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
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_fprop import _epilogue, _scale_exponent
from fused_preact.ops.triton.prologue16 import _pow2, _preact16, _relu_round, _vectors16


@triton.jit
def _stage_halo(x_ptr, sxn, sxh, sxw, sxc, st, i0, HALO, Nimg, H, W, Hp, Wp, v0, v1, v2,
                PAD_H: tl.constexpr, PAD_W: tl.constexpr, IDX64: tl.constexpr, PRO16: tl.constexpr,
                X16: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, STAGE_ROWS: tl.constexpr):
    """Rows ``[i0, i0 + HALO)`` of the zero-padded, transformed input (padded pixel index
    ``(n·Hp + hp)·Wp + wp``) into ``st`` (HALO × BLOCK_K, the operand dtype), 0 in the padding and past
    the last image; inside it, for a 16-bit x (X16) ``relu((x − m̃)·s̃ + b̃)`` (``v0, v1, v2`` = −m̃, s̃,
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
        inside = (ih.to(tl.uint32) < H.to(tl.uint32)) & (iw.to(tl.uint32) < W.to(tl.uint32)) & (nn < Nimg)
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
    down = 1.0
    # fp16: one e per call (every channel), as kernels_fprop — scaled up only for a 16-bit x (an fp32 x's
    # |x| is not bounded by fp16's range); the accumulator is scaled back by 2^e
    if SCALED:
        down = _pow2(-_scale_exponent(pack_ptr, C, pack_ptr, C, False, DOT_DTYPE, X16))
    kk = tl.arange(0, BLOCK_K)
    mean, scale, shift = tl.load(pack_ptr + kk), tl.load(pack_ptr + 3 * C + kk), tl.load(pack_ptr + 4 * C + kk)
    if X16:
        v0, v1, v2 = _vectors16(mean, scale, shift, down, DT)
    else:
        v0, v1, v2 = scale * down, shift * down, mean
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
