"""Triton backend: launch plans for fused chains (forward and backward), tile configurations, and the
launch records the static SASS report compiles.

A :class:`TritonPlan` is built once per (chain structure, BN modes, input shape/strides/dtype, compute
dtype, device) and cached by the caller; a call then only allocates its outputs and launches. Per unit,
the forward is at most two launches — the statistics finalize (from the producer's epilogue partials)
and the fused fprop — and the backward three: dgrad (ReLU mask and per-tile BN sums in its epilogue),
wgrad (whose extra programs fold the sums), dx (whose extra programs fold wgrad's split-K partials).

Allocations per call: forward — each conv output and one fp32 ``aux`` buffer split into the per-unit
packs (mean, var, invstd, scale, shift), partial-statistics tiles and dx coefficients (saved for
backward; it is the only thing besides the units' inputs that is); backward — one scratch buffer in the
compute dtype (dz and the gradients of the intermediates), dx, the weight gradients and one buffer
split into the BN parameters' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from fused_preact.ops import _bn_kernels as BK
from fused_preact.ops import _conv_kernels as CK
from fused_preact.ops._common import dot_dtype, input_precision, interpreting, nhwc_strides, triton
from fused_preact.ops._tuning import cache_for, choose, tuning_enabled
from fused_preact.ops.chain_spec import BATCH, EXTERNAL, BNMode, ChainSpec, ChainTensors, ConvGeom, StatsHandoff

__all__ = ["TritonPlan", "GemmConfig", "fprop_config", "dgrad_config", "wgrad_config", "Launch"]

_INT32_MAX = 2**31 - 1
#: Rows per statistics tile under the interpreter: its sums are sequential in fp32, so tiles stay short.
_INTERP_SUM_ROWS = 4096
#: Weight-gradient entries per program of the split-K fold.
_FOLD_BLOCK = 1024


def _p2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options of one implicit-GEMM kernel (blocks are powers of two ≥ 16)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}_w{self.num_warps}_s{self.num_stages}"


def _gpu_gemm(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    if dtype == torch.float32:  # fp32 operands (TF32 MMA) need twice the registers: 64×64 tiles
        return GemmConfig(64, _p2(n, 16, 64), _p2(k, 16, 32), 4, 4)
    block_m = 128 if m >= 8 * 128 else 64
    block_n = _p2(n, 16, 128)
    block_k = _p2(k, 16, 64)
    # 8 warps from 128×64 up: with 4 warps a 128×64×64 tile needs 255 registers (no margin).
    warps = 8 if block_m * block_n >= 128 * 64 else 4
    return GemmConfig(block_m, block_n, block_k, warps, 3)


def fprop_config(M: int, Kg: int, Cg: int, dtype: torch.dtype, stats: bool) -> GemmConfig:
    """Default fprop tiles for an (M × Cg·R·S)·(… × Kg) implicit GEMM (M = N·P·Q output pixels)."""
    if interpreting():
        return GemmConfig(_p2(M, 16, _INTERP_SUM_ROWS if stats else 4096), _p2(Kg, 16, 256), _p2(Cg, 16, 256))
    return _gpu_gemm(M, Kg, Cg, dtype)


def dgrad_config(M: int, Cg: int, Kg: int, dtype: torch.dtype) -> GemmConfig:
    """Default dgrad tiles (M = N·H·W input pixels, N = Cg, reduction over taps × Kg). 64-row tiles:
    the epilogue holds the accumulator, x, the mask and x̂ at once, and 128-row tiles sit at the
    255-register limit (they spill on sm_80 in bf16 and on sm_90 in fp32; see the static report)."""
    if interpreting():
        return GemmConfig(_p2(M, 16, _INTERP_SUM_ROWS), _p2(Cg, 16, 256), _p2(Kg, 16, 256))
    return GemmConfig(64, _p2(Cg, 16, 64 if dtype == torch.float32 else 128), _p2(Kg, 16, 32 if dtype == torch.float32
                                                                                 else 64), 4, 3)


def wgrad_config(Kg: int, Cg: int, M: int, dtype: torch.dtype) -> GemmConfig:
    """Default wgrad tiles: BLOCK_M over output channels, BLOCK_N over input channels, BLOCK_K over
    the reduction (N·P·Q rows)."""
    if interpreting():
        return GemmConfig(_p2(Kg, 16, 256), _p2(Cg, 16, 256), _p2(M, 16, 4096))
    wide = 64 if dtype == torch.float32 else 128
    block_m, block_n = _p2(Kg, 64, wide), _p2(Cg, 16, wide)  # ≥ 64 rows: wgmma's minimum M on sm_90
    tile = block_m * block_n
    if tile >= 128 * 128:  # 128×128×64 spills 48 bytes on sm_80 with split-K (static report)
        return GemmConfig(block_m, block_n, 32, 8, 4)
    block_k = 32 if dtype == torch.float32 else 64
    # Static report, sm_80: 64×128 with 4 warps sits at 255 registers and spills; a ≤ 64×32 tile with 3
    # stages spills one value at 96 registers (4 stages take 112, none).
    return GemmConfig(block_m, block_n, block_k, 8 if tile >= 64 * 128 else 4, 4 if tile <= 64 * 32 else 3)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _wgrad_split(M: int, tiles: int, block_r: int, device: torch.device) -> int:
    """K-split of the wgrad reduction: about two programs per SM on a GPU, one under the interpreter."""
    if interpreting() or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(64, 2 * sms // max(tiles, 1), M // (8 * block_r)))


def _contig_nhwc(shape) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides of an NHWC-contiguous tensor of logical (N, C, H, W) ``shape``."""
    _, C, H, W = shape
    return (H * W * C, W * C, C, 1)


