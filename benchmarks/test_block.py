"""Block level: every distinct pre-activation bottleneck of PreActResNet-50 (224²) and
PreActResNet-164 (32²), batch 128, bf16, channels_last; modes fwd, bwd, fwd+bwd; providers eager
(``fused_preact.models.PreActBottleneck``), compile, compile-max-autotune, triton
(``FusedPreActBottleneck``), cuda, recompute, auto and auto-lean (``backend="auto"``, ``memory="fastest"`` /
``"lean"``): ``timing.LAYER_PROVIDERS``.

``pytest benchmarks/test_block.py --benchmark-only`` on a CUDA machine.
"""

import pytest
from bench_support import block_cases, run_layer


@pytest.mark.parametrize("block, provider, mode", block_cases())
def test_block(benchmark, peaks, block, provider, mode):
    run_layer(benchmark, peaks, "block", block, provider, mode)
