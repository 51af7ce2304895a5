"""Triton backend: the launch plan of a fused chain — shapes, strides, tiles and buffer layout decided
once per input signature — and the order of its launches in forward and backward.

Per unit, the forward is at most two launches — the statistics finalize (from the producer's epilogue
partials) and the fused fprop — and the backward three: dgrad (ReLU mask and per-tile BN sums in its
epilogue), wgrad (whose extra programs fold the sums), dx (whose extra programs fold wgrad's split-K
partials). A network's first BatchNorm adds one statistics pass over its input.

Allocations per call: forward — each conv output and one fp32 ``aux`` buffer split into the per-unit
packs (mean, var, invstd, scale, shift), partial-statistics tiles and dx coefficients (saved for
backward; it is the only thing besides the units' inputs that is); backward — one scratch buffer in the
compute dtype (dz and the gradients of the intermediates), dx, the weight gradients and one buffer
split into the BN parameters' gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fused_preact.ops._common import interpreting, nhwc_strides, triton
from fused_preact.ops.index_range import INT32_MAX, chain_margin, max_offset, needs_idx64, range_reasons, within_reach
from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    BNMode,
    ChainForward,
    ChainGrads,
    ChainSpec,
    ChainTensors,
    ConvGeom,
    GradNeeds,
    SavedChain,
    StatsHandoff,
)
from fused_preact.ops.triton import kernels_conv as CK
from fused_preact.ops.triton import launch
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
    quad_channels,
    wgrad_config,
    wgrad_split,
)
from fused_preact.ops.triton.tuning import cache_for, choose, tuning_enabled

__all__ = ["TritonPlan"]


def mma_weight(w: Optional[torch.Tensor], cdtype: torch.dtype, quad: bool = False) -> Optional[torch.Tensor]:
    """A conv weight (K, C/groups, R, S) as the kernels' MMA operand: ``w`` itself when it is in the
    compute dtype ``cdtype`` (None stays None), else converted once per call — as ``F.conv2d`` under
    ``torch.autocast`` casts an fp32 weight to the autocast dtype (same rounding: to nearest even) —
    into channels_last (input channels contiguous: vector loads for any filter). Given an fp32 weight,
    every program of a 16-bit launch would convert its weight tiles itself (and 128×64 fprop tiles
    spill). ``quad``: a copy with the input channels in the order of fprop's quads
    (``configs.quad_channels``): channel g·16 + h·8 + 2q + e takes channel g·16 + 4q + 2h + e."""
    if w is None or (not quad and w.dtype == cdtype):
        return w
    if quad:
        K, C, R, S = w.shape
        w = w.reshape(K, C // 16, 4, 2, 2, R, S).transpose(2, 3).reshape(K, C, R, S)
    return w.to(cdtype, memory_format=torch.channels_last)


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
            if tune and overrides is None and _tunes_on(device):
                _tune_unit(self, unit, i)
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
        autocast = self.x_dtype == torch.float32 and self.cdtype != torch.float32
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
            sizes[f"pack{i}"] = CK.PACK_ROWS * C
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

    # ----------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, t: ChainTensors) -> ChainForward:
        """Run the chain on ``x`` (the input this plan was built for) with the per-call tensors ``t``."""
        dev = x.device
        if t.residual is not None:
            t = dataclasses.replace(t, residual=within_reach(t.residual, self.margin, self.channels_last))
        idx64 = self.idx64 or needs_idx64(t.residual)
        base = torch.empty(sum(self.aux_sizes), device=dev, dtype=torch.float32)
        aux = list(base.split(self.aux_sizes))
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty(self.out_shape, device=dev, dtype=self.out_dtype, memory_format=fmt)
        inputs = [x] + [torch.empty(u.M_in * u.in_shape[1], device=dev, dtype=self.cdtype) for u in self.units[1:]]
        proj_out = None
        if self.spec.proj is not None and self.spec.proj_out == "return":
            proj_out = torch.empty(self.proj_shape, device=dev, dtype=self.cdtype, memory_format=fmt)
        n = len(self.units)
        for i, u in enumerate(self.units):
            if i == 0 and u.mode.kind == BATCH and not self.in_stats:
                launch.stats_partial(x=x, x_strides=u.in_strides, part=self.aux_view(aux, "part0"),
                                     shape=u.in_shape, rows=self._stats_rows(), idx64=idx64)
            launch.finalize(**self._finalize_args(i, u, t, aux))
            launch.fprop(u, **self._fprop_args(i, u, inputs[i], out if i == n - 1 else inputs[i + 1], t, aux, x,
                                                idx64))
        if proj_out is not None:
            pu = self.proj_unit
            quad = quad_channels(x.dtype, self.cdtype, x.shape[1])
            launch.fprop(pu, x=x, w=mma_weight(t.proj_weight, self.cdtype, quad), pack=self.aux_view(aux, "pack0"), bias=None,
                         y=proj_out, part=None, cdtype=self.cdtype, idx64=idx64, quad=quad, name="fprop_proj")
        stats = None
        if self.out_stats:
            stats = StatsHandoff(self.aux_view(aux, "outpart"), *self.handoff_geometry())
        return ChainForward(out, proj_out, SavedChain(inputs, aux, base), stats)

    def _finalize_args(self, i: int, u: UnitPlan, t: ChainTensors, aux: list) -> dict:
        C = u.in_shape[1]
        args = dict(pack=self.aux_view(aux, f"pack{i}"), C=C, mode=u.mode, count=u.M_in, gamma=t.gammas[i],
                    beta=t.betas[i], mean_src=t.running_means[i], var_src=t.running_vars[i], nbt=t.num_batches[i],
                    momentum=t.momenta[i], eps=t.eps[i])
        if u.mode.kind == BATCH:
            if i == 0 and self.in_stats:
                h = t.in_stats
                args.update(part=h.part, rows=h.rows, count=h.count, num_parts=triton.cdiv(h.count, h.rows))
            else:
                rows = self._stats_rows() if i == 0 else self.units[i - 1].fcfg.BLOCK_M
                args.update(part=self.aux_view(aux, f"part{i}"), rows=rows, num_parts=triton.cdiv(u.M_in, rows))
        elif u.mode.kind == EXTERNAL:
            args.update(mean_src=t.ext_mean, var_src=t.ext_invstd)
        return args

    def _fprop_args(self, i: int, u: UnitPlan, xin, dst, t: ChainTensors, aux: list, x0, idx64: bool) -> dict:
        spec = self.spec
        last = i == len(self.units) - 1
        part = None
        if last and self.out_stats:
            part = self.aux_view(aux, "outpart")
        elif u.stats_out:
            part = self.aux_view(aux, f"part{i + 1}")
        quad = quad_channels(xin.dtype, self.cdtype, u.in_shape[1] // u.geom.groups) and not u.fcfg.halo
        args = dict(x=xin, w=mma_weight(t.weights[i], self.cdtype, quad), pack=self.aux_view(aux, f"pack{i}"), bias=t.biases[i],
                    y=dst, part=part, cdtype=self.cdtype, idx64=idx64, x0_shape=self.x_shape, quad=quad)
        proj = last and spec.proj is not None and spec.proj_out == "add"
        res = spec.residual if last else "none"
        if proj or res == "input":
            args.update(x0=x0, x0_strides=self.units[0].in_strides)
        elif res == "tensor":
            args.update(x0=t.residual, x0_strides=nhwc_strides(t.residual))
        if proj:
            args.update(proj_w=mma_weight(t.proj_weight, self.cdtype), proj_stride=spec.proj.stride[0],
                        pack0=self.aux_view(aux, "pack0"))
        args["residual"] = res != "none"
        return args

    # ---------------------------------------------------------------------------------- backward
    def backward(self, dy: torch.Tensor, dy_proj: Optional[torch.Tensor], saved: SavedChain, weights,
                 proj_weight, needs: GradNeeds) -> ChainGrads:
        """Gradients of the chain from ``dy`` (and ``dy_proj``, the returned projection's gradient,
        for ``proj_out="return"``), the forward's ``saved`` tensors and the convs' weights."""
        dev = dy.device
        n = len(self.units)
        # a gradient that is a view with strides wider than its shape (torch.cat's backward hands out
        # slices): copied where the kernels cannot address it, 64-bit offsets where its batch needs them
        dy, dy_proj = (within_reach(v, self.margin, self.channels_last) for v in (dy, dy_proj))
        idx64 = self.idx64 or needs_idx64(dy, dy_proj)
        scratch = torch.empty(sum(self.scratch_sizes), device=dev, dtype=self.cdtype).split(self.scratch_sizes)
        wparts = None
        if any(self.wpart_sizes):
            wparts = torch.empty(sum(self.wpart_sizes), device=dev, dtype=torch.float32).split(self.wpart_sizes)
        dproj_w = torch.empty_like(proj_weight) if (self.spec.proj is not None and needs.proj_weight) else None
        grads = ChainGrads(torch.empty_like(saved.inputs[0]) if needs.dx else None,
                           [torch.empty_like(weights[i]) if needs.weights[i] else None for i in range(n)],
                           [None] * n, *self._bn_grads(needs.bn_dtypes, dev), dproj_w)
        grad_in, grad_in_strides = dy, nhwc_strides(dy)
        for i in reversed(range(n)):
            u = self.units[i]
            if needs.biases[i]:
                # an inner unit's output gradient: the head of a flat scratch buffer sized for the
                # largest intermediate, contiguous NHWC
                rows, cols = u.M_out, u.out_shape[1]
                grad_view = grad_in if i == n - 1 else grad_in[: rows * cols].view(rows, cols)
                grads.biases[i] = grad_view.sum((0, 2, 3) if i == n - 1 else 0, dtype=torch.float32)
            if i > 0:
                target, target_strides = scratch[1 + (i - 1) % 2], contig_nhwc(u.in_shape)
            else:
                target = grads.dx
                target_strides = nhwc_strides(target) if target is not None else None
            self._backward_unit(i, u, grad_in, grad_in_strides, dy, dy_proj, saved, scratch, wparts, weights,
                                proj_weight, grads, target, target_strides, idx64)
            grad_in, grad_in_strides = target, target_strides
        return grads

    def _bn_grads(self, bn_dtypes, dev) -> tuple[list, list]:
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

    def _backward_unit(self, i: int, u: UnitPlan, g_out, g_strides, dy, dy_proj, saved: SavedChain, scratch,
                       wparts, weights, proj_weight, grads: ChainGrads, target, target_strides, idx64: bool) -> None:
        spec, g = self.spec, u.geom
        C = u.in_shape[1]
        xin, w = saved.inputs[i], mma_weight(weights[i], self.cdtype)
        pack, psum, coef = (self.aux_view(saved.aux, f"{name}{i}") for name in ("pack", "part", "coef"))
        kind = u.mode.kind
        skip_dx = i == 0 and target is None
        has_gamma = grads.gammas[i] is not None
        # Σdz, Σdz·x̂ feed dx (batch statistics), the BN parameters' gradients, and the gradients of
        # externally given statistics.
        need_sums = has_gamma or kind == EXTERNAL or (kind == BATCH and not skip_dx)
        cd = dict(cdtype=self.cdtype, idx64=idx64)
        proj = dict()
        if i == 0 and spec.proj is not None:
            dy2 = dy if spec.proj_out == "add" else dy_proj
            proj = dict(dy2=dy2, dy2_strides=nhwc_strides(dy2), dy2_shape=tuple(dy2.shape),
                        w2=mma_weight(proj_weight, self.cdtype), proj_stride=spec.proj.stride[0])
        # ---- dgrad (+ the projection's), epilogue: ReLU mask, per-tile sums, and dx itself when the
        # statistics are constants (eval mode / given from outside).
        write_dx = kind != BATCH and not skip_dx
        out, so = (target, target_strides) if write_dx else (scratch[0], contig_nhwc(u.in_shape))
        res_grad = i == 0 and spec.residual == "input" and not skip_dx
        res = dict(res=dy, res_strides=nhwc_strides(dy)) if res_grad else {}
        if not skip_dx or need_sums:
            launch.dgrad(u, dy=g_out, dy_strides=g_strides, w=w, x=xin, pack=pack, out=out, out_strides=so,
                         psum=psum, write_dx=write_dx, **proj, **(res if write_dx else {}), **cd)
        # ---- wgrad and the fold of the sums, in one launch
        dw = grads.weights[i]
        dw_target, sdw = (dw, dw.stride()) if (dw is not None and u.split == 1) else (None, (0, 0, 0, 0))
        if dw is not None and u.split > 1:
            dw_target = wparts[i]
        m_tiles, phases = u.dgrad_tiles()
        launch.wgrad(geom=g, in_shape=u.in_shape, out_shape=u.out_shape, in_strides=u.in_strides, cfg=u.wcfg,
                     split=u.split, dy=g_out, dy_strides=g_strides, x=xin, pack=pack, dw=dw_target, dw_strides=sdw,
                     sum_mode=_sum_mode(kind) if need_sums else launch.SumMode.NONE, psum=psum,
                     num_parts=m_tiles * phases, dbeta=grads.betas[i], dgamma=grads.gammas[i], coef=coef,
                     inv_count=1.0 / u.M_in, **cd)
        dpw = grads.proj_weight if proj else None
        if dpw is not None:  # the projection shortcut's wgrad: its own launch (own tiles)
            pu = self.proj_unit
            dw2, sdw2 = (dpw, dpw.stride()) if self.proj_split == 1 else (wparts[-1], (0, 0, 0, 0))
            launch.wgrad(geom=spec.proj, in_shape=u.in_shape, out_shape=proj["dy2_shape"], in_strides=u.in_strides,
                         cfg=pu.wcfg, split=self.proj_split, dy=proj["dy2"], dy_strides=proj["dy2_strides"], x=xin,
                         pack=pack, dw=dw2, dw_strides=sdw2, psum=psum, coef=coef, fold=False, **cd)
        # ---- dx pass of BN's backward (batch statistics) and the split-K folds, in one launch
        dx_pass = kind == BATCH and not skip_dx
        launch.dx(geom=g, shape=u.in_shape, x=xin, x_strides=u.in_strides, pack=pack, coef=coef,
                  dz=scratch[0] if dx_pass else None, out=target if dx_pass else None,
                  out_strides=target_strides if dx_pass else (0, 0, 0, 0),
                  **(res if (res_grad and dx_pass) else {}), idx64=idx64, split1=u.split,
                  fold1=(wparts[i], dw) if (dw is not None and u.split > 1) else None,
                  fold2=(wparts[-1], dpw) if (dpw is not None and self.proj_split > 1) else None,
                  k2=spec.proj.out_channels if proj else 1, split2=self.proj_split)
        if kind == EXTERNAL:
            grads.ext_stats = tuple(coef.view(2, C).unbind(0))


def _sum_mode(kind: int) -> "launch.SumMode":
    """The fold's :class:`~.launch.SumMode` for a unit whose BatchNorm has mode ``kind``."""
    return launch.SumMode.EXTERNAL if kind == EXTERNAL else launch.SumMode.BATCH


