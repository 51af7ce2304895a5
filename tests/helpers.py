"""Shared test helpers: per-dtype tolerances (the one place they are kept) and comparisons."""

from __future__ import annotations

import torch

from conftest import DEVICE

#: Max-norm relative tolerance per compute dtype: ``max|got − ref| ≤ tol · max(|ref|, floor)``.
#: fp32 against a float64 reference; fp16/bf16 against the float64 reference of the same
#: (rounded) inputs, so the tolerance covers the 16-bit activations and outputs.
TOL = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
    torch.float64: 1e-10,
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got − ref| / max|ref| (denominator floored at 1e-6), in float64."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if ref.numel() == 0:
        return 0.0
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Assert ``rel_err(got, ref) ≤ TOL[dtype]`` with a readable message."""
    err = rel_err(got, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e} ({dtype})"


def randn(*shape, dtype=torch.float32, device=DEVICE, mean=0.0, std=1.0, channels_last=False, generator=None):
    """Fresh normal data (never zeros); channels_last applies to 4-D shapes."""
    t = torch.randn(*shape, dtype=torch.float64, generator=generator) * std + mean
    t = t.to(device=device, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
