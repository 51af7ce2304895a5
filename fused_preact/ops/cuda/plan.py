"""CUDA C++ backend: a chain composed of the extension's per-unit ops (:mod:`fused_preact.ops.cuda.ext`).

:class:`CudaPlan` implements :class:`fused_preact.ops.backends.Plan`, so one autograd node
(:class:`fused_preact.ops.chain.ChainFunction`) runs it as it runs the Triton plan. Per unit it calls the extension's
statistics, fused fprop and fused backward; running statistics, the shortcut add and the sum of the
two input-gradient contributions of conv1 and the projection are ATen ops (the extension has no
epilogue fusions yet). BN's backward is linear in dz, so the projection's and conv1's contributions to
dx, dγ and dβ add.
"""

from __future__ import annotations

from typing import Optional

import torch

from fused_preact.ops.cuda import ext as _cuda
from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    RUNNING,
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

__all__ = ["CudaPlan"]


class CudaPlan:
    """Per-unit composition of the extension's ops for one chain signature (see module docstring)."""

    out_stats = False
    proj_shape: Optional[tuple] = None

    def __init__(self, spec: ChainSpec, modes: tuple[BNMode, ...], x_shape, x_dtype: torch.dtype,
                 cdtype: torch.dtype, residual_dtype: Optional[torch.dtype]):
        self.spec, self.modes, self.cdtype, self.x_dtype = spec, modes, cdtype, x_dtype
        self.units = list(spec.convs)
        self.out_shape = tuple(chain_shapes(spec, x_shape)[-1])
        res_dtype = {"input": x_dtype, "tensor": residual_dtype}.get(spec.residual)
        self.out_dtype = torch.promote_types(cdtype, res_dtype) if res_dtype is not None else cdtype
        if spec.proj is not None:
            self.proj_shape = (x_shape[0], spec.proj.out_channels, *spec.proj.out_hw(*x_shape[2:]))

    def _stats(self, i: int, h: torch.Tensor, t: ChainTensors):
        mode, u = self.modes[i], t.units[i]
        if mode.kind == EXTERNAL:
            return t.ext_mean, t.ext_invstd
        if mode.kind == RUNNING:
            return u.running_mean.float(), torch.rsqrt(u.running_var.float() + u.eps)
        mean, var = _cuda.batch_stats(h)
        if mode.update:
            nbt = u.num_batches
            if nbt is not None:
                nbt.add_(1)
            f = (1.0 / nbt.to(torch.float32)) if mode.cumulative else u.momentum
            count = h.shape[0] * h.shape[2] * h.shape[3]
            with torch.no_grad():
                rm, rv = u.running_mean, u.running_var
                rm.copy_(rm * (1 - f) + mean.to(rm.dtype) * f)
                rv.copy_(rv * (1 - f) + (var * (count / (count - 1))).to(rv.dtype) * f)
        return mean, torch.rsqrt(var + u.eps)

    def handoff_geometry(self) -> tuple[int, int]:
        """Not available: this plan hands out no output statistics (``out_stats`` is False).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("fused_preact: this plan hands out no output statistics (out_stats is False)")

    def forward(self, x: torch.Tensor, t: ChainTensors) -> ChainForward:
        """The chain's forward (no statistics handoff); saved: the units' inputs and per unit (mean,
        invstd, γ, β)."""
        spec, cd = self.spec, self.cdtype
        h, inputs, aux = x, [x], []
        for i, (g, u) in enumerate(zip(spec.convs, t.units)):
            mean, invstd = self._stats(i, h, t)
            gamma = u.gamma.detach() if u.gamma is not None else None
            beta = u.beta.detach() if u.beta is not None else None
            aux += [mean, invstd, gamma, beta]
            h = _cuda.fprop(h.to(cd), u.weight.detach(), u.bias, mean, invstd, gamma, beta,
                            list(g.stride), list(g.padding), list(g.dilation), g.groups)
            if i < len(spec.convs) - 1:
                inputs.append(h)
        p = None
        if spec.proj is not None:
            p = _cuda.fprop(x.to(cd), t.proj_weight.detach(), None, aux[0], aux[1], aux[2], aux[3],
                            list(spec.proj.stride), [0, 0], [1, 1], 1)
        h, proj_out = add_shortcut(spec, h, p, x, t)
        return ChainForward(h, proj_out, SavedChain(inputs, aux))

    def backward(self, dy, dy_proj, saved: SavedChain, weights, proj_weight, needs: GradNeeds) -> ChainGrads:
        """Gradients of the chain (see :class:`fused_preact.ops.backends.Plan`)."""
        spec, cd = self.spec, self.cdtype
        inputs, aux = saved.inputs, saved.aux
        n = len(spec.convs)
        grads = ChainGrads.empty(n)
        g_out = dy
        for i in reversed(range(n)):
            geo = spec.convs[i]
            mean, invstd, gamma, beta = aux[4 * i:4 * i + 4]
            xi = inputs[i].to(cd)
            batch = self.modes[i].kind == BATCH
            dxi, dw, db, sdzx, sdz = _cuda.backward(
                g_out, xi, weights[i], mean, invstd, gamma, beta, list(geo.stride), list(geo.padding),
                list(geo.dilation), geo.groups, batch, geo.bias)
            if i == 0 and spec.proj is not None:
                src = dy if spec.proj_out == "add" else dy_proj
                dxp, dwp, _, pzx, pz = _cuda.backward(src, xi, proj_weight, mean, invstd, gamma, beta,
                                                      list(spec.proj.stride), [0, 0], [1, 1], 1, batch, False)
                dxi, sdzx, sdz = dxi + dxp, sdzx + pzx, sdz + pz
                grads.proj_weight = dwp.to(proj_weight.dtype) if needs.proj_weight else None
            gu = grads.units[i]
            gu.weight = dw.to(weights[i].dtype) if needs.weights[i] else None
            gu.bias = db if needs.biases[i] else None
            if needs.bn_dtypes[i] is not None:
                gu.gamma, gu.beta = sdzx.to(needs.bn_dtypes[i]), sdz.to(needs.bn_dtypes[i])
            if self.modes[i].kind == EXTERNAL:
                scale = invstd * (gamma.float() if gamma is not None else 1.0)
                gam = gamma.float() if gamma is not None else torch.ones_like(invstd)
                grads.ext_stats = (-scale * sdz, gam * sdzx / invstd)
            g_out = dxi
        if needs.dx:
            dx = g_out + dy if spec.residual == "input" else g_out
            grads.dx = dx.to(inputs[0].dtype)
        return grads
