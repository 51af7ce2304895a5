"""Stand-in for ``torchvision.transforms``: every transform is a placeholder class (timm subclasses some)."""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr

__getattr__ = placeholder_getattr(__name__)
