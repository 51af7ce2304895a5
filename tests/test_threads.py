"""Module-global state never changes what another thread launches.

The autotuner times each candidate tile inside ``launch.recording()`` (the launch is recorded, then
replayed by the timer). A fused call made by another thread at that moment (``nn.DataParallel``
replicas, serving workers) must still launch its kernels, not be recorded in its place.
"""

import threading

import torch
import torch.nn.functional as F
from conftest import DEVICE

from fused_preact import FusedBNReLUConv2d
from fused_preact.ops.triton import launch


def _eager(m, x):
    return F.conv2d(F.relu(F.batch_norm(x, None, None, m.bn.weight, m.bn.bias, True, 0.0, m.bn.eps)),
                    m.conv.weight, m.conv.bias, m.conv.stride, m.conv.padding)


def test_a_recording_in_one_thread_does_not_capture_another_threads_launches():
    torch.manual_seed(0)
    m = FusedBNReLUConv2d(8, 8, 3, padding=1, backend="triton").to(DEVICE)
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    m(x)  # the plan is built and cached: the worker below runs a cached plan
    opened, done = threading.Event(), threading.Event()
    recorded: list = []

    def tuner():  # what the autotuner does per candidate: open a recording and hold it while it times
        with launch.recording() as launches:
            opened.set()
            done.wait(timeout=120)
        recorded.extend(launches)

    t = threading.Thread(target=tuner)
    t.start()
    assert opened.wait(timeout=60)
    try:
        with torch.no_grad():
            y = m(x)
    finally:
        done.set()
        t.join()
    assert m.last_backend == "triton"
    torch.testing.assert_close(y, _eager(m, x).detach(), rtol=1e-4, atol=1e-4)
    assert recorded == []  # the other thread's launches ran; nothing landed in this recording


def test_recording_still_captures_its_own_thread_and_nests():
    m = FusedBNReLUConv2d(8, 8, 1, backend="triton").to(DEVICE)
    x = torch.randn(2, 8, 4, 4, device=DEVICE)
    with launch.recording() as outer:
        with launch.recording() as inner:
            with torch.no_grad():
                m(x)
        assert inner and not outer
    assert launch._active() is None


def test_bounded_caches_take_concurrent_gets_and_sets():
    """Plan and decision caches are shared by threads (DataParallel replicas share a module's); eviction
    between another thread's lookup and its read must not raise."""
    from fused_preact.ops._common import LRUDict

    cache = LRUDict(4)
    errors: list = []

    def hammer(seed):
        try:
            for i in range(20000):
                k = (i * 7 + seed) % 9
                cache[k] = i
                cache.get((k + 1) % 9)
        except Exception as e:  # noqa: BLE001 - any exception is the failure
            errors.append(e)

    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: without the lock this raises KeyError at once
    try:
        threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors and len(cache) <= 4
