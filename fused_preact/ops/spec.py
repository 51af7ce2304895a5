"""What a fused chain computes, independent of any backend: the structure (:class:`ChainSpec`), the
BatchNorm behaviour per unit (:class:`BNMode`), the per-call tensors (:class:`ChainTensors`) and the
validation every backend shares.

A chain is the residual branch of a pre-activation block, or a single unit::

    y_0 = conv_0(relu(bn_0(x)));  y_i = conv_i(relu(bn_i(y_{i-1})))           (i = 1 … n−1)
    out = y_{n−1} [+ proj(relu(bn_0(x)))]  [+ x | + r]

``proj`` is a 1×1 projection shortcut on the pre-activation of the chain input (He et al. 2016 §4;
timm ``resnetv2``), either added to the output (``proj_out="add"``) or returned beside it
(``"return"``, for a caller that applies e.g. DropPath to the branch only). The residual is the raw
chain input (``"input"``: the identity shortcut) or any tensor of the output's shape (``"tensor"``).
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from fused_preact.ops._common import autocast_enabled, conv_out_size, pair

__all__ = ["ConvGeom", "ChainSpec", "BNKind", "BNMode", "ChainTensors", "UnitTensors", "GRAD_FIELDS", "OP_FIELDS",
           "CHAIN_FIELDS", "StatsHandoff", "SavedChain", "ChainForward",
           "GradNeeds", "ChainGrads", "BATCH", "RUNNING", "EXTERNAL", "validate_chain", "chain_shapes",
           "add_shortcut", "projection_problem", "check_running_buffers"]

class BNKind(IntEnum):
    """Where a unit's BatchNorm takes its statistics from (the kernels receive the int)."""

    BATCH = 0     #: this batch's (training)
    RUNNING = 1   #: the running buffers (eval)
    EXTERNAL = 2  #: given from outside (synchronized BN; their gradients are returned, not folded into dx)


BATCH, RUNNING, EXTERNAL = BNKind.BATCH, BNKind.RUNNING, BNKind.EXTERNAL


@dataclasses.dataclass(frozen=True)
class ConvGeom:
    """One convolution's hyper-parameters, as ``nn.Conv2d`` holds them (padding as explicit ints)."""

    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = False

    @classmethod
    def of(cls, conv: nn.Conv2d) -> "ConvGeom":
        """The geometry ``nn.Conv2d.forward`` uses: channels and kernel from the weight's shape (a replaced
        or pruned weight defines the conv, as ``F.conv2d`` reads it), stride, padding, dilation and groups
        from the module (string padding is not accepted: callers check first)."""
        w = conv.weight
        # an int or a 1-tuple set on the module after construction: F.conv2d expands it
        stride, padding, dilation = (pair(conv.stride, "stride"), pair(conv.padding, "padding"),
                                     pair(conv.dilation, "dilation"))
        if w.dim() != 4:  # refused with a clear error by the input checks
            return cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), stride, padding, dilation,
                       conv.groups, conv.bias is not None)
        return cls(w.shape[1] * conv.groups, w.shape[0], (w.shape[2], w.shape[3]), stride, padding, dilation,
                   conv.groups, conv.bias is not None)

    @classmethod
    def from_args(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], stride, padding, dilation,
                  groups: int) -> "ConvGeom":
        """The geometry of an ``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` call;
        ``padding="valid"``/``"same"`` as ``F.conv2d`` takes them.

        Raises:
            RuntimeError: a weight that is not 4-D; ``"same"`` with a stride (``F.conv2d``'s error) or
                with an odd total padding (eager pads one side more; the kernels pad symmetrically).
        """
        _check_weight_4d(weight)
        kernel, stride, dilation = (weight.shape[2], weight.shape[3]), pair(stride, "stride"), pair(dilation, "dilation")
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise RuntimeError("padding='same' is not supported for strided convolutions")
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if total[0] % 2 or total[1] % 2:
                raise RuntimeError(f"fused_preact: padding='same' for kernel {list(kernel)} and dilation "
                                   f"{list(dilation)} pads one side more (give explicit ints, or use F.conv2d)")
            padding = (total[0] // 2, total[1] // 2)
        return cls(weight.shape[1] * groups, weight.shape[0], kernel, stride, pair(padding, "padding"), dilation,
                   groups, bias is not None)

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        return (conv_out_size(h, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0]),
                conv_out_size(w, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1]))


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """The structure of a chain (see the module docstring). Hashable: plans are cached on it.

    Attributes:
        convs: the convolutions in order; ``convs[i]`` reads ``relu(bn_i(input_i))``.
        proj: a 1×1, groups=1, bias-free projection shortcut on ``relu(bn_0(x))``, or None.
        proj_out: ``"add"`` (added to the output) or ``"return"`` (a second output).
        residual: ``"none"``, ``"input"`` (add x) or ``"tensor"`` (add a given tensor r).
    """

    convs: tuple[ConvGeom, ...]
    proj: Optional[ConvGeom] = None
    proj_out: str = "add"
    residual: str = "none"