# ---------------------------------------------------------------------------------------- tuning
def _tunes_on(device: torch.device) -> bool:
    """Plans tune their tiles on GPUs when tuning is enabled (see :mod:`.tuning`)."""
    return device.type == "cuda" and tuning_enabled()


def _tune_unit(plan: TritonPlan, u: UnitPlan, i: int) -> None:
    """Pick the fprop, dgrad and wgrad tiles of u (unit i) from the tuning cache or by timing the candidates."""
    g = u.geom
    N, C, H, W = u.in_shape
    K = u.out_shape[1]
    base = (f"{plan.cdtype}|{plan.x_dtype}|R{g.kernel[0]}S{g.kernel[1]}|s{g.stride[0]}x{g.stride[1]}|"
            f"p{g.padding[0]}x{g.padding[1]}|d{g.dilation[0]}x{g.dilation[1]}|g{g.groups}|C{C}|K{K}|"
            f"cl{int(plan.channels_last)}")
    cache = cache_for(torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else plan.device.type)
    for kind in ("fprop", "dgrad", "wgrad"):
        attr = {"fprop": "fcfg", "dgrad": "dcfg", "wgrad": "wcfg"}[kind]
        rows = u.M_in if kind == "dgrad" else u.M_out
        key = f"{kind}|{base}|M{triton.next_power_of_2(rows)}|stats{int(u.stats_out)}"
        best = choose(cache, key, plan.unit_candidates(u, i, kind), getattr(u, attr),
                      lambda cfg, kind=kind: _time_config(plan, u, i, kind, cfg), dataclasses.asdict)
        setattr(u, attr, best)


