"""Static-report job provider for the kernels and launchers of commit 2332dd9 ("today's kernels").

:func:`legacy_jobs` lists, for every BN→ReLU→Conv unit and dtype, the launches the Triton path makes,
with the arguments of ``fused_preact/ops/bn_relu_conv.py`` (``_fprop_triton``, ``_backward_triton``)
and ``fused_preact/ops/stats.py`` (``_batch_stats_triton``, ``combine_partials``), tiles from their
heuristics (``_gemm_blocks``, ``_stats_blocks``; no autotuning exists yet). Tensors are
:class:`~fused_preact.bench.static.TensorSpec` (all 16-byte aligned: every tensor these launchers
pass is a fresh allocation or a contiguous channels_last activation). Which launches a unit gets
follows ``fused_preact/modules.py`` (training, chained statistics):

    fprop   conv1/conv2 (not last): STATS (next BN's statistics), and plain (eval, unchained);
            last conv of a block (conv3; conv2 in basic blocks): STATS + HAS_RES (the residual);
            projection shortcut: plain. Never HAS_BIAS (the models' convs have no bias).
            With STATS, ``_stats_combine_kernel`` folds the per-tile partials.
    dgrad   training (``WRITE_DX=False``, ``NEED_SUMS=True``); then ``_dx_kernel``.
    wgrad   split-K from ``_wgrad_split``, which depends on the GPU's SM count: 132 on sm_90
            (H100 SXM5), 108 on sm_80 (A100), so wgrad jobs are per arch.
    stats   ``_stats_partial_kernel`` + ``_stats_combine_kernel`` over each unit's input (the batch
            statistics pass of an unchained BN).

Only importable while those modules exist: the op layer's own ``static_jobs`` replaces this provider
when the kernels are rewritten (``fused_preact.bench.static.default_provider``).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from fused_preact.bench.shapes import UnitShape
from fused_preact.bench.static import StaticJob, TensorSpec

__all__ = ["legacy_jobs", "SM_COUNT"]

#: SMs per GPU used for the wgrad split: H100 SXM5 (sm_90) 132, A100 (sm_80) 108 (NVIDIA data sheets).
SM_COUNT: dict[int, int] = {90: 132, 80: 108}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
F32 = TensorSpec(torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gemm_label(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg.get('num_warps', 4)} s{cfg.get('num_stages', 3)}"


@functools.lru_cache(maxsize=None)
def _model_last_conv(model: str) -> Optional[str]:
    """``conv3`` if ``model`` (a :data:`~fused_preact.bench.shapes.MODEL_SPECS` name) has bottleneck
    blocks, else ``conv2``; None for an unknown model. Built on the meta device (no memory)."""
    from fused_preact.bench.shapes import MODEL_SPECS, build_model

    if model not in MODEL_SPECS:
        return None
    names = [n for n, _ in build_model(model, fused=False, device="meta").named_modules()]
    return "conv3" if any(n.endswith(".conv3") for n in names) else "conv2"


def _roles(units: Sequence[UnitShape]) -> dict[str, str]:
    """Per model, the name of a block's last conv (the one whose epilogue adds the residual)."""
    last: dict[str, str] = {}
    for u in units:
        if u.model not in last:
            last[u.model] = _model_last_conv(u.model) or "conv2"
        if any(n.endswith("/conv3") for n in u.names):
            last[u.model] = "conv3"
    return last


def _fprop_variants(u: UnitShape, last: str) -> list[tuple[bool, bool]]:
    """(STATS, HAS_RES) pairs the model launches for unit ``u`` (module docstring)."""
    out = []
    for n in u.names:
        role = n.rsplit("/", 1)[-1]
        want = [(False, False)] if role == "shortcut" else [(True, True)] if role == last else [(True, False), (False, False)]
        out += [v for v in want if v not in out]
    return out


