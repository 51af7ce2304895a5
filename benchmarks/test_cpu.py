"""CPU benchmarks, labelled as such: what a machine without a GPU can honestly measure.

- ``test_cpu_block_step``: one training step (forward and backward) of a pre-activation block, eager
  (``fused_preact.models``) against the ``recompute`` backend (``FusedPreActBottleneck(backend=
  "recompute")``: the convolutions are PyTorch's, BatchNorm+ReLU recomputed in backward, as the fused
  kernels do; on the CPU its elementwise steps are ATen ops). ``benchmark.extra_info`` records the
  bytes of the tensors autograd saved for backward (``saved_bytes``): the memory the fused path saves.

These say nothing about GPU speed. Blocks: PreActResNet-164's first block and a 64-channel
PreActResNet-50-like bottleneck at small sizes, fp32, batch 8.
"""

import pytest
import torch

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