@dataclasses.dataclass(frozen=True)
class BNMode:
    """How one unit's BatchNorm behaves in this call (``nn.BatchNorm2d.forward``'s decisions).

    Attributes:
        kind: a :class:`BNKind` (:data:`BATCH`, :data:`RUNNING` or :data:`EXTERNAL`; an int is converted).
        affine: has γ and β.
        update: training with running buffers: they are updated (and ``num_batches_tracked`` counted).
        cumulative: ``momentum=None``: the average factor is ``1/num_batches_tracked``.
    """

    kind: BNKind
    affine: bool = True
    update: bool = False
    cumulative: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kind", BNKind(self.kind))


class StatsHandoff(NamedTuple):
    """Partial statistics of a tensor, written by the epilogue of the conv that produced it.

    Attributes:
        part: (num_parts, 2, C) fp32 view: per tile, the mean and M2 (Σ(v − mean)²) of its rows.
        rows: rows per tile (the last tile holds ``count − (num_parts − 1)·rows``).
        count: total rows (N·H·W of the tensor).
    """

    part: torch.Tensor
    rows: int
    count: int


def _updated(obj, changes):
    """A shallow copy of the dataclass ``obj`` with the (field, value) ``changes``, built without
    ``__init__`` (``dataclasses.replace`` costs twice as much, and :meth:`ChainTensors.unflatten` runs on
    every fused call; neither class validates in ``__init__``)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclasses.dataclass
class UnitTensors:
    """One unit's tensors (None where absent), named as ``nn.Conv2d`` and ``nn.BatchNorm2d`` name them.

    Attributes:
        weight: conv_i's weight (K, C/groups, R, S). bias: its bias (K,).
        gamma, beta: bn_i's affine weight and bias (C,). running_mean, running_var: its running
            buffers (C,). num_batches: its ``num_batches_tracked`` (0-d int64), where it is counted.
        momentum: bn_i's momentum (unused when cumulative, ``momentum=None``). eps: bn_i's eps.
    """

    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    gamma: Optional[torch.Tensor] = None
    beta: Optional[torch.Tensor] = None
    running_mean: Optional[torch.Tensor] = None
    running_var: Optional[torch.Tensor] = None
    num_batches: Optional[torch.Tensor] = None
    momentum: Optional[float] = 0.1
    eps: float = 1e-5


#: The per-unit fields that take gradients, in the order of every flat list of a chain's tensors.
GRAD_FIELDS = ("weight", "bias", "gamma", "beta")
#: The per-unit tensors the custom ops of :mod:`fused_preact.ops.library` take: those and the running buffers.
OP_FIELDS = GRAD_FIELDS + ("running_mean", "running_var")
#: The chain-level tensors, after the units' in a flat list.
CHAIN_FIELDS = ("proj_weight", "residual", "ext_mean", "ext_invstd")


@dataclasses.dataclass
class ChainTensors:
    """The tensors of one call: one :class:`UnitTensors` per unit, plus chain-level extras.

    Attributes:
        units: per unit i, conv_i's and bn_i's tensors.
        proj_weight: (K', C0, 1, 1), the projection shortcut's. residual: the ``r`` of
            ``residual="tensor"``. ext_mean, ext_invstd: (C0,) fp32 statistics of an EXTERNAL bn_0.
        in_stats: a :class:`StatsHandoff` of x for a BATCH bn_0 (skips the statistics pass).

    :meth:`flatten` and :meth:`unflatten` are the one map between this and the flat tensor lists of
    autograd and the custom ops: per unit the chosen fields, then :data:`CHAIN_FIELDS`.
    """

    units: list
    proj_weight: Optional[torch.Tensor] = None
    residual: Optional[torch.Tensor] = None
    ext_mean: Optional[torch.Tensor] = None
    ext_invstd: Optional[torch.Tensor] = None
    in_stats: Optional[StatsHandoff] = None

    def flatten(self, fields: tuple[str, ...] = GRAD_FIELDS) -> list:
        """Per unit its ``fields`` in order, then :data:`CHAIN_FIELDS`: ``len(fields)·n + 4`` entries."""
        return [getattr(u, f) for u in self.units for f in fields] + [getattr(self, f) for f in CHAIN_FIELDS]

    def unflatten(self, flat, fields: tuple[str, ...] = GRAD_FIELDS) -> "ChainTensors":
        """A copy of this with the entries of :meth:`flatten` (same ``fields``) taken from ``flat``; the
        other fields stay. Raises ValueError when ``flat`` has not ``len(fields)·n + 4`` entries."""
        k, n = len(fields), len(self.units)
        flat = list(flat)
        if len(flat) != k * n + len(CHAIN_FIELDS):
            raise ValueError(f"ChainTensors.unflatten: {len(flat)} entries for {n} units of {k} fields and "
                             f"{len(CHAIN_FIELDS)} chain tensors")
        units = [_updated(u, zip(fields, flat[k * i:k * (i + 1)])) for i, u in enumerate(self.units)]
        return _updated(self, [("units", units), *zip(CHAIN_FIELDS, flat[k * n:])])

    @classmethod
    def empty(cls, n: int) -> "ChainTensors":
        """n units with every field at its default (to :meth:`unflatten` into)."""
        return cls([UnitTensors() for _ in range(n)])


@dataclasses.dataclass
class SavedChain:
    """What a fused plan's forward keeps for its backward (nothing else of the forward survives).

    Attributes:
        inputs: every unit's input: the chain input x as given, then the intermediates (the plan's
            layout, e.g. flat NHWC in the compute dtype).
        aux: the plan's per-unit per-channel buffers (fp32 (C,)-sized regions: statistics, scale/shift,
            partial sums), views of ``aux_base`` where the plan allocates them in one buffer.
        aux_base: that buffer, or None.
    """

    inputs: list
    aux: list
    aux_base: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ChainForward:
    """What a plan's forward returns.

    Attributes:
        out: (N, K, P, Q) chain output, in the input's memory format.
        proj_out: the projection's output when ``spec.proj_out == "return"``, else None.
        saved: the :class:`SavedChain` for the backward.
        stats: the output's partial statistics when the plan was built with ``out_stats``, else None.
    """

    out: torch.Tensor
    proj_out: Optional[torch.Tensor]
    saved: SavedChain
    stats: Optional[StatsHandoff] = None


@dataclasses.dataclass(frozen=True)
class GradNeeds:
    """Which gradients a backward must produce (autograd's ``needs_input_grad``, per unit).

    Attributes:
        dx: the chain input's. weights, biases: per unit, the conv weight's and bias's.
        bn_dtypes: per unit, the dtype of γ's and β's gradients, or None where they are not wanted.
        proj_weight: the projection shortcut's weight's.
    """

    dx: bool
    weights: tuple
    biases: tuple
    bn_dtypes: tuple
    proj_weight: bool = False


@dataclasses.dataclass
class ChainGrads:
    """Gradients of a chain (None where not wanted).

    Attributes:
        dx: like the chain input. units: per unit, a :class:`UnitTensors` whose weight, bias, gamma
            and beta are the gradients of conv_i's and bn_i's. proj_weight: the projection weight's.
        ext_stats: for an EXTERNAL bn_0, (∂L/∂mean, ∂L/∂invstd), each (C,) fp32.
    """

    dx: Optional[torch.Tensor]
    units: list
    proj_weight: Optional[torch.Tensor] = None
    ext_stats: Optional[tuple] = None

    @classmethod
    def empty(cls, n: int, dx: Optional[torch.Tensor] = None) -> "ChainGrads":
        """``dx`` and n units without gradients (to be filled in)."""
        return cls(dx, [UnitTensors(momentum=None, eps=0.0) for _ in range(n)])

    def alloc_bn(self, channels, bn_dtypes, device: torch.device) -> None:
        """Give each unit i whose ``bn_dtypes[i]`` is not None empty (``channels[i]``,) γ and β gradient
        buffers of that dtype: views of one buffer when the dtypes agree (one allocation)."""
        wanted = [i for i, d in enumerate(bn_dtypes) if d is not None]
        if not wanted:
            return
        sizes = [channels[i] for i in wanted for _ in range(2)]
        if len({bn_dtypes[i] for i in wanted}) == 1:
            views = iter(torch.empty(sum(sizes), device=device, dtype=bn_dtypes[wanted[0]]).split(sizes))
            for i in wanted:
                self.units[i].gamma, self.units[i].beta = next(views), next(views)
        else:
            for i in wanted:
                self.units[i].gamma = torch.empty(channels[i], device=device, dtype=bn_dtypes[i])
                self.units[i].beta = torch.empty(channels[i], device=device, dtype=bn_dtypes[i])

    def flatten(self, residual: Optional[torch.Tensor] = None, fields: tuple[str, ...] = GRAD_FIELDS) -> list:
        """The gradients in the order of :meth:`ChainTensors.flatten` (``residual``: the residual
        tensor's gradient)."""
        mean, invstd = self.ext_stats if self.ext_stats is not None else (None, None)
        return ChainTensors(self.units, self.proj_weight, residual, mean, invstd).flatten(fields)


def chain_shapes(spec: ChainSpec, x_shape) -> list[tuple[int, int, int, int]]:
    """(N, C, H, W) of every unit's input followed by the chain output's, for an input of ``x_shape``."""
    N, C, H, W = x_shape
    shapes = [(N, C, H, W)]
    for g in spec.convs:
        H, W = g.out_hw(H, W)
        shapes.append((N, g.out_channels, H, W))
    return shapes


def validate_chain(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...]) -> None:
    """Check a chain call before anything runs or any buffer changes, with PyTorch's messages and
    exception types (those of ``F.batch_norm`` and ``F.conv2d``).

    Raises:
        ValueError: x not 4-D; training with one value per channel; ``eps`` ≤ 0 in training or < 0 in
            eval; malformed geometry.
        RuntimeError: non-floating x; channel mismatch; groups not dividing channels; tensors on other
            devices; a dtype mismatch (under autocast: a float64 tensor among the others); output size ≤ 0;
            an empty image (H or W = 0) in a non-empty batch, as ``F.conv2d``; residual of the wrong shape.
    """
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    if not x.is_floating_point():
        raise RuntimeError(f"fused_preact: expected a floating-point input, got {x.dtype}")
    autocast = torch.get_autocast_dtype(x.device.type) if autocast_enabled(x.device.type) else None
    shape = tuple(x.shape)
    shapes = [shape]
    for i, (g, u) in enumerate(zip(spec.convs, t.units)):
        n, c, h, wd = shape
        # BatchNorm first, as eager PyTorch meets it first.
        for name, vec in (("running_mean", u.running_mean), ("running_var", u.running_var),
                          ("weight", u.gamma), ("bias", u.beta)):
            if vec is not None and vec.numel() != c:
                raise RuntimeError(f"{name} should contain {c} elements not {vec.numel()} (the BatchNorm before "
                                   f"conv {i} has {vec.numel()} features, its input {c} channels)")
        if modes[i].kind == BATCH and n * h * wd == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size "
                             f"{torch.Size(shape)}")
        if modes[i].kind == BATCH and not u.eps > 0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {u.eps}")
        if modes[i].kind == RUNNING and u.eps < 0:
            raise ValueError(f"batch_norm eps must be non-negative, but got {u.eps}")
        _check_conv(x, g, u.weight, u.bias, c, h, wd, shape, autocast)
        if n > 0 and c > 0 and h * wd == 0:  # F.conv2d's check (a padded empty image has an output)
            raise RuntimeError(f"Only zero batch or zero channel inputs are supported, but got input shape: "
                               f"{list(shape)}")
        shape = (n, g.out_channels, *g.out_hw(h, wd))
        shapes.append(shape)
    if spec.proj is not None:
        _check_conv(x, spec.proj, t.proj_weight, None, shapes[0][1], shapes[0][2], shapes[0][3], shapes[0], autocast)
        if spec.proj_out == "add" and (spec.proj.out_hw(shapes[0][2], shapes[0][3]) != tuple(shapes[-1][2:])
                                       or spec.proj.out_channels != shapes[-1][1]):
            raise RuntimeError(f"fused_preact: the projection shortcut's output does not match the branch output "
                               f"{list(shapes[-1])}")
    if spec.residual == "input" and tuple(shapes[0][1:]) != tuple(shapes[-1][1:]):
        raise RuntimeError(f"The size of tensor a ({shapes[-1][1]}) must match the size of tensor b ({shapes[0][1]}): "
                           f"identity shortcut of input {list(shapes[0])} onto output {list(shapes[-1])}")
    if spec.residual == "tensor":
        r = t.residual
        if tuple(r.shape) != tuple(shapes[-1]):
            raise RuntimeError(f"fused_preact: residual of shape {list(r.shape)} cannot be added to the output "
                               f"{list(shapes[-1])}")
        if r.device != x.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{x.device} and {r.device}! (residual)")


