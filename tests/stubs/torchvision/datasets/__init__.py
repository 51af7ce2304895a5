"""Stand-in for ``torchvision.datasets``: every data set class is a placeholder (timm imports the names)."""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr

__getattr__ = placeholder_getattr(__name__)