def legacy_jobs(units: Sequence[UnitShape], dtypes: Sequence[torch.dtype]) -> list[StaticJob]:
    """Every Triton launch of today's op for ``units`` × ``dtypes`` (module docstring), in order
    fprop (+ epilogue statistics fold), dgrad, dx, wgrad, stats."""
    from fused_preact.ops import _conv_kernels as K_
    from fused_preact.ops import stats as S_
    from fused_preact.ops._common import dot_dtype, input_precision
    from fused_preact.ops.bn_relu_conv import _gemm_blocks, _pow2_clamp

    last = _roles(units)
    jobs: list[StaticJob] = []
    for dt in dtypes:
        T, name = TensorSpec(dt), _NAMES[dt]
        dd = dict(DOT_DTYPE=dot_dtype(dt), INPUT_PRECISION=input_precision(dt))
        for u in units:
            shape = f"{u.name} [{u.describe()}]"
            N, C, H, W, K, R, S, P, Q = u.N, u.C, u.H, u.W, u.K, u.R, u.S, u.P, u.Q
            Cg, Kg = C // u.groups, K // u.groups
            geo = (N, H, W, C, P, Q, K, Cg, Kg, *u.stride, *u.padding, *u.dilation)
            tap = f"{R}x{S}" + (f"/s{u.stride[0]}" if u.stride != (1, 1) else "")
            job = lambda kernel, config, fn, args, kwargs, conv=True, variant=tap, archs=None: jobs.append(
                StaticJob(kernel, config, fn, tuple(args), kwargs, conv, variant, name, shape, archs))

            # fprop (_fprop_triton): x, w_f, bias (w_f when None), scale, shift, y, res (y when None), partials
            M = N * P * Q
            cfg = _gemm_blocks(M, Kg, Cg, dt)
            for stats, res in _fprop_variants(u, last[u.model]):
                flags = " ".join(f for f, on in (("stats", stats), ("res", res)) if on) or "plain"
                job("fprop", _gemm_label(cfg), K_._fprop_kernel, (T, T, T, F32, F32, T, T, F32, F32, *geo),
                    dict(R=R, S=S, HAS_BIAS=False, HAS_RES=res, STATS=stats, **dd, **cfg), variant=f"{tap} {flags}")
                if stats:  # combine_partials(part_mean, part_m2, M, BLOCK_M) over (m_tiles, K)
                    bc = S_._stats_blocks(M, K)[1]
                    job("stats_combine", f"{cfg['BLOCK_M']}x{bc}x64 w4 s3", S_._stats_combine_kernel,
                        (F32, F32, F32, F32, M, K, _cdiv(M, cfg["BLOCK_M"])),
                        dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_C=bc, BLOCK_P=64), conv=False, variant="fprop epilogue")

            # dgrad (_backward_triton, training: WRITE_DX=False) and the dx pass
            Mx = N * H * W
            cfg = _gemm_blocks(Mx, Cg, Kg, dt)
            job("dgrad", _gemm_label(cfg), K_._dgrad_kernel, (T, T, T, F32, F32, F32, F32, T, F32, F32, *geo),
                dict(R=R, S=S, WRITE_DX=False, NEED_SUMS=True, **dd, **cfg))
            bc = _pow2_clamp(C, 16, 64)
            job("dx", f"64x{bc} w4 s3", K_._dx_kernel, (T, T, F32, F32, F32, F32, F32, T, Mx, C),
                dict(BLOCK_M=64, BLOCK_C=bc), conv=False, variant="")

            # wgrad: split-K depends on the SM count (_wgrad_split), so one job per arch
            m_total = N * P * Q
            wcfg = _gemm_blocks(Kg, Cg, m_total, dt)
            tiles = R * S * _cdiv(Kg, wcfg["BLOCK_M"]) * _cdiv(Cg, wcfg["BLOCK_N"]) * u.groups
            for arch, sms in SM_COUNT.items():
                split = max(1, min(64, 2 * sms // max(tiles, 1), m_total // (8 * wcfg["BLOCK_K"])))
                chunk = _cdiv(_cdiv(max(m_total, 1), split), wcfg["BLOCK_K"]) * wcfg["BLOCK_K"]
                job("wgrad", _gemm_label(wcfg), K_._wgrad_kernel,
                    (T, T, F32, F32, F32, *geo[:9], chunk, *geo[9:]),
                    dict(R=R, S=S, SPLIT=split, **dd, **wcfg), variant=f"{tap} split{split}", archs=(arch,))

            # batch statistics of the unit's input (_batch_stats_triton)
            bm, bc = S_._stats_blocks(Mx, C)
            job("stats_partial", f"{bm}x{bc} w8 s3", S_._stats_partial_kernel, (T, F32, F32, Mx, C),
                dict(BLOCK_M=bm, BLOCK_C=bc, num_warps=8), conv=False, variant="")
            job("stats_combine", f"{bm}x{bc}x64 w4 s3", S_._stats_combine_kernel,
                (F32, F32, F32, F32, Mx, C, _cdiv(Mx, bm)), dict(BLOCK_M=bm, BLOCK_C=bc, BLOCK_P=64),
                conv=False, variant="batch_stats")
    return jobs
