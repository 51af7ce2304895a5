"""Model level: one training step (forward, cross-entropy, backward, SGD step) of PreActResNet-50
(224²) and PreActResNet-164 (32²), batch 128, bf16, channels_last; providers eager, compile,
compile-max-autotune, triton (``fused=True``), cuda, and for the CIFAR net the whole step captured
in a CUDA graph (eager-cudagraph, triton-cudagraph). ``extra_info`` records the step's peak memory.

``pytest benchmarks/test_model.py --benchmark-only`` on a CUDA machine.
"""

import pytest
from bench_support import model_cases, run_model


@pytest.mark.parametrize("model, provider", model_cases())
def test_train_step(benchmark, peaks, model, provider):
    run_model(benchmark, peaks, model, provider)
