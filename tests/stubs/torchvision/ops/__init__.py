"""Stand-in for ``torchvision.ops`` (see ``tests/stubs/torchvision/__init__.py``)."""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr

__getattr__ = placeholder_getattr(__name__)