def projection_problem(conv: nn.Conv2d) -> Optional[str]:
    """Why ``conv`` cannot be a chain's projection shortcut (:attr:`ChainSpec.proj`: the kernels read tap
    (0, 0) of a bias-free, unpadded, groups=1 conv with one stride for both axes), or None."""
    kernel = tuple(conv.weight.shape[2:]) if conv.weight.dim() == 4 else tuple(conv.kernel_size)
    stride = pair(conv.stride, "stride")
    problems = [what for what, bad in (
        (f"kernel {list(kernel)}", kernel != (1, 1)),
        (f"padding {conv.padding!r}", isinstance(conv.padding, str) or pair(conv.padding, "padding") != (0, 0)),
        (f"groups={conv.groups}", conv.groups != 1),
        ("a bias", conv.bias is not None),
        (f"stride {list(stride)}", stride[0] != stride[1]),
        (f"padding_mode={conv.padding_mode!r}", conv.padding_mode != "zeros")) if bad]
    if not problems:
        return None
    return (f"projection shortcut with {', '.join(problems)} (the fused chains take a bias-free 1×1, groups=1, "
            "unpadded one with equal strides)")


def functorch_reasons() -> list[str]:
    """``[why]`` while a ``torch.func`` transform (vmap, grad, jacrev, …) runs, else ``[]``: the fused
    ops are autograd Functions without functorch rules (``setup_context``/``vmap``), so under a
    transform the plain PyTorch ops run instead (what eager computes: eval mode works; training mode
    raises there as eager's in-place running-statistics update does). Not checked while
    ``torch.compile`` traces: a transform applied inside a compiled function still reaches the
    custom ops, which have no batching rule, and raises."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return []
    return ["a torch.func transform is active (the fused autograd Functions have no functorch rules)"]


def trace_reasons(x: torch.Tensor) -> list[str]:
    """``[why]`` while a tracer the fused path cannot serve records the call, else ``[]``; the plain
    PyTorch ops then run, which every tracer records (with their checks and messages):

    - ``torch.jit.trace``: it records the ATen ops a call runs; the fused kernels' launches would
      receive its traced sizes (0-d tensors) as arguments;
    - x's sizes symbolic outside Dynamo (``torch.export`` with a dynamic dimension, ``make_fx``): the
      fused plans are built for concrete sizes. Under ``torch.compile`` (Dynamo) the fused custom ops
      take the sizes Dynamo specializes, as before."""
    if torch.jit.is_tracing():
        return ["torch.jit.trace records the call (the fused launches cannot be traced)"]
    if not torch.compiler.is_dynamo_compiling() and any(isinstance(d, torch.SymInt) for d in x.shape):
        return [f"symbolic sizes {list(x.shape)} (e.g. torch.export with a dynamic dimension): the fused plans "
                "take concrete sizes"]
    return []


def check_running_buffers(training: bool, running_mean: Optional[torch.Tensor],
                          running_var: Optional[torch.Tensor]) -> None:
    """``F.batch_norm``'s checks of its running buffers, in its order and with its messages.

    Args:
        training: ``F.batch_norm``'s ``training`` (``nn.BatchNorm2d`` passes True in eval mode when it
            has neither buffer).
        running_mean, running_var: the buffers passed (``nn.BatchNorm2d`` passes None for both in
            training without ``track_running_stats``).

    Raises:
        ValueError: training with only one of the buffers.
        RuntimeError: not training and a buffer is None.
    """
    if training and (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be None")
    if not training:
        for name, buf in (("running_mean", running_mean), ("running_var", running_var)):
            if buf is None:
                raise RuntimeError(f"{name} must be defined in evaluation mode")


def _check_weight_4d(weight: torch.Tensor) -> None:
    if weight.dim() != 4:
        raise RuntimeError(f"fused_preact: expected a 4D conv weight (K, C/groups, R, S), got shape {list(weight.shape)}")


def _check_conv(x, g: ConvGeom, weight, bias, C, H, W, in_shape, autocast: Optional[torch.dtype]) -> None:
    # Under autocast (its dtype given) the conv sees every floating tensor but a float64 one in that dtype.
    def seen(dt):
        return dt if autocast is None or dt == torch.float64 else autocast

    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.device != x.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{x.device} and {t.device}! ({name})")
        if seen(t.dtype) != seen(x.dtype):
            raise RuntimeError(f"Input type ({seen(x.dtype)}) and {name} type ({seen(t.dtype)}) should be the same")
    _check_weight_4d(weight)
    if weight.shape[0] < 1:
        raise RuntimeError(f"Given groups={g.groups}, expected weight to be at least 1 at dimension 0, but got weight "
                           f"of size {list(weight.shape)} instead")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise RuntimeError(f"Given weight of size {list(weight.shape)}, expected bias to be 1-dimensional with "
                           f"{weight.shape[0]} elements, but got bias of size {list(bias.shape)} instead")
    groups = g.groups
    # F.conv2d's checks, in its order and with its messages
    if groups < 1:
        raise RuntimeError("non-positive groups is not supported")
    if min(g.padding) < 0:
        raise RuntimeError("negative padding is not supported")
    if min(g.stride) < 1:
        raise RuntimeError("non-positive stride is not supported")
    if min(g.dilation) < 1:
        raise RuntimeError("non-positive dilation is not supported")
    if C % groups or weight.shape[0] % groups or weight.shape[1] * groups != C:
        raise RuntimeError(
            f"Given groups={groups}, weight of size {list(weight.shape)}, expected input{list(in_shape)} to have "
            f"{weight.shape[1] * groups} channels, but got {C} channels instead")
    padded = (H + 2 * g.padding[0], W + 2 * g.padding[1])
    span = tuple(d * (k - 1) + 1 for d, k in zip(g.dilation, g.kernel))
    if padded[0] < span[0] or padded[1] < span[1]:
        raise RuntimeError(f"Calculated padded input size per channel: ({padded[0]} x {padded[1]}). Kernel size: "
                           f"({span[0]} x {span[1]}). Kernel size can't be greater than actual input size")


def add_shortcut(spec: ChainSpec, h: torch.Tensor, p: Optional[torch.Tensor], x: torch.Tensor,
                 t: ChainTensors) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chain's tail in ATen, for backends without epilogue fusions: given the branch output ``h``
    and the projection's output ``p`` (or None), return ``(out, proj_out)`` per ``spec``."""
    proj_out = None
    if p is not None:
        if spec.proj_out == "add":
            h = h + p
        else:
            proj_out = p
    if spec.residual == "input":
        h = h + x
    elif spec.residual == "tensor":
        h = h + t.residual
    return h, proj_out
