"""fused_preact: pre-activation ResNet units with BatchNorm+ReLU fused into the convolution.

Public API:
    FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck   drop-in modules (fused_preact.modules)
    models                                                      PreActResNet factories (fused or eager)
    ops                                                         the fused ops and their references
    backends(), select_backend()                                backend availability and choice

Source: He et al., "Identity Mappings in Deep Residual Networks", ECCV 2016.
"""

from fused_preact import models, ops
from fused_preact.backends import backends, select_backend
from fused_preact.modules import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck

__version__ = "0.1.0"

__all__ = [
    "FusedBNReLUConv2d",
    "FusedPreActBlock",
    "FusedPreActBottleneck",
    "backends",
    "models",
    "ops",
    "select_backend",
]
