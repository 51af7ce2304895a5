"""Triton kernels of the fused BN→ReLU→Conv op (NHWC implicit GEMM, fp32 accumulation).

Layouts (all contiguous):
    x       (N, H, W, C)        activation, the BN input
    y, dy   (N, P, Q, K)        conv output and its gradient
    w_f     (R, S, C/g, K)      weight for fprop        (w_f[r, s, c, k] = weight[k, c, r, s])
    w_d     (R, S, K, C/g)      weight for dgrad        (w_d[r, s, k, c] = weight[k, c, r, s])
    scale, shift, mean, invstd  (C,) fp32

Every kernel that reads x turns it into ``a = max(x·scale + shift, 0)`` in registers and zeroes the
conv's padded positions *after* the transform (a padded ``a`` is 0, not ``relu(shift)``).
Offsets that scale with the activation size are computed in int64.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton


@triton.jit
def _fprop_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, shift_ptr, y_ptr, res_ptr, part_mean_ptr, part_m2_ptr,
    N, H, W, C, P, Q, K, Cg, Kg,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STATS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, k] = Σ_{r,s,c} relu(x[pix(m,r,s), c]·scale[c] + shift[c]) · w_f[r, s, c, k] (+ bias[k]) (+ res[m, k]).

    Epilogue options: HAS_RES adds a residual tensor of y's shape (the block's shortcut); STATS
    writes the tile's per-channel mean and M2 of the stored (rounded) y into row ``pid_m`` of the
    (num_m_tiles, K) fp32 buffers — the partial BN statistics of the *next* BatchNorm, so no separate
    statistics pass has to read y again (combined by ``stats._stats_combine_kernel``).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < N * P * Q
    n_mask = offs_n < Kg
    k_out = g * Kg + offs_n
    q = offs_m % Q
    t = offs_m // Q
    p = t % P
    nb = (t // P).to(tl.int64)
    ih0 = p * stride_h - pad_h
    iw0 = q * stride_w - pad_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(R):
        for s in range(S):
            ih = ih0 + r * dil_h
            iw = iw0 + s * dil_w
            valid = m_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            pix = ((nb * H + ih) * W + iw) * C
            for c0 in range(0, Cg, BLOCK_K):
                offs_c = c0 + tl.arange(0, BLOCK_K)
                c_mask = offs_c < Cg
                c_in = g * Cg + offs_c
                amask = valid[:, None] & c_mask[None, :]
                xt = tl.load(x_ptr + pix[:, None] + c_in[None, :], mask=amask, other=0.0).to(tl.float32)
                sc = tl.load(scale_ptr + c_in, mask=c_mask, other=0.0)
                sh = tl.load(shift_ptr + c_in, mask=c_mask, other=0.0)
                a = tl.maximum(xt * sc[None, :] + sh[None, :], 0.0)
                a = tl.where(amask, a, 0.0)
                w_offs = ((r * S + s) * Cg + offs_c[:, None]).to(tl.int64) * K + k_out[None, :]
                wt = tl.load(w_ptr + w_offs, mask=c_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(a.to(DOT_DTYPE), wt.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        b = tl.load(bias_ptr + k_out, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * K + k_out[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + y_offs, mask=y_mask, other=0.0).to(tl.float32)
    yv = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + y_offs, yv, mask=y_mask)
    if STATS:
        # Corrected two-pass over the tile's valid rows (as stats._stats_partial_kernel).
        v = tl.where(y_mask, yv.to(tl.float32), 0.0)
        count = tl.minimum(N * P * Q - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
        mean0 = tl.sum(v, axis=0) / count
        d = tl.where(y_mask, v - mean0[None, :], 0.0)
        s1 = tl.sum(d, axis=0)
        m2 = tl.maximum(tl.sum(d * d, axis=0) - s1 * s1 / count, 0.0)
        part = pid_m.to(tl.int64) * K + k_out
        tl.store(part_mean_ptr + part, mean0 + s1 / count, mask=n_mask)
        tl.store(part_m2_ptr + part, m2, mask=n_mask)


@triton.jit
def _dgrad_kernel(
    dy_ptr, w_ptr, x_ptr, scale_ptr, shift_ptr, mean_ptr, invstd_ptr,
    out_ptr, psum_dz_ptr, psum_dzx_ptr,
    N, H, W, C, P, Q, K, Cg, Kg,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, WRITE_DX: tl.constexpr, NEED_SUMS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """da = dgrad(dy, W); epilogue: dz = da·[x·scale+shift > 0], per-tile Σdz and Σdz·x̂.

    Stores dz (training) or dx = scale·dz (WRITE_DX, eval mode) into ``out``, and, if NEED_SUMS,
    the tile's column sums into row ``pid_m`` of the (num_m_tiles, C) fp32 partial buffers.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < N * H * W
    n_mask = offs_n < Cg
    c_in = g * Cg + offs_n
    wi = offs_m % W
    t = offs_m // W
    hi = t % H
    nb = (t // H).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(R):
        for s in range(S):
            ph = hi + pad_h - r * dil_h
            pw = wi + pad_w - s * dil_w
            ph_ok = ph >= 0
            pw_ok = pw >= 0
            ph = tl.where(ph_ok, ph, 0)
            pw = tl.where(pw_ok, pw, 0)
            p = ph // stride_h
            q = pw // stride_w
            valid = m_mask & ph_ok & pw_ok & (p * stride_h == ph) & (q * stride_w == pw) & (p < P) & (q < Q)
            row = ((nb * P + p) * Q + q) * K
            for k0 in range(0, Kg, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < Kg
                k_glob = g * Kg + offs_k
                dyt = tl.load(dy_ptr + row[:, None] + k_glob[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
                w_offs = ((r * S + s) * K + k_glob[:, None]).to(tl.int64) * Cg + offs_n[None, :]
                wt = tl.load(w_ptr + w_offs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(dyt.to(DOT_DTYPE), wt.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    tile_mask = m_mask[:, None] & n_mask[None, :]
    x_offs = offs_m.to(tl.int64)[:, None] * C + c_in[None, :]
    xt = tl.load(x_ptr + x_offs, mask=tile_mask, other=0.0).to(tl.float32)
    sc = tl.load(scale_ptr + c_in, mask=n_mask, other=0.0)
    sh = tl.load(shift_ptr + c_in, mask=n_mask, other=0.0)
    dz = tl.where(tile_mask & (xt * sc[None, :] + sh[None, :] > 0.0), acc, 0.0)
    if WRITE_DX:
        tl.store(out_ptr + x_offs, (dz * sc[None, :]).to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        tl.store(out_ptr + x_offs, dz.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if NEED_SUMS:
        mu = tl.load(mean_ptr + c_in, mask=n_mask, other=0.0)
        istd = tl.load(invstd_ptr + c_in, mask=n_mask, other=0.0)
        xhat = (xt - mu[None, :]) * istd[None, :]
        part = pid_m.to(tl.int64) * C + c_in
        tl.store(psum_dz_ptr + part, tl.sum(dz, axis=0), mask=n_mask)
        tl.store(psum_dzx_ptr + part, tl.sum(dz * xhat, axis=0), mask=n_mask)


@triton.jit
def _wgrad_kernel(
    dy_ptr, x_ptr, scale_ptr, shift_ptr, dw_ptr,
    N, H, W, C, P, Q, K, Cg, Kg, CHUNK,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    R: tl.constexpr, S: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dW[k, c, r, s] = Σ_m dy[m, k] · relu(x[pix(m,r,s), c]·scale[c] + shift[c]), split-K over m.

    Program (pid0, pid1, pid2) covers filter tap (r, s) and output channels [kb·BLOCK_M, …) from
    pid0, input channels from pid1, group and K-split from pid2. Writes fp32 partials
    ``dw[split, k, c, r, s]``; the launcher sums the splits in a fixed order (deterministic).
    """
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    pid2 = tl.program_id(2)
    num_kb = tl.cdiv(Kg, BLOCK_M)
    rs = pid0 // num_kb
    kb = pid0 % num_kb
    r = rs // S
    s = rs % S
    g = pid2 // SPLIT
    split = pid2 % SPLIT
    offs_k = kb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid1 * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < Kg
    c_mask = offs_c < Cg
    k_glob = g * Kg + offs_k
    c_in = g * Cg + offs_c
    sc = tl.load(scale_ptr + c_in, mask=c_mask, other=0.0)
    sh = tl.load(shift_ptr + c_in, mask=c_mask, other=0.0)
    m_total = N * P * Q
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, m_total)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_K):
        offs_m = m0 + tl.arange(0, BLOCK_K)
        m_mask = offs_m < end
        q = offs_m % Q
        t = offs_m // Q
        p = t % P
        nb = (t // P).to(tl.int64)
        ih = p * stride_h - pad_h + r * dil_h
        iw = q * stride_w - pad_w + s * dil_w
        valid = m_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        dy_offs = offs_m.to(tl.int64)[None, :] * K + k_glob[:, None]
        dyt = tl.load(dy_ptr + dy_offs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        pix = ((nb * H + ih) * W + iw) * C
        amask = valid[:, None] & c_mask[None, :]
        xt = tl.load(x_ptr + pix[:, None] + c_in[None, :], mask=amask, other=0.0).to(tl.float32)
        a = tl.where(amask, tl.maximum(xt * sc[None, :] + sh[None, :], 0.0), 0.0)
        acc = tl.dot(dyt.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
    out = ((split * K + k_glob[:, None]).to(tl.int64) * Cg + offs_c[None, :]) * (R * S) + r * S + s
    tl.store(dw_ptr + out, acc, mask=k_mask[:, None] & c_mask[None, :])


@triton.jit
def _dx_kernel(
    dz_ptr, x_ptr, scale_ptr, mean_ptr, invstd_ptr, sum_dz_ptr, sum_dzx_ptr, dx_ptr,
    M, C, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Training-mode BN backward: dx = scale·(dz − Σdz/M − x̂·Σ(dz·x̂)/M), elementwise over (M, C)."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    dz = tl.load(dz_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(scale_ptr + cols, mask=cmask, other=0.0)
    mu = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    istd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    c1 = tl.load(sum_dz_ptr + cols, mask=cmask, other=0.0) / M
    c2 = tl.load(sum_dzx_ptr + cols, mask=cmask, other=0.0) / M
    xhat = (x - mu[None, :]) * istd[None, :]
    dx = sc[None, :] * (dz - c1[None, :] - xhat * c2[None, :])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
