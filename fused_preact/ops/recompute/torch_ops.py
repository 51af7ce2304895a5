"""The ``recompute`` backend's elementwise steps in plain PyTorch, for devices where its Triton kernels
cannot run (a CPU without Triton's interpreter, a machine without triton). Same arithmetic as the
kernels — fp32 statistics and transform, ``threshold_backward``'s mask, BN's backward in scale/shift
form — in ATen ops; semantics of ``nn.BatchNorm2d`` for the running statistics.
"""

from __future__ import annotations

from typing import Optional

import torch

from fused_preact.ops.spec import EXTERNAL, RUNNING, BNMode, ChainTensors

__all__ = ["pack", "preact", "mask_sums", "fold", "dx"]

_C = (1, -1, 1, 1)


def pack(h: torch.Tensor, i: int, mode: BNMode, t: ChainTensors) -> torch.Tensor:
    """The (6, C) fp32 rows (mean, var, invstd, scale, shift, γ) of unit ``i``'s BatchNorm on its input
    ``h`` (N, C, H, W): batch statistics (running buffers and ``num_batches_tracked`` updated as
    ``nn.BatchNorm2d`` updates them), the running statistics (eval), or the given ones (EXTERNAL)."""
    u = t.units[i]
    eps = u.eps
    if mode.kind == EXTERNAL:
        mean, invstd = t.ext_mean.float(), t.ext_invstd.float()
        var = 1.0 / (invstd * invstd) - eps
    elif mode.kind == RUNNING:
        mean, var = u.running_mean.float(), u.running_var.float()
        invstd = torch.rsqrt(var + eps)
    else:
        var, mean = torch.var_mean(h.float(), dim=(0, 2, 3), correction=0)
        invstd = torch.rsqrt(var + eps)
        if mode.update:
            nbt = u.num_batches
            if nbt is not None:
                nbt.add_(1)
            f = (1.0 / float(nbt)) if mode.cumulative else u.momentum
            count = h.shape[0] * h.shape[2] * h.shape[3]
            rm, rv = u.running_mean, u.running_var
            rm.copy_(rm * (1 - f) + mean.to(rm.dtype) * f)
            rv.copy_(rv * (1 - f) + (var * (count / max(count - 1, 1))).to(rv.dtype) * f)
    gamma, beta = u.gamma, u.beta
    gamma = gamma.float() if gamma is not None else torch.ones_like(invstd)
    scale = invstd * gamma
    shift = (beta.float() if beta is not None else 0.0) - mean * scale
    return torch.stack([mean, var, invstd, scale, shift, gamma])


def preact(x: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``relu(x·scale + shift)`` in ``dtype`` (fp32 arithmetic; relu keeps NaN)."""
    return torch.relu(torch.addcmul(p[4].view(_C), x.float(), p[3].view(_C))).to(dtype)


def mask_sums(da: torch.Tensor, x: torch.Tensor, p: torch.Tensor, write_dx: bool, res: Optional[torch.Tensor],
              dx_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz in da's dtype — or, with ``write_dx``, ``(dz·invstd)·γ + res`` in ``dx_dtype`` —, Σdz, Σdz·x̂)
    with ``dz = da·[x·scale + shift > 0]``; the sums over the rounded dz, in fp32."""
    xf = x.float()
    z = torch.addcmul(p[4].view(_C), xf, p[3].view(_C))
    dz = torch.where(z <= 0, 0.0, da.float())
    if write_dx:
        out = (dz * p[2].view(_C)) * p[5].view(_C)
        if res is not None:
            out = out + res
        out = out.to(dx_dtype)
    else:
        out = dz.to(da.dtype)
        dz = out.float()
    xhat = (xf - p[0].view(_C)) * p[2].view(_C)
    return out, dz.sum((0, 2, 3)), (dz * xhat).sum((0, 2, 3))


def fold(s_dz: torch.Tensor, s_dzx: torch.Tensor, p: torch.Tensor, kind: int, count: int) -> torch.Tensor:
    """(2, C) fp32: the dx coefficients (Σdz, Σdz·x̂)/count (batch statistics) or, for EXTERNAL
    statistics, their gradients (∂L/∂mean, ∂L/∂invstd) = (−scale·Σdz, scale·Σdz·x̂/invstd²)."""
    if kind == EXTERNAL:
        istd, sc = p[2], p[3]
        return torch.stack([-sc * s_dz, (sc / istd) * s_dzx / istd])
    return torch.stack([s_dz, s_dzx]) / count


def dx(dz: torch.Tensor, x: torch.Tensor, p: torch.Tensor, coef: torch.Tensor, res: Optional[torch.Tensor],
       dtype: torch.dtype) -> torch.Tensor:
    """Training-mode BN backward ``((dz − c1 − x̂·c2)·invstd)·γ`` (+ ``res``) in ``dtype``: γ last, as
    eager's ``batch_norm_backward``."""
    xhat = (x.float() - p[0].view(_C)) * p[2].view(_C)
    out = (dz.float() - coef[0].view(_C) - xhat * coef[1].view(_C)) * p[2].view(_C) * p[5].view(_C)
    if res is not None:
        out = out + res
    return out.to(dtype)

