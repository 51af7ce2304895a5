"""CPU benchmarks, labelled as such: what a machine without a GPU can honestly measure.

- ``test_cpu_block_step``: one training step (forward and backward) of a pre-activation block, eager
  (``fused_preact.models``) against the ``recompute`` backend (``FusedPreActBottleneck(backend=
  "recompute")``: the convolutions are PyTorch's, BatchNorm+ReLU recomputed in backward, as the fused
  kernels do; on the CPU its elementwise steps are ATen ops). ``benchmark.extra_info`` records the
  bytes of the tensors autograd saved for backward (``saved_bytes``): the memory the fused path saves.

- ``test_cpu_host_cost``: the host side of a training step's calls, no kernel run — eager on meta
  tensors against the fused block with its Triton launches recorded instead of made.

These say nothing about GPU speed. Blocks: PreActResNet-164's first block and a 64-channel
PreActResNet-50-like bottleneck at small sizes, fp32, batch 8.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.cpu

#: (name, in_planes, planes, stride, image size)
BLOCKS = [("r164-layer1.0-16x32x32", 16, 16, 1, 32), ("r50-like-64x16x16", 64, 64, 1, 16)]


def _saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves during ``step``'s forward."""
    seen: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


@pytest.mark.parametrize("provider", ["eager", "recompute"])
@pytest.mark.parametrize("name, in_planes, planes, stride, size", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_cpu_block_step(benchmark, provider, name, in_planes, planes, stride, size):
    from fused_preact.models import PreActBottleneck
    from fused_preact.modules import FusedPreActBottleneck

    torch.manual_seed(0)
    block = (PreActBottleneck(in_planes, planes, stride) if provider == "eager"
             else FusedPreActBottleneck(in_planes, planes, stride, backend="recompute"))
    x = torch.randn(8, in_planes, size, size, requires_grad=True)

    def step():
        x.grad = None
        block(x).sum().backward()

    saved = _saved_bytes(lambda: block(x))
    benchmark.pedantic(step, warmup_rounds=1, rounds=5)
    ran = {getattr(m, "last_backend", None) for m in block.modules()} - {None}
    assert ran <= ({"recompute"} if provider == "recompute" else set()), ran
    benchmark.extra_info.update(name=f"cpu/{name}", device="cpu", provider=provider, mode="fwd+bwd", dtype="fp32",
                                batch=8, saved_bytes=saved)


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("provider", ["eager", "triton"])
@pytest.mark.parametrize("name, in_planes, planes, stride, size", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_cpu_host_cost(benchmark, monkeypatch, provider, name, in_planes, planes, stride, size):
    """The host side of one training step's calls (forward and backward), with no kernel run: eager's
    ``PreActBottleneck`` on meta tensors (Python, the dispatcher and its ATen ops' shape functions)
    against ``FusedPreActBottleneck(backend="triton")`` with its Triton launches recorded instead of made
    (Python, the plan-cache lookup, autograd, buffer allocation and every launch's arguments; the
    triton backend is told the interpreter is on so that it takes the CPU tensors, and launches
    nothing). A GPU adds the launch calls themselves: ``extra_info`` has eager's ATen op count and the
    fused block's launch count."""
    from fused_preact.models import PreActBottleneck
    from fused_preact.modules import FusedPreActBottleneck
    from fused_preact.ops import backends
    from fused_preact.ops.triton import launch

    torch.manual_seed(0)
    if provider == "eager":
        block = PreActBottleneck(in_planes, planes, stride).to("meta")
        x = torch.empty(8, in_planes, size, size, device="meta", requires_grad=True)

        def step():
            block(x).sum().backward()

        with _CountOps() as counter:
            step()
        calls = counter.ops
    else:
        monkeypatch.setattr(backends, "triton_mode", lambda: "interpreter")
        block = FusedPreActBottleneck(in_planes, planes, stride, backend="triton")
        x = torch.randn(8, in_planes, size, size, requires_grad=True)

        def step():
            with launch.recording() as launches:
                block(x).sum().backward()
            return launches

        calls = len(step())
        assert block.last_backend == "triton"
    benchmark.pedantic(step, warmup_rounds=2, rounds=20, iterations=5)
    benchmark.extra_info.update(name=f"cpu/{name}", device="cpu", provider=provider, mode="host fwd+bwd",
                                dtype="fp32", batch=8, calls=calls,
                                calls_are="ATen ops" if provider == "eager" else "Triton launches")
