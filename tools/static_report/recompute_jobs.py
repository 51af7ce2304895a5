"""Job provider of the static report for the recompute backend's Triton launches.

``python -m tools.static_report --provider tools.static_report.recompute_jobs:recompute_jobs ...``
compiles offline every Triton launch a :class:`fused_preact.ops.recompute.plan.RecomputePlan` makes for the
distinct blocks of the requested models — the statistics pass and finalize, the pre-activation pass,
BatchNorm's backward reduction, the fold (the wgrad kernel launched without its weight gradient,
reported as ``fold``) and the dx pass — recorded on the meta device in train and eval mode, for
channels_last and NCHW inputs (convolution results laid out as cuDNN lays them out). None of them is
a convolution (cuDNN runs those), so ``--check`` holds them to the no-spill and shared-memory rules
only.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from fused_preact.bench.shapes import UnitShape, enumerate_blocks
from tools.static_report.jobs import _NAMES, StaticJob, _chain, _label, _meta_tensors, _variant

__all__ = ["recompute_jobs"]


@contextlib.contextmanager
def _layouts_as_on_a_gpu(channels_last: bool):
    """Meta convolutions return NCHW tensors whatever their inputs' layout; cuDNN (and the CPU) return
    channels_last outputs and input gradients for channels_last inputs. While recording, convolution
    results take the input's layout as on a GPU, so the recorded strides are those a GPU launch sees."""
    conv, bwd = torch.convolution, torch.ops.aten.convolution_backward
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def convolution(*args, **kwargs):
        return conv(*args, **kwargs).contiguous(memory_format=fmt)

    def convolution_backward(*args, **kwargs):
        return tuple(g.contiguous(memory_format=fmt) if g is not None and g.dim() == 4 and i == 0 else g
                     for i, g in enumerate(bwd(*args, **kwargs)))

    torch.convolution, torch.ops.aten.convolution_backward = convolution, convolution_backward
    try:
        yield
    finally:
        torch.convolution, torch.ops.aten.convolution_backward = conv, bwd


def _record(spec, modes, x_shape, dtype, channels_last: bool) -> list:
    from fused_preact.ops.recompute.plan import RecomputePlan
    from fused_preact.ops.spec import GradNeeds
    from fused_preact.ops.triton.launch import recording

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.empty(x_shape, device="meta", dtype=dtype).contiguous(memory_format=fmt)
    plan = RecomputePlan(spec, modes, x.shape, x.stride(), dtype, x.device, dtype, False, use_triton=True)
    t = _meta_tensors(spec, dtype)
    if not channels_last:
        for u in t.units:
            u.weight = u.weight.contiguous()
    n = len(spec.convs)
    with recording() as launches, _layouts_as_on_a_gpu(channels_last):
        fwd = plan.forward(x, t)
        dy = torch.empty_like(fwd.out)
        plan.backward(dy, None, fwd.saved, [u.weight for u in t.units], t.proj_weight,
                      GradNeeds(True, (True,) * n, (False,) * n, (torch.float32,) * n, spec.proj is not None))
    return launches


def recompute_jobs(units: Sequence[UnitShape], dtypes: Sequence[torch.dtype]) -> list[StaticJob]:
    """Every Triton launch of the recompute backend for the blocks that contain ``units``."""
    from fused_preact.ops import BATCH, RUNNING, BNMode

    wanted = {n for u in units for n in u.names}
    batch = units[0].N if units else 128
    blocks = [b for m in sorted({u.model for u in units}) for b in enumerate_blocks(m, batch)
              if any(name in wanted for u in b.units for name in u.names)]
    jobs: list[StaticJob] = []
    for dtype in dtypes:
        for b in blocks:
            spec, x_shape = _chain(b)
            shape = f"{b.name} [{b.describe()}]"
            for train in (True, False):
                modes = tuple(BNMode(BATCH if train else RUNNING, True, train) for _ in spec.convs)
                for cl in (True, False):
                    for rec in _record(spec, modes, x_shape, dtype, cl):
                        kernel = "fold" if rec.name == "wgrad" else rec.name
                        jobs.append(StaticJob(kernel, _label(rec), rec.fn, rec.args, rec.kwargs, False,
                                              _variant(rec) + ("" if cl else " nchw"), _NAMES[dtype], shape))
    return jobs
