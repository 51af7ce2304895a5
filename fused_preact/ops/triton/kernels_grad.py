"""Jit helpers of the gradient kernels (:mod:`.kernels_dgrad`, :mod:`.kernels_wgrad`): division-free row
arithmetic (multiply-shift division, fixed-point range tests), the wgrad kernel's operand pieces and
the rounding of the dgrad epilogue.

Sources: Granlund & Montgomery, "Division by invariant integers using multiplication" (PLDI 1994) for
:func:`_udiv`; Lemire, Kaser & Kurz, "Faster remainder by direct computation" (2019) for
:func:`_frac_range`.
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton


@triton.jit
def _udiv(n, mul, shr):
    """``n // d`` for int32 ``0 <= n < 2**31`` by multiply-high and shift, with ``(mul, shr)`` from
    :func:`fused_preact.ops.triton.launch.magic` (``d`` given on the host; no division instruction)."""
    nu = n.to(tl.uint32, bitcast=True)
    return ((tl.umulhi(nu, mul) + nu) >> shr).to(tl.int32, bitcast=True)


@triton.jit
def _cdiv_signed(a, B: tl.constexpr):
    """``ceil(a / B)`` for an int32 ``a`` of either sign and a constant ``B > 0``."""
    return tl.where(a > 0, (a + (B - 1)) // B, -((-a) // B))


@triton.jit
def _frac_range(c, a, b, d):
    """Constants of a range test ``a <= r < b`` on ``r = n mod d`` by fixed-point fractions: with
    ``c = ceil(2**32 / d)`` (mod 2**32, so 0 for d = 1), ``L(n) = c·n mod 2**32`` lies in
    ``[c·r, c·r + c)`` while ``(n + d)·d < 2**32`` (Lemire, Kaser & Kurz, "Faster remainder by direct
    computation", 2019). Returns ``(c_eff, off, span)`` such that the test is one unsigned compare,
    ``(c_eff·n + off) mod 2**32 < span``: ``off = −c·a`` moves ``[c·a, c·b)`` to ``[0, c·(b − a))``, and a
    range reaching d takes ``span = 2**32 − c·a`` (L never wraps past 2**32, so ``[c·a, 2**32)`` holds
    exactly the r ≥ a); a full or empty range gives ``c_eff = 0``. L is linear in n, so stepping a row
    block is one add."""
    full = (a <= 0) & (b >= d)
    empty = b <= a
    to_end = (b >= d) & (a > 0)
    c_eff = tl.where(full | empty, 0, c).to(tl.uint32)
    lo = tl.maximum(a, 0).to(tl.uint32)
    span = tl.where(full, 1, tl.where(empty, 0, tl.where(to_end, 0 - c * lo, c * (b.to(tl.uint32) - lo))))
    off = 0 - c_eff * lo
    return c_eff, off.to(tl.uint32), span.to(tl.uint32)


@triton.jit
def _both_below(u, su, v, sv, PTX: tl.constexpr):
    """``(u < su) & (v < sv)`` (unsigned), as one predicate. PTX: in inline PTX (``setp``, then
    ``setp.and``), which LLVM cannot split into a chain of selects on the async copies' src-size
    (the plain form costs 3 more instructions per row in wgrad's loop)."""
    if PTX:
        both = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.lt.u32 p, $1, $2; setp.lt.u32.and q, $3, $4, p; selp.u32 $0, 1, 0, q; }",
            "=r,r,r,r,r", [u, su, v, sv], dtype=tl.int32, is_pure=True, pack=1)
        return both != 0
    else:
        return (u < su) & (v < sv)


