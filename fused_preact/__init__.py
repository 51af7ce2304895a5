"""fused_preact: pre-activation ResNet units with BatchNorm+ReLU fused into the convolution.

Public API (loaded lazily, so ``python -m fused_preact`` can choose Triton's interpreter before
triton is imported):
    FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck   drop-in modules (fused_preact.modules)
    models                                                      PreActResNet factories (fused or eager)
    experiments                                                 the main job and the paper's variants, gradient flow
    bench                                                       benchmarks (``python -m fused_preact.bench``)
    ops                                                         the fused ops and their references
    convert(), ConversionReport                                 swap fused modules into existing models (timm, ...)
    convert_sync_batchnorm()                                    SyncBatchNorm that keeps fused modules fused
    backends(), select_backend()                                backend availability and choice
    dispatch_report(), set_memory_policy()                      what backend="auto" decided per block, and its policy

Source: He et al., "Identity Mappings in Deep Residual Networks", ECCV 2016.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "FusedBNReLUConv2d": "fused_preact.modules",
    "FusedPreActBlock": "fused_preact.modules",
    "FusedPreActBottleneck": "fused_preact.modules",
    "convert": "fused_preact.conversion",
    "ConversionReport": "fused_preact.conversion",
    "convert_sync_batchnorm": "fused_preact.modules",
    "backends": "fused_preact.dispatch",
    "select_backend": "fused_preact.dispatch",
    "dispatch_report": "fused_preact.dispatch",
    "set_memory_policy": "fused_preact.dispatch",
}
_SUBMODULES = ("models", "ops", "modules", "conversion", "experiments", "bench")

__all__ = sorted(list(_LAZY) + ["models", "ops"])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"fused_preact.{name}")
    raise AttributeError(f"module 'fused_preact' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
