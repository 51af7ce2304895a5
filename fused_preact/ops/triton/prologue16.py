"""The packed 16-bit BN+ReLU transform shared by the fprop and wgrad kernels (jit helpers only).

For a 16-bit input (``DT`` = fp16 or bf16) both kernels compute the pre-activation as BatchNorm
centred on a representable mean:

    a = relu((x − m̃)·s̃ + b̃),   m̃ = DT(mean), s̃ = DT(scale·2^−e), b̃ = DT((shift + m̃·scale)·2^−e)

two roundings to ``DT`` (``d = x − m̃``, exact for x within a factor 2 of m̃, then one fused
multiply-add), a ReLU that keeps NaN and maps −inf to 0, and an exponent ``e`` (fp16 only; 0 for
bf16) that brings the vectors into fp16's range — down below 2^15, or up into [1/4, 1/2) from below
1/4 (:func:`_pow2_exponent`); the kernel multiplies its fp32 accumulator by 2^e, so both scalings
are exact. fp16 takes the difference halved, ``d = fp16(x/2 − h̃)`` with h̃ = fp16(mean/2), m̃ = 2h̃
and the scale doubled: halving is exact in the normal range, so ``d·s̃`` is the same product bit for
bit, but ``|d| ≤ (|x| + |m̃|)/2`` cannot overflow, where ``x − m̃`` itself does whenever a value lies
more than 65,504 from its channel's mean (bf16's range has no such case). On a GPU each pair of
elements is two packed instructions
(``fma.rn{.relu}.{bf16x2,f16x2}``, PTX ISA 7.8, sm_80+); under Triton's interpreter, where inline PTX
does not run, the same roundings are computed from exact float64 sums and products.

Source of the semantics: ``F.batch_norm`` → ``F.relu``; eager PyTorch rounds ``x·scale + shift``
once from fp32, so this form differs from it by at most one more rounding of ``d`` (see
docs/semantics.md).
"""

from __future__ import annotations

from fused_preact.ops._common import tl, triton

#: fp16 vectors are scaled below 2**15 (< 65504 after rounding).
_FP16_EXP_LIMIT = tl.constexpr(127 + 14)
#: ... and, for 16-bit activations, scaled up into [2**-2, 2**-1) from below 2**-2.
_FP16_UP_BELOW = tl.constexpr(127 - 2)


@triton.jit
def _centre16(mean, DT: tl.constexpr):
    """m̃ in fp32, the centre of the transform: 2·fp16(mean/2) for fp16 (fp16(mean) wherever mean/2 is
    normal), bf16(mean) for bf16."""
    if DT == tl.float16:
        c = (mean * 0.5).to(DT).to(tl.float32) * 2.0
    else:
        c = mean.to(DT).to(tl.float32)
    return c


@triton.jit
def _absmax16(mean, scale, shift, DT: tl.constexpr, WITH_SHIFT: tl.constexpr, PER_TERM: tl.constexpr):
    """Per channel, the largest of |2·scale| and |shift + m̃·scale| (the unscaled s̃ and b̃ of
    :func:`_vectors16`; with WITH_SHIFT also |shift|, the value ``(0 − m̃)·scale + b̃`` approaches) if it
    is finite, else 0 (NaN and inf are not counted); with
    PER_TERM each term counted where it is finite (a channel with β = −inf still bounds a call's
    exponent by its scale: scaled up from the other channels' tiny vectors, its finite scale would
    make inf − inf = NaN)."""
    t = tl.fma(_centre16(mean, DT), scale, shift)
    s2 = 2.0 * tl.abs(scale) if DT == tl.float16 else tl.abs(scale)
    if PER_TERM:
        v = tl.maximum(tl.where(s2 < float("inf"), s2, 0.0), tl.where(tl.abs(t) < float("inf"), tl.abs(t), 0.0))
        if WITH_SHIFT:
            v = tl.maximum(v, tl.where(tl.abs(shift) < float("inf"), tl.abs(shift), 0.0))
    else:
        v = tl.maximum(s2, tl.abs(t))
        if WITH_SHIFT:
            v = tl.maximum(v, tl.abs(shift))
        v = tl.where(v < float("inf"), v, 0.0)
    return v


