"""Per-channel batch statistics kernels against float64."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import assert_close

from fused_preact.ops import batch_stats


def _ref(x):
    var, mean = torch.var_mean(x.double().cpu(), dim=(0, 2, 3), correction=0)
    return mean, var


def _cases():
    """Shapes × layouts: 1×1 images, several channel blocks, many row tiles; NCHW (a layout copy around
    the same kernel) beyond the first shape and the plain (4, 24, 9, 9) are ``slow``."""
    shapes = [(2, 3, 7, 7), (3, 5, 1, 1), (4, 24, 9, 9), (2, 70, 5, 3), (1, 16, 33, 40)]
    for i, shape in enumerate(shapes):
        for channels_last in (False, True):
            slow = shape == (4, 24, 9, 9) or (i > 0 and not channels_last)
            yield pytest.param(shape, channels_last, id=f"{shape}-{'nhwc' if channels_last else 'nchw'}",
                               marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("shape,channels_last", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_float64(shape, dtype, channels_last):
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).to(DEVICE, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    mean, var = batch_stats(x)
    assert mean.dtype == var.dtype == torch.float32 and mean.shape == (shape[1],)
    rm, rv = _ref(x)
    assert_close(mean, rm, torch.float32, "mean")
    assert_close(var, rv, torch.float32, "var")


def test_large_mean_small_spread():
    """mean 1e4, std 1: E[x²] − E[x]² would lose every digit of the variance in fp32."""
    x = torch.randn(4, 8, 16, 16, dtype=torch.float64) + 1e4
    mean, var = batch_stats(x.float().to(DEVICE))
    rm, rv = _ref(x.float())
    assert_close(mean, rm, torch.float32, "mean")
    assert_close(var, rv, torch.float32, "var")


def test_fp16_large_magnitude():
    """fp16 inputs near the fp16 maximum: Σx² would overflow in 16-bit; fp32 accumulation does not."""
    x = (torch.randn(4, 6, 8, 8, dtype=torch.float64) * 2e3 + 3e4).to(torch.float16)
    mean, var = batch_stats(x.to(DEVICE))
    assert torch.isfinite(mean).all() and torch.isfinite(var).all()
    rm, rv = _ref(x)
    assert_close(mean, rm, torch.float32, "mean")
    assert_close(var, rv, torch.float32, "var")


def test_nan_stays_in_its_channel():
    x = torch.randn(2, 4, 5, 5)
    x[1, 2, 3, 3] = float("nan")
    mean, var = batch_stats(x.to(DEVICE))
    assert torch.isnan(mean[2]) and torch.isnan(var[2])
    keep = [0, 1, 3]
    rm, rv = _ref(x)
    assert_close(mean[keep], rm[keep], torch.float32, "mean")
    assert_close(var[keep], rv[keep], torch.float32, "var")


def test_non_contiguous_input():
    base = torch.randn(3, 10, 9, 12, device=DEVICE)
    x = base[:, ::2, :, ::3]
    assert not x.is_contiguous()
    mean, var = batch_stats(x)
    rm, rv = _ref(x)
    assert_close(mean, rm, torch.float32, "mean")
    assert_close(var, rv, torch.float32, "var")