def _out_strides(shape, channels_last: bool) -> tuple[int, int, int, int]:
    N, C, H, W = shape
    return _contig_nhwc(shape) if channels_last else (C * H * W, W, 1, H * W)


def _max_offset(shape, strides) -> int:
    N, C, H, W = shape
    return sum((s - 1) * abs(st) for s, st in zip((N, H, W, C), strides))


def candidates(kind: str, m: int, n: int, k: int, dtype: torch.dtype) -> list[GemmConfig]:
    """The pruned tile space of a conv kernel for an (m × k)·(k × n) GEMM (``kind``: fprop, dgrad
    or wgrad; for wgrad m is the output channels, n the input channels, k the rows): blocks clamped to
    the problem (powers of two ≥ 16), duplicates removed. Every entry is compiled by the static report,
    which fails CI if one spills."""
    half = 2 if dtype == torch.float32 else 1
    space = {"fprop": _FPROP_SPACE, "dgrad": _DGRAD_SPACE, "wgrad": _WGRAD_SPACE}[kind]
    out: list[GemmConfig] = []
    for bm, bn, bk, warps, stages in space:
        if half == 2 and (bm > 64 or bn > 64):  # fp32 operands: 64×64 tiles at most (static report)
            continue
        bm, bn = min(bm, _p2(m, 64, bm)), min(bn, _p2(n, 16, bn))
        # A tile clamped below 128×64 has too few operand elements for 8 warps: 16-bit scalar loads
        # (e.g. a 16×16 weight tile over 256 threads; static report), so it runs with 4.
        cfg = GemmConfig(bm, bn, min(bk // half, _p2(k, 16, bk // half)), 4 if bm * bn < 128 * 64 else warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of fprop; BLOCK_K halves for fp32 operands. Pruned by the
#: static report (no spills on sm_90 or sm_80, in every epilogue variant).
_FPROP_SPACE = ((128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 8, 3), (128, 64, 32, 8, 4),
                (64, 64, 64, 4, 4), (64, 64, 32, 4, 4))
#: dgrad: 64-row tiles (its epilogue holds accumulator, x, mask and x̂ at once; 128-row tiles spill).
_DGRAD_SPACE = ((64, 128, 64, 4, 3), (64, 128, 32, 4, 4), (64, 64, 64, 4, 4), (64, 64, 32, 4, 5))
#: wgrad: (output channels, input channels, rows) per tile.
_WGRAD_SPACE = ((128, 128, 32, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 8, 4), (64, 64, 64, 4, 4),
                (64, 64, 128, 4, 3))


def _dgrad_tiles(u: "_Unit") -> tuple[int, int]:
    """(row tiles per phase, phases) of u's dgrad grid: a strided, undilated conv runs by phases."""
    g = u.geom
    N, _, H, W = u.in_shape
    sh, sw = g.stride
    if max(sh, sw) > 1 and g.dilation == (1, 1):
        return triton.cdiv(N * triton.cdiv(H, sh) * triton.cdiv(W, sw), u.dcfg.BLOCK_M), sh * sw
    return triton.cdiv(u.M_in, u.dcfg.BLOCK_M), 1


def _tunes_on(device: torch.device) -> bool:
    """Plans tune their tiles on GPUs when tuning is enabled (see :mod:`fused_preact.ops._tuning`)."""
    return device.type == "cuda" and tuning_enabled()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _contig_nchw_strides(shape) -> tuple[int, int, int, int]:
    """Logical (N, C, H, W) strides of a channels_last tensor of ``shape``."""
    N, C, H, W = shape
    return (H * W * C, 1, W * C, C)


def _random_tensors(u: "_Unit", device, cdtype) -> ChainTensors:
    g = u.geom
    C = u.in_shape[1]
    w = torch.randn((g.out_channels, C // g.groups, *g.kernel), device=device, dtype=cdtype)
    w = w.contiguous(memory_format=torch.channels_last)
    gamma = torch.rand(C, device=device) + 0.5
    return ChainTensors([w], [None], [gamma], [torch.randn(C, device=device)], [None], [None], [None], [0.1], [1e-5])


@dataclasses.dataclass
class Launch:
    """One kernel launch: ``fn[grid](*args, **kwargs)`` (kwargs: constexprs, num_warps, num_stages)."""

    name: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.kwargs)


@dataclasses.dataclass
class _Unit:
    geom: ConvGeom
    in_shape: tuple
    out_shape: tuple
    in_strides: tuple
    out_strides: tuple
    mode: BNMode
    fcfg: GemmConfig
    dcfg: GemmConfig
    wcfg: GemmConfig
    split: int
    stats_out: bool  # this conv's epilogue writes statistics of its output

    @property
    def M_in(self) -> int:
        N, _, H, W = self.in_shape
        return N * H * W

    @property
    def M_out(self) -> int:
        N, _, P, Q = self.out_shape
        return N * P * Q


class TritonPlan:
    """Everything a chain call decides once: shapes, strides, tiles, grids, buffer layouts.

    Args:
        spec: the chain structure. modes: each unit's :class:`BNMode`.
        x_shape, x_strides, x_dtype, device: the chain input's. cdtype: the compute dtype (the dot's
            operand dtype; the autocast dtype under autocast). in_stats: bn_0's batch statistics come
            as a :class:`StatsHandoff`. out_stats: the last conv's epilogue writes its output's
            partial statistics (for the next block). residual_dtype: dtype of the ``r`` of
            ``residual="tensor"``.
        overrides: ``{"fprop" | "dgrad" | "wgrad": GemmConfig or [GemmConfig per unit]}`` forced tiles
            (tuning, the static report); split: forced wgrad K-split (also the projection's); tune: look up / tune tiles
            (:mod:`fused_preact.ops._tuning`) when tuning is enabled and the device is a GPU.
    """

    def __init__(self, spec: ChainSpec, modes: tuple[BNMode, ...], x_shape, x_strides, x_dtype: torch.dtype,
                 device: torch.device, cdtype: torch.dtype, in_stats: bool, out_stats: bool,
                 residual_dtype: Optional[torch.dtype] = None, overrides: Optional[dict] = None,
                 split: Optional[int] = None, tune: bool = True):
        self.spec, self.modes, self.device, self.cdtype = spec, modes, device, cdtype
        self.x_shape, self.x_strides, self.x_dtype = tuple(x_shape), tuple(x_strides), x_dtype
        self.in_stats, self.out_stats = in_stats, out_stats
        self._forced_split = split
        self.channels_last = len(x_strides) == 4 and _is_channels_last(x_shape, x_strides)
        n = len(spec.convs)
        res_dtype = {"input": x_dtype, "tensor": residual_dtype}.get(spec.residual)
        self.out_dtype = torch.promote_types(cdtype, res_dtype) if res_dtype is not None else cdtype
        shapes = [tuple(x_shape)]
        for g in spec.convs:
            N, _, H, W = shapes[-1]
            shapes.append((N, g.out_channels, *g.out_hw(H, W)))
        self.out_shape = shapes[-1]
        self.units: list[_Unit] = []
        for i, g in enumerate(spec.convs):
            last = i == n - 1
            in_strides = tuple(nhwc_strides_of(x_shape, x_strides)) if i == 0 else _contig_nhwc(shapes[i])
            out_strides = _out_strides(shapes[i + 1], self.channels_last) if last else _contig_nhwc(shapes[i + 1])
            stats_out = out_stats if last else modes[i + 1].kind == BATCH
            N, C, H, W = shapes[i]
            _, K, P, Q = shapes[i + 1]
            Cg, Kg = C // g.groups, K // g.groups
            over = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in (overrides or {}).items()}
            fcfg = over.get("fprop") or fprop_config(N * P * Q, Kg, Cg, cdtype, stats_out)
            dcfg = over.get("dgrad") or dgrad_config(N * H * W, Cg, Kg, cdtype)
            wcfg = over.get("wgrad") or wgrad_config(Kg, Cg, N * P * Q, cdtype)
            unit = _Unit(g, shapes[i], shapes[i + 1], in_strides, out_strides, modes[i], fcfg, dcfg, wcfg, 1,
                         stats_out)
            if tune and overrides is None and _tunes_on(device):
                self._tune_unit(unit, x_dtype)
            unit.split = split or self._split(unit)
            self.units.append(unit)
        self._plan_proj()
        self._plan_buffers()
        self.idx64 = self._needs_idx64(shapes)

    def _split(self, u: _Unit) -> int:
        g = u.geom
        Cg, Kg = u.in_shape[1] // g.groups, u.out_shape[1] // g.groups
        tiles = triton.cdiv(Kg, u.wcfg.BLOCK_M) * triton.cdiv(Cg, u.wcfg.BLOCK_N) * g.kernel[0] * g.kernel[1] * g.groups
        return _wgrad_split(u.M_out, tiles, u.wcfg.BLOCK_K, self.device)

    # ------------------------------------------------------------------------------------ tuning
    def _tune_unit(self, u: _Unit, x_dtype: torch.dtype) -> None:
        """Pick u's fprop, dgrad and wgrad tiles from the cache or by timing the candidates."""
        g = u.geom
        N, C, H, W = u.in_shape
        K = u.out_shape[1]
        base = (f"{self.cdtype}|{x_dtype}|R{g.kernel[0]}S{g.kernel[1]}|s{g.stride[0]}{g.stride[1]}|"
                f"p{g.padding[0]}{g.padding[1]}|d{g.dilation[0]}{g.dilation[1]}|g{g.groups}|C{C}|K{K}|"
                f"cl{int(self.channels_last)}")
        cache = cache_for(_device_name(self.device))
        to_d, from_d = dataclasses.asdict, lambda d: GemmConfig(**d)
        Cg, Kg = C // g.groups, K // g.groups
        for kind, m, n, k in (("fprop", u.M_out, Kg, Cg), ("dgrad", u.M_in, Cg, Kg), ("wgrad", Kg, Cg, u.M_out)):
            attr = {"fprop": "fcfg", "dgrad": "dcfg", "wgrad": "wcfg"}[kind]
            rows = u.M_in if kind == "dgrad" else u.M_out
            key = f"{kind}|{base}|M{triton.next_power_of_2(rows)}|stats{int(u.stats_out)}"
            cands = candidates(kind, m, n, k, self.cdtype)
            best = choose(cache, key, cands, getattr(u, attr), lambda cfg: self._time_config(u, kind, cfg, x_dtype),
                          to_d, from_d)
            setattr(u, attr, best)

    def _time_config(self, u: _Unit, kind: str, cfg: GemmConfig, x_dtype: torch.dtype) -> float:
        """ms of u's ``kind`` kernel with tiles ``cfg``, on random data of u's shapes (a one-unit plan)."""
        import triton.testing

        plan = TritonPlan(ChainSpec((u.geom,)), (BNMode(BATCH, True),), u.in_shape, _contig_nchw_strides(u.in_shape),
                          x_dtype, self.device, self.cdtype, False, u.stats_out, overrides={kind: cfg}, split=u.split
                          if kind != "wgrad" else None)
        t = _random_tensors(u, self.device, self.cdtype)
        x = torch.randn(u.in_shape, device=self.device, dtype=x_dtype).contiguous(memory_format=torch.channels_last)
        out, _, inputs, aux, _, _ = plan.forward(x, t)
        if kind == "fprop":
            with plan.recording() as launches:
                plan.forward(x, t)
        else:
            dy = torch.randn_like(out)
            with plan.recording() as launches:
                plan.backward(dy, None, inputs, aux, t.weights, None, True, [True], [False], False, [t.gammas[0].dtype])
        (launch,) = [rec for rec in launches if rec.name == kind]
        return triton.testing.do_bench(launch, warmup=3, rep=10)

    # ----------------------------------------------------------------------------------- launches
    _recorder: Optional[list] = None

    def _launch(self, name: str, fn, grid: tuple, *args, **kwargs) -> None:
        """Launch ``fn[grid](*args, **kwargs)``, or, while :meth:`recording`, only record it."""
        if self._recorder is not None:
            self._recorder.append(Launch(name, fn, grid, args, kwargs))
            return
        fn[grid](*args, **kwargs)

    def recording(self) -> "_Recording":
        """``with plan.recording() as launches: plan.forward(...)`` lists the launches a call would make
        (:class:`Launch` records, replayable with ``launch()``) instead of making them: for the
        static SASS report and the per-kernel benchmark."""
        return _Recording(self)

    # ------------------------------------------------------------------------------------ layout
    def _plan_proj(self) -> None:
        spec = self.spec
        self.proj_split = 1
        self.proj_fcfg = self.proj_wcfg = None
        if spec.proj is None:
            return
        N, C, H, W = self.x_shape
        K, (P, Q) = spec.proj.out_channels, spec.proj.out_hw(H, W)
        self.proj_shape = (N, K, P, Q)
        self.proj_strides = _out_strides(self.proj_shape, self.channels_last)
        self.proj_fcfg = fprop_config(N * P * Q, K, C, self.cdtype, False)
        self.proj_wcfg = wgrad_config(K, C, N * P * Q, self.cdtype)
        tiles = triton.cdiv(K, self.proj_wcfg.BLOCK_M) * triton.cdiv(C, self.proj_wcfg.BLOCK_N)
        self.proj_split = self._forced_split or _wgrad_split(N * P * Q, tiles, self.proj_wcfg.BLOCK_K, self.device)

    def _stats_rows(self) -> int:
        M = self.units[0].M_in
        return _p2(M, 16, _INTERP_SUM_ROWS) if interpreting() else 256

    def _plan_buffers(self) -> None:
        """Sizes of the fp32 ``aux`` regions and the backward scratch."""
        sizes: dict[str, int] = {}
        for i, u in enumerate(self.units):
            C = u.in_shape[1]
            sizes[f"pack{i}"] = CK.PACK_ROWS * C
            fwd_tiles = 0
            if u.mode.kind == BATCH:
                if i > 0:
                    fwd_tiles = triton.cdiv(self.units[i - 1].M_out, self.units[i - 1].fcfg.BLOCK_M)
                elif not self.in_stats:
                    fwd_tiles = triton.cdiv(u.M_in, self._stats_rows())
            m_tiles, phases = _dgrad_tiles(u)
            bwd_tiles = m_tiles * phases
            sizes[f"part{i}"] = max(fwd_tiles, bwd_tiles) * 2 * C
            sizes[f"coef{i}"] = 2 * C
        last = self.units[-1]
        if self.out_stats:
            sizes["outpart"] = triton.cdiv(last.M_out, last.fcfg.BLOCK_M) * 2 * last.out_shape[1]
        self.aux_names = list(sizes)
        self.aux_sizes = list(sizes.values())
        # Backward scratch in the compute dtype: dz (largest BN input of a BATCH unit) and two ping-pong
        # buffers for the gradients of the intermediates (the inputs of units 1 … n−1).
        dz = max([u.M_in * u.in_shape[1] for i, u in enumerate(self.units) if u.mode.kind == BATCH or i == 0])
        inter = [u.M_in * u.in_shape[1] for u in self.units[1:]]
        pp = max(inter + [0])
        self.scratch_sizes = [dz, pp, pp if len(inter) > 1 else 0]
        wparts = [u.split * u.geom.out_channels * u.geom.in_channels // u.geom.groups * u.geom.kernel[0] * u.geom.kernel[1]
                  if u.split > 1 else 0 for u in self.units]
        wparts.append(self.proj_split * self.spec.proj.out_channels * self.spec.proj.in_channels
                      if self.spec.proj is not None and self.proj_split > 1 else 0)
        self.wpart_sizes = wparts

    def _needs_idx64(self, shapes) -> bool:
        big = _max_offset(self.x_shape, nhwc_strides_of(self.x_shape, self.x_strides))
        for s in shapes[1:]:
            big = max(big, _max_offset(s, _contig_nhwc(s)) + 1)
        return big >= _INT32_MAX

    def aux_view(self, aux: list, name: str) -> torch.Tensor:
        return aux[self.aux_names.index(name)]

    # ----------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, t: ChainTensors):
        """Run the chain. Returns ``(out, proj_out, inputs, aux, handoff, aux_base)``: the output (x's
        memory format), the projection's output when ``proj_out="return"`` (else None), every unit's
        input (x, then the NHWC intermediates, flat), the aux views (packs, partials), the output's
        :class:`StatsHandoff` when ``out_stats``, and the fp32 buffer the aux views split."""
        dev = x.device
        base = torch.empty(sum(self.aux_sizes), device=dev, dtype=torch.float32)
        aux = list(base.split(self.aux_sizes))
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty(self.out_shape, device=dev, dtype=self.out_dtype, memory_format=fmt)
        inputs = [x] + [torch.empty(u.M_in * u.in_shape[1], device=dev, dtype=self.cdtype) for u in self.units[1:]]
        proj_out = None
        if self.spec.proj is not None and self.spec.proj_out == "return":
            proj_out = torch.empty(self.proj_shape, device=dev, dtype=self.cdtype, memory_format=fmt)
        n = len(self.units)
        handoff = None
        for i, u in enumerate(self.units):
            self._finalize(i, u, inputs[0], t, aux)
            dst = out if i == n - 1 else inputs[i + 1]
            part = self.aux_view(aux, "outpart") if (i == n - 1 and self.out_stats) else (
                self.aux_view(aux, f"part{i + 1}") if u.stats_out else None)
            self._fprop(u, i, inputs[i], dst, part, t, aux, x)
        if proj_out is not None:
            self._proj_fprop(x, proj_out, t, aux)
        if self.out_stats:
            last = self.units[-1]
            handoff = StatsHandoff(self.aux_view(aux, "outpart"), last.fcfg.BLOCK_M, last.M_out)
        return out, proj_out, inputs, aux, handoff, base

    def _finalize(self, i: int, u: _Unit, x: torch.Tensor, t: ChainTensors, aux: list) -> None:
        C = u.in_shape[1]
        pack = self.aux_view(aux, f"pack{i}")
        mode = u.mode
        part, num_parts, rows, count = None, 0, 1, u.M_in
        rm, rv = t.running_means[i], t.running_vars[i]
        if mode.kind == BATCH:
            if i == 0 and self.in_stats:
                h = t.in_stats
                part, rows, count = h.part, h.rows, h.count
                num_parts = triton.cdiv(count, rows)
            elif i == 0:
                rows = self._stats_rows()
                part = self.aux_view(aux, "part0")
                num_parts = triton.cdiv(u.M_in, rows)
                block_c = _p2(C, 16, 256) if interpreting() else 64
                sn, sh, sw, sc = u.in_strides
                self._launch("stats", BK._stats_partial_kernel, (num_parts, triton.cdiv(C, block_c)),
                    x, sn, sh, sw, sc, part, u.M_in, H=u.in_shape[2], W=u.in_shape[3], C=C, IDX64=self.idx64,
                    BLOCK_M=rows, BLOCK_C=block_c, num_warps=8 if not interpreting() else 1)
            else:
                prev = self.units[i - 1]
                part, rows = self.aux_view(aux, f"part{i}"), prev.fcfg.BLOCK_M
                num_parts = triton.cdiv(u.M_in, rows)
        elif mode.kind == EXTERNAL:
            rm, rv = t.ext_mean, t.ext_invstd
        block_c = _p2(C, 16, 256) if interpreting() else 64
        grid = (1,) if mode.cumulative else (triton.cdiv(C, block_c),)
        unbias = count / (count - 1) if count > 1 else 1.0
        self._launch("finalize", BK._finalize_kernel, grid,
            part, num_parts, count, rows, unbias,
            pack, t.gammas[i], t.betas[i], rm, rv, t.num_batches[i], float(t.momenta[i] or 0.0), float(t.eps[i]),
            C=C, MODE=mode.kind, HAS_AFFINE=mode.affine, UPDATE_RUNNING=mode.update, CUMULATIVE=mode.cumulative,
            INC_NBT=mode.update and t.num_batches[i] is not None,
            BLOCK_C=block_c, BLOCK_P=_p2(num_parts, 16, 1024) if interpreting() else 32,
        )

    def _fprop(self, u: _Unit, i: int, xin: torch.Tensor, dst: torch.Tensor, part, t: ChainTensors, aux, x0) -> None:
        spec, g, cfg = self.spec, u.geom, u.fcfg
        last = i == len(self.units) - 1
        N, C, H, W = u.in_shape
        _, K, P, Q = u.out_shape
        w = t.weights[i]
        sxn, sxh, sxw, sxc = u.in_strides
        swk, swc, swr, sws = w.stride()
        syn, syh, syw, syc = u.out_strides
        proj = last and spec.proj is not None and spec.proj_out == "add"
        res = spec.residual if last else "none"
        xin2, sin = None, (0, 0, 0, 0)
        if proj or res == "input":
            xin2, sin = x0, self.units[0].in_strides
        elif res == "tensor":
            xin2, sin = t.residual, nhwc_strides(t.residual)
        w2, sw2 = (t.proj_weight, t.proj_weight.stride()[:2]) if proj else (None, (0, 0))
        C2 = self.x_shape[1]
        grid = (triton.cdiv(u.M_out, cfg.BLOCK_M), triton.cdiv(K // g.groups, cfg.BLOCK_N), g.groups)
        self._launch("fprop", CK._fprop_kernel, grid,
            xin, sxn, sxh, sxw, sxc, w, swk, swc, swr, sws,
            self.aux_view(aux, f"pack{i}"), t.biases[i],
            xin2, *sin, w2, *sw2, self.aux_view(aux, "pack0") if proj else None,
            dst, syn, syh, syw, syc, part, u.M_out,
            H=H, W=W, C=C, P=P, Q=Q, K=K, GROUPS=g.groups, R=g.kernel[0], S=g.kernel[1],
            STRIDE_H=g.stride[0], STRIDE_W=g.stride[1], PAD_H=g.padding[0], PAD_W=g.padding[1],
            DIL_H=g.dilation[0], DIL_W=g.dilation[1],
            H2=self.x_shape[2], W2=self.x_shape[3], C2=C2, STRIDE2=spec.proj.stride[0] if proj else 1,
            HAS_BIAS=g.bias, HAS_PROJ=proj, HAS_RES=res != "none", STATS=part is not None,
            DOT_DTYPE=dot_dtype(self.cdtype), INPUT_PRECISION=input_precision(self.cdtype), IDX64=self.idx64,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            BLOCK_K2=_p2(C2, 16, cfg.BLOCK_K if not interpreting() else 256),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def _proj_fprop(self, x: torch.Tensor, out: torch.Tensor, t: ChainTensors, aux) -> None:
        """The projection as its own output (``proj_out="return"``): a 1-unit fprop on x with bn_0's pack."""
        g, cfg = self.spec.proj, self.proj_fcfg
        N, C, H, W = self.x_shape
        _, K, P, Q = self.proj_shape
        w = t.proj_weight
        self._launch("fprop_proj", CK._fprop_kernel, (triton.cdiv(N * P * Q, cfg.BLOCK_M), triton.cdiv(K, cfg.BLOCK_N), 1),
            x, *self.units[0].in_strides, w, *w.stride(), self.aux_view(aux, "pack0"), None,
            None, 0, 0, 0, 0, None, 0, 0, None,
            out, *self.proj_strides, None, N * P * Q,
            H=H, W=W, C=C, P=P, Q=Q, K=K, GROUPS=1, R=1, S=1, STRIDE_H=g.stride[0], STRIDE_W=g.stride[1],
            PAD_H=0, PAD_W=0, DIL_H=1, DIL_W=1, H2=1, W2=1, C2=1, STRIDE2=1,
            HAS_BIAS=False, HAS_PROJ=False, HAS_RES=False, STATS=False,
            DOT_DTYPE=dot_dtype(self.cdtype), INPUT_PRECISION=input_precision(self.cdtype), IDX64=self.idx64,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, BLOCK_K2=16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    # ---------------------------------------------------------------------------------- backward
    def handoff_geometry(self) -> tuple[int, int]:
        """(rows per tile, total rows) of the output statistics' tiles (see :class:`StatsHandoff`)."""
        last = self.units[-1]
        return last.fcfg.BLOCK_M, last.M_out

    def backward(self, dy: torch.Tensor, dy_proj: Optional[torch.Tensor], inputs: list, aux: list, weights,
                 proj_weight, need_dx: bool, need_w: list, need_b: list, need_proj_w: bool, bn_dtypes: list):
        """Gradients of the chain.

        Args:
            dy: gradient of the output; dy_proj: of the returned projection (``proj_out="return"``).
            inputs, aux: what :meth:`forward` returned. weights, proj_weight: the convs' weights.
            need_dx, need_w, need_b, need_proj_w: which gradients autograd wants.
            bn_dtypes: per unit, the dtype of γ/β's gradients, or None where they are not wanted.

        Returns:
            ``(dx, dws, dbs, dgammas, dbetas, dproj_w, dstats)``: dx like x (or None); per unit the
            weight, bias, γ and β gradients (None where not wanted); the projection weight's; for an
            EXTERNAL bn_0 the (∂L/∂mean, ∂L/∂invstd) pair (else None).
        """
        dev = dy.device
        n = len(self.units)
        scratch = torch.empty(sum(self.scratch_sizes), device=dev, dtype=self.cdtype).split(self.scratch_sizes)
        wparts = None
        if any(self.wpart_sizes):
            wparts = torch.empty(sum(self.wpart_sizes), device=dev, dtype=torch.float32).split(self.wpart_sizes)
        dws = [torch.empty_like(weights[i]) if need_w[i] else None for i in range(n)]
        dproj_w = torch.empty_like(proj_weight) if (self.spec.proj is not None and need_proj_w) else None
        dgammas, dbetas = self._bn_grads(bn_dtypes, dev)
        dbs = [None] * n
        dx = torch.empty_like(inputs[0]) if need_dx else None
        dstats = None
        grad_in, grad_in_strides = dy, nhwc_strides(dy)
        for i in reversed(range(n)):
            u = self.units[i]
            if need_b[i]:
                dbs[i] = self._bias_grad(grad_in, u, i == n - 1)
            if i > 0:
                target, target_strides = scratch[1 + (i - 1) % 2], _contig_nhwc(u.in_shape)
            else:
                target, target_strides = dx, (nhwc_strides(dx) if dx is not None else None)
            dsts = self._backward_unit(i, u, grad_in, grad_in_strides, dy, dy_proj, inputs, aux, scratch, wparts,
                                       weights, proj_weight, dws, dproj_w, dgammas, dbetas, target, target_strides,
                                       i == 0 and dx is None)
            if dsts is not None:
                dstats = dsts
            grad_in, grad_in_strides = target, target_strides
        return dx, dws, dbs, dgammas, dbetas, dproj_w, dstats

    def _bn_grads(self, bn_dtypes: list, dev):
        n = len(self.units)
        dg, db = [None] * n, [None] * n
        sizes = [self.units[i].in_shape[1] for i in range(n) if bn_dtypes[i] is not None for _ in range(2)]
        if not sizes:
            return dg, db
        dtypes = {d for d in bn_dtypes if d is not None}
        if len(dtypes) == 1:
            views = iter(torch.empty(sum(sizes), device=dev, dtype=dtypes.pop()).split(sizes))
            for i in range(n):
                if bn_dtypes[i] is not None:
                    dg[i], db[i] = next(views), next(views)
        else:
            for i in range(n):
                if bn_dtypes[i] is not None:
                    C = self.units[i].in_shape[1]
                    dg[i] = torch.empty(C, device=dev, dtype=bn_dtypes[i])
                    db[i] = torch.empty(C, device=dev, dtype=bn_dtypes[i])
        return dg, db

    def _bias_grad(self, grad, u: _Unit, is_last: bool) -> torch.Tensor:
        """Σ over (n, p, q) of a conv output's gradient, in fp32 (ATen: conv biases are rare here)."""
        if is_last:
            return grad.sum((0, 2, 3), dtype=torch.float32)
        return grad.view(u.M_out, u.out_shape[1]).sum(0, dtype=torch.float32)

    def _backward_unit(self, i, u: _Unit, g_out, g_strides, dy, dy_proj, inputs, aux, scratch, wparts, weights,
                       proj_weight, dws, dproj_w, dgammas, dbetas, target, target_strides, skip_dx):
        spec, g = self.spec, u.geom
        N, C, H, W = u.in_shape
        _, K, P, Q = u.out_shape
        dot = dict(DOT_DTYPE=dot_dtype(self.cdtype), INPUT_PRECISION=input_precision(self.cdtype), IDX64=self.idx64)
        geo = dict(H=H, W=W, C=C, P=P, Q=Q, K=K, GROUPS=g.groups, R=g.kernel[0], S=g.kernel[1],
                   STRIDE_H=g.stride[0], STRIDE_W=g.stride[1], PAD_H=g.padding[0], PAD_W=g.padding[1],
                   DIL_H=g.dilation[0], DIL_W=g.dilation[1])
        xin, sx, w = inputs[i], u.in_strides, weights[i]
        pack = self.aux_view(aux, f"pack{i}")
        psum = self.aux_view(aux, f"part{i}")
        coef = self.aux_view(aux, f"coef{i}")
        kind = u.mode.kind
        has_gamma = dgammas[i] is not None
        # Σdz, Σdz·x̂ feed dx (batch statistics), the BN parameters' gradients, and the gradients of
        # externally given statistics.
        need_sums = has_gamma or kind == EXTERNAL or (kind == BATCH and not skip_dx)
        proj = i == 0 and spec.proj is not None
        if proj:
            dy2 = dy if spec.proj_out == "add" else dy_proj
            P2, Q2 = self.out_shape[2:] if spec.proj_out == "add" else self.proj_shape[2:]
            K2, pw = spec.proj.out_channels, proj_weight
            dproj = (dy2, *nhwc_strides(dy2), pw, pw.stride()[0], pw.stride()[1])
        else:
            P2 = Q2 = K2 = 1
            dproj = (None, 0, 0, 0, 0, None, 0, 0)
        stride2 = spec.proj.stride[0] if proj else 1
        # ---- dgrad (+ the projection's), epilogue: ReLU mask, per-tile sums, and dx itself when the
        # statistics are constants (eval mode / given from outside).
        write_dx = kind != BATCH and not skip_dx
        if write_dx:
            out, so = target, target_strides
        else:
            out, so = scratch[0], _contig_nhwc(u.in_shape)
        res_grad = i == 0 and spec.residual == "input" and not skip_dx
        dres = (dy, *nhwc_strides(dy)) if (res_grad and write_dx) else (None, 0, 0, 0, 0)
        cfg = u.dcfg
        m_tiles, phases = _dgrad_tiles(u)
        num_parts = m_tiles * phases
        if not skip_dx or need_sums:
            self._launch("dgrad", CK._dgrad_kernel, (m_tiles, triton.cdiv(C // g.groups, cfg.BLOCK_N), g.groups * phases),
                g_out, *g_strides, w, *w.stride(), *dproj, xin, *sx, pack, out, *so, *dres, psum, u.M_in,
                **geo, P2=P2, Q2=Q2, K2=K2, STRIDE2=stride2,
                HAS_PROJ=proj, WRITE_DX=write_dx, HAS_RES=dres[0] is not None, **dot,
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                BLOCK_K2=_p2(K2, 16, cfg.BLOCK_K if not interpreting() else 256),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        # ---- wgrad and the fold of the sums, in one launch
        wc = u.wcfg
        dw = dws[i]
        n_wg = 0
        dw_target, sdw = None, (0, 0, 0, 0)
        if dw is not None:
            n_wg = (triton.cdiv(K // g.groups, wc.BLOCK_M) * triton.cdiv(C // g.groups, wc.BLOCK_N)
                    * g.kernel[0] * g.kernel[1] * g.groups * u.split)
            dw_target, sdw = (dw, dw.stride()) if u.split == 1 else (wparts[i], (0, 0, 0, 0))
        chunk = triton.cdiv(triton.cdiv(u.M_out, u.split), wc.BLOCK_K) * wc.BLOCK_K
        sum_mode = (2 if kind == EXTERNAL else 1) if need_sums else 0
        block_c = _p2(C, 16, 256) if interpreting() else 64
        n_red = triton.cdiv(C, block_c) if sum_mode else 0
        if n_wg + n_red:
            self._launch("wgrad", CK._wgrad_kernel, (n_wg + n_red,),
                g_out, *g_strides, xin, *sx, pack, dw_target, *sdw,
                psum, num_parts, dbetas[i], dgammas[i], coef, 1.0 / u.M_in,
                u.M_out, chunk, n_wg, **geo, SPLIT_K=u.split > 1,
                SUM_MODE=sum_mode, HAS_GAMMA=has_gamma, **dot,
                BLOCK_M=wc.BLOCK_M, BLOCK_N=wc.BLOCK_N, BLOCK_R=wc.BLOCK_K,
                BLOCK_C=block_c, BLOCK_P=_p2(num_parts, 16, 1024) if interpreting() else 32,
                num_warps=wc.num_warps, num_stages=wc.num_stages,
            )
        n_wg2 = 0
        if proj and dproj_w is not None:  # the projection shortcut's wgrad: its own launch (own tiles)
            pwc, N2 = self.proj_wcfg, self.x_shape[0]
            M2 = N2 * P2 * Q2
            n_wg2 = triton.cdiv(K2, pwc.BLOCK_M) * triton.cdiv(C, pwc.BLOCK_N) * self.proj_split
            dw2, sdw2 = (dproj_w, dproj_w.stride()) if self.proj_split == 1 else (wparts[-1], (0, 0, 0, 0))
            self._launch("wgrad_proj", CK._wgrad_kernel, (n_wg2,),
                *dproj[:5], xin, *sx, pack, dw2, *sdw2,
                psum, 0, None, None, coef, 1.0,
                M2, triton.cdiv(triton.cdiv(M2, self.proj_split), pwc.BLOCK_K) * pwc.BLOCK_K, n_wg2,
                H=H, W=W, C=C, P=P2, Q=Q2, K=K2, GROUPS=1, R=1, S=1, STRIDE_H=stride2, STRIDE_W=stride2,
                PAD_H=0, PAD_W=0, DIL_H=1, DIL_W=1, SPLIT_K=self.proj_split > 1, SUM_MODE=0, HAS_GAMMA=False, **dot,
                BLOCK_M=pwc.BLOCK_M, BLOCK_N=pwc.BLOCK_N, BLOCK_R=pwc.BLOCK_K, BLOCK_C=16, BLOCK_P=16,
                num_warps=pwc.num_warps, num_stages=pwc.num_stages,
            )
        # ---- dx pass of BN's backward (batch statistics) and the split-K folds, in one launch
        n_red1 = triton.cdiv(dw.numel(), _FOLD_BLOCK) if (dw is not None and u.split > 1) else 0
        n_red2 = triton.cdiv(dproj_w.numel(), _FOLD_BLOCK) if (n_wg2 and self.proj_split > 1) else 0
        bm, bc = (_p2(u.M_in, 16, 4096), _p2(C, 16, 256)) if interpreting() else (64, 64)
        n_dx = triton.cdiv(u.M_in, bm) * triton.cdiv(C, bc) if (kind == BATCH and not skip_dx) else 0
        if n_dx + n_red1 + n_red2:
            rres = (dy, *nhwc_strides(dy)) if (res_grad and n_dx) else (None, 0, 0, 0, 0)
            tgt = (target, *target_strides) if n_dx else (None, 0, 0, 0, 0)
            job1 = (wparts[i], dw, *dw.stride()) if n_red1 else (None, None, 0, 0, 0, 0)
            job2 = (wparts[-1], dproj_w, *dproj_w.stride()) if n_red2 else (None, None, 0, 0, 0, 0)
            self._launch("dx", BK._dx_kernel, (n_dx + n_red1 + n_red2,),
                scratch[0] if n_dx else None, xin, *sx, pack, coef, *rres, *tgt, u.M_in, n_dx,
                *job1, n_red1, *job2,
                H=H, W=W, C=C, HAS_RES=rres[0] is not None, IDX64=self.idx64,
                K1=K, CG1=C // g.groups, R1=g.kernel[0], S1=g.kernel[1], SPLIT1=u.split, HAS_RED1=n_red1 > 0,
                K2=K2, CG2=C, SPLIT2=self.proj_split, HAS_RED2=n_red2 > 0,
                BLOCK_M=bm, BLOCK_C=bc, BLOCK_E=_FOLD_BLOCK, num_warps=4,
            )
        if kind == EXTERNAL:
            return coef.view(2, C).unbind(0)
        return None


class _Recording:
    def __init__(self, plan: TritonPlan):
        self.plan, self.launches = plan, []

    def __enter__(self) -> list:
        self.plan._recorder = self.launches
        return self.launches

    def __exit__(self, *exc) -> None:
        self.plan._recorder = None


def nhwc_strides_of(shape, strides) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides from logical (N, C, H, W) ``strides``."""
    sn, sc, sh, sw = strides
    return sn, sh, sw, sc


def _is_channels_last(shape, strides) -> bool:
    N, C, H, W = shape
    t = torch.empty_strided(shape, strides, device="meta")
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
