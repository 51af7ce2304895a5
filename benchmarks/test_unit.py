"""Unit benchmark: one BN→ReLU→Conv unit, forward+backward, eager (cuDNN) vs torch.compile vs fused Triton.

``pytest benchmarks --benchmark-only`` on a CUDA machine. Each timed call runs forward and backward
and synchronizes the device; the first calls (compilation, autotuning) run before timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

# (name, N, C, H, K, R, stride): PreActResNet-50 at 224² and PreActResNet-164 at 32², batch 128.
SHAPES = [
    ("preact_resnet50/layer1.0/conv2", 128, 64, 56, 64, 3, 1),
    ("preact_resnet50/layer3.0/conv3", 128, 256, 14, 1024, 1, 1),
    ("preact_resnet164/layer1.0/conv2", 128, 16, 32, 16, 3, 1),
]


def _unit(provider: str, C: int, K: int, R: int, stride: int):
    from fused_preact import FusedBNReLUConv2d

    fused = FusedBNReLUConv2d(C, K, R, stride=stride, padding=R // 2, backend="triton")
    if provider == "triton":
        return fused
    eager = nn.Sequential(fused.bn, nn.ReLU(), fused.conv)
    return torch.compile(eager) if provider == "compile" else eager


@pytest.mark.parametrize("provider", ["eager", "compile", "triton"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_unit_fwd_bwd(benchmark, shape, provider):
    name, N, C, H, K, R, stride = shape
    dtype = torch.bfloat16
    mod = _unit(provider, C, K, R, stride).cuda().to(dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(N, C, H, H, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()

    def step():
        mod(x).sum().backward()
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    benchmark.extra_info.update(name=name, provider=provider, mode="fwd+bwd", dtype=str(dtype), batch=N)
    benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=2)
