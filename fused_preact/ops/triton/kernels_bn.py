"""Triton kernels of the BatchNorm side of the fused op: batch statistics, their finalization into the
per-channel pack, and the elementwise dx pass of BN's backward.

    _stats_partial_kernel   per-tile (mean, M2) of an activation — the only full read of a BN input
                            whose producer is not fused (a network's first BN)
    _finalize_kernel        partial (mean, M2) tiles → pack rows (mean, var, invstd, scale, shift);
                            running-stat update and num_batches_tracked, as nn.BatchNorm2d does
    _dx_kernel              dx = (dz − Σdz/M − x̂·Σdz·x̂/M)·invstd·γ (+ the identity shortcut's gradient),
                            plus the fixed-order split-K sums of the weight gradients

Statistics follow Chan, Golub & LeVeque ("Updating formulae and a pairwise algorithm for computing
sample variances", 1979): corrected two-pass per tile, then the k-way combination
``mean = ref + Σ n_i(mean_i − ref)/M``, ``M2 = Σ M2_i + Σ n_i(mean_i − mean)²`` in a fixed order
(deterministic; accurate for inputs whose mean is large against their spread).
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton


@triton.jit
def tile_mean_m2(v, mask, rows, out_ptr, out_mask, C):
    """Store the per-column mean (at ``out_ptr``) and M2 = Σ(v − mean)² (at ``out_ptr + C``) of the
    ``rows`` valid rows of the fp32 tile ``v`` (invalid entries masked out by ``mask``), by the
    corrected two-pass algorithm (Chan, Golub & LeVeque 1983: the second pass's Σd repairs the first
    mean). M2 is +inf when Σ(v − mean)² overflows fp32, NaN for NaN or infinite entries."""
    count = rows.to(tl.float32)
    v = tl.where(mask, v, 0.0)
    mean0 = tl.sum(v, axis=0) / count
    d = tl.where(mask, v - mean0[None, :], 0.0)
    s1 = tl.sum(d, axis=0)
    ss = tl.sum(d * d, axis=0)
    m2 = ss - (s1 / count) * s1
    # Rounding can make the corrected sum slightly negative (→ 0). A NaN comes from an overflowed Σd²
    # (inf − inf: the variance is inf, as eager's) or from NaN/inf inputs (NaN): Σd² itself says which.
    m2 = tl.where(m2 >= 0.0, m2, tl.where(m2 < 0.0, 0.0, ss))
    # An infinite value makes Σd NaN: keep the plain mean then (±inf, as a sum-based mean gives).
    mean = tl.where(tl.abs(mean0) < float("inf"), mean0 + s1 / count, mean0)
    tl.store(out_ptr, mean, mask=out_mask)
    tl.store(out_ptr + C, m2, mask=out_mask)


@triton.jit(do_not_specialize=("M", "H", "W"))
def _stats_partial_kernel(
    x_ptr, sxn, sxh, sxw, sxc, part_ptr, M,
    H, W, C, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Row ``pid_m`` of ``part`` (tiles, 2, C): mean and M2 of x's rows [pid_m·BLOCK_M, …) (x addressed
    through its (n, h, w, c) strides). Grid: (cdiv(M, BLOCK_M), cdiv(C, BLOCK_C))."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < M
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    wi = rows % W
    hi = (rows // W) % H
    nb = rows // (H * W)
    if IDX64:
        nb = nb.to(tl.int64)
    offs = (nb * sxn + hi * sxh + wi * sxw)[:, None] + cols[None, :] * sxc
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tile_mean_m2(x, mask, tl.minimum(M - pid_m * BLOCK_M, BLOCK_M), part_ptr + pid_m.to(tl.int64) * (2 * C) + cols,
                 cmask, C)


@triton.jit(do_not_specialize=("num_parts", "M", "rows_per_part"))
def _finalize_kernel(
    part_ptr, num_parts, M, rows_per_part, unbias,
    pack_ptr, gamma_ptr, beta_ptr, rmean_ptr, rvar_ptr, nbt_ptr, momentum, eps,
    C, MODE: tl.constexpr, HAS_AFFINE: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
    CUMULATIVE: tl.constexpr, INC_NBT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Write one BatchNorm's pack (9, C) fp32: rows 0-4 mean, biased var, invstd = 1/√(var + eps),
    scale = γ·invstd, shift = β − mean·scale, and row 8 γ (γ = 1, β = 0 without affine; rows 5-7 are
    the fprop kernel's scratch).

    MODE 0 (training): mean and var from the ``num_parts`` tiles of ``part`` (tiles, 2, C) — tile i
    holds ``min(M − i·rows_per_part, rows_per_part)`` rows — and, with UPDATE_RUNNING, the running
    buffers become ``(1 − f)·r + f·batch`` with the unbiased variance (``var·unbias``, unbias = M/(M−1))
    and f = ``momentum``, or f = 1/num_batches_tracked after the increment when CUMULATIVE
    (``momentum=None``; the launch then has ONE program, so the counter is read and written by the
    same program). INC_NBT adds 1 to the int64 ``num_batches_tracked`` (program 0).
    MODE 1 (eval): mean and var are the running buffers. MODE 2 (statistics given from outside, e.g.
    synchronized BN): mean and invstd are read from ``rmean_ptr`` and ``rvar_ptr``.
    Grid: (cdiv(C, BLOCK_C),).
    Semantics: ``torch.nn.BatchNorm2d.forward`` / ``F.batch_norm``.
    """
    pid = tl.program_id(0)
    if INC_NBT:
        nbt = tl.load(nbt_ptr) + 1
        if pid == 0:
            tl.store(nbt_ptr, nbt)
        if CUMULATIVE:
            momentum = 1.0 / nbt.to(tl.float32)
    for c0 in range(pid * BLOCK_C, C, tl.num_programs(0) * BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < C
        if MODE == 0:
            ref = tl.load(part_ptr + cols, mask=cmask, other=0.0)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            plain = tl.zeros([BLOCK_C], dtype=tl.float32)
            for p0 in range(0, num_parts, BLOCK_P):
                parts = p0 + tl.arange(0, BLOCK_P)
                pmask = (parts < num_parts)[:, None] & cmask[None, :]
                nb = tl.minimum(M - parts * rows_per_part, rows_per_part).to(tl.float32)
                mb = tl.load(part_ptr + parts.to(tl.int64)[:, None] * (2 * C) + cols[None, :], mask=pmask, other=0.0)
                acc += tl.sum(tl.where(pmask, nb[:, None] * (mb - ref[None, :]), 0.0), axis=0)
                plain += tl.sum(tl.where(pmask, nb[:, None] * mb, 0.0), axis=0)
            mean = ref + acc / M
            # With an infinite tile mean the shifted form is NaN; the plain weighted mean is ±inf (or NaN
            # for +inf and -inf together), as a sum-based mean is.
            mean = tl.where(mean == mean, mean, plain / M)
            m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
            for p0 in range(0, num_parts, BLOCK_P):
                parts = p0 + tl.arange(0, BLOCK_P)
                pmask = (parts < num_parts)[:, None] & cmask[None, :]
                nb = tl.minimum(M - parts * rows_per_part, rows_per_part).to(tl.float32)
                offs = parts.to(tl.int64)[:, None] * (2 * C) + cols[None, :]
                mb = tl.load(part_ptr + offs, mask=pmask, other=0.0)
                m2b = tl.load(part_ptr + offs + C, mask=pmask, other=0.0)
                delta = mb - mean[None, :]
                m2 += tl.sum(tl.where(pmask, m2b + nb[:, None] * delta * delta, 0.0), axis=0)
            var = m2 / M
            if UPDATE_RUNNING:
                rm = tl.load(rmean_ptr + cols, mask=cmask, other=0.0)
                rv = tl.load(rvar_ptr + cols, mask=cmask, other=0.0)
                new_rm = momentum * mean + (1.0 - momentum) * rm.to(tl.float32)
                new_rv = momentum * (var * unbias) + (1.0 - momentum) * rv.to(tl.float32)
                tl.store(rmean_ptr + cols, new_rm.to(rmean_ptr.dtype.element_ty), mask=cmask)
                tl.store(rvar_ptr + cols, new_rv.to(rvar_ptr.dtype.element_ty), mask=cmask)
            invstd = 1.0 / tl.sqrt(var + eps)
        elif MODE == 1:
            mean = tl.load(rmean_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            var = tl.load(rvar_ptr + cols, mask=cmask, other=1.0).to(tl.float32)
            invstd = 1.0 / tl.sqrt(var + eps)
        else:
            mean = tl.load(rmean_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            invstd = tl.load(rvar_ptr + cols, mask=cmask, other=1.0).to(tl.float32)
            var = 1.0 / (invstd * invstd) - eps
        if HAS_AFFINE:
            gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            scale = invstd * gamma
            shift = tl.fma(-mean, scale, tl.load(beta_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
        else:
            gamma = tl.full([BLOCK_C], 1.0, tl.float32)
            scale = invstd
            shift = -mean * scale
        tl.store(pack_ptr + cols, mean, mask=cmask)
        tl.store(pack_ptr + C + cols, var, mask=cmask)
        tl.store(pack_ptr + 2 * C + cols, invstd, mask=cmask)
        tl.store(pack_ptr + 3 * C + cols, scale, mask=cmask)
        tl.store(pack_ptr + 4 * C + cols, shift, mask=cmask)
        tl.store(pack_ptr + 8 * C + cols, gamma, mask=cmask)


@triton.jit
def _splitk_sum(part_ptr, dw_ptr, swk, swc, swr, sws, blk,
                K, CG, R: tl.constexpr, S: tl.constexpr, SPLIT,
                BLOCK_E: tl.constexpr):
    """dw[k, c, r, s] = Σ_split part[split, r, s, k, c] (fixed order) for flat block ``blk`` of the
    R·S·K·CG entries, stored in dw's dtype and strides. ``SPLIT`` is a runtime value: one compilation
    serves every split count."""
    NUMEL = K * CG * R * S
    e = blk * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < NUMEL
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for i in range(SPLIT):
        acc += tl.load(part_ptr + i * NUMEL + e, mask=emask, other=0.0)
    c = e % CG
    k = (e // CG) % K
    rs = e // (CG * K)
    r = rs // S
    s = rs - r * S
    tl.store(dw_ptr + k * swk + c * swc + r * swr + s * sws, acc.to(dw_ptr.dtype.element_ty), mask=emask)


@triton.jit(do_not_specialize=("M", "NUM_DX", "NUM_RED", "H", "W", "SPLIT1", "SPLIT2"))
def _dx_kernel(
    dz_ptr, x_ptr, sxn, sxh, sxw, sxc, pack_ptr, coef_ptr,
    res_ptr, srn, srh, srw, src,
    dx_ptr, son, soh, sow, soc,
    M, NUM_DX,
    wpart_ptr, dw_ptr, swk, swc, swr, sws, NUM_RED,
    wpart2_ptr, dw2_ptr, sw2k, sw2c, sw2r, sw2s,
    H, W, C, HAS_RES: tl.constexpr, IDX64: tl.constexpr,
    K1, CG1, R1: tl.constexpr, S1: tl.constexpr, SPLIT1, HAS_RED1: tl.constexpr,
    K2, CG2, SPLIT2, HAS_RED2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Training-mode BN backward, one elementwise pass, plus the weight gradients' split-K sums.

    Programs ``[0, NUM_DX)``: ``dx = ((dz − c1 − x̂·c2)·invstd)·γ`` with ``x̂ = (x − mean)·invstd`` —
    eager's ``batch_norm_backward`` with γ last, so a γ near fp32's range does not overflow invstd·γ —
    and the coefficients ``coef = (c1, c2) = (Σdz, Σdz·x̂)/M_bn`` of the wgrad launch; dz is (M, C) contiguous,
    x, dx and ``res`` (HAS_RES: the gradient reaching x through an identity shortcut, added here) go
    through their (n, h, w, c) strides. Grid rows: cdiv(M, BLOCK_M) × cdiv(C, BLOCK_C) programs.
    Programs ``[NUM_DX, NUM_DX + NUM_RED)``: :func:`_splitk_sum` of the conv's weight gradient
    (HAS_RED1: SPLIT1 > 1 partials); the following ones (HAS_RED2) that of a 1×1 projection shortcut's
    (K2, CG2).
    """
    pid = tl.program_id(0)
    if pid < NUM_DX:
        NCB = tl.cdiv(C, BLOCK_C)
        pid_m = pid // NCB
        pid_c = pid % NCB
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (rows < M)[:, None] & cmask[None, :]
        wi = rows % W
        hi = (rows // W) % H
        nb = rows // (H * W)
        if IDX64:
            nb = nb.to(tl.int64)
        rows_i = rows
        if IDX64:
            rows_i = rows.to(tl.int64)
        dz = tl.load(dz_ptr + rows_i[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + (nb * sxn + hi * sxh + wi * sxw)[:, None] + cols[None, :] * sxc,
                    mask=mask, other=0.0).to(tl.float32)
        mu = tl.load(pack_ptr + cols, mask=cmask, other=0.0)
        istd = tl.load(pack_ptr + 2 * C + cols, mask=cmask, other=0.0)
        gam = tl.load(pack_ptr + 8 * C + cols, mask=cmask, other=0.0)
        c1 = tl.load(coef_ptr + cols, mask=cmask, other=0.0)
        c2 = tl.load(coef_ptr + C + cols, mask=cmask, other=0.0)
        xhat = (x - mu[None, :]) * istd[None, :]
        dx = ((dz - c1[None, :] - xhat * c2[None, :]) * istd[None, :]) * gam[None, :]
        if HAS_RES:
            dx += tl.load(res_ptr + (nb * srn + hi * srh + wi * srw)[:, None] + cols[None, :] * src,
                          mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + (nb * son + hi * soh + wi * sow)[:, None] + cols[None, :] * soc,
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        blk = pid - NUM_DX
        if HAS_RED1:
            if blk < NUM_RED:
                _splitk_sum(wpart_ptr, dw_ptr, swk, swc, swr, sws, blk, K1, CG1, R1, S1, SPLIT1, BLOCK_E)
            blk -= NUM_RED
        if HAS_RED2:
            if blk >= 0:
                _splitk_sum(wpart2_ptr, dw2_ptr, sw2k, sw2c, sw2r, sw2s, blk, K2, CG2, 1, 1, SPLIT2, BLOCK_E)
