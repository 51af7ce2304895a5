"""The ``recompute`` backend's plan: cuDNN's convolutions (``aten.convolution`` and
``aten.convolution_backward``) with BatchNorm+ReLU recomputed from the saved BN input around them.

Per unit, forward: the BN statistics (the statistics kernel and its finalize, or the finalize of the
producer's handed-over partial statistics), one elementwise pass ``a = relu(x·scale + shift)`` into a
transient buffer, the convolution, and ``a`` is dropped at once. Saved for backward: the units' inputs
and per-channel vectors — what the fused kernels save — never ``a`` or the BN output. Backward, per
unit from the last: ``a`` recomputed (one elementwise pass), cuDNN's dgrad and wgrad in one
``convolution_backward`` call, then BatchNorm's backward as one reduction over the input gradient
(the ReLU mask, dz and its per-program sums Σdz, Σdz·x̂), the fold of those sums (dβ, dγ and the dx
coefficients) and one elementwise dx pass — the last two are the Triton backend's own kernels.

This trades one recomputation of ``a`` per unit for not storing it: the memory-for-time exchange of
InPlace-ABN (Rota Bulò, Porzi, Kontschieder, "In-Place Activated BatchNorm for Memory-Optimized
Training of DNNs", CVPR 2018), here by recomputation from the stored BN input rather than by
inverting the activation.

On CUDA (and on CPU under Triton's interpreter) the elementwise steps are Triton kernels
(:mod:`.kernels`, :mod:`fused_preact.ops.triton.kernels_bn`); elsewhere they are ATen ops
(:mod:`.torch_ops`). Semantics are those of ``F.batch_norm → F.relu → F.conv2d``
(:func:`fused_preact.ops.chain.reference_chain`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fused_preact.ops._common import interpreting, nhwc_strides, triton, triton_mode
from fused_preact.ops.index_range import INT32_MAX, chain_margin, max_offset, needs_idx64, range_reasons, within_reach
from fused_preact.ops.recompute import launch as RL
from fused_preact.ops.recompute import torch_ops as RT
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
    add_shortcut,
    chain_shapes,
)
from fused_preact.ops.triton import launch as TL
from fused_preact.ops.triton.configs import INTERP_SUM_ROWS, contig_nhwc, nhwc_strides_of, p2
from fused_preact.ops.triton.pack import PACK_ROWS

__all__ = ["RecomputePlan", "uses_triton"]

_NO_PAD = [0, 0]


def uses_triton(device: torch.device) -> bool:
    """Whether the recompute backend's elementwise steps run as Triton kernels on ``device``: on CUDA
    devices of compute capability ≥ 8.0 (the Triton backend's own floor) with compiled Triton, on CPU
    under Triton's interpreter; ATen ops otherwise."""
    mode = triton_mode()
    if device.type == "cuda":
        return mode == "compiled" and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and mode == "interpreter"


def _nhwc_dense(t: torch.Tensor) -> bool:
    """Whether element (n, h, w, c) of ``t`` sits at ``((n·H + h)·W + w)·C + c`` (channels_last-dense;
    strides of size-1 dimensions do not matter), checked on the strides without an ATen call."""
    N, C, H, W = t.shape
    want = (H * W * C, 1, W * C, C)
    return all(size == 1 or st == w for size, st, w in zip(t.shape, t.stride(), want))


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


class RecomputePlan:
    """What a recompute chain call decides once (see the module docstring).

    Args:
        spec, modes: the chain and its BN modes. x_shape, x_strides, x_dtype, device: the chain input's.
        cdtype: the compute dtype (the convolutions' and ``a``'s; the autocast dtype under autocast).
        in_stats: bn_0's batch statistics come as a :class:`~fused_preact.ops.spec.StatsHandoff` (the
            Triton path finalizes them instead of reading x). residual_dtype: the ``r`` of
            ``residual="tensor"``. use_triton: run the elementwise steps as Triton kernels (default:
            :func:`uses_triton` of ``device``; the static report records them on the meta device).

    The output's partial statistics are never handed out (``out_stats = False``): the next chain
    computes its own.
    """

    out_stats = False
    proj_shape: Optional[tuple] = None

    def __init__(self, spec: ChainSpec, modes: tuple[BNMode, ...], x_shape, x_strides, x_dtype: torch.dtype,
                 device: torch.device, cdtype: torch.dtype, in_stats: bool,
                 residual_dtype: Optional[torch.dtype] = None, use_triton: Optional[bool] = None):
        self.spec, self.modes, self.cdtype, self.x_dtype = spec, modes, cdtype, x_dtype
        self.triton = uses_triton(device) if use_triton is None else use_triton
        self.in_stats = in_stats and self.triton
        self.shapes = [tuple(s) for s in chain_shapes(spec, tuple(x_shape))]
        self.out_shape = self.shapes[-1]
        res_dtype = {"input": x_dtype, "tensor": residual_dtype}.get(spec.residual)
        self.out_dtype = torch.promote_types(cdtype, res_dtype) if res_dtype is not None else cdtype
        N, C, H, W = x_shape
        self.channels_last = tuple(x_strides)[1] == 1 and C > 1
        if spec.proj is not None:
            self.proj_shape = (N, spec.proj.out_channels, *spec.proj.out_hw(H, W))
            self.proj_args = (list(spec.proj.stride), _NO_PAD, [1, 1], False, _NO_PAD, 1)
        self.conv_args = [(list(g.stride), list(g.padding), list(g.dilation), False, _NO_PAD, g.groups)
                          for g in spec.convs]
        self.bias_sizes = [[g.out_channels] if g.bias else None for g in spec.convs]
        # the Triton steps' index range (see fused_preact.ops.index_range): x with its strides, and
        # dense tensors of every shape (a per-call output gradient adds its own, at the call)
        self.margin = chain_margin(spec)
        reasons = range_reasons(self.shapes, tuple(x_strides), self.margin) if self.triton else []
        if reasons:
            raise ValueError("RecomputePlan: " + "; ".join(reasons))
        big = max_offset(tuple(x_shape), nhwc_strides_of(tuple(x_strides)))
        self.idx64 = max([big] + [max_offset(s, contig_nhwc(s)) for s in self.shapes]) >= INT32_MAX
        # fp32 per-call buffer, per unit: pack (5, C), partial sums (rows, 2, C), coefficients (2, C)
        self.stats_rows, self.sum_rows, self.aux_sizes = [], [], []
        for i, mode in enumerate(modes):
            n, c, h, w = self.shapes[i]
            M = n * h * w
            self.stats_rows.append(p2(M, 16, INTERP_SUM_ROWS) if interpreting() else 256)
            inner = (x_strides[1] == 1) if i == 0 else (self.channels_last or c == 1)
            self.sum_rows.append(RL.sum_rows(M, c, inner) if self.triton else M)
            fwd = triton.cdiv(M, self.stats_rows[i]) if mode.kind == BATCH and not (i == 0 and self.in_stats) else 0
            self.aux_sizes += [PACK_ROWS * c, max(fwd, triton.cdiv(M, self.sum_rows[i])) * 2 * c, 2 * c]
        self.aux_total = sum(self.aux_sizes)
        #: elements of the backward's dz scratch, for input gradients that cuDNN does not lay out
        #: channels_last-dense (then dz cannot overwrite da in place): the largest BN input
        self.dz_numel = max(s[0] * s[1] * s[2] * s[3] for s in self.shapes[:-1])

    def handoff_geometry(self) -> tuple[int, int]:
        """Not available: this plan hands out no output statistics (``out_stats`` is False).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("fused_preact: this plan hands out no output statistics (out_stats is False)")

    # ----------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, t: ChainTensors) -> ChainForward:
        """Run the chain on ``x`` with the call's tensors ``t``; running statistics are updated as
        ``nn.BatchNorm2d`` updates them. Saved: the units' inputs and the per-unit fp32 buffers."""
        spec, cd = self.spec, self.cdtype
        n = len(spec.convs)
        base = None
        if self.triton:
            base = torch.empty(self.aux_total, device=x.device, dtype=torch.float32)
            aux = list(base.split(self.aux_sizes))
        else:
            aux = []
        h, inputs, p = x, [x], None
        for i in range(n):
            mode = self.modes[i]
            if self.triton:
                pack = aux[3 * i]
                if mode.kind == BATCH and not (i == 0 and self.in_stats):
                    TL.stats_partial(x=h, x_strides=nhwc_strides(h), part=aux[3 * i + 1], shape=self.shapes[i],
                                     rows=self.stats_rows[i], idx64=self.idx64)
                TL.finalize(**self._finalize_args(i, t, aux))
                a = torch.empty_like(h, dtype=cd)
                RL.preact(x=h, pack=pack, a=a, idx64=self.idx64)
            else:
                pack = RT.pack(h, i, mode, t)
                aux.append(pack)
                a = RT.preact(h, pack, cd)
            h = torch.convolution(a, _cast(t.units[i].weight, cd), _cast(t.units[i].bias, cd), *self.conv_args[i])
            if i == 0 and spec.proj is not None:
                p = torch.convolution(a, _cast(t.proj_weight, cd), None, *self.proj_args)
            del a  # the pre-activation lives only as long as its convolution
            if i < n - 1:
                inputs.append(h)
        out, proj_out = add_shortcut(spec, h, p, x, t)
        return ChainForward(out, proj_out, SavedChain(inputs, aux, base))

    def _finalize_args(self, i: int, t: ChainTensors, aux: list) -> dict:
        mode = self.modes[i]
        n, C, h, w = self.shapes[i]
        u = t.units[i]
        args = dict(pack=aux[3 * i], C=C, mode=mode, count=n * h * w, gamma=u.gamma, beta=u.beta,
                    mean_src=u.running_mean, var_src=u.running_var, nbt=u.num_batches, momentum=u.momentum, eps=u.eps)
        if mode.kind == BATCH:
            if i == 0 and self.in_stats:
                st = t.in_stats
                args.update(part=st.part, rows=st.rows, count=st.count, num_parts=triton.cdiv(st.count, st.rows))
            else:
                rows = self.stats_rows[i]
                args.update(part=aux[3 * i + 1], rows=rows, num_parts=triton.cdiv(n * h * w, rows))
        elif mode.kind == EXTERNAL:
            args.update(mean_src=t.ext_mean, var_src=t.ext_invstd)
        return args

    # ---------------------------------------------------------------------------------- backward
    def backward(self, dy: torch.Tensor, dy_proj: Optional[torch.Tensor], saved: SavedChain, weights,
                 proj_weight: Optional[torch.Tensor], needs: GradNeeds) -> ChainGrads:
        """Gradients of the chain from ``dy`` (and ``dy_proj`` for ``proj_out="return"``), the
        forward's ``saved`` tensors and the convs' weights (see
        :class:`fused_preact.ops.backends.Plan`)."""
        n = len(self.spec.convs)
        grads = ChainGrads.empty(n)
        grads.alloc_bn([s[1] for s in self.shapes[:n]], needs.bn_dtypes, dy.device)
        g_out, scratch = dy, []
        if self.triton:  # the identity shortcut's gradient is read by Triton kernels, with dy's strides
            dy = within_reach(dy, self.margin, self.channels_last)
        idx64 = self.idx64 or (self.triton and needs_idx64(dy))
        for i in reversed(range(n)):
            g_out = self._backward_unit(i, g_out, dy, dy_proj, saved, weights, proj_weight, needs, grads, scratch,
                                        idx64)
        grads.dx = g_out if needs.dx else None
        return grads

    def _backward_unit(self, i: int, g_out: torch.Tensor, dy: torch.Tensor, dy_proj, saved: SavedChain, weights,
                       proj_weight, needs: GradNeeds, grads: ChainGrads, scratch: list,
                       idx64: bool) -> Optional[torch.Tensor]:
        """Unit ``i``'s backward: the gradients of its conv (and of the projection for unit 0) and BN
        parameters into ``grads``; returns the gradient of the unit's input (None when not wanted).
        ``scratch`` holds the call's dz buffer once a unit has needed one (shared by the units)."""
        spec, cd, kind = self.spec, self.cdtype, self.modes[i].kind
        xin = saved.inputs[i]
        if self.triton:
            pack, psum, coef = saved.aux[3 * i:3 * i + 3]
            a = torch.empty_like(xin, dtype=cd)
            RL.preact(x=xin, pack=pack, a=a, idx64=idx64)
        else:
            pack = saved.aux[i]
            a = RT.preact(xin, pack, cd)
        skip_dx = i == 0 and not needs.dx
        gu = grads.units[i]
        dgamma, dbeta = gu.gamma, gu.beta
        need_sums = dgamma is not None or kind == EXTERNAL or (kind == BATCH and not skip_dx)
        need_da = need_sums or not skip_dx
        da, dw, db = torch.ops.aten.convolution_backward(
            _cast(g_out, cd), a, _cast(weights[i], cd), self.bias_sizes[i], *self.conv_args[i],
            (need_da, needs.weights[i], needs.biases[i]))
        if i == 0 and spec.proj is not None:
            src = dy if spec.proj_out == "add" else dy_proj
            dap, dwp, _ = torch.ops.aten.convolution_backward(
                _cast(src, cd), a, _cast(proj_weight, cd), None, *self.proj_args, (need_da, needs.proj_weight, False))
            if need_da:
                da.add_(dap)
            grads.proj_weight = _cast(dwp, proj_weight.dtype) if needs.proj_weight else None
        del a
        gu.weight = _cast(dw, weights[i].dtype) if needs.weights[i] else None
        gu.bias = db if needs.biases[i] else None
        if not need_da:
            return None
        res = dy if i == 0 and spec.residual == "input" and not skip_dx else None
        write_dx = kind != BATCH and not skip_dx
        shape = self.shapes[i]
        C, M = shape[1], shape[0] * shape[2] * shape[3]
        in_place = i > 0 or xin.dtype == cd  # the input gradient may take da's buffer (and dtype)
        if not self.triton:
            out, s_dz, s_dzx = RT.mask_sums(da, xin, pack, write_dx, res, cd if in_place else xin.dtype)
            if dgamma is not None:
                dgamma.copy_(s_dzx)
                dbeta.copy_(s_dz)
            if need_sums:
                coef = RT.fold(s_dz, s_dzx, pack, kind, M)
                if kind == EXTERNAL:
                    grads.ext_stats = tuple(coef.unbind(0))
            if skip_dx:
                return None
            if kind == BATCH:
                return RT.dx(out, xin, pack, coef, res, xin.dtype if i == 0 else cd)
            return out
        # dz is stored (M, C) NHWC-contiguous for the dx pass: in da itself when da is laid out so, else in
        # the call's scratch (its first M·C elements; one allocation for every unit)
        if write_dx:
            target = da if in_place else torch.empty_like(xin)
            out, out_strides = target, nhwc_strides(target)
        else:
            if _nhwc_dense(da):
                out = da
            else:
                if not scratch:
                    scratch.append(torch.empty(self.dz_numel, device=da.device, dtype=cd))
                out = scratch[0]
            out_strides = contig_nhwc(shape)
        parts = RL.mask_sums(da=da, x=xin, pack=pack, out=out, out_strides=out_strides, psum=psum,
                             rows=self.sum_rows[i], write_dx=write_dx, res=res if write_dx else None, idx64=idx64)
        if need_sums:
            sum_mode = TL.SumMode.EXTERNAL if kind == EXTERNAL else TL.SumMode.BATCH
            RL.fold(psum=psum, num_parts=parts, C=C, pack=pack, sum_mode=sum_mode, coef=coef, dbeta=dbeta, dgamma=dgamma,
                    inv_count=1.0 / M)
            if kind == EXTERNAL:
                grads.ext_stats = tuple(coef.view(2, C).unbind(0))
        if skip_dx or write_dx:
            return None if skip_dx else out
        target = da if in_place else torch.empty_like(xin)
        TL.dx(geom=spec.convs[i], shape=shape, x=xin, x_strides=nhwc_strides(xin), pack=pack, coef=coef, dz=out, out=target,
              out_strides=nhwc_strides(target), res=res, res_strides=nhwc_strides(res) if res is not None else (0, 0, 0, 0),
              idx64=idx64)
        return target
