"""Unit level: every distinct BN→ReLU→Conv unit of PreActResNet-50 (224²) and PreActResNet-164 (32²),
batch 128, bf16, channels_last; modes fwd, bwd, fwd+bwd; providers eager (cuDNN), compile,
compile-max-autotune, triton, cuda (skipped with the dispatcher's reason where not built), recompute,
auto and auto-lean (``backend="auto"``, ``memory="fastest"`` / ``"lean"``): ``timing.LAYER_PROVIDERS``.

``pytest benchmarks/test_unit.py --benchmark-only`` on a CUDA machine.
"""

import pytest
from bench_support import run_layer, unit_cases


@pytest.mark.parametrize("unit, provider, mode", unit_cases())
def test_unit(benchmark, peaks, unit, provider, mode):
    run_layer(benchmark, peaks, "unit", unit, provider, mode)
