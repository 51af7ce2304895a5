"""Residual-unit and shortcut variants of He et al. 2016 (Fig. 2, Fig. 4): the math of one unit
against the paper's formulas written out by hand, and the CIFAR factory's structure and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close

from fused_preact import FusedPreActBlock, FusedPreActBottleneck
from fused_preact.experiments.variants import (
    SHORTCUTS,
    UNIT_CLASSES,
    UNITS,
    FullPreActUnit,
    ResNetVariant,
    preact_resnet_cifar_variant,
)
from fused_preact.models import PreActBlock, PreActBottleneck, PreActResNet, preact_resnet_cifar

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- hand-written paper formulas


def bn(t, m):
    """Training-mode BatchNorm with the batch's statistics and the module's γ, β."""
    return F.batch_norm(t, None, None, m.weight, m.bias, True, 0.0, m.eps)


def conv(t, c):
    return F.conv2d(t, c.weight, None, c.stride, c.padding)


def weights(u):
    return [getattr(u, f"conv{i}") for i in range(1, 4) if hasattr(u, f"conv{i}")]


def bns(u):
    return [getattr(u, f"bn{i}") for i in range(1, 4) if hasattr(u, f"bn{i}")]


def post_stack(u, t, last_bn=True):
    """W → BN → ReLU → … → W → BN (Fig. 4(a) residual function)."""
    ws, ns = weights(u), bns(u)
    for i, w in enumerate(ws):
        t = conv(t, w)
        if i < len(ws) - 1:
            t = F.relu(bn(t, ns[i]))
        elif last_bn:
            t = bn(t, ns[i])
    return t


def reference(u, x, kind, scale=0.5, scale_residual=True, p=0.5):
    """y_l = h(x) ⊕ F(x), x_{l+1} = f(y_l) per Fig. 4 (units) and Fig. 2 / Table 1 (shortcuts)."""
    unit = u.unit
    if unit == "original":
        f, s = post_stack(u, x), x
    elif unit == "bn_after_add":
        f, s = post_stack(u, x, last_bn=False), x
    elif unit == "relu_before_add":
        f, s = F.relu(post_stack(u, x)), x
    elif unit == "relu_only_preact":
        s = F.relu(x)
        f = post_stack(u, s)
    else:
        s = F.relu(bn(x, u.bn1))
        ws, ns = weights(u), bns(u)
        f = conv(s, ws[0])
        for w, n in zip(ws[1:], ns[1:]):
            f = conv(F.relu(bn(f, n)), w)
    h = conv(s, u.shortcut) if u.shortcut is not None else x
    if kind in ("identity", "conv1x1"):
        y = h + f
    elif kind == "constant_scaling":
        y = scale * h + ((1 - scale) * f if scale_residual else f)
    elif kind == "dropout":
        y = (1 - p) * h + f
    else:
        g = torch.sigmoid(F.conv2d(x, u.gate.weight, u.gate.bias, u.gate.stride))
        y = (1 - g) * h + (g * f if kind == "exclusive_gating" else f)
    if unit == "original":
        return F.relu(y)
    if unit == "bn_after_add":
        return F.relu(bn(y, u.bn_add))
    return y


def randomize(module, seed=0):
    """Non-trivial BN affine parameters and gate biases (the defaults would hide mistakes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen, dtype=torch.float64) * 0.5)
    if getattr(module, "gate", None) is not None:
        with torch.no_grad():
            module.gate.bias.copy_(torch.randn(module.gate.bias.shape, generator=gen, dtype=torch.float64))
    return module


CASES = [
    ("identity", {}),
    ("constant_scaling", {}),
    ("constant_scaling", {"scale": 0.3, "scale_residual": False}),
    ("exclusive_gating", {}),
    ("shortcut_only_gating", {}),
    ("conv1x1", {}),
    ("dropout", {"p": 0.3}),
]


@pytest.mark.parametrize("stride,widen", [(1, False), (2, True)], ids=["same", "transition"])
@pytest.mark.parametrize("bottleneck", [False, True], ids=["basic", "bottleneck"])
@pytest.mark.parametrize("shortcut,opts", CASES, ids=[f"{s}{'-' + '-'.join(map(str, o.values())) if o else ''}"
                                                      for s, o in CASES])
