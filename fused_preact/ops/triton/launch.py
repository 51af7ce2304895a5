"""Launchers of the Triton backend: one function per kernel, tensors and strides by name.

Each launcher derives the grid and the kernel's constexprs from a :class:`~.configs.UnitPlan` (or
explicit sizes) and launches on the current stream — or, inside :func:`recording`, appends a
:class:`Launch` record instead (the static SASS report and the per-kernel benchmark replay or
compile those records). Activations are addressed through their (n, h, w, c) strides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from enum import IntEnum
from typing import Iterator, Optional

import torch

from fused_preact.ops._common import dot_dtype, input_precision, interpreting, triton
from fused_preact.ops.dtypes import traits
from fused_preact.ops.spec import BNMode, ConvGeom
from fused_preact.ops.triton import kernels_bn as BK
from fused_preact.ops.triton import kernels_dgrad as DK
from fused_preact.ops.triton import kernels_fprop as FK
from fused_preact.ops.triton import kernels_halo as HK
from fused_preact.ops.triton import kernels_wgrad as WK
from fused_preact.ops.triton.configs import (
    FOLD_BLOCK,
    GemmConfig,
    UnitPlan,
    halo_chunk,
    halo_rows,
    halo_wgrad_span,
    one_step_tile,
    p2,
)

__all__ = ["Launch", "Pro16", "SumMode", "recording", "conv_label", "magic", "stats_partial", "finalize", "fprop",
           "dgrad", "wgrad", "dx"]


@dataclasses.dataclass
class Launch:
    """One kernel launch: ``fn[grid](*args, **kwargs)`` (kwargs: constexprs, num_warps, num_stages).
    ``conv``: the convolution a conv launch serves (:func:`conv_label`; "" for the BatchNorm kernels), so
    that tools can tell apart the convs of one chain that launch the same kernel."""

    name: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict
    conv: str = ""

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.kwargs)


#: The open recording of each thread: recording is per thread, so a recording that the autotuner or a
#: tool opens never captures (and so never skips) the launches another thread makes meanwhile.
_local = threading.local()


def _active() -> Optional[list]:
    """The calling thread's open recording, or None (launches run)."""
    return getattr(_local, "recorder", None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """``with recording() as launches: plan.forward(...)`` lists the :class:`Launch` records a call in
    this thread would make instead of making them; launches in other threads run as usual. Nests (the
    inner recording gets its own list)."""
    outer = _active()
    _local.recorder = []
    try:
        yield _local.recorder
    finally:
        _local.recorder = outer


def _record(name: str, fn, grid: tuple, args: tuple, kwargs: dict, conv: str = "") -> None:
    _active().append(Launch(name, fn, grid, args, kwargs, conv))


def _launcher(name: str, fn, grid: tuple, conv: str = ""):
    """What a launcher calls with its arguments: ``fn[grid]`` (Triton's launch), or inside
    :func:`recording` a callable that records the :class:`Launch` (``name``, ``conv``: its labels)
    instead. The launch itself adds no frame of ours."""
    if _active() is None:
        return fn[grid]
    return functools.partial(_record_call, name, fn, grid, conv)


def _record_call(name: str, fn, grid: tuple, conv: str, *args, **kwargs) -> None:
    _record(name, fn, grid, args, kwargs, conv)


def conv_label(geom: ConvGeom, in_shape, out_shape) -> str:
    """``3x3/2 64→128 @32x32`` — filter/stride, input → output channels (``/g`` groups), input H×W: the
    conv of a launch record (two convs of a chain with one label are the same problem)."""
    sh, sw = geom.stride
    stride = f"{sh}" if sh == sw else f"{sh}x{sw}"
    grp = f"/g{geom.groups}" if geom.groups != 1 else ""
    return f"{geom.kernel[0]}x{geom.kernel[1]}/{stride} {in_shape[1]}→{out_shape[1]}{grp} @{in_shape[2]}x{in_shape[3]}"


def magic(d: int) -> tuple[int, int]:
    """Multiplier and shift that divide by ``d`` without a division instruction (round-up method,
    Granlund & Montgomery, PLDI 1994): for every ``0 <= n < 2**31``,
    ``n // d == (umulhi(n, mul) + n) >> shr`` in 32-bit unsigned arithmetic, where
    ``mul + 2**32 = ceil(2**(32 + shr) / d)`` and ``shr = ceil(log2 d)`` (the sum stays below 2**32).
    ``mul`` is returned as the int32 with the same bits, so it always binds as an ``i32`` argument.

    Raises:
        ValueError: ``d`` is not in ``[1, 2**31)``.
    """
    if not 1 <= d < 2**31:
        raise ValueError(f"magic: divisor {d} not in [1, 2**31)")
    shr = (d - 1).bit_length()
    mul = -(-(1 << (32 + shr)) // d) - (1 << 32)
    return (mul - (1 << 32) if mul >= 1 << 31 else mul), shr


def frac(d: int) -> int:
    """``ceil(2**32 / d) mod 2**32`` as the int32 with the same bits: the fixed-point reciprocal of the
    wgrad kernel's range tests on ``n mod d`` (``_frac_range``)."""
    c = -(-(1 << 32) // d) & 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


def _linear(g: ConvGeom, in_shape, out_shape, in_strides, out_strides, rows: int) -> bool:
    """Whether the wgrad kernel's pixel-linear path applies: both tensors pixel-linear ((n, h, w)
    strides of an NHWC layout with any pixel stride), input sizes exactly stride × output sizes, and
    ``rows`` (the largest row index the kernel forms) small enough for exact fixed-point range tests
    on ``m mod Q`` and ``m mod P·Q`` (``(rows + d)·d < 2**32``)."""
    _, _, H, W = in_shape
    _, _, P, Q = out_shape
    sxn, sxh, sxw, _ = in_strides
    sdn, sdh, sdw, _ = out_strides
    return ((H, W) == (g.stride[0] * P, g.stride[1] * Q) and sxn == H * sxh and sxh == W * sxw
            and sdn == P * sdh and sdh == Q * sdw and (rows + P * Q) * P * Q < 2**32 and Q < 2**16)


def _block_c(C: int) -> int:
    return p2(C, 16, 256) if interpreting() else 64


def _block_p(num_parts: int) -> int:
    return p2(num_parts, 16, 1024) if interpreting() else 32


def _geo(g: ConvGeom, in_shape, out_shape) -> dict:
    _, C, H, W = in_shape
    _, K, P, Q = out_shape
    return dict(H=H, W=W, C=C, P=P, Q=Q, K=K, GROUPS=g.groups, R=g.kernel[0], S=g.kernel[1],
                STRIDE_H=g.stride[0], STRIDE_W=g.stride[1], PAD_H=g.padding[0], PAD_W=g.padding[1],
                DIL_H=g.dilation[0], DIL_W=g.dilation[1])


class Pro16(IntEnum):
    """How the kernels transform 16-bit inputs (their ``PRO16`` constexpr, passed as its int)."""

    FP32 = 0         #: an fp32 compute dtype: the fp32 transform
    INTERPRETER = 1  #: the packed 16-bit transform's interpreter form (:mod:`.prologue16`)
    PTX = 2          #: the packed 16-bit transform in inline PTX (compiled kernels)


class SumMode(IntEnum):
    """What wgrad's fold programs make of dgrad's per-tile Σdz, Σdz·x̂ (the ``SUM_MODE`` constexpr)."""

    NONE = 0      #: no sums (a projection shortcut's own wgrad launch)
    BATCH = 1     #: batch statistics: dβ, dγ and the dx coefficients
    EXTERNAL = 2  #: statistics given from outside: dβ, dγ and the statistics' gradients


def _pro16(cdtype: torch.dtype) -> int:
    """:class:`Pro16` of a launch in compute dtype ``cdtype`` (its :mod:`~fused_preact.ops.dtypes` traits),
    as the kernels' int.

    Raises:
        TypeError: a dtype the kernels do not compute in (float64, an integer dtype).
    """
    if not traits(cdtype).fused:
        raise TypeError(f"fused_preact: the Triton kernels do not compute in {cdtype}")
    if not traits(cdtype).mma16:
        return int(Pro16.FP32)
    return int(Pro16.INTERPRETER if interpreting() else Pro16.PTX)


def _dot(cdtype: torch.dtype, idx64: bool) -> dict:
    return dict(DOT_DTYPE=dot_dtype(cdtype), INPUT_PRECISION=input_precision(cdtype), IDX64=idx64)


# ---------------------------------------------------------------------------------- statistics
def stats_partial(*, x: torch.Tensor, x_strides, part: torch.Tensor, shape, rows: int, idx64: bool) -> int:
    """Per-tile (mean, M2) of ``x`` (logical ``shape`` (N, C, H, W)) into ``part`` (tiles, 2, C) fp32,
    ``rows`` rows per tile. Returns the number of tiles."""
    N, C, H, W = shape
    M = N * H * W
    num_parts, block_c = triton.cdiv(M, rows), _block_c(C)
    grid = (num_parts, triton.cdiv(C, block_c))
    args = (x, *x_strides, part, M)
    kw = dict(H=H, W=W, C=C, IDX64=idx64, BLOCK_M=rows, BLOCK_C=block_c, num_warps=1 if interpreting() else 8)
    _launcher("stats", BK._stats_partial_kernel, grid)(*args, **kw)
    return num_parts


def finalize(*, pack: torch.Tensor, C: int, mode: BNMode, part: Optional[torch.Tensor] = None, num_parts: int = 0,
             count: int = 1, rows: int = 1, gamma=None, beta=None, mean_src=None, var_src=None, nbt=None,
             momentum: Optional[float] = None, eps: float = 0.0) -> None:
    """One BatchNorm's pack (5, C) fp32 — mean, var, invstd, scale, shift — from ``num_parts`` partial
    tiles of ``part`` (BATCH; ``count`` rows, ``rows`` per tile; running buffers ``mean_src``/``var_src``
    updated when ``mode.update``), from the running buffers (RUNNING), or from given mean and invstd
    (EXTERNAL: ``mean_src``, ``var_src`` = invstd)."""
    block_c = _block_c(C)
    grid = (1,) if mode.cumulative else (triton.cdiv(C, block_c),)
    unbias = count / (count - 1) if count > 1 else 1.0
    inc = mode.update and nbt is not None
    args = (part, num_parts, count, rows, unbias, pack, gamma, beta, mean_src, var_src, nbt,
            float(momentum or 0.0), float(eps))
    kw = dict(C=C, MODE=int(mode.kind), HAS_AFFINE=mode.affine, UPDATE_RUNNING=mode.update, CUMULATIVE=mode.cumulative,
              INC_NBT=inc, BLOCK_C=block_c, BLOCK_P=_block_p(num_parts))
    _launcher("finalize", BK._finalize_kernel, grid)(*args, **kw)


# ----------------------------------------------------------------------------------------- fprop
def fprop(u: UnitPlan, *, x: torch.Tensor, w: torch.Tensor, pack: torch.Tensor, bias: Optional[torch.Tensor],
          y: torch.Tensor, part: Optional[torch.Tensor], cdtype: torch.dtype, idx64: bool,
          x0: Optional[torch.Tensor] = None, x0_strides=(0, 0, 0, 0), x0_shape=(1, 1, 1, 1),
          proj_w: Optional[torch.Tensor] = None, proj_stride: int = 1, pack0: Optional[torch.Tensor] = None,
          residual: bool = False, quad: bool = False, name: str = "fprop") -> None:
    """``y = conv(relu(x·scale + shift), w) (+ bias)`` for unit ``u`` (x: u's input through
    ``u.in_strides``; y through ``u.out_strides``), with the epilogue options: ``part`` gets the
    per-tile (mean, M2) of the stored y; ``proj_w`` adds a 1×1 stride-``proj_stride`` projection of
    ``relu(bn_0(x0))`` (``pack0``) to the accumulator; ``residual`` adds ``x0`` itself (identity
    shortcut, or a residual tensor passed as ``x0``). ``quad``: x's channels taken in quads, ``w``'s
    input channels given in that order (``configs.quad_channels``, ``plan.mma_weight``). A halo tile
    (``u.fcfg.halo``) runs the staged-halo kernel instead (:func:`_fprop_halo`).

    Raises:
        ValueError: a halo tile with a projection or quad channels, or a unit it does not take.
    """
    g, cfg = u.geom, u.fcfg
    if cfg.halo:
        if proj_w is not None or quad:
            raise ValueError("fprop: the staged-halo tile takes no projection and no quad channels")
        return _fprop_halo(u, x=x, w=w, pack=pack, bias=bias, y=y, part=part, cdtype=cdtype, idx64=idx64,
                           res=x0 if residual else None, res_strides=x0_strides, name=name)
    K = u.out_shape[1]
    grid = (triton.cdiv(u.M_out, cfg.BLOCK_M), triton.cdiv(K // g.groups, cfg.BLOCK_N), g.groups)
    C2 = x0_shape[1]
    w2_strides = proj_w.stride()[:2] if proj_w is not None else (0, 0)
    args = (x, *u.in_strides, w, *w.stride(), pack, bias, x0, *x0_strides, proj_w, *w2_strides, pack0,
            y, *u.out_strides, part, u.M_out)
    block_k2 = p2(C2, 16, cfg.BLOCK_K)
    Cg, Kg = u.in_shape[1] // g.groups, K // g.groups
    even_c = Cg % cfg.BLOCK_K == 0 and (proj_w is None or C2 % block_k2 == 0)
    # the reduction one iteration of the (unrolled) loop, the projection's one step: the loops fold away
    steps = triton.cdiv(Cg, cfg.BLOCK_K)
    one_iter = (g.kernel == (1, 1) and steps <= cfg.unroll and (proj_w is None or C2 <= block_k2)
                and one_step_tile(cfg))
    pro16 = _pro16(cdtype)
    kw = dict(**_geo(g, u.in_shape, u.out_shape), H2=x0_shape[2], W2=x0_shape[3], C2=C2, STRIDE2=proj_stride,
              HAS_BIAS=bias is not None, HAS_PROJ=proj_w is not None, HAS_RES=residual, STATS=part is not None,
              **_dot(cdtype, idx64), PRO16=pro16, EVEN_C=even_c, EVEN_N=Kg % cfg.BLOCK_N == 0,
              ONE_CK=Cg <= cfg.BLOCK_K, QUAD=quad, STEPS=steps if one_iter else 0,
              BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, BLOCK_K2=block_k2,
              UNROLL=cfg.unroll, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher(name, FK._fprop_kernel, grid, conv_label(g, u.in_shape, u.out_shape))(*args, **kw)


def _fprop_halo(u: UnitPlan, *, x: torch.Tensor, w: torch.Tensor, pack: torch.Tensor, bias: Optional[torch.Tensor],
                y: torch.Tensor, part: Optional[torch.Tensor], cdtype: torch.dtype, idx64: bool,
                res: Optional[torch.Tensor], res_strides, name: str) -> None:
    """:func:`fprop` through the staged halo (``kernels_halo``; ``u.fcfg.halo``): an x of
    ``u.fcfg.BLOCK_K`` channels (16-bit, or fp32 under autocast), groups 1, 16-bit compute. Allocates the
    staging buffer (``halo_rows`` padded input pixels per program in the operand dtype; freed after
    the launch, to the caching allocator).

    Raises:
        ValueError: the unit is not one the kernel takes (fp32 compute, groups, channels ≠ BLOCK_K,
            output channels > BLOCK_N).
    """
    g, cfg = u.geom, u.fcfg
    _, C, H, W = u.in_shape
    K = u.out_shape[1]
    if not traits(cdtype).mma16 or g.groups != 1 or C != cfg.BLOCK_K or K > cfg.BLOCK_N:
        # (K > BLOCK_N: programs of one row tile would share, and race on, its staging region)
        raise ValueError(f"fprop: the staged-halo tile {cfg.label()} does not take {C} → {K} channels, groups "
                         f"{g.groups}, compute dtype {cdtype}")
    tiles = triton.cdiv(u.M_out, cfg.BLOCK_M)
    halo = halo_rows(u.in_shape, u.out_shape, g, cfg.BLOCK_M)
    # the operand dtype (fp32 for bf16 under the interpreter, whose bf16 dots are wrong)
    stage_dtype = torch.float32 if dot_dtype(cdtype) == dot_dtype(torch.float32) else cdtype
    stage = torch.empty(tiles * halo * C, device=x.device, dtype=stage_dtype)
    grid = (tiles, triton.cdiv(K, cfg.BLOCK_N))
    args = (x, *u.in_strides, w, *w.stride(), pack, bias, res, *res_strides, stage, y, *u.out_strides, part, u.M_out)
    kw = dict(H=H, W=W, C=C, P=u.out_shape[2], Q=u.out_shape[3], K=K, HALO=halo, R_LOOP=g.kernel[0],
              R=g.kernel[0], S=g.kernel[1], STRIDE_H=g.stride[0], STRIDE_W=g.stride[1], PAD_H=g.padding[0],
              PAD_W=g.padding[1], DIL_H=g.dilation[0], DIL_W=g.dilation[1], HAS_BIAS=bias is not None,
              HAS_RES=res is not None, STATS=part is not None, **_dot(cdtype, idx64), PRO16=_pro16(cdtype),
              EVEN_N=K % cfg.BLOCK_N == 0, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
              STAGE_ROWS=128, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher(name, HK._fprop_halo_kernel, grid, conv_label(g, u.in_shape, u.out_shape))(*args, **kw)


# ----------------------------------------------------------------------------------------- dgrad
def dgrad(u: UnitPlan, *, dy: torch.Tensor, dy_strides, w: torch.Tensor, x: torch.Tensor, pack: torch.Tensor,
          out: torch.Tensor, out_strides, psum: torch.Tensor, write_dx: bool, cdtype: torch.dtype, idx64: bool,
          dy2: Optional[torch.Tensor] = None, dy2_strides=(0, 0, 0, 0), dy2_shape=(1, 1, 1, 1),
          w2: Optional[torch.Tensor] = None, proj_stride: int = 1, res: Optional[torch.Tensor] = None,
          res_strides=(0, 0, 0, 0)) -> None:
    """``da = dgrad(dy, w)`` (+ the projection's ``dgrad(dy2, w2)``) for unit ``u``; epilogue: ReLU
    mask recomputed from ``x`` (u's input), per-tile Σdz, Σdz·x̂ into ``psum``; stores dz, or with
    ``write_dx`` ``dx = (dz·invstd)·γ`` (+ ``res``, the identity shortcut's gradient), into ``out``."""
    g, cfg = u.geom, u.dcfg
    C = u.in_shape[1]
    m_tiles, phases = u.dgrad_tiles()
    grid = (m_tiles, triton.cdiv(C // g.groups, cfg.BLOCK_N), g.groups * phases)
    K2 = dy2_shape[1]
    w2_strides = w2.stride()[:2] if w2 is not None else (0, 0)
    args = (dy, *dy_strides, w, *w.stride(), dy2, *dy2_strides, w2, *w2_strides, x, *u.in_strides, pack,
            out, *out_strides, res, *res_strides, psum, u.M_in)
    # the projection's reduction in 64-deep steps also beside a narrower main loop (a 16-deep step is
    # one 8-clock MMA of a 16-channel tile, under the loop's fixed cost); fp32 keeps its 32-deep ones
    block_k2 = p2(K2, 16, cfg.BLOCK_K if not traits(cdtype).mma16 else max(cfg.BLOCK_K, 64))
    Kg = u.out_shape[1] // g.groups
    # each reduction a single step: the kernel's loops fold away
    one_step = (g.kernel == (1, 1) and g.stride == (1, 1) and cfg.slots == 1 and Kg <= cfg.BLOCK_K
                and (w2 is None or K2 <= block_k2) and one_step_tile(cfg))
    kw = dict(**_geo(g, u.in_shape, u.out_shape), P2=dy2_shape[2], Q2=dy2_shape[3], K2=K2, STRIDE2=proj_stride,
              HAS_PROJ=w2 is not None, WRITE_DX=write_dx, HAS_RES=res is not None,
              EVEN_K=Kg % (cfg.BLOCK_K // cfg.slots) == 0, EVEN_N=C // g.groups % cfg.BLOCK_N == 0,
              EVEN_K2=K2 % block_k2 == 0, **_dot(cdtype, idx64), ASM=not interpreting(),
              BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, BLOCK_K2=block_k2, SLOTS=cfg.slots,
              STEPS=int(one_step), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher("dgrad", DK._dgrad_kernel, grid, conv_label(g, u.in_shape, u.out_shape))(*args, **kw)


# ----------------------------------------------------------------------------------------- wgrad
def wgrad(*, geom: ConvGeom, in_shape, out_shape, in_strides, cfg: GemmConfig, split: int, dy: torch.Tensor,
          dy_strides, x: torch.Tensor, pack: torch.Tensor, dw: Optional[torch.Tensor], dw_strides,
          cdtype: torch.dtype, idx64: bool, sum_mode: SumMode = SumMode.NONE, psum: Optional[torch.Tensor] = None,
          num_parts: int = 0, dbeta=None, dgamma=None, coef: Optional[torch.Tensor] = None,
          inv_count: float = 1.0, fold: bool = True) -> None:
    """``dw = wgrad(dy, relu(x·scale + shift))`` (stored in dw's dtype and ``dw_strides``; with
    ``split`` > 1 as fp32 partials ``dw[split, r, s, k, c]``) and, in extra programs of the same launch,
    the fold of the dgrad tiles' sums (``sum_mode`` 1: dβ, dγ and the dx coefficients; 2: dβ, dγ and the
    gradients of externally given statistics into ``coef``). ``dw=None``: the fold alone. ``fold=False``:
    a launch that never folds (a projection shortcut's own wgrad, recorded as ``wgrad_proj``). A halo
    tile (``cfg.halo``) with a dw to compute runs the staged-halo kernel (:func:`_wgrad_halo`), its
    ``split`` programs splitting the rows."""
    if cfg.halo and dw is not None:
        return _wgrad_halo(geom=geom, in_shape=in_shape, out_shape=out_shape, in_strides=in_strides, cfg=cfg,
                           split=split, dy=dy, dy_strides=dy_strides, x=x, pack=pack, dw=dw, dw_strides=dw_strides,
                           cdtype=cdtype, idx64=idx64, sum_mode=sum_mode, psum=psum, num_parts=num_parts,
                           dbeta=dbeta, dgamma=dgamma, coef=coef, inv_count=inv_count)
    g = geom
    N, C, H, W = in_shape
    _, K, P, Q = out_shape
    M = N * P * Q
    n_wg = 0
    if dw is not None:
        n_wg = (triton.cdiv(K // g.groups, cfg.BLOCK_M) * triton.cdiv(C // g.groups, cfg.BLOCK_N)
                * g.kernel[0] * g.kernel[1] * g.groups * split)
    block_c = _block_c(C)
    n_red = triton.cdiv(C, block_c) if sum_mode else 0
    if not n_wg + n_red:
        return
    step = cfg.BLOCK_K * cfg.unroll  # rows per main-loop iteration
    chunk = triton.cdiv(triton.cdiv(M, split), step) * step
    grid = (n_wg + n_red,)
    # Without dw no program runs the wgrad tiles, but they are compiled: their store needs a pointer type
    # (a None dw_ptr fails to compile for a GPU; the interpreter never reaches it). psum is fp32, as the
    # split-K partials are.
    args = (dy, *dy_strides, x, *in_strides, pack, dw if dw is not None else psum, *dw_strides, psum, num_parts,
            dbeta, dgamma, coef, inv_count, M, chunk, n_wg)
    q_mul, q_shr = magic(Q)
    pq_mul, pq_shr = magic(P * Q)
    linear = _linear(g, in_shape, out_shape, in_strides, dy_strides, M + step)
    # a tile of 16 output channels over a stride-1 conv: x's and dy's pixel strides as constexprs
    const_pix = linear and cfg.BLOCK_M <= 16 and g.stride == (1, 1)
    # row blocks of whole images (≤ 128 rows: a 256-row tile's hoisted padding tests spilled on sm_90)
    whole = linear and cfg.BLOCK_K % (P * Q) == 0 and cfg.BLOCK_K <= 128
    # beside such a 1-warp main loop the fold role spilled loading 32 × 64 fp32 partials per step
    block_p = 8 if const_pix and cfg.num_warps == 1 and not interpreting() else _block_p(num_parts)
    kw = dict(**_geo(g, in_shape, out_shape), Q_MUL=q_mul, Q_SHR=q_shr, PQ_MUL=pq_mul, PQ_SHR=pq_shr,
              CQ=frac(Q), CPQ=frac(P * Q), SPLIT_K=split > 1,
              LINEAR=linear, XW=in_strides[2] if const_pix else 0, DW=dy_strides[2] if const_pix else 0,
              WHOLE=whole,
              EVEN_M=M % step == 0, EVEN_K=K // g.groups % cfg.BLOCK_M == 0,
              EVEN_C=C // g.groups % cfg.BLOCK_N == 0, SUM_MODE=int(sum_mode), HAS_GAMMA=dgamma is not None,
              **_dot(cdtype, idx64), PRO16=_pro16(cdtype), PTX=not interpreting(), BLOCK_M=cfg.BLOCK_M,
              BLOCK_N=cfg.BLOCK_N, BLOCK_R=cfg.BLOCK_K,
              BLOCK_C=block_c if fold else 16, BLOCK_P=block_p if fold else 16, UNROLL=cfg.unroll,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher("wgrad" if fold else "wgrad_proj", WK._wgrad_kernel, grid, conv_label(g, in_shape, out_shape))(*args, **kw)


def _wgrad_halo(*, geom: ConvGeom, in_shape, out_shape, in_strides, cfg: GemmConfig, split: int, dy: torch.Tensor,
                dy_strides, x: torch.Tensor, pack: torch.Tensor, dw: torch.Tensor, dw_strides, cdtype: torch.dtype,
                idx64: bool, sum_mode: SumMode, psum: Optional[torch.Tensor], num_parts: int, dbeta, dgamma,
                coef: Optional[torch.Tensor], inv_count: float) -> None:
    """:func:`wgrad` through the staged halo (``kernels_halo._wgrad_halo_kernel``; ``cfg.halo``): ``split``
    programs of :func:`~.configs.halo_chunk` output image rows each (with ``split`` > 1 fp32 partials
    ``dw[split, r, s, k, c]``), each staging :func:`~.configs.halo_wgrad_span` pixels of x's
    ``cfg.BLOCK_N`` channels (a buffer in the operand dtype, freed after the launch).

    Raises:
        ValueError: the conv is not one the kernel takes (fp32 compute, groups, channels ≠ BLOCK_N, more
            output channels than BLOCK_M, a filter over 3 × 3, or BLOCK_K not whole image rows dividing P).
    """
    g = geom
    N, C, H, W = in_shape
    _, K, P, Q = out_shape
    rpi = cfg.BLOCK_K // Q
    if (not traits(cdtype).mma16 or g.groups != 1 or C != cfg.BLOCK_N or K > cfg.BLOCK_M or max(g.kernel) > 3
            or rpi == 0 or cfg.BLOCK_K % Q or P % rpi):
        raise ValueError(f"wgrad: the staged-halo tile {cfg.label()} does not take {C} → {K} channels, groups "
                         f"{g.groups}, a {g.kernel} filter, {P}×{Q} outputs, compute dtype {cdtype}")
    chunk = halo_chunk(N * P, rpi, split)
    halo = halo_wgrad_span(in_shape, out_shape, g, chunk)
    # the operand dtype (fp32 for bf16 under the interpreter, whose bf16 dots are wrong)
    stage_dtype = torch.float32 if dot_dtype(cdtype) == dot_dtype(torch.float32) else cdtype
    stage = torch.empty(split * halo * C, device=x.device, dtype=stage_dtype)
    block_c = _block_c(C)
    n_red = triton.cdiv(C, block_c) if sum_mode else 0
    grid = (split + n_red,)
    args = (dy, *dy_strides, x, *in_strides, pack, stage, dw, *dw_strides, psum, num_parts, dbeta, dgamma, coef,
            inv_count, N * P, halo, chunk, split)
    kw = dict(H=H, P=P, Q=Q, K=K, W=W, C=C, R=g.kernel[0], S=g.kernel[1], STRIDE_H=g.stride[0], STRIDE_W=g.stride[1],
              PAD_H=g.padding[0], PAD_W=g.padding[1], DIL_H=g.dilation[0], DIL_W=g.dilation[1], SPLIT_K=split > 1,
              EVEN_K=K == cfg.BLOCK_M, SUM_MODE=int(sum_mode), HAS_GAMMA=dgamma is not None, **_dot(cdtype, idx64),
              PRO16=_pro16(cdtype), BLOCK_M=cfg.BLOCK_M, BLOCK_R=cfg.BLOCK_K, RPI=rpi, BLOCK_C=block_c,
              BLOCK_P=_block_p(num_parts), STAGE_ROWS=128, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _launcher("wgrad", HK._wgrad_halo_kernel, grid, conv_label(g, in_shape, out_shape))(*args, **kw)


# -------------------------------------------------------------------------------------------- dx
def dx(*, geom: ConvGeom, shape, x: torch.Tensor, x_strides, pack: torch.Tensor, coef: Optional[torch.Tensor],
       dz: Optional[torch.Tensor], out: Optional[torch.Tensor], out_strides=(0, 0, 0, 0),
       res: Optional[torch.Tensor] = None, res_strides=(0, 0, 0, 0), idx64: bool = False, split1: int = 1,
       fold1: Optional[tuple] = None, fold2: Optional[tuple] = None, k2: int = 1, split2: int = 1) -> None:
    """Training-mode BN backward ``out = scale·(dz − c1 − x̂·c2)`` (+ ``res``) over the logical
    (N, C, H, W) ``shape`` of the input of the conv ``geom`` when ``dz`` is given, plus, in extra
    programs of the same launch, the fixed-order split-K sums ``fold1 = (partials, dw)`` of that conv's
    weight gradient (``split1`` partials) and ``fold2`` of a 1×1 projection's ((k2, C), ``split2``)."""
    N, C, H, W = shape
    M = N * H * W
    bm, bc = (p2(M, 16, 4096), p2(C, 16, 256)) if interpreting() else (64, 64)
    n_dx = triton.cdiv(M, bm) * triton.cdiv(C, bc) if dz is not None else 0
    n_red1 = triton.cdiv(fold1[1].numel(), FOLD_BLOCK) if fold1 is not None else 0
    n_red2 = triton.cdiv(fold2[1].numel(), FOLD_BLOCK) if fold2 is not None else 0
    if not n_dx + n_red1 + n_red2:
        return
    job1 = (fold1[0], fold1[1], *fold1[1].stride()) if fold1 is not None else (None, None, 0, 0, 0, 0)
    job2 = (fold2[0], fold2[1], *fold2[1].stride()) if fold2 is not None else (None, None, 0, 0, 0, 0)
    grid = (n_dx + n_red1 + n_red2,)
    # A launch of the folds alone still compiles the dx programs, whose loads and stores need typed
    # pointers (None fails to compile for a GPU; the interpreter never reaches them): x stands in for
    # dz and out there, never read or written (NUM_DX = 0).
    args = (dz if dz is not None else x, x, *x_strides, pack, coef, res, *res_strides,
            out if out is not None else x, *out_strides, M, n_dx, *job1, n_red1, *job2)
    kw = dict(H=H, W=W, C=C, HAS_RES=res is not None, IDX64=idx64, K1=geom.out_channels, CG1=C // geom.groups,
              R1=geom.kernel[0], S1=geom.kernel[1], SPLIT1=split1, HAS_RED1=n_red1 > 0,
              K2=k2, CG2=C, SPLIT2=split2, HAS_RED2=n_red2 > 0, BLOCK_M=bm, BLOCK_C=bc, BLOCK_E=FOLD_BLOCK,
              num_warps=4)
    _launcher("dx", BK._dx_kernel, grid)(*args, **kw)
