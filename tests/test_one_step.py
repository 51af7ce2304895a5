"""One-step launches (the fprop and dgrad kernels' ``STEPS`` > 0): a 1×1 whose reduction fits one
iteration of the loop (one tile step; fprop's two unrolled ones), and its projection's one step, runs
without a loop; the same layers with more channels run the loops. Each against a float64 reference,
with the launches' STEPS recorded to show which path ran."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE
from helpers import assert_within_eager, pooled_training_errors
from test_convert import _randomize_bn as _randomize_kinks
from test_modules import _compare, _randomize_bn
from test_op import _run

import fused_preact.ops.bn_relu_conv as op_mod
import fused_preact.ops.triton.layout as triton_layout
from fused_preact import FusedPreActBottleneck
from fused_preact.models import PreActBottleneck
from fused_preact.ops.triton import launch
from fused_preact.ops.triton.configs import GemmConfig

SMALL = GemmConfig(16, 16, 16)


class _Spy:
    """Stands in for a ``@triton.jit`` kernel: records whether each launch runs without a loop
    (``STEPS`` > 0), then launches."""

    def __init__(self, kernel, name: str, seen: list):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch_(*args, **kwargs):
            self.seen.append((self.name, kwargs["STEPS"] > 0))
            return run(*args, **kwargs)

        return launch_


def _spy(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(launch.FK, "_fprop_kernel", _Spy(launch.FK._fprop_kernel, "fprop", seen))
    monkeypatch.setattr(launch.DK, "_dgrad_kernel", _Spy(launch.DK._dgrad_kernel, "dgrad", seen))
    return seen


def _small_tiles(monkeypatch):
    for name in ("fprop_config", "dgrad_config"):
        monkeypatch.setattr(triton_layout, name, lambda *args, **kwargs: SMALL)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())  # plans are cached: start from none


def _steps(seen: list, kernel: str) -> set:
    return {one for name, one in seen if name == kernel}


# (in_planes, small tiles, loop-free launches seen in fprop, in dgrad). Bottleneck 16 → 8 → 32 with a projection
# (16 → 32): under the interpreter's tiles conv1 (16 channels) and conv3 with its projection (8 and 16
# channels) are one step each in fprop, conv3's dgrad (32 output channels) too, conv2 (3×3) loops.
# 24 input channels in 16-channel steps: conv1's fprop and the projection's loop, and conv3's dgrad
# (32 > 16 output channels) loops.
CASES = [(16, False, {True, False}, {True, False}), (24, True, {False}, {False})]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("in_planes, small, fprop_steps, dgrad_steps", CASES, ids=["one-step", "loops"])
def test_bottleneck_with_projection_fp32(monkeypatch, in_planes, small, fprop_steps, dgrad_steps, train):
    """A projection bottleneck in fp32: output, every gradient and the running statistics within fp32's
    tolerance of float64 over two steps, through one-step launches and through the loops."""
    if small:
        _small_tiles(monkeypatch)
    seen = _spy(monkeypatch)
    torch.manual_seed(0)
    fused = FusedPreActBottleneck(in_planes, 8, backend="triton")
    _randomize_bn(fused)
    eager64 = PreActBottleneck(in_planes, 8)
    eager64.load_state_dict(fused.state_dict())
    _compare(fused.to(DEVICE), eager64.double(), torch.randn(2, in_planes, 5, 6) + 0.3, train)
    assert fused.last_backend == "triton"
    assert (_steps(seen, "fprop"), _steps(seen, "dgrad")) == (fprop_steps, dgrad_steps)


@pytest.mark.parametrize("in_planes, small, fprop_steps, dgrad_steps", CASES, ids=["one-step", "loops"])
def test_bottleneck_with_projection_fp16(monkeypatch, in_planes, small, fprop_steps, dgrad_steps):
    """The same blocks in fp16 (channels_last, training): as close to float64 as eager PyTorch in fp16
    (the eager-relative rule, errors pooled over two draws). fp16's dgrad takes the projection in
    64-deep steps, so conv1's is one step in both cases."""
    if small:
        _small_tiles(monkeypatch)
    seen = _spy(monkeypatch)
    torch.manual_seed(1)
    model = PreActBottleneck(in_planes, 8)
    _randomize_kinks(model, kink=3.0)  # ReLU kinks 3σ out: few 16-bit rounding flips (test_convert)
    fused = FusedPreActBottleneck(in_planes, 8, backend="triton")
    fused.load_state_dict(model.state_dict())
    low = copy.deepcopy(model).to(DEVICE, torch.float16).to(memory_format=torch.channels_last)
    builds = {"float64": model.to(DEVICE, torch.float64), "eager": low,
              "fused": fused.to(DEVICE, torch.float16).to(memory_format=torch.channels_last)}
    pools = pooled_training_errors(builds, (2, in_planes, 6, 6), (2, 32, 6, 6), torch.float16)
    assert_within_eager(pools["fused"], pools["eager"], torch.float16, f"in_planes {in_planes}")
    assert _steps(seen, "fprop") == fprop_steps and True in _steps(seen, "dgrad")


def test_loop_free_off_keeps_every_loop(monkeypatch):
    """``FUSED_PREACT_LOOP_FREE=0`` (``configs.LOOP_FREE``, for timing the two against each other):
    the one-step case's launches all keep their loops, with the same numbers."""
    import fused_preact.ops.triton.configs as configs

    monkeypatch.setattr(configs, "LOOP_FREE", False)
    monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    seen = _spy(monkeypatch)
    _run((2, 24, 5, 6, 40, 1, 1, 0, 1, 1), True, True, torch.float16)
    assert (_steps(seen, "fprop"), _steps(seen, "dgrad")) == ({False}, {False})


@pytest.mark.parametrize("tiles, fprop_steps, dgrad_steps", [
    (None, {True}, {True}), (SMALL, {False}, {False}), (GemmConfig(16, 16, 16, unroll=2), {True}, {False})],
    ids=["one-step", "loops", "two-unrolled-steps"])
def test_unit_1x1_fp16(monkeypatch, tiles, fprop_steps, dgrad_steps):
    """A 1×1 unit 24 → 40 in fp16 (test_op's float64 comparison): one step in fprop and dgrad under the
    interpreter's tiles; 2 channel steps in fprop and 3 output-channel steps in dgrad with 16-wide
    tiles — fprop's loop-free where its loop is unrolled twice (``STEPS`` 2: both accumulators)."""
    if tiles is not None:
        for name in ("fprop_config", "dgrad_config"):
            monkeypatch.setattr(triton_layout, name, lambda *args, **kwargs: tiles)
        monkeypatch.setattr(op_mod, "_PLANS", type(op_mod._PLANS)())
    seen = _spy(monkeypatch)
    _run((2, 24, 5, 6, 40, 1, 1, 0, 1, 1), True, True, torch.float16)
    assert (_steps(seen, "fprop"), _steps(seen, "dgrad")) == (fprop_steps, dgrad_steps)
