"""Offsets past 2³¹: every operand decides 64-bit indexing, and what no launch can address is refused.

The views below lie over tensors of 2³¹+ elements that are allocated but never touched (the OS backs
only the pages the kernels read), so the tests run on a CPU under Triton's interpreter in megabytes of
real memory. A view with strides wider than its shape is what ``torch.cat``'s backward hands out
(``narrow()`` slices of the concatenation's gradient).
"""

import pytest
import torch
from conftest import DEVICE
from helpers import FUSED_BACKENDS

from fused_preact import FusedPreActBlock
from fused_preact.ops import index_range
from fused_preact.ops.backends import RecomputeBackend, TritonBackend
from fused_preact.ops.spec import ChainSpec, ConvGeom

BIG = 2**31 + 2**12  # elements of the untouched storage under each view (bf16: 4 GiB of address space)


def _view(shape, strides, dtype=torch.bfloat16, seed=0):
    """An (N, C, H, W) view with ``strides`` over a fresh 2³¹-element storage, filled with random values
    (only its own elements are written), and a contiguous copy of it."""
    storage = torch.empty(BIG, dtype=dtype, device=DEVICE)
    v = storage.as_strided(shape, strides)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    v.copy_(torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32))
    return v, v.contiguous()


def _block(backend):
    torch.manual_seed(0)
    return FusedPreActBlock(4, 4, backend=backend).to(DEVICE, torch.bfloat16)


def _grads(m, x, dy):
    x = x.detach().clone().requires_grad_()
    m.zero_grad()
    out = m(x)
    out.backward(dy)
    return [out, x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("strides", [(2**31, 1, 20, 4), (1, 2**31 // 3 + 1, 10, 2)],
                         ids=["batch-stride-2^31", "channel-stride-2^31/3"])
def test_output_gradient_views_give_the_gradients_of_their_contents(backend, strides):
    """dy with a batch stride of 2³¹ (64-bit image offsets) or channels 2³¹/3 apart (an image spanning
    2³¹: copied before the kernels read it): every gradient equals the one from a contiguous dy of the
    same values."""
    m = _block(backend)
    x = torch.randn(2, 4, 5, 5, device=DEVICE, dtype=torch.bfloat16)
    dy, dy_dense = _view((2, 4, 5, 5), strides)
    assert index_range.needs_idx64(dy)
    want = _grads(m, x, dy_dense)
    got = _grads(m, x, dy)
    assert m.last_backend == backend
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs"


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_an_input_with_its_batch_past_int32_runs_fused(backend):
    """x whose second image starts 2³¹ elements in: 64-bit image offsets, the same results as dense x."""
    m = _block(backend)
    x, x_dense = _view((2, 4, 5, 5), (2**31, 1, 20, 4), seed=1)
    dy = torch.randn(2, 4, 5, 5, device=DEVICE, dtype=torch.bfloat16)
    want = _grads(m, x_dense, dy)
    got = _grads(m, x, dy)
    assert m.last_backend == backend
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_an_image_spanning_2_31_elements_is_refused_and_auto_runs_plain_pytorch():
    """x whose channels lie 2²⁸ elements apart (nine of them span 2³¹): the kernels' in-image offsets
    are int32, so the fused backends say why they cannot serve it, a forced one raises, and auto runs
    the reference — with the reference's results."""
    x, x_dense = _view((1, 9, 3, 3), (9 * 2**28, 2**28, 3, 1), seed=2)
    spec = ChainSpec((ConvGeom(9, 9, (3, 3), padding=(1, 1)),))
    for backend in (TritonBackend, RecomputeBackend):
        reasons = backend.not_supported_reasons(x, spec)
        assert any("index range: in-image offsets" in r for r in reasons), reasons
        assert backend.not_supported_reasons(x_dense, spec) == []
    torch.manual_seed(0)
    fused = FusedPreActBlock(9, 9, backend="triton").to(DEVICE, torch.bfloat16)
    with pytest.raises(RuntimeError, match="index range"):
        fused(x)
    fused.backend = "auto"
    ref = FusedPreActBlock(9, 9, backend="reference").to(DEVICE, torch.bfloat16)
    ref.load_state_dict(fused.state_dict())
    assert torch.equal(fused(x), ref(x))
    assert fused.last_backend == "reference" and "index range" in fused.fallback_reason


def test_row_counts_near_2_31_are_refused():
    """N·H·W of 2³¹ rows (a stride-0 expansion: no memory) is past the int32 row index."""
    x = torch.zeros(1, 1, 1, 1, device=DEVICE, dtype=torch.bfloat16).expand(2**15, 1, 256, 256)
    spec = ChainSpec((ConvGeom(1, 1, (1, 1)),))
    reasons = TritonBackend.not_supported_reasons(x, spec)
    assert any("pixel rows" in r for r in reasons), reasons
    small = x[: 2**14]
    assert not any("index range" in r for r in TritonBackend.not_supported_reasons(small, spec))


def test_the_reach_counts_taps_and_padding_past_the_image():
    """A 1-row image with a 2³¹/3 row stride: its own offsets are small, but a 3×3 conv padded by 1
    reads rows −1 … 1 of it."""
    shape, strides = (1, 1, 1, 4), (0, 2**31 // 3 + 1, 1, 1)
    assert index_range.image_reach(shape, strides) < index_range.INT32_MAX
    spec = ChainSpec((ConvGeom(1, 1, (3, 3), padding=(1, 1)),))
    assert index_range.chain_margin(spec) == (4, 4)
    assert index_range.image_reach(shape, strides, index_range.chain_margin(spec)) >= index_range.INT32_MAX
