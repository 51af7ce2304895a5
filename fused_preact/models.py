"""Pre-activation ResNets, built from fused blocks or from plain PyTorch modules with the same names.

ImageNet networks (``preact_resnet18/34/50/101/152``): 7×7/2 stem conv and 3×3/2 max-pool with no
BN (the first block pre-activates), four stages of widths 64/128/256/512 (×4 for bottlenecks),
final BN → ReLU before global average pooling, as timm's ``resnetv2`` with ``preact=True``.
CIFAR networks (He et al. 2016, §4 and Table 2/3): 3×3 stem conv to 16 channels, three stages of
widths 16/32/64 — basic blocks, (depth−2)/6 per stage (``preact_resnet110``), or bottlenecks,
(depth−2)/9 per stage with output widths 64/128/256 (``preact_resnet164``, ``preact_resnet1001``).
A bottleneck downsamples in its 3×3 conv (as timm and torchvision do); the paper's own code
(``resnet-pre-act.lua``) strides its first 1×1 conv instead: same parameters, other FLOPs.

Every factory takes ``fused=True|False``: the two builds have identical architecture and parameter
names (``stem.0.weight``, ``layer1.0.bn1.weight``, …, ``bn.weight``, ``fc.weight``), so a state_dict
moves between them unchanged.
"""

from __future__ import annotations

from typing import Optional, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.modules import (
    FusedPreActBlock,
    FusedPreActBottleneck,
    build_basic_layers,
    build_bottleneck_layers,
    plain_call,
    run_blocks,
)

__all__ = [
    "PreActBlock",
    "PreActBottleneck",
    "PreActResNet",
    "preact_resnet18",
    "preact_resnet34",
    "preact_resnet50",
    "preact_resnet101",
    "preact_resnet152",
    "preact_resnext50_32x4d",
    "preact_resnext101_32x8d",
    "preact_resnet_cifar",
    "preact_resnet110",
    "preact_resnet164",
    "preact_resnet1001",
]


class PreActBlock(nn.Module):
    """Eager twin of :class:`fused_preact.FusedPreActBlock` (same attributes, same math, plain PyTorch ops)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 device=None, dtype=None):
        super().__init__()
        build_basic_layers(self, in_planes, planes, stride, eps, momentum, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(x))
        sc = self.shortcut(a) if self.shortcut is not None else x
        out = self.conv1(a)
        return self.conv2(F.relu(self.bn2(out))) + sc


class PreActBottleneck(nn.Module):
    """Eager twin of :class:`fused_preact.FusedPreActBottleneck` (expansion 4)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 groups: int = 1, base_width: int = 64, device=None, dtype=None):
        super().__init__()
        build_bottleneck_layers(self, in_planes, planes, stride, eps, momentum, groups, base_width,
                                device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(x))
        sc = self.shortcut(a) if self.shortcut is not None else x
        out = self.conv1(a)
        out = self.conv2(F.relu(self.bn2(out)))
        return self.conv3(F.relu(self.bn3(out))) + sc


