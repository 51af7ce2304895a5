"""Runtime behaviour: CUDA-graph capture of a training step, the current CUDA stream, threads.

All three need a GPU (compiled Triton kernels).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import assert_close

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock
from fused_preact.models import preact_resnet_cifar


@pytest.mark.gpu
def test_training_step_captures_in_a_cuda_graph():
    """Forward, backward and an SGD step of a fused CIFAR net captured once and replayed: no host
    synchronization may happen inside (capture would fail), and replays match eager steps."""
    torch.manual_seed(0)
    model = preact_resnet_cifar(20, fused=True, backend="triton").cuda().to(memory_format=torch.channels_last)
    twin = preact_resnet_cifar(20, fused=True, backend="triton").cuda().to(memory_format=torch.channels_last)
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    data = [(torch.randn(16, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last),
             torch.randint(0, 10, (16,), device="cuda")) for _ in range(5)]
    static_x, static_y = data[0][0].clone(), data[0][1].clone()

    def step(m, o, x, y):
        o.zero_grad(set_to_none=False)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compiles the kernels outside the capture
        for x, y in data[:2]:
            step(model, opt, x, y)
            step(twin, opt_twin, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x, static_y)
    for x, y in data[2:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        ref = step(twin, opt_twin, x, y)
        assert_close(static_loss, ref, torch.float32, "graph-replayed loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p, q, torch.float32, name)
    for (name, b), c in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(b, c) if b.dtype == torch.long else torch.allclose(b, c, rtol=1e-4, atol=1e-5), name


@pytest.mark.gpu
def test_kernels_run_on_the_current_stream():
    """Results computed under torch.cuda.stream(s) equal those on the default stream (the launches
    must be ordered after the producer on s; a kernel on another stream would race)."""
    torch.manual_seed(0)
    block = FusedPreActBlock(32, 64, stride=2, backend="triton").cuda()
    x = torch.randn(8, 32, 40, 40, device="cuda")
    y_ref = block(x)
    y_ref.sum().backward()
    g_ref = block.conv1.weight.grad.clone()
    block.zero_grad()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        xs = x * 1.0 + 0.0  # produced on s: the fused kernels must run after it, on s
        y = block(xs)
        y.sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    assert_close(y, y_ref, torch.float32, "forward on a side stream")
    assert_close(block.conv1.weight.grad, g_ref, torch.float32, "wgrad on a side stream")


@pytest.mark.gpu
def test_modules_are_thread_safe():
    """Several threads running their own fused modules at once get each module's own answer (no
    shared mutable launch state between calls). GPU only: Triton's interpreter itself is not
    thread-safe (it patches ``triton.language`` globals while it runs a kernel)."""
    torch.manual_seed(0)
    mods = [FusedBNReLUConv2d(4, 6, 3, padding=1, backend="triton").to(DEVICE).eval() for _ in range(3)]
    xs = [torch.randn(2, 4, 6, 6, device=DEVICE) + i for i in range(3)]
    expected = [m(x) for m, x in zip(mods, xs)]
    got: list = [None] * 3
    errors: list = []

    def run(i):
        try:
            got[i] = mods[i](xs[i])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
