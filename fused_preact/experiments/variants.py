"""The residual-unit and shortcut variants that He et al. compare, as eager PyTorch modules.

Source: He, Zhang, Ren, Sun, "Identity Mappings in Deep Residual Networks", ECCV 2016
(arXiv:1603.05027). A residual unit computes (Eq. (1)–(2))

    y_l = h(x_l) + F(x_l, W_l),        x_{l+1} = f(y_l),

and the paper varies the shortcut ``h`` (§3, Fig. 2, Table 1) and where the activations sit
(§4, Fig. 4, Table 2). Both axes are exposed here so one training script can reproduce both tables.

Units (Fig. 4), each in a basic form (two 3×3 convs) and a bottleneck form (1×1, 3×3, 1×1 with
expansion 4, stride on the 3×3), written for the identity shortcut:

    (a) ``original``          x_{l+1} = ReLU(x + BN(W2 ReLU(BN(W1 x))))
    (b) ``bn_after_add``      x_{l+1} = ReLU(BN(x + W2 ReLU(BN(W1 x))))
    (c) ``relu_before_add``   x_{l+1} = x + ReLU(BN(W2 ReLU(BN(W1 x))))
    (d) ``relu_only_preact``  x_{l+1} = x + BN(W2 ReLU(BN(W1 ReLU(x))))
    (e) ``full_preact``       x_{l+1} = x + W2 ReLU(BN(W1 ReLU(BN(x))))

Shortcuts (Fig. 2, Table 1), with ``P`` the shortcut path (``x``, or the 1×1 projection ``W_s s`` at a
stage transition) and ``s`` what a projection reads (below):

    ``identity``              y = P + F                                   (Eq. (3), Fig. 2(a))
    ``constant_scaling``      y = λ·P + (1−λ)·F, or λ·P + F               (Eq. (6), Fig. 2(b))
    ``exclusive_gating``      y = (1−g(x))·P + g(x)·F,  g(x) = σ(W_g x + b_g)   (Fig. 2(c))
    ``shortcut_only_gating``  y = (1−g(x))·P + F                          (Fig. 2(d))
    ``conv1x1``               y = W_s s + F  (1×1 conv shortcut in every unit)  (Fig. 2(e))
    ``dropout``               y = m ⊙ P + F,  m ~ Bernoulli(1−p)          (Fig. 2(f))

Choices the paper leaves open, fixed here and documented on the classes:

* Stage transitions (stride 2 and/or a width change) need a projection in every variant: a 1×1
  conv with the unit's stride, no BN, exactly the projection of :mod:`fused_preact.modules`. In
  pre-activation units (d), (e) it reads the pre-activated input (ReLU(x), resp. ReLU(BN(x))), as
  in the paper's code and the fused blocks; in post-activation units (a)–(c) it reads ``x``. The
  ``conv1x1`` shortcut uses that same 1×1 conv in every unit.
* The gate ``g(x)`` reads the unit's raw input ``x`` (the paper's definition), is a 1×1 conv with
  bias and one output per channel and pixel, with the unit's stride.
* The dropout shortcut keeps each element with probability ``1−p`` *without* rescaling: the
  paper's point (§3.1) is that it imposes, statistically, a scale λ with expectation 0.5 on the
  shortcut, which inverted dropout (PyTorch's ``nn.Dropout``) would undo; in eval mode the
  shortcut is multiplied by that expectation ``1−p``.
* Networks (§4.1 and He et al. 2015 §4.2): units (a)–(c) are the original ResNet, with
  conv → BN → ReLU as stem and no activation after the last unit; pre-activation units (d), (e)
  follow :class:`fused_preact.models.PreActResNet`: the stem is a conv only and the last unit is
  followed by the unit's own activation (ReLU for (d), BN → ReLU for (e)) before pooling. As
  there, the first unit's identity shortcut reads the raw stem output (the paper instead applies
  the first unit's activation before the split, §4.1; for bottlenecks the first unit projects, so
  the two agree).

Full pre-activation with the identity shortcut is the fused network of :mod:`fused_preact.models`;
:func:`preact_resnet_cifar_variant` returns exactly that model for it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "UNITS",
    "SHORTCUTS",
    "SHORTCUT_OPTIONS",
    "OriginalUnit",
    "BNAfterAdditionUnit",
    "ReLUBeforeAdditionUnit",
    "ReLUOnlyPreActUnit",
    "FullPreActUnit",
    "UNIT_CLASSES",
    "ResNetVariant",
    "preact_resnet_cifar_variant",
]

#: Residual-unit names, in the order of the paper's Fig. 4 (a)–(e).
UNITS: tuple[str, ...] = ("original", "bn_after_add", "relu_before_add", "relu_only_preact", "full_preact")

#: Shortcut names, in the order of the paper's Fig. 2 (a)–(f).
SHORTCUTS: tuple[str, ...] = (
    "identity", "constant_scaling", "exclusive_gating", "shortcut_only_gating", "conv1x1", "dropout",
)

#: Keyword options each shortcut accepts, with their defaults (the paper's settings).
SHORTCUT_OPTIONS: dict[str, dict[str, object]] = {
    "identity": {},
    "constant_scaling": {"scale": 0.5, "scale_residual": True},
    "exclusive_gating": {"gate_bias": -6.0},
    "shortcut_only_gating": {"gate_bias": -6.0},
    "conv1x1": {},
    "dropout": {"p": 0.5},
}


def _check_name(kind: str, name: str, valid: tuple[str, ...]) -> None:
    if name not in valid:
        raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(valid)}")


def _shortcut_options(shortcut: str, options: dict) -> dict:
    """Merge ``options`` into the shortcut's defaults, rejecting unknown keys and bad values."""
    _check_name("shortcut", shortcut, SHORTCUTS)
    allowed = SHORTCUT_OPTIONS[shortcut]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise TypeError(f"shortcut {shortcut!r} got unexpected option(s) {unknown}; accepted: {accepted}")
    merged = {**allowed, **options}
    if shortcut == "dropout" and not 0.0 <= float(merged["p"]) < 1.0:
        raise ValueError(f"dropout shortcut needs 0 <= p < 1, got p={merged['p']}")
    return merged