class PreActResNet(nn.Module):
    """A pre-activation ResNet: stem → stages of pre-activation blocks → BN → ReLU → avg-pool → fc.

    Args:
        block: ``"basic"`` or ``"bottleneck"``.
        layers: blocks per stage. widths: bottleneck/basic width per stage (output = width·expansion).
        stem: ``"imagenet"`` (7×7/2 conv, 3×3/2 max-pool) or ``"cifar"`` (3×3 conv).
        stem_width: channels after the stem. num_classes: classifier outputs.
        fused: build from :mod:`fused_preact.modules` blocks (True) or the eager twins (False).
        backend: passed to every fused block (ignored when ``fused=False``).
        groups, base_width: ResNeXt cardinality and width per group of every bottleneck's 3×3 conv
            (``groups=1, base_width=64``: a ResNet). Basic blocks require the defaults.

    Raises:
        ValueError: unknown ``block``/``stem``, ``groups``/``base_width`` given for basic blocks, or
            ``layers``/``widths`` not one positive entry each per stage.

    Input (N, 3, H, W) float, NCHW or channels_last; output (N, num_classes) logits.
    """

    def __init__(self, block: str, layers: list[int], widths: list[int], stem: str, stem_width: int,
                 num_classes: int, fused: bool = True, backend: str = "auto", groups: int = 1, base_width: int = 64):
        super().__init__()
        if block not in ("basic", "bottleneck"):
            raise ValueError(f"block must be 'basic' or 'bottleneck', got {block!r}")
        if block == "basic" and (groups, base_width) != (1, 64):
            raise ValueError(f"basic blocks support only groups=1, base_width=64 (got {groups}, {base_width})")
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        if len(layers) != len(widths) or not layers:
            raise ValueError(f"layers and widths must have one entry per stage, got {len(layers)} and {len(widths)}")
        if any(n < 1 for n in layers) or any(w < 1 for w in widths):
            raise ValueError(f"every stage needs at least one block and a positive width, got layers={list(layers)}, "
                             f"widths={list(widths)}")
        cls: Type[nn.Module]
        if fused:
            cls = FusedPreActBlock if block == "basic" else FusedPreActBottleneck
        else:
            cls = PreActBlock if block == "basic" else PreActBottleneck
        kw = dict(backend=backend) if fused else {}
        if block == "bottleneck":
            kw.update(groups=groups, base_width=base_width)
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(3, stem_width, 7, 2, 3, bias=False), nn.MaxPool2d(3, 2, 1)
            )
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, stem_width, 3, 1, 1, bias=False))
        in_planes = stem_width
        self.num_stages = len(layers)
        for i, (n, w) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(cls(in_planes, w, stride, **kw))
                in_planes = w * cls.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.bn = nn.BatchNorm2d(in_planes)
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        # All stages as one chain of blocks: each fused block's last conv computes the next block's
        # bn1 statistics in its epilogue (fused_preact.modules.run_blocks). Stages that are not plain
        # Sequentials called plainly (hooks of any kind, a forward of their own) are called as such.
        stages = [getattr(self, f"layer{i + 1}") for i in range(self.num_stages)]
        if not all(type(s) is nn.Sequential and plain_call(s) for s in stages):
            for stage in stages:
                x = stage(x)
        else:
            x = run_blocks([blk for stage in stages for blk in stage], x)
        x = F.relu(self.bn(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _imagenet(block: str, layers: list[int], num_classes: int, fused: bool, backend: str, **kw) -> PreActResNet:
    return PreActResNet(block, layers, [64, 128, 256, 512], "imagenet", 64, num_classes, fused, backend, **kw)


def preact_resnet18(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """PreActResNet-18 for 224×224 ImageNet input (basic blocks [2, 2, 2, 2])."""
    return _imagenet("basic", [2, 2, 2, 2], num_classes, fused, backend)


def preact_resnet34(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """PreActResNet-34 (basic blocks [3, 4, 6, 3])."""
    return _imagenet("basic", [3, 4, 6, 3], num_classes, fused, backend)


def preact_resnet50(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """PreActResNet-50 (bottlenecks [3, 4, 6, 3])."""
    return _imagenet("bottleneck", [3, 4, 6, 3], num_classes, fused, backend)


def preact_resnet101(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """PreActResNet-101 (bottlenecks [3, 4, 23, 3])."""
    return _imagenet("bottleneck", [3, 4, 23, 3], num_classes, fused, backend)


def preact_resnet152(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """PreActResNet-152 (bottlenecks [3, 8, 36, 3])."""
    return _imagenet("bottleneck", [3, 8, 36, 3], num_classes, fused, backend)


def preact_resnext50_32x4d(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """Pre-activation ResNeXt-50 (32×4d): bottlenecks [3, 4, 6, 3] with 32-group 3×3 convs of width
    4 per group in the first stage (Xie et al., "Aggregated Residual Transformations", CVPR 2017, Table 1)."""
    return _imagenet("bottleneck", [3, 4, 6, 3], num_classes, fused, backend, groups=32, base_width=4)


def preact_resnext101_32x8d(num_classes: int = 1000, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """Pre-activation ResNeXt-101 (32×8d): bottlenecks [3, 4, 23, 3], 32 groups of width 8."""
    return _imagenet("bottleneck", [3, 4, 23, 3], num_classes, fused, backend, groups=32, base_width=8)


def preact_resnet_cifar(depth: int, num_classes: int = 10, fused: bool = True, backend: str = "auto",
                        bottleneck: Optional[bool] = None) -> PreActResNet:
    """The paper's CIFAR ResNet (full pre-activation units, identity shortcuts) of any valid depth, 32×32 input.

    Args:
        depth: total weighted layers. Basic blocks need ``(depth − 2) % 6 == 0`` (20, 56, 110, …);
            bottlenecks need ``(depth − 2) % 9 == 0`` (164, 1001, …).
        num_classes, backend: as :class:`PreActResNet`.
        fused: fused build (True) or its eager twin (False); same parameter names either way.
        bottleneck: force the block type; default: bottleneck exactly when ``depth ≥ 164``.

    The other residual-unit and shortcut variants of the paper (Fig. 2 and 4) are eager networks
    built by :func:`fused_preact.experiments.variants.preact_resnet_cifar_variant`.

    Raises:
        ValueError: depth does not fit the block type.
    """
    if bottleneck is None:
        bottleneck = depth >= 164
    per = 9 if bottleneck else 6
    if depth < 2 + per or (depth - 2) % per:
        kind = "bottleneck" if bottleneck else "basic"
        raise ValueError(f"depth {depth} invalid for {kind} blocks: need depth = {per}·n + 2 with n ≥ 1")
    n = (depth - 2) // per
    return PreActResNet("bottleneck" if bottleneck else "basic", [n, n, n], [16, 32, 64], "cifar", 16,
                        num_classes, fused, backend)


def preact_resnet110(num_classes: int = 10, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """CIFAR PreActResNet-110 (basic blocks, 18 per stage)."""
    return preact_resnet_cifar(110, num_classes, fused, backend)


def preact_resnet164(num_classes: int = 10, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """CIFAR PreActResNet-164 (bottlenecks, 18 per stage, output widths 64/128/256)."""
    return preact_resnet_cifar(164, num_classes, fused, backend)


def preact_resnet1001(num_classes: int = 10, fused: bool = True, backend: str = "auto") -> PreActResNet:
    """CIFAR PreActResNet-1001 (bottlenecks, 111 per stage)."""
    return preact_resnet_cifar(1001, num_classes, fused, backend)
