"""Synchronized BatchNorm statistics across a ``torch.distributed`` process group.

Forward: each rank reduces its own batch with the fused statistics kernel (``batch_stats``), the
ranks all-gather their ``(count, mean, var)`` (3·C + … floats, one collective), and every rank folds
them with Chan et al.'s parallel rule into the global mean and biased variance — the same numbers
``nn.SyncBatchNorm`` normalizes with.

Backward: the fused conv's backward returns ∂L/∂mean and ∂L/∂invstd (both (C,) vectors built from
the dgrad epilogue's Σdz and Σdz·x̂); they are all-reduced (summed over ranks — every rank's loss
depends on the shared statistics), and one elementwise pass adds the statistics' share of dx:

    dx_stats = ∂L/∂mean / M + ∂L/∂invstd · (−invstd³) · (x − mean) / M       (M = global N·H·W)

which, added to the conv's ``scale·dz``, is ``nn.SyncBatchNorm``'s
``scale·(dz − ΣΣdz/M − x̂·ΣΣdz·x̂/M)``.

Source: ``torch.nn.SyncBatchNorm`` (forward: ``batch_norm_gather_stats_with_counts``; backward:
all-reduce of ``sum_dy`` and ``sum_dy_xmu``); Chan, Golub, LeVeque, "Updating formulae and a
pairwise algorithm for computing sample variances" (1979).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fused_preact.ops.stats import batch_stats, batch_stats_reference

__all__ = ["sync_enabled", "sync_bn_statistics"]


def sync_enabled(bn: torch.nn.Module) -> bool:
    """Whether ``bn`` must synchronize its statistics now, with ``nn.SyncBatchNorm.forward``'s rule:
    an ``nn.SyncBatchNorm`` in training mode, ``torch.distributed`` initialized, and more than one
    rank in its process group (otherwise it behaves as ``nn.BatchNorm2d``)."""
    if not isinstance(bn, torch.nn.SyncBatchNorm) or not bn.training:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = bn.process_group if bn.process_group is not None else dist.group.WORLD
    return dist.get_world_size(group) > 1


def _local_stats(x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[0] * x.shape[2] * x.shape[3] == 0:
        z = torch.zeros(x.shape[1], device=x.device, dtype=torch.float32)
        return z, z
    return batch_stats(x) if fused else batch_stats_reference(x)


class _SyncStats(torch.autograd.Function):
    """(x) → (global mean, global invstd, global count), differentiable in x; see module docstring."""

    @staticmethod
    def forward(ctx, x, eps, group, fused):
        C = x.shape[1]
        count = x.shape[0] * x.shape[2] * x.shape[3]
        mean, var = _local_stats(x.detach(), fused)
        acc = mean.dtype
        local = torch.cat([mean, var, torch.full((1,), float(count), device=x.device, dtype=acc)])
        world = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        gathered = torch.stack(parts)
        means, vars_, counts = gathered[:, :C], gathered[:, C:2 * C], gathered[:, 2 * C:]
        total = counts.sum()
        w = counts / total.clamp_min(1)
        g_mean = (w * means).sum(0)
        g_var = (w * (vars_ + (means - g_mean).square())).sum(0)
        invstd = torch.rsqrt(g_var + eps)
        ctx.save_for_backward(x, g_mean, invstd, total)
        ctx.group = group
        ctx.mark_non_differentiable(g_var, total)
        return g_mean, invstd, g_var, total

    @staticmethod
    def backward(ctx, d_mean, d_invstd, _d_var, _d_total):
        x, mean, invstd, total = ctx.saved_tensors
        d_mean = torch.zeros_like(mean) if d_mean is None else d_mean.to(mean.dtype)
        d_invstd = torch.zeros_like(invstd) if d_invstd is None else d_invstd.to(invstd.dtype)
        both = torch.cat([d_mean, d_invstd])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.group)
        C = mean.numel()
        a = both[:C] / total
        b = -both[C:] * invstd.pow(3) / total
        shape = (1, C, 1, 1)
        dx = (x.to(mean.dtype) - mean.view(shape)) * b.view(shape) + a.view(shape)
        return dx.to(x.dtype), None, None, None


def sync_bn_statistics(
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    momentum: float,
    eps: float,
    process_group=None,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch statistics synchronized over ``process_group``, with ``nn.SyncBatchNorm``'s semantics.

    Args:
        x: (N, C, H, W) local batch, float32/float16/bfloat16 (float64 with ``fused=False``); a
            rank may hold N = 0.
        running_mean, running_var: (C,) buffers updated in place with the *global* mean and unbiased
            variance (``r ← (1 − momentum)·r + momentum·batch``), or ``None``.
        momentum: exponential-average factor (``momentum=None`` resolved by the caller).
        eps: added to the variance.
        process_group: the group to synchronize over (``None``: the default group).
        fused: local statistics by the Triton kernel (True) or by PyTorch (False, any device/dtype).

    Returns:
        ``(mean, invstd)``, (C,) fp32, differentiable functions of x (their gradients flow back through
        the collectives): a fused chain takes them as given statistics (``EXTERNAL`` mode) and returns
        ∂L/∂mean, ∂L/∂invstd instead of folding the statistics terms into dx itself.

    Like ``nn.SyncBatchNorm`` with more than one rank, it does not check the global count on the
    host (that would synchronize the device); the caller checks the local batch.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    mean, invstd, var, total = _SyncStats.apply(x, eps, group, fused)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():  # no host read of the global count: the unbiased factor stays on device
            unbiased = var * (total / (total - 1).clamp_min(1))
            running_mean.lerp_(mean.detach().to(running_mean.dtype), momentum)
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    return mean, invstd