def _conv_specs(in_planes: int, planes: int, stride: int, bottleneck: bool) -> list[tuple[int, int, int, int]]:
    """(in, out, kernel, stride) of each weight layer of the residual function F."""
    if bottleneck:
        return [(in_planes, planes, 1, 1), (planes, planes, 3, stride), (planes, 4 * planes, 1, 1)]
    return [(in_planes, planes, 3, stride), (planes, planes, 3, 1)]


class _ResidualUnit(nn.Module):
    """Shared construction and shortcut merging; subclasses define the residual function's layout.

    Children, in registration order: the weight layers ``conv1``, ``conv2`` (, ``conv3``) and
    their BatchNorms (``bn1``, …, see each subclass), ``shortcut`` (1×1 conv or ``None``) and
    ``gate`` (1×1 conv with bias, gating shortcuts only, else ``None``).
    """

    unit: str = ""
    #: whether a projection shortcut reads the pre-activated input (units (d), (e)) or ``x``
    preact: bool = False

    def __init__(self, in_planes: int, planes: int, stride: int = 1, bottleneck: bool = False,
                 shortcut: str = "identity", eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 device=None, dtype=None, **shortcut_options):
        super().__init__()
        opts = _shortcut_options(shortcut, shortcut_options)
        factory = dict(device=device, dtype=dtype)
        self.in_planes = in_planes
        self.planes = planes
        self.stride = stride
        self.bottleneck = bottleneck
        self.expansion = 4 if bottleneck else 1
        self.out_planes = planes * self.expansion
        self.shortcut_kind = shortcut
        self.scale = float(opts.get("scale", 1.0))
        self.scale_residual = bool(opts.get("scale_residual", False))
        self.p = float(opts.get("p", 0.0))
        self.num_convs = 0
        self._build(_conv_specs(in_planes, planes, stride, bottleneck), eps, momentum, factory)
        needs_projection = shortcut == "conv1x1" or stride != 1 or in_planes != self.out_planes
        self.shortcut = (
            nn.Conv2d(in_planes, self.out_planes, 1, stride, bias=False, **factory) if needs_projection else None
        )
        self.gate: Optional[nn.Conv2d] = None
        if shortcut in ("exclusive_gating", "shortcut_only_gating"):
            self.gate = nn.Conv2d(in_planes, self.out_planes, 1, stride, bias=True, **factory)
            nn.init.constant_(self.gate.bias, float(opts["gate_bias"]))

    def _build(self, specs, eps, momentum, factory) -> None:
        """Post-activation layout (units (a)–(d)): ``conv_i`` followed by ``bn_i`` over its output."""
        for i, (cin, cout, k, s) in enumerate(specs, 1):
            self.add_module(f"conv{i}", nn.Conv2d(cin, cout, k, s, k // 2, bias=False, **factory))
            self.add_module(f"bn{i}", nn.BatchNorm2d(cout, eps=eps, momentum=momentum, **factory))
        self.num_convs = len(specs)

    def _conv(self, i: int) -> nn.Conv2d:
        return getattr(self, f"conv{i}")

    def _bn(self, i: int) -> nn.BatchNorm2d:
        return getattr(self, f"bn{i}")

    def _post_stack(self, t: torch.Tensor, last_bn: bool = True) -> torch.Tensor:
        """``W_k … ReLU(BN(W_1 t))``: conv → BN → ReLU per layer, the last BN optional, no last ReLU."""
        for i in range(1, self.num_convs + 1):
            t = self._conv(i)(t)
            if i < self.num_convs or last_bn:
                t = self._bn(i)(t)
            if i < self.num_convs:
                t = F.relu(t)
        return t

    def residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(F(x), s)`` where ``s`` is the tensor a projection shortcut reads."""
        raise NotImplementedError

    def merge(self, x: torch.Tensor, s: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """The shortcut and its combination with ``F`` (Fig. 2): returns ``y = h(x) ⊕ F(x)``.

        ``x`` is the unit's raw input (read by the gate and by the identity), ``s`` what a
        projection reads, ``f`` the residual ``F(x)``.
        """
        h = self.shortcut(s) if self.shortcut is not None else x
        kind = self.shortcut_kind
        if kind in ("identity", "conv1x1"):
            return h + f
        if kind == "constant_scaling":
            return self.scale * h + ((1.0 - self.scale) * f if self.scale_residual else f)
        if kind == "dropout":
            if self.training:
                return h * torch.empty_like(h).bernoulli_(1.0 - self.p) + f
            return (1.0 - self.p) * h + f
        g = torch.sigmoid(self.gate(x))
        if kind == "exclusive_gating":
            return (1.0 - g) * h + g * f
        return (1.0 - g) * h + f

    def after_addition(self, y: torch.Tensor) -> torch.Tensor:
        """The after-addition activation ``f`` of Eq. (2); identity unless a subclass overrides it."""
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, s = self.residual(x)
        return self.after_addition(self.merge(x, s, f))

    def extra_repr(self) -> str:
        extra = ""
        if self.shortcut_kind == "constant_scaling":
            extra = f", scale={self.scale}, scale_residual={self.scale_residual}"
        elif self.shortcut_kind == "dropout":
            extra = f", p={self.p}"
        return f"unit={self.unit!r}, bottleneck={self.bottleneck}, shortcut={self.shortcut_kind!r}{extra}"


_UNIT_DOC = """

    Args:
        in_planes: input channels. planes: width of the residual function; the output has
            ``planes`` channels (basic) or ``4·planes`` (bottleneck).
        stride: stride of the 3×3 conv (conv1 basic, conv2 bottleneck), of the projection and gate.
        bottleneck: basic unit (3×3, 3×3) if False, bottleneck (1×1, 3×3, 1×1 ×4) if True.
        shortcut: one of :data:`SHORTCUTS` (module docstring; paper Fig. 2).
        eps, momentum: of every BatchNorm2d. device, dtype: factory kwargs of all children.
        **shortcut_options: the shortcut's options, see :data:`SHORTCUT_OPTIONS` —
            ``constant_scaling``: ``scale`` (λ, default 0.5) and ``scale_residual`` (default True:
            F is scaled by 1−λ; False: F unscaled — the two rows of Table 1);
            ``exclusive_gating`` / ``shortcut_only_gating``: ``gate_bias`` (initial b_g, default −6,
            the value the paper selected by cross-validation over 0…−10, §3.1);
            ``dropout``: ``p`` (drop probability, default 0.5).

    Attributes: ``conv1``, ``bn1``, ``conv2``, ``bn2`` (, ``conv3``, ``bn3``); ``shortcut``: the 1×1
    projection (``conv1x1`` shortcut, or a stride/width change) or ``None``; ``gate``: the 1×1 gate
    conv ``W_g, b_g`` or ``None``; ``expansion`` (1 or 4) and ``out_planes``.

    Shapes: (N, in_planes, H, W) → (N, out_planes, ⌈H/stride⌉, ⌈W/stride⌉), in the input's dtype
    (any floating dtype nn.Conv2d/BatchNorm2d accept on the device: float32/float64, and
    float16/bfloat16 on CUDA).

    Raises:
        ValueError: unknown shortcut name (lists the valid ones) or ``p`` outside [0, 1).
        TypeError: an option the shortcut does not take.
        (forward) RuntimeError from PyTorch for a wrong channel count; ValueError from BatchNorm
        for one value per channel in training.
    """


class OriginalUnit(_ResidualUnit):
    """(a) The original post-activation unit (He et al. 2016, Fig. 4(a); He et al. 2015).

    ``x_{l+1} = ReLU(h(x) ⊕ F(x))`` with ``F = BN(W2 ReLU(BN(W1 x)))`` (bottleneck: three weight
    layers, BN after each, ReLU between). ``f`` = ReLU is applied after the addition (Eq. (2)),
    which is the unit every shortcut experiment of Table 1 uses. A projection reads ``x``.
    """

    unit = "original"

    def residual(self, x):
        return self._post_stack(x), x

    def after_addition(self, y):
        return F.relu(y)


class BNAfterAdditionUnit(_ResidualUnit):
    """(b) BN after addition (He et al. 2016, Fig. 4(b), §4.1).

    ``x_{l+1} = ReLU(BN_add(h(x) ⊕ W_k … ReLU(BN(W1 x))))``: the last BN of the original unit is
    moved after the element-wise addition, so it alters the signal on the shortcut path too. The
    post-addition BatchNorm is ``bn_add`` (over ``out_planes`` channels); the residual function has
    ``bn1`` (, ``bn2``) only. A projection reads ``x``.
    """

    unit = "bn_after_add"

    def _build(self, specs, eps, momentum, factory):
        super()._build(specs, eps, momentum, factory)
        last = len(specs)
        delattr(self, f"bn{last}")
        self.bn_add = nn.BatchNorm2d(specs[-1][1], eps=eps, momentum=momentum, **factory)

    def residual(self, x):
        return self._post_stack(x, last_bn=False), x

    def after_addition(self, y):
        return F.relu(self.bn_add(y))


class ReLUBeforeAdditionUnit(_ResidualUnit):
    """(c) ReLU before addition (He et al. 2016, Fig. 4(c), §4.1).

    ``x_{l+1} = h(x) ⊕ ReLU(BN(W2 ReLU(BN(W1 x))))``: the after-addition ReLU is moved into the
    residual branch, so ``f`` is the identity but ``F`` is non-negative (the paper's explanation of
    its worse result). A projection reads ``x``.
    """

    unit = "relu_before_add"

    def residual(self, x):
        return F.relu(self._post_stack(x)), x


class ReLUOnlyPreActUnit(_ResidualUnit):
    """(d) ReLU-only pre-activation (He et al. 2016, Fig. 4(d), §4.1).

    ``x_{l+1} = h(ReLU(x)) ⊕ BN(W2 ReLU(BN(W1 ReLU(x))))``: ReLU is moved before the first weight
    layer, BN stays after each weight layer, and ``f`` is the identity. With the identity shortcut
    ``h`` is the raw ``x``; a projection (``conv1x1`` or a stage transition) reads ``ReLU(x)``.
    """

    unit = "relu_only_preact"
    preact = True

    def residual(self, x):
        a = F.relu(x)
        return self._post_stack(a), a


class FullPreActUnit(_ResidualUnit):
    """(e) Full pre-activation (He et al. 2016, Fig. 4(e), §4.1): BN → ReLU before every weight layer.

    ``x_{l+1} = h(x) ⊕ W2 ReLU(BN2(W1 ReLU(BN1(x))))``, ``f`` the identity (Eq. (3)). With the
    identity shortcut ``h`` is the raw ``x``; a projection reads ``ReLU(BN1(x))`` — the rule of
    :class:`fused_preact.models.PreActBlock`. Here ``bn_i`` normalizes the *input* of ``conv_i``,
    and with ``shortcut="identity"`` parameter names, order and math equal
    :class:`~fused_preact.models.PreActBlock` / ``PreActBottleneck`` (and the fused blocks), so
    their state_dicts load into each other.
    """

    unit = "full_preact"
    preact = True

    def _build(self, specs, eps, momentum, factory):
        for i, (cin, cout, k, s) in enumerate(specs, 1):
            self.add_module(f"bn{i}", nn.BatchNorm2d(cin, eps=eps, momentum=momentum, **factory))
            self.add_module(f"conv{i}", nn.Conv2d(cin, cout, k, s, k // 2, bias=False, **factory))
        self.num_convs = len(specs)

    def residual(self, x):
        a = F.relu(self.bn1(x))
        t = self.conv1(a)
        for i in range(2, self.num_convs + 1):
            t = self._conv(i)(F.relu(self._bn(i)(t)))
        return t, a


#: Unit name → class (Fig. 4 (a)–(e)).
UNIT_CLASSES: dict[str, type[_ResidualUnit]] = {
    "original": OriginalUnit,
    "bn_after_add": BNAfterAdditionUnit,
    "relu_before_add": ReLUBeforeAdditionUnit,
    "relu_only_preact": ReLUOnlyPreActUnit,
    "full_preact": FullPreActUnit,
}
for _cls in UNIT_CLASSES.values():
    _cls.__doc__ = (_cls.__doc__ or "").rstrip() + _UNIT_DOC


class ResNetVariant(nn.Module):
    """A CIFAR-style ResNet built from one unit variant and one shortcut variant (eager).

    Structure (He et al. 2016 §4.1 and Table 2; He et al. 2015 §4.2): 3×3 stem conv to
    ``stem_width`` channels, then ``len(layers)`` stages (``layer1``, …) whose first unit has stride 2
    (except stage 1), then global average pooling and ``fc``. Units (a)–(c) (post-activation): the
    stem is conv → BN → ReLU (``stem.0``, ``stem.1``) and nothing follows the last unit. Units (d),
    (e) (pre-activation): the stem is the conv alone and the last unit is followed by its
    activation — ReLU for (d), ``bn`` → ReLU for (e) — as in
    :class:`fused_preact.models.PreActResNet`. Conv weights get Kaiming-normal (fan_out) init, BN
    γ=1, β=0, gate biases ``gate_bias``.

    Args:
        unit: one of :data:`UNITS`. shortcut: one of :data:`SHORTCUTS`.
        layers: units per stage. widths: residual width per stage (output = width · expansion).
        bottleneck: bottleneck units (expansion 4) instead of basic ones.
        num_classes: classifier outputs. stem_width: stem channels (16 in the paper's CIFAR nets).
        **shortcut_options: see :data:`SHORTCUT_OPTIONS`.

    Input (N, 3, H, W) float; output (N, num_classes) logits in the input's dtype.

    Raises:
        ValueError: unknown unit or shortcut name (lists the valid ones), bad shortcut option value,
            or ``layers`` and ``widths`` of different lengths.
        TypeError: an option the shortcut does not take.
    """

    def __init__(self, unit: str, shortcut: str, layers: list[int], widths: list[int], bottleneck: bool = False,
                 num_classes: int = 10, stem_width: int = 16, **shortcut_options):
        super().__init__()
        _check_name("unit", unit, UNITS)
        _shortcut_options(shortcut, shortcut_options)
        if len(layers) != len(widths):
            raise ValueError(f"layers and widths differ in length: {layers} vs {widths}")
        cls = UNIT_CLASSES[unit]
        self.unit = unit
        self.shortcut = shortcut
        self.final_activation = {"full_preact": "bn_relu", "relu_only_preact": "relu"}.get(unit, "none")
        stem: list[nn.Module] = [nn.Conv2d(3, stem_width, 3, 1, 1, bias=False)]
        if not cls.preact:
            stem += [nn.BatchNorm2d(stem_width), nn.ReLU()]
        self.stem = nn.Sequential(*stem)
        in_planes = stem_width
        self.num_stages = len(layers)
        for i, (n, w) in enumerate(zip(layers, widths)):
            units = []
            for j in range(n):
                u = cls(in_planes, w, 2 if (i > 0 and j == 0) else 1, bottleneck, shortcut, **shortcut_options)
                units.append(u)
                in_planes = u.out_planes
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
        self.bn = nn.BatchNorm2d(in_planes) if self.final_activation == "bn_relu" else None
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        if self.bn is not None:
            x = F.relu(self.bn(x))
        elif self.final_activation == "relu":
            x = F.relu(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def extra_repr(self) -> str:
        return f"unit={self.unit!r}, shortcut={self.shortcut!r}"


def _units_per_stage(depth: int, bottleneck: bool) -> int:
    per = 9 if bottleneck else 6
    if depth < 2 + per or (depth - 2) % per:
        kind = "bottleneck" if bottleneck else "basic"
        raise ValueError(f"depth {depth} invalid for {kind} blocks: need depth = {per}·n + 2 with n ≥ 1")
    return (depth - 2) // per


def preact_resnet_cifar_variant(depth: int, unit: str = "full_preact", shortcut: str = "identity",
                                num_classes: int = 10, bottleneck: Optional[bool] = None,
                                fused: Optional[bool] = None, backend: str = "auto",
                                **shortcut_options) -> nn.Module:
    """The paper's CIFAR ResNet of any valid depth with a chosen unit (Fig. 4) and shortcut (Fig. 2).

    3×3 stem conv to 16 channels, three stages of widths 16/32/64 (bottleneck outputs 64/128/256),
    the same depth rules as :func:`fused_preact.models.preact_resnet_cifar`, 32×32 input intended
    (any H, W ≥ 4 works). Table 1 (shortcuts) uses ``unit="original"`` at depth 110; Table 2
    (units) uses ``shortcut="identity"`` at depths 110 and 164.

    Args:
        depth: total weighted layers: ``6n + 2`` for basic units (20, 56, 110, …), ``9n + 2`` for
            bottlenecks (164, 1001, …).
        unit: one of :data:`UNITS` (Fig. 4 (a)–(e)). shortcut: one of :data:`SHORTCUTS` (Fig. 2).
        num_classes: classifier outputs.
        bottleneck: force the unit form; default: bottleneck exactly when ``depth ≥ 164``.
        fused: build the fused network. Default (None): True for ``full_preact`` + ``identity`` and
            False otherwise. Only that combination has a fused build.
        backend: fused backend (``"auto"``, ``"triton"``, ``"reference"``); unused when not fused.
        **shortcut_options: the shortcut's options (:data:`SHORTCUT_OPTIONS`), e.g. ``scale=0.5``.

    Returns:
        ``full_preact`` + ``identity``: exactly ``fused_preact.models.preact_resnet_cifar(depth,
        num_classes, fused, backend, bottleneck)`` (a :class:`~fused_preact.models.PreActResNet`;
        fused or its eager twin). Otherwise an eager :class:`ResNetVariant`. Input (N, 3, H, W)
        float, output (N, num_classes) logits.

    Raises:
        ValueError: unknown unit or shortcut (the message lists the valid names); invalid depth;
            ``fused=True`` for a variant without a fused build; a bad option value.
        TypeError: an option the shortcut does not take (identity takes none).
    """
    _check_name("unit", unit, UNITS)
    _shortcut_options(shortcut, shortcut_options)
    fusable = unit == "full_preact" and shortcut == "identity"
    if fused is None:
        fused = fusable
    if fused and not fusable:
        raise ValueError(
            f"fused=True needs unit='full_preact' with shortcut='identity', got unit={unit!r}, shortcut={shortcut!r}: "
            "the fused kernels compute conv(ReLU(BN(x))) with BN→ReLU folded into the conv's input, which is "
            "only the layout of the full pre-activation unit (Fig. 4(e)), and its output is a plain sum with the "
            "identity (or the pre-activated projection); build this variant with fused=False"
        )
    if bottleneck is None:
        bottleneck = depth >= 164
    n = _units_per_stage(depth, bottleneck)
    if fusable:  # imported here: importing this module must not build the Triton kernels (gradient_flow's CLI
        from fused_preact.models import preact_resnet_cifar  # sets TRITON_INTERPRET after parsing its arguments)

        return preact_resnet_cifar(depth, num_classes, fused=fused, backend=backend, bottleneck=bottleneck)
    return ResNetVariant(unit, shortcut, [n, n, n], [16, 32, 64], bottleneck, num_classes, **shortcut_options)