@triton.jit
def _dy_piece(dy_ptr, off, kb, j: tl.constexpr, Kg, g, sdc, valid, USE_ROWS: tl.constexpr, EVEN_K: tl.constexpr,
              KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Load piece ``j`` (output channels ``[kb·BLOCK_M + j·KP, … + KP)``) of the dy row block at element
    offsets ``off`` (rows × 1, broadcast), rows masked by ``valid`` when USE_ROWS."""
    offs_k = kb * BLOCK_M + j * KP + tl.arange(0, KP)
    ptrs = dy_ptr + off + ((g * Kg + offs_k) * sdc)[None, :]
    if USE_ROWS:
        if EVEN_K:
            return tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=valid[:, None] & (offs_k < Kg)[None, :], other=0.0)
    else:
        if EVEN_K:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(offs_k < Kg)[None, :], other=0.0)


@triton.jit
def _dw_piece(dw_ptr, acc, kb, j: tl.constexpr, Kg, Cg, K, g, offs_c, c_mask, r, s, rs, split, swk, swc, swr, sws,
              R: tl.constexpr, S: tl.constexpr, SPLIT_K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store the accumulator of piece ``j`` (input channels × output channels) into dW (transposed
    through the strides) or, with SPLIT_K, into the fp32 partials ``[split, r, s, k, c]`` (tap-major,
    input channels innermost: a tile's partials are contiguous rows of c)."""
    offs_k = kb * BLOCK_M + j * KP + tl.arange(0, KP)
    k_glob = g * Kg + offs_k
    mask = c_mask[:, None] & (offs_k < Kg)[None, :]
    if not SPLIT_K:
        tl.store(dw_ptr + k_glob[None, :] * swk + offs_c[:, None] * swc + r * swr + s * sws,
                 acc.to(dw_ptr.dtype.element_ty), mask=mask)
    else:  # a weight-sized slice is < 2**31 elements: int32 offsets from an int64 base
        base = dw_ptr + (split * (R * S) + rs).to(tl.int64) * K * Cg
        tl.store(base + (k_glob[None, :] * Cg + offs_c[:, None]), acc, mask=mask)


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """``v.to(DTYPE)`` (round to nearest even). With ASM (compiled kernels) a 16-bit DTYPE rounds pairs
    with ``cvt.rn.{bf16x2,f16x2}.f32``: ptxas serializes the wgmma pipeline of a kernel whose
    epilogue rounds accumulator registers one by one (performance advisory C7514)."""
    if ASM and DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [v], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    elif ASM and DTYPE == tl.float16:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [v], dtype=tl.float16,
                                         is_pure=True, pack=2)
    else:
        return v.to(DTYPE)


@triton.jit
def _fold_sums(pack_ptr, psum_ptr, num_parts, gbeta_ptr, ggamma_ptr, coef_ptr, inv_count, C, block,
               SUM_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """The wgrad launches' fold role, for channels ``[block·BLOCK_C, (block + 1)·BLOCK_C)``: the dgrad
    tiles' partial Σdz, Σdz·x̂ (``num_parts`` rows of ``psum``, summed in order: deterministic) into
    SUM_MODE 1 (batch statistics): dβ = Σdz and dγ = Σdz·x̂ (in their pointers' dtypes, with HAS_GAMMA)
    and the dx coefficients ``coef = (Σdz, Σdz·x̂)·inv_count``; SUM_MODE 2 (statistics given from
    outside, e.g. synchronized BN): dβ, dγ and the gradients of the statistics in ``coef``:
    ∂L/∂mean = −scale·Σdz, ∂L/∂invstd = γ·Σdz·x̂/invstd."""
    cols = block * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    s_dz = tl.zeros([BLOCK_C], dtype=tl.float32)
    s_dzx = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        pmask = (parts < num_parts)[:, None] & cmask[None, :]
        rows = psum_ptr + parts.to(tl.int64)[:, None] * (2 * C) + cols[None, :]
        s_dz += tl.sum(tl.load(rows, mask=pmask, other=0.0), axis=0)
        s_dzx += tl.sum(tl.load(rows + C, mask=pmask, other=0.0), axis=0)
    if HAS_GAMMA:
        tl.store(gbeta_ptr + cols, s_dz.to(gbeta_ptr.dtype.element_ty), mask=cmask)
        tl.store(ggamma_ptr + cols, s_dzx.to(ggamma_ptr.dtype.element_ty), mask=cmask)
    if SUM_MODE == 1:
        tl.store(coef_ptr + cols, s_dz * inv_count, mask=cmask)
        tl.store(coef_ptr + C + cols, s_dzx * inv_count, mask=cmask)
    else:
        istd = tl.load(pack_ptr + 2 * C + cols, mask=cmask, other=1.0)
        sc = tl.load(pack_ptr + 3 * C + cols, mask=cmask, other=0.0)
        tl.store(coef_ptr + cols, -sc * s_dz, mask=cmask)
        tl.store(coef_ptr + C + cols, (sc / istd) * s_dzx / istd, mask=cmask)
