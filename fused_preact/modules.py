"""Drop-in modules: ``FusedBNReLUConv2d``, ``FusedPreActBlock``, ``FusedPreActBottleneck``.

Every module holds plain ``nn.BatchNorm2d`` and ``nn.Conv2d`` children, so parameters, buffers and
state_dict keys are exactly those of the eager modules they replace, and ``.eval()``, momentum,
``momentum=None`` (cumulative average), ``affine=False`` and ``track_running_stats=False`` behave as
in ``nn.BatchNorm2d``. Only ``forward`` differs: it runs the fused op (``fused_preact.ops``) when a
fused backend can serve the input and the reference PyTorch path otherwise. The backend that ran
is in ``module.last_backend`` and any fallback's reason in ``module.fallback_reason``.

Source: He, Zhang, Ren, Sun, "Identity Mappings in Deep Residual Networks", ECCV 2016, Fig. 4(e)
(full pre-activation unit) and §4 (projection shortcut on the pre-activated input).
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.dispatch import select_backend
from fused_preact.ops import (
    bn_relu_conv2d_with_stats,
    bn_relu_conv2d_with_stats_out,
    bn_statistics,
    check_inputs,
    check_training_batch,
)
from fused_preact.ops.sync_stats import sync_bn_statistics, sync_enabled

__all__ = ["FusedBNReLUConv2d", "FusedPreActBlock", "FusedPreActBottleneck", "bottleneck_width", "convert_sync_batchnorm", "fused_bn_relu_convs",
           "fused_bn_relu_convs_chained", "run_blocks"]

logger = logging.getLogger("fused_preact")


def _bn_forward_args(bn: nn.BatchNorm2d):
    """``nn.BatchNorm2d.forward``'s prologue: (use batch stats, average factor, running_mean, running_var).

    Increments ``num_batches_tracked`` in training exactly as PyTorch does; callers validate first
    so that a call which raises leaves the buffers untouched.
    """
    eaf = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        eaf = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    bn_training = bn.training or (bn.running_mean is None and bn.running_var is None)
    use_buffers = not bn.training or bn.track_running_stats
    return (
        bn_training,
        eaf,
        bn.running_mean if use_buffers else None,
        bn.running_var if use_buffers else None,
    )


def _validate(x: torch.Tensor, bn: nn.BatchNorm2d, convs: list[nn.Conv2d]) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    if x.shape[1] != bn.num_features:
        raise RuntimeError(
            f"fused_preact: expected input with {bn.num_features} channels (BatchNorm2d num_features), got {x.shape[1]}"
        )
    if bn.training and not sync_enabled(bn):  # nn.SyncBatchNorm leaves the global count unchecked
        check_training_batch(x)
    for c in convs:
        if not isinstance(c.padding, str):
            check_inputs(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)


def _conv_reasons(conv: nn.Conv2d) -> list[str]:
    reasons = []
    if conv.padding_mode != "zeros":
        reasons.append(f"fused conv: padding_mode={conv.padding_mode!r} (only 'zeros' is fused)")
    if isinstance(conv.padding, str):
        reasons.append(f"fused conv: string padding {conv.padding!r} (give explicit ints)")
    return reasons


def fused_bn_relu_convs(owner: nn.Module, x: torch.Tensor, bn: nn.BatchNorm2d, convs: list[nn.Conv2d]) -> list[torch.Tensor]:
    """Run ``[conv(relu(bn(x))) for conv in convs]`` with one set of BN statistics.

    The BN statistics (and the running-stat update) are computed once and feed every conv, each of
    which fuses BN+ReLU into its input prologue and saves only ``x``. When ``bn`` is an
    ``nn.SyncBatchNorm`` that must synchronize (training, >1 rank; see
    :func:`fused_preact.ops.sync_stats.sync_enabled`) the statistics are all-gathered over its
    process group and their gradients all-reduced in backward, as ``nn.SyncBatchNorm`` does — so
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` on a fused model keeps it fused *and* synchronized.

    Args:
        owner: the module whose ``backend`` attribute is requested and whose ``last_backend`` /
            ``fallback_reason`` record what ran.
        x: (N, C, H, W) input of ``bn``.
        bn: the BatchNorm2d holding γ, β and the running buffers.
        convs: convolutions reading the pre-activation ``relu(bn(x))``.

    Returns:
        The conv outputs, in order.

    Raises:
        ValueError / RuntimeError: bad input rank or channel count, one value per channel in
            training, or a forced backend that cannot serve the input.
    """
    return fused_bn_relu_convs_chained(owner, x, bn, convs)[0]


def _needs_batch_stats(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn``'s forward will normalize with batch statistics (``F.batch_norm``'s rule)."""
    return bn.training or (bn.running_mean is None and bn.running_var is None)


def fused_bn_relu_convs_chained(
    owner: nn.Module,
    x: torch.Tensor,
    bn: nn.BatchNorm2d,
    convs: list[nn.Conv2d],
    batch_mean_var: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    residual: Optional[torch.Tensor] = None,
    want_stats: bool = False,
) -> tuple[list[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`fused_bn_relu_convs` with the epilogue fusions of a residual block.

    Args:
        owner, x, bn, convs: as :func:`fused_bn_relu_convs`.
        batch_mean_var: ``x``'s per-channel (mean, biased var), fp32, already computed by the
            producer's epilogue; used instead of a statistics pass when this BN normalizes with batch
            statistics on the non-synchronized Triton path (ignored otherwise).
        residual: added to ``convs[0]``'s output — in its epilogue on the Triton path when the dtypes
            agree and autocast is off, otherwise by a separate add.
        want_stats: also return the (mean, var) of ``convs[0]``'s output (plus residual) from its
            epilogue, for the BatchNorm that reads it next; only the Triton path provides them.

    Returns:
        ``(outputs, stats)``: the conv outputs in order, and the (K,) fp32 (mean, var) of
        ``outputs[0]`` or ``None`` when they were not asked for or this path cannot provide them.
    """
    _validate(x, bn, convs)
    requested = owner.backend
    conv_reasons = [r for c in convs for r in _conv_reasons(c)]
    if conv_reasons and requested not in ("auto", "reference"):
        raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this module: " + "; ".join(conv_reasons))
    conv_args = [(c.weight, c.stride, c.padding, c.dilation, c.groups) for c in convs]
    choice = select_backend("reference" if conv_reasons else requested, x, conv_args)
    reason = "; ".join(conv_reasons) if conv_reasons else choice.reason
    _record(owner, choice.name, reason, x)
    bn_training, eaf, running_mean, running_var = _bn_forward_args(bn)
    if sync_enabled(bn):
        stats = sync_bn_statistics(
            x, running_mean, running_var, eaf, bn.eps, bn.process_group, fused=choice.name != "reference"
        )
        if choice.name == "reference":
            shape = (1, -1, 1, 1)
            a = (x.float() - stats.mean.view(shape)) * stats.invstd.view(shape)
            if bn.weight is not None:
                a = a * bn.weight.float().view(shape) + bn.bias.float().view(shape)
            a = F.relu(a).to(x.dtype)
            return _add_residual([conv(a) for conv in convs], residual), None
    elif choice.name == "reference":
        a = F.relu(F.batch_norm(x, running_mean, running_var, bn.weight, bn.bias, bn_training, eaf, bn.eps))
        return _add_residual([conv(a) for conv in convs], residual), None
    else:
        given = batch_mean_var if bn_training and choice.name == "triton" else None
        stats = bn_statistics(x, running_mean, running_var, bn_training, eaf, bn.eps, batch_mean_var=given)
    epilogue_res = (
        residual is not None and residual.dtype == x.dtype and not torch.is_autocast_enabled(x.device.type)
    )
    # The statistics epilogue serves convs[0] when its output statistics are wanted and any residual
    # can be added in the same epilogue (otherwise they would describe the output without it).
    use_epilogue = choice.name == "triton" and (epilogue_res or (want_stats and residual is None))
    outs, out_stats = [], None
    for i, c in enumerate(convs):
        conv_args = (c.weight, c.bias, bn.weight, bn.bias, c.stride, c.padding, c.dilation, c.groups)
        if i == 0 and use_epilogue:
            y, y_mean, y_var = bn_relu_conv2d_with_stats_out(x, stats, *conv_args, residual=residual)
            out_stats = (y_mean, y_var) if want_stats else None
            residual = None  # added in the epilogue
        else:
            y = bn_relu_conv2d_with_stats(x, stats, *conv_args, choice.name)
        outs.append(y)
    return _add_residual(outs, residual), out_stats


def _add_residual(outs: list[torch.Tensor], residual: Optional[torch.Tensor]) -> list[torch.Tensor]:
    if residual is not None:
        outs[0] = outs[0] + residual
    return outs


def _record(owner: nn.Module, name: str, reason: Optional[str], x: torch.Tensor) -> None:
    if owner.last_backend != name or owner.fallback_reason != reason:
        owner.last_backend = name
        owner.fallback_reason = reason
        if reason is not None:
            msg = f"fused_preact: {type(owner).__name__} runs the {name} path: {reason}"
            if x.device.type == "cuda":
                warnings.warn(msg, stacklevel=3)
            else:
                logger.info(msg)


class _FusedBase(nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.last_backend: Optional[str] = None
        self.fallback_reason: Optional[str] = None

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"


def _bn(c, eps, momentum, affine=True, track_running_stats=True, **kw):
    return nn.BatchNorm2d(c, eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats, **kw)


def build_basic_layers(block: nn.Module, in_planes: int, planes: int, stride: int, eps: float,
                       momentum: Optional[float], **factory) -> None:
    """Give ``block`` the basic unit's children: ``bn1, conv1 (3×3, stride), bn2, conv2 (3×3), shortcut``.

    ``shortcut`` is a 1×1 strided conv (no BN) when the shape changes, else ``None``. Shared by the
    fused and the eager block so both have the same parameters in the same order.
    """
    block.bn1 = _bn(in_planes, eps, momentum, **factory)
    block.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False, **factory)
    block.bn2 = _bn(planes, eps, momentum, **factory)
    block.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False, **factory)
    block.shortcut = (
        nn.Conv2d(in_planes, planes, 1, stride, bias=False, **factory) if stride != 1 or in_planes != planes else None
    )


def bottleneck_width(planes: int, groups: int = 1, base_width: int = 64) -> int:
    """Channels of a bottleneck's 3×3 conv: ``⌊planes·base_width/64⌋·groups`` (ResNeXt, Xie et al. 2017,
    Table 1; torchvision's ``Bottleneck`` convention). ``groups=1, base_width=64`` gives ``planes``.

    Raises:
        ValueError: ``groups`` or ``base_width`` < 1, or a width of 0.
    """
    if groups < 1 or base_width < 1:
        raise ValueError(f"groups and base_width must be ≥ 1, got groups={groups}, base_width={base_width}")
    width = (planes * base_width // 64) * groups
    if width < 1:
        raise ValueError(f"bottleneck width is 0 for planes={planes}, base_width={base_width}")
    return width


def build_bottleneck_layers(block: nn.Module, in_planes: int, planes: int, stride: int, eps: float,
                            momentum: Optional[float], groups: int = 1, base_width: int = 64, **factory) -> None:
    """Give ``block`` the bottleneck's children: ``bn1, conv1 1×1, bn2, conv2 3×3 (stride, groups), bn3,
    conv3 1×1`` to ``4·planes``, and ``shortcut`` (1×1 strided conv when the shape changes, else
    ``None``). The inner width is :func:`bottleneck_width` (``planes`` for a ResNet, ResNeXt's
    ``groups × base_width`` cardinality otherwise)."""
    out_planes = planes * 4
    width = bottleneck_width(planes, groups, base_width)
    block.bn1 = _bn(in_planes, eps, momentum, **factory)
    block.conv1 = nn.Conv2d(in_planes, width, 1, bias=False, **factory)
    block.bn2 = _bn(width, eps, momentum, **factory)
    block.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False, **factory)
    block.bn3 = _bn(width, eps, momentum, **factory)
    block.conv3 = nn.Conv2d(width, out_planes, 1, bias=False, **factory)
    block.shortcut = (
        nn.Conv2d(in_planes, out_planes, 1, stride, bias=False, **factory) if stride != 1 or in_planes != out_planes
        else None
    )


def _block_forward(block: nn.Module, x: torch.Tensor, units: list[tuple[nn.BatchNorm2d, nn.Conv2d]],
                   x_stats: Optional[tuple[torch.Tensor, torch.Tensor]] = None, want_stats: bool = False):
    """A pre-activation block ``x + conv_n(…relu(bn_1(x))…)`` (shortcut: ``block.shortcut`` on the
    pre-activation, or the raw x). Each conv's epilogue computes the statistics of the next BN's
    input (when that BN uses batch statistics), and the last conv's epilogue adds the shortcut.

    ``x_stats``: x's (mean, var) from the previous block's epilogue, or None. Returns the output
    and, with ``want_stats``, its (mean, var) (None where the path cannot provide them)."""
    first_bn, first_conv = units[0]
    convs = [first_conv] + ([block.shortcut] if block.shortcut is not None else [])
    outs, stats = fused_bn_relu_convs_chained(
        block, x, first_bn, convs, batch_mean_var=x_stats, want_stats=_needs_batch_stats(units[1][0])
    )
    out, sc = outs[0], (outs[1] if block.shortcut is not None else x)
    for i, (bn, conv) in enumerate(units[1:], start=1):
        last = i == len(units) - 1
        want = want_stats if last else _needs_batch_stats(units[i + 1][0])
        (out,), stats = fused_bn_relu_convs_chained(
            block, out, bn, [conv], batch_mean_var=stats, residual=sc if last else None, want_stats=want
        )
    return out, stats


def run_blocks(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run consecutive residual blocks, handing each fused block's output statistics to the next.

    When a fused block is followed by another fused block whose bn1 normalizes with batch
    statistics, the last conv's epilogue of the first computes them (together with the residual
    add), so the second runs no statistics pass over its input. Blocks that are not fused, or that
    carry forward hooks (which must see a plain ``block(x)`` call), are called normally and break
    the chain. Same result as ``for b in blocks: x = b(x)``.

    Args:
        blocks: modules mapping (N, C, H, W) → (N, C', H', W'), e.g. a stage's ``nn.Sequential``.
        x: the first block's input.
    """
    hooked = bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    chained = [
        isinstance(b, (FusedPreActBlock, FusedPreActBottleneck)) and not (hooked or b._forward_hooks or b._forward_pre_hooks)
        for b in blocks
    ]
    stats = None
    for i, blk in enumerate(blocks):
        if not chained[i]:
            x, stats = blk(x), None
            continue
        want = i + 1 < len(blocks) and chained[i + 1] and _needs_batch_stats(blocks[i + 1].bn1)
        x, stats = _block_forward(blk, x, blk._units(), stats, want)
    return x


class FusedBNReLUConv2d(_FusedBase):
    """BatchNorm2d → ReLU → Conv2d as one fused module (a pre-activation unit's basic step).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias: as ``nn.Conv2d``.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d``.
        backend: ``"auto"``, ``"triton"``, ``"cuda"`` or ``"reference"`` (see ``fused_preact.dispatch``).
        device, dtype: factory kwargs for both children.

    Shapes: input (N, in_channels, H, W), NCHW or channels_last; output (N, out_channels, P, Q) in
    the input's memory format. dtypes: float32/float16/bfloat16 fused; float64 on the reference path.

    Attributes: ``bn`` (nn.BatchNorm2d), ``conv`` (nn.Conv2d); state_dict keys ``bn.weight``,
    ``bn.bias``, ``bn.running_mean``, ``bn.running_var``, ``bn.num_batches_tracked``, ``conv.weight``
    (and ``conv.bias``).

    Raises (in forward): ValueError for non-4D input or one value per channel in training;
    RuntimeError for a wrong channel count or a forced backend that cannot serve the input.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__(backend)
        kw = dict(device=device, dtype=dtype)
        self.bn = _bn(in_channels, eps, momentum, affine, track_running_stats, **kw)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, **kw)

    @classmethod
    def from_modules(cls, bn: nn.BatchNorm2d, conv: nn.Conv2d, backend: str = "auto") -> "FusedBNReLUConv2d":
        """Wrap existing ``bn`` and ``conv`` modules (shared, not copied) into a fused module."""
        mod = cls.__new__(cls)
        _FusedBase.__init__(mod, backend)
        mod.bn = bn
        mod.conv = conv
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_bn_relu_convs(self, x, self.bn, [self.conv])[0]


class FusedPreActBlock(_FusedBase):
    """Full pre-activation basic block (He et al. 2016, Fig. 4(e)): ``x + conv2(relu(bn2(conv1(relu(bn1(x))))))``.

    Args:
        in_planes: input channels. planes: output channels (``expansion = 1``).
        stride: stride of conv1 and of the projection shortcut.
        eps, momentum: of both BatchNorms. backend: see ``fused_preact.dispatch``.

    Attributes: ``bn1``, ``conv1`` (3×3, stride), ``bn2``, ``conv2`` (3×3), and ``shortcut``: a 1×1
    conv with the block's stride (no BN) when the shape changes, otherwise ``None``.

    Shortcut rule: the projection reads the pre-activated input ``relu(bn1(x))`` (the paper's code,
    timm ``resnetv2``, kuangliu's CIFAR code); the identity shortcut reads the raw ``x``. Some
    published snippets take the identity from the pre-activated tensor, which puts BN and ReLU on the
    skip path and breaks the clean identity propagation the paper is about (§3). bn1's statistics are
    computed once and feed both conv1 and the projection.

    Shapes: (N, in_planes, H, W) → (N, planes, ⌈H/stride⌉, ⌈W/stride⌉).
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 backend: str = "auto", device=None, dtype=None):
        super().__init__(backend)
        build_basic_layers(self, in_planes, planes, stride, eps, momentum, device=device, dtype=dtype)

    def _units(self) -> list[tuple[nn.BatchNorm2d, nn.Conv2d]]:
        return [(self.bn1, self.conv1), (self.bn2, self.conv2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _block_forward(self, x, self._units())[0]


class FusedPreActBottleneck(_FusedBase):
    """Full pre-activation bottleneck block (He et al. 2016, Fig. 4(e); expansion 4).

    ``x + conv3(relu(bn3(conv2(relu(bn2(conv1(relu(bn1(x)))))))))`` with conv1 1×1, conv2 3×3
    (stride), conv3 1×1 to ``4·planes``; ``shortcut`` is a 1×1 strided conv on the pre-activated
    input when the shape changes, else ``None`` (identity on raw x) — the same rule as
    :class:`FusedPreActBlock`.

    Args: in_planes, planes (output has ``4·planes`` channels), stride, eps, momentum, backend as
    :class:`FusedPreActBlock`; ``groups`` and ``base_width`` make it a ResNeXt bottleneck (grouped
    3×3 conv of width ``⌊planes·base_width/64⌋·groups``, Xie et al. 2017).
    Shapes: (N, in_planes, H, W) → (N, 4·planes, ⌈H/stride⌉, ⌈W/stride⌉).
    """

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 backend: str = "auto", groups: int = 1, base_width: int = 64, device=None, dtype=None):
        super().__init__(backend)
        build_bottleneck_layers(self, in_planes, planes, stride, eps, momentum, groups, base_width,
                                device=device, dtype=dtype)

    def _units(self) -> list[tuple[nn.BatchNorm2d, nn.Conv2d]]:
        return [(self.bn1, self.conv1), (self.bn2, self.conv2), (self.bn3, self.conv3)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _block_forward(self, x, self._units())[0]


def convert_sync_batchnorm(model: nn.Module, process_group=None) -> nn.Module:
    """Turn every BatchNorm of ``model`` (fused modules included) into ``nn.SyncBatchNorm``.

    This is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (same arguments, same result), given
    here so the contract is explicit: the fused modules hold their BatchNorms as plain children, so
    the converter swaps those children for ``nn.SyncBatchNorm`` and leaves the fused modules in
    place; their forward then sees a SyncBatchNorm and synchronizes the statistics over its
    ``process_group`` (all-gather of (count, mean, var) in forward, all-reduce of the statistics'
    gradients in backward). Calling torch's converter directly is therefore equally safe: it cannot
    silently turn a fused model back into an unsynchronized or unfused one.

    Args:
        model: any module tree. process_group: group to synchronize over (``None``: default group).

    Returns:
        ``model`` itself if it is not a BatchNorm, else its SyncBatchNorm replacement (as torch).
    """
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
