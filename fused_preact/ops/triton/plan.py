"""Triton backend: the launch plan of a fused chain — the order of its launches in forward and
backward, over the shapes, strides, tiles and buffer layout decided once per input signature
(:class:`~.layout.ChainLayout`).

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

from fused_preact.ops._common import nhwc_strides, triton
from fused_preact.ops.index_range import needs_idx64, within_reach
from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    BNMode,
    ChainForward,
    ChainGrads,
    ChainSpec,
    ChainTensors,
    GradNeeds,
    SavedChain,
    StatsHandoff,
    UnitTensors,
)
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.configs import (
    GemmConfig,
    UnitPlan,
    contig_nhwc,
    quad_channels,
)
from fused_preact.ops.triton.layout import ChainLayout
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


class TritonPlan(ChainLayout):
    """A :class:`~.layout.ChainLayout` that runs: the launches of a chain call's forward and backward
    (:class:`fused_preact.ops.backends.Plan`). Arguments: :class:`~.layout.ChainLayout`'s."""

    def tune_unit(self, u: UnitPlan, i: int) -> None:
        """Tiles of u (unit i) from the tuning cache or by timing the candidates, on GPUs with tuning
        enabled (:mod:`.tuning`); elsewhere the rules' tiles stay."""
        if _tunes_on(self.device):
            _tune_unit(self, u, i)

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
        ut = t.units[i]
        args = dict(pack=self.aux_view(aux, f"pack{i}"), C=C, mode=u.mode, count=u.M_in, gamma=ut.gamma,
                    beta=ut.beta, mean_src=ut.running_mean, var_src=ut.running_var, nbt=ut.num_batches,
                    momentum=ut.momentum, eps=ut.eps)
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
        args = dict(x=xin, w=mma_weight(t.units[i].weight, self.cdtype, quad), pack=self.aux_view(aux, f"pack{i}"),
                    bias=t.units[i].bias,
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
        grads = ChainGrads.empty(n, torch.empty_like(saved.inputs[0]) if needs.dx else None)
        grads.proj_weight = dproj_w
        grads.alloc_bn([u.in_shape[1] for u in self.units], needs.bn_dtypes, dev)
        for i, gu in enumerate(grads.units):
            gu.weight = torch.empty_like(weights[i]) if needs.weights[i] else None
        grad_in, grad_in_strides = dy, nhwc_strides(dy)
        for i in reversed(range(n)):
            u = self.units[i]
            if needs.biases[i]:
                # an inner unit's output gradient: the head of a flat scratch buffer sized for the
                # largest intermediate, contiguous NHWC
                rows, cols = u.M_out, u.out_shape[1]
                grad_view = grad_in if i == n - 1 else grad_in[: rows * cols].view(rows, cols)
                grads.units[i].bias = grad_view.sum((0, 2, 3) if i == n - 1 else 0, dtype=torch.float32)
            if i > 0:
                target, target_strides = scratch[1 + (i - 1) % 2], contig_nhwc(u.in_shape)
            else:
                target = grads.dx
                target_strides = nhwc_strides(target) if target is not None else None
            self._backward_unit(i, u, grad_in, grad_in_strides, dy, dy_proj, saved, scratch, wparts, weights,
                                proj_weight, grads, target, target_strides, idx64)
            grad_in, grad_in_strides = target, target_strides
        return grads

    def _backward_unit(self, i: int, u: UnitPlan, g_out, g_strides, dy, dy_proj, saved: SavedChain, scratch,
                       wparts, weights, proj_weight, grads: ChainGrads, target, target_strides, idx64: bool) -> None:
        spec, g = self.spec, u.geom
        C = u.in_shape[1]
        xin, w = saved.inputs[i], mma_weight(weights[i], self.cdtype)
        pack, psum, coef = (self.aux_view(saved.aux, f"{name}{i}") for name in ("pack", "part", "coef"))
        kind = u.mode.kind
        skip_dx = i == 0 and target is None
        gu = grads.units[i]
        has_gamma = gu.gamma is not None
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
        dw = gu.weight
        dw_target, sdw = (dw, dw.stride()) if (dw is not None and u.split == 1) else (None, (0, 0, 0, 0))
        if dw is not None and u.split > 1:
            dw_target = wparts[i]
        m_tiles, phases = u.dgrad_tiles()
        launch.wgrad(geom=g, in_shape=u.in_shape, out_shape=u.out_shape, in_strides=u.in_strides, cfg=u.wcfg,
                     split=u.split, dy=g_out, dy_strides=g_strides, x=xin, pack=pack, dw=dw_target, dw_strides=sdw,
                     sum_mode=_sum_mode(kind) if need_sums else launch.SumMode.NONE, psum=psum,
                     num_parts=m_tiles * phases, dbeta=gu.beta, dgamma=gu.gamma, coef=coef,
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
    t = ChainTensors([UnitTensors(w.contiguous(memory_format=torch.channels_last), None, torch.rand(C, device=dev) + 0.5,
                                  torch.randn(C, device=dev))])
    x = torch.randn(u.in_shape, device=dev, dtype=x_dtype).contiguous(memory_format=torch.channels_last)
    fwd = one.forward(x, t)
    with launch.recording() as launches:
        if kind == "fprop":
            one.forward(x, t)
        else:
            one.backward(torch.randn_like(fwd.out), None, fwd.saved, [t.units[0].weight], None,
                         GradNeeds(True, (True,), (False,), (t.units[0].gamma.dtype,)))
    (rec,) = [r for r in launches if r.name == kind]
    return triton.testing.do_bench(rec, warmup=3, rep=10)
