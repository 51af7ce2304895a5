"""Test-only stand-in for ``torchvision`` (tests/stubs), so ``import timm`` works on the CPU CI.

timm's model code never calls torchvision at run time, but ``timm.layers`` and ``timm.data`` import
names from it at import time (``torchvision.ops.misc.FrozenBatchNorm2d``,
``torchvision.transforms``, ``torchvision.transforms.functional.InterpolationMode``). The real
package cannot be imported next to the CPU-only torch used here, so the tests put this directory
on ``sys.path`` only while importing timm (see ``tests/test_convert.py``) and only when the real
torchvision is not importable.

Every public name these modules do not define is a placeholder class: it can be imported,
subclassed and used in ``isinstance`` checks, and raises ``RuntimeError`` when instantiated.
"""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr

__version__ = "0.0.0+fused_preact.stub"

__getattr__ = placeholder_getattr(__name__)
