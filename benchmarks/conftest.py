"""Benchmarks need a CUDA device; without one every benchmark is skipped (CPU timings of GPU kernels mean nothing)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA device")
    for item in items:
        item.add_marker(skip)
