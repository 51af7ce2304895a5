"""Benchmark shapes and roofline arithmetic: which BN→ReLU→Conv units and blocks a model has, how many
FLOPs and how few bytes each must cost, and the floor those two numbers put under its run time.

Pure Python and CPU-only (the models are walked on the ``meta`` device, nothing is allocated), so
every number here is testable without a GPU. The timing half lives in :mod:`fused_preact.bench.timing`.

Cost model (per BN→ReLU→Conv unit; x: (N, C, H, W), W: (K, C/g, R, S), y: (N, K, P, Q); ``e`` bytes
per element of the benchmark dtype):

FLOPs (multiply-add = 2 FLOPs; the convolution's implicit GEMM only — BN and ReLU add O(|x|)
elementwise work: about 5/(2·K·R·S/stride²) of the conv's, a few percent for the 16→64 1×1 CIFAR
units and well under 1% for the rest, on units other than the tensor cores)
    fwd      F = 2·N·P·Q·K·(C/g)·R·S
    bwd      2F (dgrad + wgrad, the same GEMM size each)
    fwd+bwd  3F

Minimum bytes through device memory: every tensor that must cross the kernel boundary is read
once or written once, nothing more (per-channel vectors of C or K floats are ignored: < 0.1%).
    fwd      read x, read W, write y                          e·(|x| + |W| + |y|)
    bwd      read dy, read saved x, read W, write dx, write dW  e·(|y| + 2|x| + 2|W|)
    fwd+bwd  the sum (x must leave the chip between forward and backward)
This is an ideal single-pass bound, not the fused design's traffic: BatchNorm's batch statistics are
global reductions, so a real kernel reads x twice in forward (stats, then the conv prologue) and
its inputs twice in backward; ``docs/design.md`` counts those passes. The floor is therefore a
bound no implementation beats, and "percent of floor" (floor/measured) says how close one comes.

Floor: ``max(FLOPs / peak FLOP/s, bytes / peak B/s)`` with the peaks *measured* on the machine
(a large matmul in the timed dtype, fp32 with TF32 as cuDNN's convolutions use it, and a large
device copy; :func:`fused_preact.bench.timing.measure_peaks`),
as in the roofline model (Williams, Waterman, Patterson, CACM 52(4), 2009).

A block's FLOPs, bytes and floor are the sums over its units (each intermediate activation feeds a
BatchNorm whose statistics need the whole tensor, so it must reach memory once between units),
except that a projection shortcut shares conv1's input: x is read once in forward, and read once
and its gradient written once in backward, so the shortcut unit's |x| terms are not counted twice.
The residual add's read of the shortcut is not counted (this keeps the floor a lower bound).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from fused_preact.ops.dtypes import NAMES, by_name

__all__ = [
    "MODES",
    "MODEL_SPECS",
    "ModelSpec",
    "UnitShape",
    "BlockShape",
    "build_model",
    "enumerate_units",
    "enumerate_blocks",
    "unit_flops",
    "unit_min_bytes",
    "block_flops",
    "block_min_bytes",
    "floor_ms",
    "achieved",
    "pct_of_floor",
    "quick_units",
    "quick_blocks",
    "dtype_from_name",
]

#: Benchmark modes of a unit or block (``step`` is the model level's training step).
MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")

def dtype_from_name(name: str) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or a torch dtype's own name) → ``torch.dtype``: a dtype the
    fused kernels compute in (:mod:`fused_preact.ops.dtypes`).

    Raises:
        ValueError: unknown name, or a dtype that is not fused (float64).
    """
    try:
        t = by_name(name)
    except ValueError:
        t = None
    if t is None or not t.fused:
        raise ValueError(f"unknown dtype {name!r}; expected one of {[n for n, v in NAMES.items() if v.fused]}")
    return t.dtype


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmarkable model: its factory in :mod:`fused_preact.models` and its input resolution.

    Attributes:
        name: the benchmark's model name (first component of every entry name).
        factory: ``(fused: bool, backend: str) -> nn.Module``.
        image_size: input height = width in pixels (224 ImageNet, 32 CIFAR).
        num_classes: classifier outputs (labels are drawn from ``range(num_classes)``).
    """

    name: str
    factory: Callable[..., nn.Module]
    image_size: int
    num_classes: int

    @property
    def cifar(self) -> bool:
        """True for the 32×32 CIFAR networks (the model level adds CUDA-graph variants for them)."""
        return self.image_size == 32


def _specs() -> dict[str, ModelSpec]:
    from fused_preact import models as M

    def cifar(depth):
        return lambda fused, backend: M.preact_resnet_cifar(depth, 10, fused, backend)

    return {
        "preact_resnet50": ModelSpec("preact_resnet50", lambda fused, backend: M.preact_resnet50(1000, fused, backend),
                                     224, 1000),
        "preact_resnet18": ModelSpec("preact_resnet18", lambda fused, backend: M.preact_resnet18(1000, fused, backend),
                                     224, 1000),
        "preact_resnet164": ModelSpec("preact_resnet164", cifar(164), 32, 10),
        "preact_resnet110": ModelSpec("preact_resnet110", cifar(110), 32, 10),
        "preact_resnet20": ModelSpec("preact_resnet20", cifar(20), 32, 10),
    }


#: Models the benchmark knows, by name (``preact_resnet50`` at 224², the CIFAR nets at 32²).
MODEL_SPECS: dict[str, ModelSpec] = _specs()


def build_model(name: str, fused: bool, backend: str = "triton", device=None) -> nn.Module:
    """Build model ``name`` from :data:`MODEL_SPECS` (eager twin when ``fused=False``), on ``device``.

    Raises:
        KeyError: unknown model name.
    """
    spec = MODEL_SPECS[name]
    if device is None:
        return spec.factory(fused, backend)
    with torch.device(device):
        return spec.factory(fused, backend)


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


@dataclasses.dataclass(frozen=True)
class UnitShape:
    """One distinct BN→ReLU→Conv unit: BN over C channels, then a (K, C/groups, R, S) convolution.

    Attributes:
        model: model name. name: entry name of its first occurrence, ``<model>/<block>/<conv>``
            (e.g. ``preact_resnet50/layer1.0/conv1``). names: every layer of the model with this shape.
        N, C, H, W: input batch, channels, height, width. K, R, S: output channels, kernel size.
        stride, padding, dilation: (h, w) pairs. groups: conv groups.
    """

    model: str
    name: str
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    names: tuple[str, ...] = ()

    @property
    def P(self) -> int:
        """Output height."""
        return _conv_out(self.H, self.R, self.stride[0], self.padding[0], self.dilation[0])

    @property
    def Q(self) -> int:
        """Output width."""
        return _conv_out(self.W, self.S, self.stride[1], self.padding[1], self.dilation[1])

    @property
    def count(self) -> int:
        """How many layers of the model have this shape."""
        return max(1, len(self.names))

    def key(self) -> tuple:
        """What makes two units the same benchmark (everything but the names)."""
        return (self.N, self.C, self.H, self.W, self.K, self.R, self.S, self.stride, self.padding, self.dilation, self.groups)

    def numel(self) -> tuple[int, int, int]:
        """Element counts (|x|, |W|, |y|)."""
        return (self.N * self.C * self.H * self.W, self.K * (self.C // self.groups) * self.R * self.S,
                self.N * self.K * self.P * self.Q)

    def describe(self) -> str:
        """Short geometry string, e.g. ``64→64 3×3/1 @56²``."""
        groups = f" g{self.groups}" if self.groups > 1 else ""
        return f"{self.C}→{self.K} {self.R}×{self.S}/{self.stride[0]} @{self.H}²{groups}"


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """One distinct pre-activation block configuration.

    Attributes:
        model, name, names: as :class:`UnitShape` (name e.g. ``preact_resnet50/layer2.0``).
        kind: ``"basic"`` or ``"bottleneck"``. N, H, W: input batch and size. in_planes, planes,
        stride, groups, base_width: the block constructor's arguments. units: its BN→ReLU→Conv units
        (conv1, conv2[, conv3][, shortcut]) in module order.
    """

    model: str
    name: str
    kind: str
    N: int
    H: int
    W: int
    in_planes: int
    planes: int
    stride: int
    groups: int = 1
    base_width: int = 64
    units: tuple[UnitShape, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        """How many blocks of the model have this configuration."""
        return max(1, len(self.names))

    def key(self) -> tuple:
        """What makes two blocks the same benchmark."""
        return (self.kind, self.N, self.H, self.W, self.in_planes, self.planes, self.stride, self.groups, self.base_width)

    def describe(self) -> str:
        """Short string: kind, input → output channels, stride, input size, e.g. ``bottleneck 256→512 /2 @56²``."""
        out = self.planes * (4 if self.kind == "bottleneck" else 1)
        return f"{self.kind} {self.in_planes}→{out} /{self.stride} @{self.H}²"


def _walk(model_name: str, batch: int):
    """Run the eager model on meta tensors; return ((block path, block module, input shape), ...) and
    {conv path: input shape} for every conv inside a block."""
    from fused_preact.models import PreActBlock, PreActBottleneck

    spec = MODEL_SPECS[model_name]
    model = build_model(model_name, fused=False, device="meta")
    blocks: list[tuple[str, nn.Module, tuple]] = []
    conv_in: dict[str, tuple] = {}
    hooks = []
    for path, mod in model.named_modules():
        if isinstance(mod, (PreActBlock, PreActBottleneck)):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, p=path: blocks.append((p, m, tuple(a[0].shape)))))
        elif isinstance(mod, nn.Conv2d) and path.startswith("layer"):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, p=path: conv_in.__setitem__(p, tuple(a[0].shape))))
    with torch.no_grad():
        model(torch.empty(batch, 3, spec.image_size, spec.image_size, device="meta"))
    for h in hooks:
        h.remove()
    return blocks, conv_in


def _unit_of(model_name: str, block_path: str, conv_name: str, conv: nn.Conv2d, shape: tuple) -> UnitShape:
    N, C, H, W = shape
    name = f"{model_name}/{block_path}/{conv_name}"
    return UnitShape(model_name, name, N, C, H, W, conv.out_channels, conv.kernel_size[0], conv.kernel_size[1],
                     tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups, (name,))


def _block_units(model_name: str, path: str, block: nn.Module, conv_in: dict) -> tuple[UnitShape, ...]:
    units = []
    for conv_name in ("conv1", "conv2", "conv3", "shortcut"):
        conv = getattr(block, conv_name, None)
        if isinstance(conv, nn.Conv2d):
            units.append(_unit_of(model_name, path, conv_name, conv, conv_in[f"{path}.{conv_name}"]))
    return tuple(units)


def _dedupe(items: list, merge: Callable) -> list:
    first: dict = {}
    for it in items:
        k = it.key()
        first[k] = merge(first[k], it) if k in first else it
    return list(first.values())


def enumerate_units(model_name: str, batch: int = 128) -> list[UnitShape]:
    """Every distinct BN→ReLU→Conv unit of ``model_name`` at batch ``batch``, projection shortcuts
    included (they read ``relu(bn1(x))``), in first-occurrence order; ``names`` lists all occurrences.

    The stem conv reads the raw image (no BN before it) and is not a unit. Units are found by
    running the eager twin on ``meta`` tensors with forward pre-hooks (no memory, no compute).
    """
    blocks, conv_in = _walk(model_name, batch)
    units = [u for path, blk, _ in blocks for u in _block_units(model_name, path, blk, conv_in)]
    return _dedupe(units, lambda a, b: dataclasses.replace(a, names=a.names + b.names))


def enumerate_blocks(model_name: str, batch: int = 128) -> list[BlockShape]:
    """Every distinct block configuration of ``model_name`` at batch ``batch`` (first occurrence
    names it, e.g. ``preact_resnet50/layer2.0``; ``names`` lists all occurrences)."""
    from fused_preact.models import PreActBottleneck

    found, conv_in = _walk(model_name, batch)
    out = []
    for path, blk, (N, C, H, W) in found:
        bottleneck = isinstance(blk, PreActBottleneck)
        planes = blk.conv3.out_channels // 4 if bottleneck else blk.conv2.out_channels
        groups = blk.conv2.groups
        width = blk.conv2.out_channels
        base_width = width * 64 // (planes * groups) if bottleneck else 64
        name = f"{model_name}/{path}"
        out.append(BlockShape(model_name, name, "bottleneck" if bottleneck else "basic", N, H, W, C, planes,
                              blk.conv2.stride[0] if bottleneck else blk.conv1.stride[0], groups, base_width,
                              _block_units(model_name, path, blk, conv_in), (name,)))
    return _dedupe(out, lambda a, b: dataclasses.replace(a, names=a.names + b.names))


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def unit_flops(u: UnitShape, mode: str) -> int:
    """FLOPs of unit ``u`` in ``mode``: fwd ``2·N·P·Q·K·(C/g)·R·S``, bwd twice that (dgrad + wgrad),
    fwd+bwd three times (see the module docstring).

    Raises:
        ValueError: unknown mode.
    """
    _check_mode(mode)
    fwd = 2 * u.N * u.P * u.Q * u.K * (u.C // u.groups) * u.R * u.S
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd+bwd": 3 * fwd}[mode]


def unit_min_bytes(u: UnitShape, mode: str, elem_bytes: int) -> int:
    """Fewest bytes unit ``u`` must move through device memory in ``mode`` (module docstring):
    fwd ``e·(|x|+|W|+|y|)``, bwd ``e·(|y|+2|x|+2|W|)``, fwd+bwd their sum; ``e`` = ``elem_bytes``.

    Raises:
        ValueError: unknown mode.
    """
    _check_mode(mode)
    nx, nw, ny = u.numel()
    fwd = nx + nw + ny
    bwd = ny + 2 * nx + 2 * nw
    return elem_bytes * {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def block_flops(b: BlockShape, mode: str) -> int:
    """FLOPs of block ``b`` in ``mode``: the sum over its units (:func:`unit_flops`)."""
    return sum(unit_flops(u, mode) for u in b.units)


def block_min_bytes(b: BlockShape, mode: str, elem_bytes: int) -> int:
    """Minimum bytes of block ``b`` in ``mode``: the sum over its units (:func:`unit_min_bytes`) less
    the input terms a projection shortcut shares with conv1 (``e·|x|`` fwd, ``2e·|x|`` bwd, ``3e·|x|``
    fwd+bwd per shortcut; module docstring)."""
    _check_mode(mode)
    shared = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode]
    total = sum(unit_min_bytes(u, mode, elem_bytes) for u in b.units)
    return total - sum(shared * elem_bytes * u.numel()[0] for u in b.units if u.name.endswith("/shortcut"))


def floor_ms(flops: float, nbytes: float, peak_tflops: float, peak_gbps: float) -> float:
    """Roofline floor in ms: ``max(flops / (peak_tflops·1e12), nbytes / (peak_gbps·1e9)) · 1e3``.

    Args:
        flops: FLOPs. nbytes: bytes. peak_tflops: measured matmul rate, TFLOP/s.
        peak_gbps: measured copy bandwidth, GB/s (1 GB = 1e9 bytes).

    Raises:
        ValueError: a non-positive peak.
    """
    if peak_tflops <= 0 or peak_gbps <= 0:
        raise ValueError(f"peaks must be positive, got {peak_tflops} TFLOP/s, {peak_gbps} GB/s")
    return max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)) * 1e3


def achieved(flops: float, nbytes: float, median_ms: float) -> tuple[float, float]:
    """(TFLOP/s, GB/s) achieved when ``flops`` FLOPs and ``nbytes`` minimum bytes take ``median_ms`` ms.

    GB/s is *effective* bandwidth: minimum bytes over time, not the bytes actually moved.
    """
    s = median_ms * 1e-3
    return flops / s / 1e12, nbytes / s / 1e9


def pct_of_floor(floor: Optional[float], median_ms: float) -> Optional[float]:
    """``100 · floor / median_ms``: 100 means the run sits on the roofline floor; None without a floor."""
    if floor is None or median_ms <= 0:
        return None
    return 100.0 * floor / median_ms


#: Unit layers the ``--quick`` run measures (name suffixes after the model name).
QUICK_UNIT_LAYERS: dict[str, tuple[str, ...]] = {
    "preact_resnet50": ("layer1.0/conv2", "layer2.0/conv2", "layer3.1/conv3"),
    "preact_resnet164": ("layer1.1/conv2",),
}
#: Block paths the ``--quick`` run measures.
QUICK_BLOCKS: dict[str, tuple[str, ...]] = {
    "preact_resnet50": ("layer2.0",),
    "preact_resnet164": ("layer1.1",),
}


def _pick(items: Sequence, model: str, wanted: dict[str, tuple[str, ...]]) -> list:
    names = {f"{model}/{w}" for w in wanted.get(model, ())}
    picked = [it for it in items if names & set(it.names)]
    return picked or list(items[:1])


def quick_units(model_name: str, batch: int = 128) -> list[UnitShape]:
    """The ``--quick`` subset of :func:`enumerate_units` (a 3×3 at full size, a stride-2 3×3, a 1×1;
    the first unit for models without a listed subset)."""
    return _pick(enumerate_units(model_name, batch), model_name, QUICK_UNIT_LAYERS)


def quick_blocks(model_name: str, batch: int = 128) -> list[BlockShape]:
    """The ``--quick`` subset of :func:`enumerate_blocks` (one block per model)."""
    return _pick(enumerate_blocks(model_name, batch), model_name, QUICK_BLOCKS)