@pytest.mark.parametrize("unit", UNITS)
def test_unit_matches_paper_formula(unit, shortcut, opts, bottleneck, stride, widen):
    torch.manual_seed(0)
    planes = 4
    out_planes = planes * (4 if bottleneck else 1)
    in_planes = out_planes * 2 if widen else out_planes
    u = UNIT_CLASSES[unit](in_planes, planes, stride, bottleneck, shortcut, dtype=torch.float64, **opts)
    randomize(u)
    has_projection = shortcut == "conv1x1" or stride != 1 or in_planes != out_planes
    assert (u.shortcut is not None) == has_projection
    assert (u.gate is not None) == shortcut.endswith("gating")
    x = torch.randn(4, in_planes, 6, 6, dtype=torch.float64)
    if shortcut == "dropout":
        u.eval()
        for m in u.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.train()
    got = u(x)
    assert got.shape == (4, out_planes, 6 // stride, 6 // stride)
    assert_close(got, reference(u, x, shortcut, **opts), torch.float64, f"{unit}/{shortcut}")


def test_projection_reads_preactivation_only_in_preact_units():
    """Transition projection: on ReLU(BN(x)) for (e), on ReLU(x) for (d), on x for (a)–(c)."""
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    for unit, cls in UNIT_CLASSES.items():
        u = cls(8, 4, 2, dtype=torch.float64)
        seen = []
        u.shortcut.register_forward_hook(lambda m, a, o: seen.append(a[0]))
        u(x)
        want = F.relu(bn(x, u.bn1)) if unit == "full_preact" else F.relu(x) if unit == "relu_only_preact" else x
        assert_close(seen[0], want, torch.float64, unit)


def test_dropout_shortcut_keeps_or_drops_without_rescaling():
    """Fig. 2(f): the shortcut is m ⊙ x with m ~ Bernoulli(1−p), expectation (1−p)·x (not inverted dropout)."""
    torch.manual_seed(0)
    for p in (0.5, 0.2):
        u = FullPreActUnit(16, 16, shortcut="dropout", p=p, dtype=torch.float64).train()
        x = torch.randn(4, 16, 8, 8, dtype=torch.float64)
        d = (u(x) - reference(u, x, "identity") + x).detach()
        kept = (d - x).abs() < 1e-9
        dropped = d.abs() < 1e-9
        assert bool((kept | dropped).all()), "shortcut elements must be exactly x or 0"
        assert abs(kept.double().mean().item() - (1 - p)) < 0.04


def test_gate_bias_initialisation():
    assert torch.all(UNIT_CLASSES["original"](8, 8, shortcut="exclusive_gating").gate.bias == -6.0)
    u = UNIT_CLASSES["original"](8, 8, shortcut="shortcut_only_gating", gate_bias=0.0)
    assert torch.all(u.gate.bias == 0.0)
    m = preact_resnet_cifar_variant(8, "original", "exclusive_gating", gate_bias=-3.0)
    assert all(torch.all(b.gate.bias == -3.0) for b in m.modules() if getattr(b, "gate", None) is not None)


@pytest.mark.parametrize("bottleneck,stride,in_planes", [(False, 1, 8), (False, 2, 4), (True, 1, 16), (True, 1, 8)])
def test_full_preact_unit_is_the_models_block(bottleneck, stride, in_planes):
    """Fig. 4(e) with identity shortcut here == the eager block the fused model mirrors (names, order, math)."""
    torch.manual_seed(0)
    ref = (PreActBottleneck if bottleneck else PreActBlock)(in_planes, 4 if bottleneck else 8, stride).double()
    randomize(ref)
    u = FullPreActUnit(in_planes, 4 if bottleneck else 8, stride, bottleneck, dtype=torch.float64)
    assert list(u.state_dict()) == list(ref.state_dict())
    u.load_state_dict(ref.state_dict())
    x = torch.randn(3, in_planes, 6, 6, dtype=torch.float64)
    assert_close(u(x), ref(x), torch.float64, "output")
    for (name, a), b in zip(u.named_buffers(), ref.buffers()):
        assert torch.allclose(a, b), name


# ---------------------------------------------------------------- networks and the factory


@pytest.mark.parametrize("bottleneck", [False, True], ids=["basic", "bottleneck"])
@pytest.mark.parametrize("shortcut", SHORTCUTS)
@pytest.mark.parametrize("unit", UNITS)
def test_every_variant_trains_one_step(unit, shortcut, bottleneck):
    torch.manual_seed(0)
    m = preact_resnet_cifar_variant(11 if bottleneck else 8, unit, shortcut, num_classes=7, bottleneck=bottleneck,
                                    fused=False)
    x = torch.randn(4, 3, 8, 8)
    out = m(x)
    assert out.shape == (4, 7) and torch.isfinite(out).all()
    F.cross_entropy(out, torch.arange(4)).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    convs = [b.conv1.weight.grad for b in m.modules() if hasattr(b, "conv1")]
    assert len(convs) == 3 and all(g.abs().sum() > 0 for g in convs)


@pytest.mark.parametrize("depth,bottleneck", [(20, False), (11, True)])
def test_full_preact_identity_is_the_models_network(depth, bottleneck):
    eager = preact_resnet_cifar_variant(depth, fused=False, bottleneck=bottleneck)
    ref = preact_resnet_cifar(depth, fused=False, bottleneck=bottleneck)
    assert type(eager) is PreActResNet and list(eager.state_dict()) == list(ref.state_dict())
    assert any(isinstance(b, PreActBottleneck if bottleneck else PreActBlock) for b in eager.modules())
    fused = preact_resnet_cifar_variant(depth, "full_preact", "identity", bottleneck=bottleneck, backend="reference")
    blocks = [b for b in fused.modules() if isinstance(b, (FusedPreActBlock, FusedPreActBottleneck))]
    assert len(blocks) == 3 * (depth - 2) // (9 if bottleneck else 6)
    assert {b.backend for b in blocks} == {"reference"}
    assert list(fused.state_dict()) == list(ref.state_dict())
    variant = preact_resnet_cifar_variant(depth, "full_preact", "conv1x1", bottleneck=bottleneck)
    assert isinstance(variant, ResNetVariant) and set(ref.state_dict()) <= set(variant.state_dict())
    assert all(b.shortcut is not None for i in (1, 2, 3) for b in getattr(variant, f"layer{i}"))


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("depth,bottleneck", [(20, False), (29, True)])
def test_depth_counts_weighted_layers(unit, depth, bottleneck):
    """Depth = stem conv + the residual functions' convs + fc (projections and gates not counted)."""
    m = preact_resnet_cifar_variant(depth, unit, "identity", bottleneck=bottleneck, fused=False)
    convs = [n for n, c in m.named_modules() if isinstance(c, nn.Conv2d) and not n.endswith(("shortcut", "gate"))]
    assert len(convs) + 1 == depth
    widths = [getattr(m, f"layer{i}")[-1].conv1.in_channels for i in (1, 2, 3)]
    assert m.fc.in_features == 64 * (4 if bottleneck else 1) and widths[0] == 16 * (4 if bottleneck else 1)


def test_original_resnet110_parameter_count():
    """ResNet-110 with original units has the 1.7M parameters of its pre-activation twin (Table 3):
    the unit variants move BN/ReLU around, they add no weights."""
    m = preact_resnet_cifar_variant(110, "original")
    assert abs(sum(p.numel() for p in m.parameters()) / 1e6 - 1.7) < 0.05


def test_network_stem_and_final_activation():
    """Post-activation nets: conv → BN → ReLU stem, nothing after the last unit; pre-activation:
    conv stem, last unit followed by its activation (BN → ReLU for (e), ReLU for (d))."""
    for unit in ("original", "bn_after_add", "relu_before_add"):
        m = preact_resnet_cifar_variant(8, unit)
        assert [type(c) for c in m.stem] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU] and m.bn is None
    d = preact_resnet_cifar_variant(8, "relu_only_preact")
    assert len(d.stem) == 1 and d.bn is None and d.final_activation == "relu"
    e = preact_resnet_cifar_variant(8, "full_preact", "conv1x1")
    assert len(e.stem) == 1 and isinstance(e.bn, nn.BatchNorm2d)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        d.eval()
        t = d.layer3(d.layer2(d.layer1(d.stem(x))))
        assert_close(d(x), d.fc(F.relu(t).mean((2, 3))), torch.float32, "relu_only final activation")


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="unknown unit 'preact'.*" + ".*".join(UNITS)):
        preact_resnet_cifar_variant(20, "preact")
    with pytest.raises(ValueError, match="unknown shortcut 'gating'.*" + ".*".join(SHORTCUTS)):
        preact_resnet_cifar_variant(20, "original", "gating")
    with pytest.raises(ValueError, match="unknown shortcut"):
        UNIT_CLASSES["original"](8, 8, shortcut="highway")


