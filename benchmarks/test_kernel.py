"""Kernel level: each fused convolution kernel alone (fprop with the BN+ReLU prologue, dgrad with its
ReLU-mask/Σdz/Σdz·x̂ epilogue, wgrad with the prologue recomputed) against cuDNN doing the same
convolution on the already pre-activated tensor, for every distinct unit of PreActResNet-50 (224²) and
PreActResNet-164 (32²), batch 128, bf16, channels_last. Providers ``cudnn`` (the reference), ``triton``,
``cuda`` and ``cudnn-fused`` (float16 only, skipped in this bf16 suite's runs with its reason) — the calls
of :class:`fused_preact.bench.kernels.KernelBench`, which ``python -m fused_preact.bench --level kernel``
times with CUDA events (device time only); here pytest-benchmark's host clock times each round up to a
``torch.cuda.synchronize()``, so small kernels also carry the launch overhead.

``pytest benchmarks/test_kernel.py --benchmark-only`` on a CUDA machine (``FUSED_PREACT_BENCH=quick``:
two shapes).
"""

import pytest
from bench_support import BATCH, DTYPE, MODELS, QUICK, _pedantic

from fused_preact.bench.kernels import KERNEL_MODES, KERNEL_PROVIDERS, kernel_flops, quick_kernel_units
from fused_preact.bench.shapes import enumerate_units

_UNITS = [u for m in MODELS for u in (quick_kernel_units if QUICK else enumerate_units)(m, BATCH)]


class _LastBench:
    """The inputs of the latest unit, shared by its providers and modes."""

    key = None
    value = None

    @classmethod
    def get(cls, u, peaks):
        from fused_preact.bench.kernels import KernelBench

        if cls.key != u.name:
            cls.key, cls.value = u.name, KernelBench(u, DTYPE, peaks.l2_bytes)
        return cls.value


@pytest.mark.parametrize("unit, provider, mode", [
    pytest.param(u, p, mode, id=f"{u.name}-{p}-{mode}") for u in _UNITS for p in KERNEL_PROVIDERS
    for mode in KERNEL_MODES])
def test_kernel(benchmark, peaks, unit, provider, mode):
    from fused_preact.bench import timing as BT

    bench = _LastBench.get(unit, peaks)
    if mode not in bench.modes(provider):
        pytest.skip(f"{provider} has no {mode}")
    try:
        call = bench.call(provider, mode)
    except BT.Skip as e:
        pytest.skip(str(e))
    med_ms = _pedantic(benchmark, call.setup, call.run, "layer")
    fl = kernel_flops(unit)
    benchmark.extra_info.update(name=unit.name, level="kernel", provider=provider, mode=mode, dtype="bf16",
                                batch=BATCH, shape=unit.describe(), flops=fl, tflops=fl / (med_ms * 1e9),
                                launches=call.launches, note=call.note)
