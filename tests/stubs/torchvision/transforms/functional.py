"""Stand-in for ``torchvision.transforms.functional``: a real ``InterpolationMode`` enum, placeholders otherwise.

The enum values are torchvision's documented mode strings; timm maps them to and from names at
import time (``timm.data.transforms``).
"""

from __future__ import annotations

import enum

from torchvision._placeholder import placeholder_getattr


class InterpolationMode(enum.Enum):
    """Interpolation modes, with the string values torchvision documents."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = placeholder_getattr(__name__)
