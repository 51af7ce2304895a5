"""The GPU benchmarks need a CUDA device (CPU timings of GPU kernels mean nothing); the CPU benchmarks
(``test_cpu.py``, marked ``cpu``) measure what a CPU can: eager vs the ``recompute`` backend's training
step and saved-tensor bytes, in plain PyTorch ops.

Run: ``pytest benchmarks --benchmark-only`` (``FUSED_PREACT_BENCH=quick`` for the short GPU subset; see
``bench_support.py``). Without CUDA (or with Triton's interpreter on) the GPU benchmarks are deselected
with one summary line and the CPU ones run; with CUDA the CPU ones are deselected. The peaks of the
roofline floor are measured once per session.
"""

import os

import pytest
import torch

_DESELECTED: list = []


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu: a CPU benchmark (plain PyTorch ops); runs only without CUDA")


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    keep = [it for it in items if ("cpu" in it.keywords) != gpu]
    dropped = [it for it in items if it not in keep]
    if dropped:
        reason = ("CPU benchmarks: this machine has CUDA" if gpu else
                  "GPU benchmarks: no CUDA device" if not torch.cuda.is_available() else
                  "GPU benchmarks: TRITON_INTERPRET is set (the fused kernels would run in Triton's interpreter)")
        _DESELECTED[:] = [f"{len(dropped)} {reason}"]
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    for line in _DESELECTED:
        terminalreporter.write_line(f"deselected: {line}")


@pytest.fixture(scope="session")
def peaks():
    """Measured bf16 matmul TFLOP/s (the suite's dtype), copy GB/s and L2 size of this GPU
    (``fused_preact.bench.timing.Peaks``)."""
    from fused_preact.bench import timing as BT

    torch.backends.cudnn.benchmark = True
    return BT.measure_peaks()
