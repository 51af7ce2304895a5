"""Test configuration: run the Triton kernels through Triton's interpreter when there is no GPU.

TRITON_INTERPRET must be set before ``triton`` is first imported (the kernels are decorated at
import time), so it is set here, before any test module imports fused_preact.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: device the fused kernels run on in this session
DEVICE = "cuda" if HAS_CUDA else "cpu"
# backend="auto" takes the static priority in tests (so that a test's expectations do not depend on a
# GPU's timings); tests/test_auto.py switches measuring on where it tests it.
os.environ.setdefault("FUSED_PREACT_DISPATCH", "priority")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _ieee_fp32():
    """fp32 tests compare at ~1e-4: keep cuDNN/Triton fp32 math in IEEE (no TF32) while they run."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny ops: one intra-op thread (with two on a busy 2-core runner each op
    waits for a descheduled thread, 10-20× slower); restored after the module."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