@pytest.mark.parametrize("unit,shortcut", [("original", "identity"), ("full_preact", "dropout")])
def test_fused_rejects_unfusable_variant(unit, shortcut):
    with pytest.raises(ValueError, match="fused=True needs unit='full_preact' with shortcut='identity'"):
        preact_resnet_cifar_variant(20, unit, shortcut, fused=True)
    assert isinstance(preact_resnet_cifar_variant(20, unit, shortcut), ResNetVariant)


def test_bad_depth_and_options():
    with pytest.raises(ValueError, match="depth 21 invalid for basic"):
        preact_resnet_cifar_variant(21, "original")
    with pytest.raises(ValueError, match="depth 23 invalid for bottleneck"):
        preact_resnet_cifar_variant(23, "original", bottleneck=True)
    with pytest.raises(TypeError, match="'identity' got unexpected option.*scale"):
        preact_resnet_cifar_variant(20, "original", "identity", scale=0.5)
    with pytest.raises(TypeError, match="accepted: p"):
        preact_resnet_cifar_variant(20, "original", "dropout", gate_bias=0.0)
    with pytest.raises(ValueError, match="0 <= p < 1"):
        preact_resnet_cifar_variant(20, "original", "dropout", p=1.0)
    with pytest.raises(ValueError, match="differ in length"):
        ResNetVariant("original", "identity", [1, 1], [16])