@triton.jit
def _pack16_absmax(pack_ptr, c_lo, n_ch, C, DT: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_absmax16` (without |shift|) over channels ``[c_lo, c_lo + n_ch)`` of a pack, reduced to
    one value (0 if none): the base of fprop's one exponent per call."""
    mx = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(c_lo, c_lo + n_ch, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cm = cols < c_lo + n_ch
        mean = tl.load(pack_ptr + cols, mask=cm, other=0.0)
        scale = tl.load(pack_ptr + 3 * C + cols, mask=cm, other=0.0)
        shift = tl.load(pack_ptr + 4 * C + cols, mask=cm, other=0.0)
        mx = tl.maximum(mx, _absmax16(mean, scale, shift, DT, False, True))
    return tl.max(mx, axis=0)


@triton.jit
def _pow2_exponent(absmax, UP: tl.constexpr):
    """e such that absmax·2^−e < 2^15: the biased fp32 exponent of ``absmax`` beyond 127 + 14, else 0;
    with UP (16-bit activations) also e < 0 where absmax < 1/4, so that absmax·2^−e ∈ [1/4, 1/2):
    vectors below fp16's normal range (6.1e-5: a BatchNorm scale γ/σ of a wide input) keep their
    precision, and since |d| ≤ 65504 for 16-bit x and each of |s̃|, |b̃| is then < 1/2, the
    scaled pre-activation stays finite. e ≥ −100 (2^e and 2^−e normal in fp32); 0 for an absmax of 0
    (a channel's :func:`_absmax16` with a non-finite vector, e.g. β = −inf, or all-zero vectors: a
    finite scale beside an infinite shift must not be scaled up to inf, where inf − inf is NaN)."""
    biased = (absmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(biased - _FP16_EXP_LIMIT, 0)
    if UP:
        e = tl.where((biased < _FP16_UP_BELOW) & (absmax > 0.0), tl.maximum(biased - _FP16_UP_BELOW, -100), e)
    return e


@triton.jit
def _pow2(e):
    """2^e as fp32 for an int32 e in [−126, 127] (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _vectors16(mean, scale, shift, down, DT: tl.constexpr):
    """(−h̃, s̃, b̃) (fp16) or (−m̃, s̃, b̃) (bf16, whose x − m̃ cannot overflow: no halving) in ``DT`` from
    the fp32 mean, scale and shift of a pack (``down`` = 2^−e): each rounded once from fp32. −h̃ is
    rounded from −mean/2 (rounding is symmetric; negating 16-bit values misbehaves in the interpreter)."""
    if DT == tl.float16:
        nm = (mean * -0.5).to(DT)
        s = (scale * (2.0 * down)).to(DT)
    else:
        nm = (-mean).to(DT)
        s = (scale * down).to(DT)
    b = (tl.fma(_centre16(mean, DT), scale, shift) * down).to(DT)
    return nm, s, b


@triton.jit
def _channel_exponent(mean, scale, shift, DT: tl.constexpr):
    """Per channel, the e of a kernel that scales each channel by its own 2^−e (fp16; the scalar 0 for
    bf16). It
    covers |shift| too: a masked (zero) x transforms to about shift·2^−e, which must stay finite. An
    elementwise e: a reduction over channels would take the transform out of the MMA operand layout."""
    if DT == tl.float16:
        e = _pow2_exponent(_absmax16(mean, scale, shift, DT, True, False), True)
    else:
        e = 0
    return e


@triton.jit
def _vectors16_of(mean, scale, shift, DT: tl.constexpr):
    """:func:`_vectors16` with each channel's own exponent (:func:`_channel_exponent`); the kernel
    multiplies what it accumulates from channel c by 2^e_c."""
    if DT == tl.float16:
        v = _vectors16(mean, scale, shift, _pow2(-_channel_exponent(mean, scale, shift, DT)), DT)
    else:
        v = _vectors16(mean, scale, shift, 1.0, DT)
    return v


@triton.jit
def _relu_round(z, DT: tl.constexpr, PTX: tl.constexpr):
    """``relu(z)`` of an fp32 tile rounded to ``DT`` (round to nearest even), keeping NaN and mapping
    −inf to 0: the fp32 transform's last step (an fp32 input under autocast, whose BatchNorm eager
    PyTorch computes in fp32 before the conv rounds its input). PTX with a 16-bit ``DT``: one
    ``cvt.rn.relu.{bf16x2,f16x2}.f32`` per pair of elements (PTX ISA 7.0, sm_80+; ``.relu`` clamps a
    negative result to 0 and keeps NaN, as canonical NaN), where the ReLU would otherwise take a compare
    and a select per element; else a ``where`` (``pack._relu_nan``) and Triton's conversion."""
    if PTX and (DT == tl.bfloat16 or DT == tl.float16):
        # pack=2: $1, $2 are elements 0 and 1; cvt puts its first source in the upper half.
        if DT == tl.bfloat16:
            a = tl.inline_asm_elementwise("cvt.rn.relu.bf16x2.f32 $0, $2, $1;", "=r,f,f", [z], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            a = tl.inline_asm_elementwise("cvt.rn.relu.f16x2.f32 $0, $2, $1;", "=r,f,f", [z], dtype=tl.float16,
                                          is_pure=True, pack=2)
    else:
        a = tl.where(z < 0.0, 0.0, z).to(DT)
    return a


@triton.jit
def _preact16_2d(xt, nm2, s2, b2, keep2, HAS_KEEP: tl.constexpr, PTX: tl.constexpr):
    """``relu((x·h + nm)·s + b)`` (h = ½ for fp16, 1 for bf16: :func:`_vectors16`) of a 16-bit tile in
    its dtype, with the vectors already broadcast to the
    tile's shape; 0 where the int32 ``keep2`` is 0 (−1: kept; HAS_KEEP).

    PTX: packed instructions, two elements each; the mask is an AND with the low half of the first
    element's keep word and the high half of the second's (one ``prmt``), so each element of a pair
    carries its own mask whatever elements the register layout pairs (in the MMA operand layout both
    are of one row, and the ``prmt`` of a row's word is computed once per row). Otherwise the same
    roundings from exact float64 sums and products; bf16 goes through float32 there (the
    interpreter's float64→bf16 conversion is wrong, its float32→bf16 one truncates, so bf16 results
    differ from the GPU's in the last bit; fp16 ones do not)."""
    DT: tl.constexpr = xt.dtype
    if PTX:
        # x·1 + (−m̃) for bf16, x·½ + (−h̃) for fp16 (see the module docstring)
        HALF: tl.constexpr = "0x3F803F80" if DT == tl.bfloat16 else "0x38003800"
        SFX: tl.constexpr = "bf16x2" if DT == tl.bfloat16 else "f16x2"
        if HAS_KEEP:  # keep2 int32: one register per element, $5 and $6
            a = tl.inline_asm_elementwise(
                "{ .reg .b32 t, half, k; mov.b32 half, " + HALF + "; fma.rn." + SFX + " t, $1, half, $2; fma.rn.relu."
                + SFX + " t, t, $3, $4; prmt.b32 k, $5, $6, 0x7610; and.b32 $0, t, k; }",
                "=r,r,r,r,r,r,r", [xt, nm2, s2, b2, keep2], dtype=xt.dtype, is_pure=True, pack=2)
        else:
            a = tl.inline_asm_elementwise(
                "{ .reg .b32 t, half; mov.b32 half, " + HALF + "; fma.rn." + SFX + " t, $1, half, $2; fma.rn.relu."
                + SFX + " $0, t, $3, $4; }",
                "=r,r,r,r,r", [xt, nm2, s2, b2], dtype=xt.dtype, is_pure=True, pack=2)
    else:
        VIA: tl.constexpr = tl.float32 if DT == tl.bfloat16 else tl.float64
        HX: tl.constexpr = 1.0 if DT == tl.bfloat16 else 0.5
        d = (xt.to(tl.float64) * HX + nm2.to(tl.float64)).to(VIA).to(DT)
        z = d.to(tl.float64) * s2.to(tl.float64) + b2.to(tl.float64)
        a = tl.where(z < 0.0, 0.0, z).to(VIA).to(DT)
        if HAS_KEEP:
            a = tl.where(keep2 != 0, a, 0.0)
    return a


@triton.jit
def _preact16(xt, nm, s, b, keep, HAS_KEEP: tl.constexpr, PTX: tl.constexpr):
    """:func:`_preact16_2d` of an (rows × channels) tile: ``nm`` = −h̃, ``s``, ``b`` vectors over its
    columns, ``keep`` an int32 vector over its rows (−1: kept, 0: zeroed; HAS_KEEP)."""
    BM: tl.constexpr = xt.shape[0]
    BK: tl.constexpr = xt.shape[1]
    nm2 = tl.broadcast_to(nm[None, :], [BM, BK])
    s2 = tl.broadcast_to(s[None, :], [BM, BK])
    b2 = tl.broadcast_to(b[None, :], [BM, BK])
    keep2 = None
    if HAS_KEEP:
        keep2 = tl.broadcast_to(keep[:, None], [BM, BK])
    return _preact16_2d(xt, nm2, s2, b2, keep2, HAS_KEEP, PTX)


@triton.jit
def _preact16_t(xt, nm, s, b, PTX: tl.constexpr):
    """:func:`_preact16_2d` of a transposed (channels × rows) tile: the vectors run over its rows."""
    BC: tl.constexpr = xt.shape[0]
    BR: tl.constexpr = xt.shape[1]
    return _preact16_2d(xt, tl.broadcast_to(nm[:, None], [BC, BR]), tl.broadcast_to(s[:, None], [BC, BR]),
                        tl.broadcast_to(b[:, None], [BC, BR]), None, False, PTX)
