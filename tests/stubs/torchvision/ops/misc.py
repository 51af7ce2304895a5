"""Stand-in for ``torchvision.ops.misc``: ``FrozenBatchNorm2d`` is a non-constructible ``nn.Module``.

timm imports it to recognise and create frozen BatchNorm layers (``freeze_batch_norm_2d``); the
tests never freeze layers, so only the name and the ``isinstance`` check are needed.
"""

from __future__ import annotations

import torch.nn as nn

from torchvision._placeholder import placeholder, placeholder_getattr

FrozenBatchNorm2d = placeholder(f"{__name__}.FrozenBatchNorm2d", nn.Module)

__getattr__ = placeholder_getattr(__name__)
