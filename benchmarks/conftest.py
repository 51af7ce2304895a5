"""Benchmarks need a CUDA device; without one every benchmark is skipped (CPU timings of GPU kernels mean nothing).

Run: ``pytest benchmarks --benchmark-only`` (``FUSED_PREACT_BENCH=quick`` for the short subset; see
``bench_support.py``). The peaks of the roofline floor are measured once per session.
"""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    reason = ("benchmarks need a CUDA device" if not torch.cuda.is_available() else
              "TRITON_INTERPRET is set: the fused kernels would run in Triton's interpreter")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def peaks():
    """Measured bf16 matmul TFLOP/s (the suite's dtype), copy GB/s and L2 size of this GPU
    (``fused_preact.bench.timing.Peaks``)."""
    from fused_preact.bench import timing as BT

    torch.backends.cudnn.benchmark = True
    return BT.measure_peaks()