def _time_config(plan: TritonPlan, u: UnitPlan, i: int, kind: str, cfg: GemmConfig) -> float:
    """ms of the ``kind`` kernel of u (unit i) with tiles ``cfg``, on random data of u's shapes and
    input dtype (a one-unit plan for the same arch)."""
    import triton.testing

    dev, cd = plan.device, plan.cdtype
    N, C, H, W = u.in_shape
    x_dtype = plan.x_dtype if i == 0 else cd
    one = TritonPlan(ChainSpec((u.geom,)), (BNMode(BATCH, True),), u.in_shape, (H * W * C, 1, W * C, C),
                     x_dtype, dev, cd, False, u.stats_out, overrides={kind: cfg},
                     split=u.split if kind != "wgrad" else None, arch=plan.arch)
    g = u.geom
    w = torch.randn((g.out_channels, C // g.groups, *g.kernel), device=dev, dtype=cd)
    t = ChainTensors([w.contiguous(memory_format=torch.channels_last)], [None], [torch.rand(C, device=dev) + 0.5],
                     [torch.randn(C, device=dev)], [None], [None], [None], [0.1], [1e-5])
    x = torch.randn(u.in_shape, device=dev, dtype=x_dtype).contiguous(memory_format=torch.channels_last)
    fwd = one.forward(x, t)
    with launch.recording() as launches:
        if kind == "fprop":
            one.forward(x, t)
        else:
            one.backward(torch.randn_like(fwd.out), None, fwd.saved, t.weights, None,
                         GradNeeds(True, (True,), (False,), (t.gammas[0].dtype,)))
    (rec,) = [r for r in launches if r.name == kind]
    return triton.testing.do_bench(rec, warmup=3, rep=10)
