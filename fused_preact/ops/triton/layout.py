"""Triton backend: the layout of a fused chain call — shapes, strides, tiles, grids and buffer sizes,
decided once per input signature (:class:`ChainLayout`). :class:`~.plan.TritonPlan` adds the order of
the launches in forward and backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from fused_preact.ops._common import interpreting, triton
from fused_preact.ops.dtypes import traits
from fused_preact.ops.index_range import INT32_MAX, chain_margin, max_offset, range_reasons
from fused_preact.ops.spec import BATCH, BNMode, ChainSpec, ConvGeom
from fused_preact.ops.triton.configs import (
    INTERP_SUM_ROWS,
    GemmConfig,
    UnitPlan,
    arch_of,
    candidates,
    contig_nhwc,
    dgrad_config,
    dgrad_slots,
    fprop_config,
    halo_fprop,
    halo_geometry,
    halo_sync_config,
    halo_wgrad_programs,
    halo_wgrad_rows,
    is_channels_last,
    nhwc_strides_of,
    out_strides,
    p2,
    wgrad_config,
    wgrad_split,
)
from fused_preact.ops.triton.pack import PACK_ROWS

__all__ = ["ChainLayout"]


class ChainLayout:
    """Everything a chain call decides once: shapes, strides, tiles, grids, buffer layouts (no launch:
    :class:`~.plan.TritonPlan` runs them).

    Args:
        spec: the chain structure. modes: each unit's :class:`BNMode`.
        x_shape, x_strides, x_dtype, device: the chain input's. cdtype: the compute dtype (the dot's
            operand dtype; the autocast dtype under autocast). in_stats: bn_0's batch statistics come
            as a :class:`StatsHandoff`. out_stats: the last conv's epilogue writes its output's
            partial statistics (for the next block). residual_dtype: dtype of the ``r`` of
            ``residual="tensor"``.
        overrides: ``{"fprop" | "dgrad" | "wgrad": GemmConfig or [GemmConfig per unit]}`` forced tiles
            (tuning, the static report); split: forced wgrad K-split (also the projection's); tune:
            look up / tune tiles (:mod:`.tuning`) when tuning is enabled and the device is a GPU.
        arch: compute capability the tiles are for (10·major + minor; default: the device's, 0 off
            CUDA); the static report plans for each arch on the meta device.
    """

    def __init__(self, spec: ChainSpec, modes: tuple[BNMode, ...], x_shape, x_strides, x_dtype: torch.dtype,
                 device: torch.device, cdtype: torch.dtype, in_stats: bool, out_stats: bool,
                 residual_dtype: Optional[torch.dtype] = None, overrides: Optional[dict] = None,
                 split: Optional[int] = None, tune: bool = True, arch: Optional[int] = None):
        self.spec, self.modes, self.device, self.cdtype = spec, modes, device, cdtype
        self.arch = arch_of(device) if arch is None else arch
        self.x_shape, self.x_strides, self.x_dtype = tuple(x_shape), tuple(x_strides), x_dtype
        self.in_stats, self.out_stats = in_stats, out_stats
        self.channels_last = is_channels_last(self.x_shape, self.x_strides)
        n = len(spec.convs)
        res_dtype = {"input": x_dtype, "tensor": residual_dtype}.get(spec.residual)
        self.out_dtype = torch.promote_types(cdtype, res_dtype) if res_dtype is not None else cdtype
        shapes = [self.x_shape]
        for g in spec.convs:
            N, _, H, W = shapes[-1]
            shapes.append((N, g.out_channels, *g.out_hw(H, W)))
        self.out_shape = shapes[-1]
        self.shapes = shapes  # every unit's input shape, then the output's
        self.margin = chain_margin(spec)
        reasons = range_reasons(shapes, self.x_strides, self.margin)
        if reasons:
            raise ValueError("TritonPlan: " + "; ".join(reasons))
        self.units: list[UnitPlan] = []
        for i, g in enumerate(spec.convs):
            last = i == n - 1
            in_strides = nhwc_strides_of(self.x_strides) if i == 0 else contig_nhwc(shapes[i])
            out_st = out_strides(shapes[i + 1], self.channels_last) if last else contig_nhwc(shapes[i + 1])
            stats_out = out_stats if last else modes[i + 1].kind == BATCH
            N, C, H, W = shapes[i]
            _, K, P, Q = shapes[i + 1]
            Cg, Kg = C // g.groups, K // g.groups
            over = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in (overrides or {}).items()}
            unit = UnitPlan(g, shapes[i], shapes[i + 1], in_strides, out_st, modes[i],
                            over.get("fprop") or fprop_config(N * P * Q, Kg, Cg, cdtype, stats_out,
                                                              **self.tile_args(i, g, "fprop")),
                            over.get("dgrad") or dgrad_config(N * H * W, Cg, Kg, cdtype, **self.tile_args(i, g, "dgrad")),
                            over.get("wgrad") or wgrad_config(Kg, Cg, N * P * Q, cdtype, **self.tile_args(i, g)), 1,
                            stats_out)
            if tune and overrides is None:
                self.tune_unit(unit, i)
            if unit.wcfg.halo:  # the halo wgrad's programs split the rows: its K-split
                # (a forced tile of fewer pixels than an image row: 1, and the launcher refuses it)
                unit.split = split or halo_wgrad_programs(N * P, max(1, unit.wcfg.BLOCK_K // Q), device)
            else:
                unit.split = split or wgrad_split(unit.M_out, unit.wgrad_tiles(),
                                                  unit.wcfg.BLOCK_K * unit.wcfg.unroll, device)
            self.units.append(unit)
        self._plan_proj(split)
        self._plan_buffers()
        # 64-bit image offsets where any tensor of the plan reaches 2**31 − 1: x with its strides, and
        # the NHWC-contiguous outputs, scratch and gradients of every shape (a per-call residual or
        # output gradient with its own strides adds its own, at the call)
        tensors = [(self.x_shape, nhwc_strides_of(self.x_strides))] + [(s, contig_nhwc(s)) for s in shapes]
        if spec.proj is not None:
            tensors.append((self.proj_shape, contig_nhwc(self.proj_shape)))
        self.idx64 = max(max_offset(s, st) for s, st in tensors) >= INT32_MAX

    def tune_unit(self, u: UnitPlan, i: int) -> None:
        """Hook: replace the rules' tiles of u (unit i) with tuned ones. A layout keeps them; a plan
        that can launch its kernels times the candidates (:meth:`.plan.TritonPlan.tune_unit`)."""

    def tile_args(self, i: int, g: ConvGeom, kind: str = "wgrad") -> dict:
        """The tile rules' arguments (:func:`wgrad_config`, :func:`fprop_config`, ``candidates``) for
        the ``kind`` kernel of the conv ``g`` reading unit i's input: arch; taps: g's R·S; x32: under
        16-bit compute the launch reads fp32 activations — unit i's input (the chain's, i = 0) or, for
        fprop, the residual the last unit adds (assumed of the chain input's dtype); for fprop proj:
        the launch adds the projection shortcut (the last unit's) and halo: g admits the staged-halo
        kernel (:func:`~.configs.halo_geometry`; :func:`~.configs.halo_fprop` decides the rest); for
        wgrad strided, proj (g is the projection shortcut) and halo: the staged-halo tile's rows where g
        admits it (:func:`~.configs.halo_wgrad_rows`, 0 where not; :func:`~.configs.halo_wgrad` decides
        the rest); for dgrad slots (:func:`dgrad_slots`) and res: the launch adds the identity
        shortcut's gradient to dx."""
        autocast = self.x_dtype == torch.float32 and traits(self.cdtype).mma16
        taps = g.kernel[0] * g.kernel[1]
        if kind == "fprop":
            last = i == len(self.spec.convs) - 1
            last_adds = last and self.spec.residual != "none"
            proj = last and self.spec.proj is not None and self.spec.proj_out == "add" and g is not self.spec.proj
            halo = g is not self.spec.proj and halo_geometry(g, self.shapes[i], self.shapes[i + 1], self.arch)
            return dict(arch=self.arch, x32=autocast and (i == 0 or last_adds), taps=taps, proj=proj, halo=halo)
        if kind == "dgrad":  # res: the launch adds the identity shortcut's gradient (unit 0, dx written)
            res = i == 0 and self.spec.residual == "input" and self.modes[0].kind != BATCH
            return dict(slots=dgrad_slots(g, g.out_channels // g.groups, self.cdtype), arch=self.arch,
                        taps=taps, res=res)
        x32 = i == 0 and autocast
        halo = halo_wgrad_rows(g, self.shapes[i], self.shapes[i + 1]) if g is not self.spec.proj else 0
        return dict(arch=self.arch, x32=x32, strided=g.stride != (1, 1), taps=taps, halo=halo,
                    proj=g is self.spec.proj)

    def unit_candidates(self, u: UnitPlan, i: int, kind: str) -> list[GemmConfig]:
        """The autotune candidates of the ``kind`` kernel (fprop, dgrad, wgrad) of u, unit i: the ones
        the tuner times and the static report compiles (:func:`~.configs.candidates`; for an fprop on
        the staged halo also its mma.sync tile, :func:`~.configs.halo_sync_config`, where that tile's
        rows' staging fits, :func:`~.configs.halo_geometry`)."""
        g = u.geom
        Cg, Kg = u.in_shape[1] // g.groups, u.out_shape[1] // g.groups
        m, n, k = {"fprop": (u.M_out, Kg, Cg), "dgrad": (u.M_in, Cg, Kg), "wgrad": (Kg, Cg, u.M_out)}[kind]
        args = self.tile_args(i, g, kind)
        out = candidates(kind, m, n, k, self.cdtype, **args)
        sync = halo_sync_config(Kg, Cg, self.arch) if kind == "fprop" else None
        # the staged halo's mma.sync tile: where the wgmma one is a candidate and its rows' staging fits
        if (sync is not None and args["halo"] and halo_fprop(m, n, k, self.cdtype, self.arch, args["taps"], args["proj"])
                and halo_geometry(g, u.in_shape, u.out_shape, self.arch, sync.BLOCK_M)):
            out.append(sync)
        return out

    # ------------------------------------------------------------------------------------ layout
    def _plan_proj(self, split: Optional[int]) -> None:
        spec = self.spec
        self.proj_split = 1
        self.proj_fcfg = self.proj_wcfg = self.proj_unit = self.proj_shape = None
        if spec.proj is None:
            return
        N, C, H, W = self.x_shape
        K, (P, Q) = spec.proj.out_channels, spec.proj.out_hw(H, W)
        self.proj_shape = (N, K, P, Q)
        self.proj_fcfg = fprop_config(N * P * Q, K, C, self.cdtype, False, **self.tile_args(0, spec.proj, "fprop"))
        self.proj_wcfg = wgrad_config(K, C, N * P * Q, self.cdtype, **self.tile_args(0, spec.proj))
        tiles = triton.cdiv(K, self.proj_wcfg.BLOCK_M) * triton.cdiv(C, self.proj_wcfg.BLOCK_N)
        self.proj_split = split or wgrad_split(N * P * Q, tiles,
                                               self.proj_wcfg.BLOCK_K * self.proj_wcfg.unroll, self.device)
        # The projection as a unit of its own (its fprop when the chain returns it separately).
        u0 = self.units[0]
        self.proj_unit = UnitPlan(spec.proj, self.x_shape, self.proj_shape, u0.in_strides,
                                  out_strides(self.proj_shape, self.channels_last), u0.mode, self.proj_fcfg,
                                  u0.dcfg, self.proj_wcfg, self.proj_split, False)

    def _stats_rows(self) -> int:
        return p2(self.units[0].M_in, 16, INTERP_SUM_ROWS) if interpreting() else 256

    def _plan_buffers(self) -> None:
        """Sizes of the fp32 ``aux`` regions and the backward scratch."""
        sizes: dict[str, int] = {}
        for i, u in enumerate(self.units):
            C = u.in_shape[1]
            sizes[f"pack{i}"] = PACK_ROWS * C
            fwd_tiles = 0
            if u.mode.kind == BATCH:
                if i > 0:
                    fwd_tiles = triton.cdiv(self.units[i - 1].M_out, self.units[i - 1].fcfg.BLOCK_M)
                elif not self.in_stats:
                    fwd_tiles = triton.cdiv(u.M_in, self._stats_rows())
            m_tiles, phases = u.dgrad_tiles()
            sizes[f"part{i}"] = max(fwd_tiles, m_tiles * phases) * 2 * C
            sizes[f"coef{i}"] = 2 * C
        last = self.units[-1]
        if self.out_stats:
            sizes["outpart"] = triton.cdiv(last.M_out, last.fcfg.BLOCK_M) * 2 * last.out_shape[1]
        self.aux_names = list(sizes)
        self.aux_sizes = list(sizes.values())
        self._aux_index = {name: j for j, name in enumerate(self.aux_names)}
        # Backward scratch in the compute dtype: dz (largest BN input of a BATCH unit) and two ping-pong
        # buffers for the gradients of the intermediates (the inputs of units 1 … n−1).
        dz = max([u.M_in * u.in_shape[1] for i, u in enumerate(self.units) if u.mode.kind == BATCH or i == 0])
        inter = [u.M_in * u.in_shape[1] for u in self.units[1:]]
        pp = max(inter + [0])
        self.scratch_sizes = [dz, pp, pp if len(inter) > 1 else 0]
        wparts = [u.split * u.geom.out_channels * u.geom.in_channels // u.geom.groups * u.geom.kernel[0]
                  * u.geom.kernel[1] if u.split > 1 else 0 for u in self.units]
        wparts.append(self.proj_split * self.spec.proj.out_channels * self.spec.proj.in_channels
                      if self.spec.proj is not None and self.proj_split > 1 else 0)
        self.wpart_sizes = wparts

    def aux_view(self, aux: list, name: str) -> torch.Tensor:
        """The ``aux`` region ``name`` (``pack<i>``, ``part<i>``, ``coef<i>``, ``outpart``)."""
        return aux[self._aux_index[name]]

    def handoff_geometry(self) -> tuple[int, int]:
        """(rows per tile, total rows) of the output statistics' tiles (see :class:`StatsHandoff`)."""
        last = self.units[-1]
        return last.fcfg.BLOCK_M, last.M_out
