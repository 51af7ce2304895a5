"""What the pytest-benchmark suite shares: the cases (the shapes and providers of
``python -m fused_preact.bench``) and one runner per level built on the same harnesses
(:mod:`fused_preact.bench.timing`) and cost model (:mod:`fused_preact.bench.shapes`).

Environment:
    FUSED_PREACT_BENCH        ``full`` (default: every distinct unit and block of PreActResNet-50 and
                              PreActResNet-164, every provider: eager, compile, compile-max-autotune,
                              triton, cuda, recompute, auto, auto-lean, and at the model level
                              eager-cudagraph, triton-cudagraph; hours of compilation with
                              max-autotune) or ``quick`` (the ``--quick`` subset, few rounds, no
                              max-autotune and no model-level compile: a few minutes)
    FUSED_PREACT_BENCH_BATCH  batch size (default 128); the dtype is bf16, the layout channels_last.

Each timed round is one call followed by ``torch.cuda.synchronize()`` (pytest-benchmark's host clock
then measures device time); untimed setup (the forward of a ``bwd`` round, a batch copy into a CUDA
graph's input) ends with a synchronize too. Warm-up rounds (compilation, autotuning) are untimed.
``benchmark.extra_info`` records name, level, provider, mode, dtype, batch, peak_mem_bytes, backend
(what ran: ``eager``, ``triton``, ``cuda``, ``recompute`` or ``auto``, checked on every fused module's
``last_backend``) and, for
units and blocks, flops, min_bytes, floor_ms (roofline floor from the measured peaks), tflops, gbps
and pct_of_floor — the fields of a ``python -m fused_preact.bench`` results entry.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch

from fused_preact.bench import timing as BT
from fused_preact.bench.shapes import (
    MODEL_SPECS,
    MODES,
    achieved,
    block_flops,
    block_min_bytes,
    enumerate_blocks,
    enumerate_units,
    floor_ms,
    pct_of_floor,
    quick_blocks,
    quick_units,
    unit_flops,
    unit_min_bytes,
)

QUICK = os.environ.get("FUSED_PREACT_BENCH", "full") == "quick"
BATCH = int(os.environ.get("FUSED_PREACT_BENCH_BATCH", "128"))
DTYPE = torch.bfloat16
MODELS = ("preact_resnet50", "preact_resnet164")
#: (warm-up rounds, timed rounds) per level
ROUNDS = {"layer": (2, 5) if QUICK else (3, 30), "model": (2, 3) if QUICK else (3, 10)}


#: Providers that ``quick`` leaves out (level → providers): the slow compilations.
QUICK_SKIPS = {"layer": ("compile-max-autotune",), "model": ("compile", "compile-max-autotune")}


def _providers(level: str, providers) -> list[str]:
    return [p for p in providers if not (QUICK and p in QUICK_SKIPS[level])]


def unit_cases() -> list:
    """pytest params (UnitShape, provider, mode), grouped so consecutive cases share a module."""
    units = [u for m in MODELS for u in (quick_units if QUICK else enumerate_units)(m, BATCH)]
    return [pytest.param(u, p, mode, id=f"{u.name}-{p}-{mode}") for u in units
            for p in _providers("layer", BT.LAYER_PROVIDERS) for mode in MODES]


def block_cases() -> list:
    """pytest params (BlockShape, provider, mode)."""
    blocks = [b for m in MODELS for b in (quick_blocks if QUICK else enumerate_blocks)(m, BATCH)]
    return [pytest.param(b, p, mode, id=f"{b.name}-{p}-{mode}") for b in blocks
            for p in _providers("layer", BT.LAYER_PROVIDERS) for mode in MODES]


def model_cases() -> list:
    """pytest params (model name, provider); the CUDA-graph providers for the CIFAR net only."""
    return [pytest.param(m, p, id=f"{m}/train_step-{p}") for m in MODELS for p in _providers("model", BT.MODEL_PROVIDERS)
            if not (p.endswith("-cudagraph") and not MODEL_SPECS[m].cifar)]


class _LastHarness:
    """Keeps the harness of the latest (item, provider) so the three modes share one compiled module."""

    key = None
    value = None

    @classmethod
    def get(cls, key, build):
        if key != cls.key:
            cls.key = cls.value = None
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
            try:
                cls.value = build()
            except Exception as e:  # a Skip, or an error the other modes of this case need not rebuild to hit
                cls.value = e
            cls.key = key
        if isinstance(cls.value, BT.Skip):
            pytest.skip(str(cls.value))
        if isinstance(cls.value, Exception):
            raise RuntimeError(f"building the harness failed: {type(cls.value).__name__}: {cls.value}") from cls.value
        return cls.value


def _pedantic(benchmark, setup_fn, run_fn, level: str) -> float:
    counter = itertools.count()

    def setup():
        state = setup_fn(next(counter))
        torch.cuda.synchronize()
        return (state,), {}

    def target(state):
        run_fn(state)
        torch.cuda.synchronize()

    warmup, rounds = ROUNDS[level]
    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
    stats = getattr(benchmark, "stats", None)
    return stats.stats.median * 1e3 if stats is not None else float("nan")


def run_layer(benchmark, peaks: BT.Peaks, level: str, item, provider: str, mode: str) -> None:
    """Benchmark one unit or block (``level`` ``"unit"``/``"block"``) of ``provider`` in ``mode``."""
    unit = level == "unit"

    def build():
        mod = (BT.unit_module if unit else BT.block_module)(provider, item, DTYPE)
        c = item.C if unit else item.in_planes
        return BT.LayerHarness(mod, (item.N, c, item.H, item.W), DTYPE, peaks.l2_bytes, provider=provider)

    h = _LastHarness.get((level, item.name, provider), build)
    setup_fn, run_fn = h.fns(mode)
    med_ms = _pedantic(benchmark, setup_fn, run_fn, "layer")
    fl = unit_flops(item, mode) if unit else block_flops(item, mode)
    nb = unit_min_bytes(item, mode, 2) if unit else block_min_bytes(item, mode, 2)
    floor = floor_ms(fl, nb, peaks.tflops, peaks.gbps)
    tflops, gbps = achieved(fl, nb, med_ms)
    benchmark.extra_info.update(name=item.name, level=level, provider=provider, mode=mode, dtype="bf16", batch=BATCH,
                                shape=item.describe(), flops=fl, min_bytes=nb, floor_ms=floor, tflops=tflops,
                                gbps=gbps, pct_of_floor=pct_of_floor(floor, med_ms),
                                peak_mem_bytes=BT.peak_memory(run_fn, setup_fn),
                                backend=BT.check_backend(h.module, provider))


def run_model(benchmark, peaks: BT.Peaks, model: str, provider: str) -> None:
    """Benchmark one training step of ``model`` with ``provider``."""

    def build():
        return BT.StepHarness(MODEL_SPECS[model], provider, BATCH, DTYPE, peaks.l2_bytes)

    h = _LastHarness.get(("model", model, provider), build)
    setup_fn, run_fn = h.fns()
    _pedantic(benchmark, setup_fn, run_fn, "model")
    peak = h.capture_peak if h.graph is not None else BT.peak_memory(run_fn, setup_fn)
    benchmark.extra_info.update(name=f"{model}/train_step", level="model", provider=provider, mode="step",
                                dtype="bf16", batch=BATCH, peak_mem_bytes=peak,
                                backend=BT.check_backend(h.model, provider))
