"""Model factories and fused-vs-eager training of a whole network."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import FUSED_BACKENDS, assert_close

from fused_preact import FusedPreActBlock, FusedPreActBottleneck
from fused_preact.models import (
    PreActBlock,
    PreActBottleneck,
    PreActResNet,
    preact_resnet18,
    preact_resnet50,
    preact_resnet110,
    preact_resnet164,
    preact_resnet1001,
    preact_resnet_cifar,
)


def _params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize(
    "factory,millions",
    [(preact_resnet110, 1.7), (preact_resnet164, 1.7), (preact_resnet1001, 10.3)],
    ids=["110", "164", "1001"],
)
def test_cifar_parameter_counts_match_paper(factory, millions):
    """He et al. 2016, Table 3: ResNet-110 1.7M, ResNet-164 1.7M, ResNet-1001 10.2M parameters."""
    assert abs(_params(factory(fused=False)) / 1e6 - millions) < 0.1


def test_imagenet_models_build_and_run_eager():
    assert abs(_params(preact_resnet50(fused=False)) / 1e6 - 25.55) < 0.05  # timm resnetv2_50: 25.55M
    m = preact_resnet18(num_classes=7, fused=True, backend="reference")
    assert m(torch.randn(2, 3, 64, 64)).shape == (2, 7)


@pytest.mark.parametrize("depth,block", [(20, FusedPreActBlock), (11, FusedPreActBottleneck)])
def test_cifar_factory_structure(depth, block):
    m = preact_resnet_cifar(depth, bottleneck=block is FusedPreActBottleneck)
    blocks = [b for b in m.modules() if isinstance(b, block)]
    assert len(blocks) == 3 * (depth - 2) // (6 if block is FusedPreActBlock else 9)
    eager = preact_resnet_cifar(depth, fused=False, bottleneck=block is FusedPreActBottleneck)
    assert all(isinstance(b, (PreActBlock, PreActBottleneck)) for b in eager.modules() if "Block" in type(b).__name__
               or "Bottleneck" in type(b).__name__)
    assert list(m.state_dict()) == list(eager.state_dict())


def test_invalid_depth():
    with pytest.raises(ValueError, match="depth 21 invalid"):
        preact_resnet_cifar(21)


@pytest.mark.parametrize("layers,widths", [([1, 1, 1], [16, 32]), ([1, 1], [16, 32, 64]), ([-3, 1], [16, 32]),
                                           ([1, 0], [16, 32]), ([], [])])
def test_stage_lists_must_match(layers, widths):
    for fused in (True, False):
        with pytest.raises(ValueError, match="layers"):
            PreActResNet("basic", layers, widths, "cifar", 16, 10, fused=fused)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("bottleneck", [False, True], ids=["basic", "bottleneck"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_fused_model_trains_like_eager_twin(bottleneck, channels_last, backend):
    """Several SGD steps: fused fp32 and eager float64 give the same losses, grads, buffers."""
    depth = 11 if bottleneck else 8
    torch.manual_seed(0)
    fused = preact_resnet_cifar(depth, fused=True, backend=backend, bottleneck=bottleneck).to(DEVICE)
    eager = preact_resnet_cifar(depth, fused=False, bottleneck=bottleneck).double()
    eager.load_state_dict(fused.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    fused = fused.to(memory_format=fmt)
    opt_f = torch.optim.SGD(fused.parameters(), lr=0.01, momentum=0.9)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (4,), generator=gen)
        losses = []
        for model, opt, xx in ((fused, opt_f, x.float().to(DEVICE).contiguous(memory_format=fmt)), (eager, opt_e, x)):
            opt.zero_grad()
            loss = F.cross_entropy(model(xx), y.to(xx.device))
            loss.backward()
            losses.append(loss)
        assert_close(losses[0], losses[1], torch.float32, f"step {step} loss")
        for (name, p), p_ref in zip(fused.named_parameters(), eager.parameters()):
            assert_close(p.grad, p_ref.grad, torch.float32, f"step {step} grad {name}")
        opt_f.step()
        opt_e.step()
    for (name, b), b_ref in zip(fused.named_buffers(), eager.buffers()):
        if b.dtype == torch.long:
            assert torch.equal(b.cpu(), b_ref), name
        else:
            assert_close(b, b_ref, torch.float32, name)
    fused.eval()
    eager.eval()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    assert_close(fused(x.float().to(DEVICE)), eager(x), torch.float32, "eval batch of one")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_chained_statistics_at_few_values_per_channel(count, backend):
    """Blocks chained through their epilogue statistics, last stage at 1×1 so every BN there sees
    N·H·W = ``count`` values per channel; compared with a float64 twin, fused error ≤ 2 × eager fp32's
    own error + 1e-4 for output, input gradient, every parameter gradient and every running statistic.

    BN eps is 1e-2 here. With PyTorch's 1e-5, two values per channel make the network chaotic: a BN
    output is ±γ·d/√(d² + ε) + β for half-difference d, so channels with d² ≈ ε amplify input
    perturbations by ~1/√ε per block, and eager fp32 itself then differs from float64 by 30–60%
    on timm's resnetv2_50 (measured) — the fused chain is as far, in both directions, seed by seed.
    At eps 1e-2 both are within 1e-6, and a statistics defect (a wrong count, a wrong tile fold)
    still shows at the 1e-1 level."""
    torch.manual_seed(count)
    fused = preact_resnet_cifar(14, fused=True, backend=backend).to(DEVICE)
    for m in fused.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0.0, 0.3)
            m.eps = 1e-2
    eager = preact_resnet_cifar(14, fused=False).to(DEVICE)
    exact = preact_resnet_cifar(14, fused=False).double()
    for twin in (eager, exact):
        twin.load_state_dict(fused.state_dict())
        for m in twin.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eps = 1e-2
    x = torch.randn(count, 3, 4, 4, dtype=torch.float64)
    runs = []
    for model, xx in ((fused, x.float().to(DEVICE)), (eager, x.float().to(DEVICE)), (exact, x)):
        xx = xx.clone().requires_grad_()
        y = model(xx)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y))
        runs.append([("output", y), ("input gradient", xx.grad)]
                    + [(f"grad {n}", p.grad) for n, p in model.named_parameters()]
                    + [(n, b) for n, b in model.named_buffers() if b.is_floating_point()])
    assert model.layer3[0].bn1.num_batches_tracked.item() == 1
    for (what, f), (_, e), (_, r) in zip(*runs):
        fe, ee = _rel(f, r), _rel(e, r)
        assert fe <= 2 * ee + 1e-4, f"{what}: fused error {fe:.2e} > 2 × eager fp32 error {ee:.2e} + 1e-4"


class _HalfFused(FusedPreActBlock):
    """A subclass with a forward of its own: half the residual branch (as a residual scale does)."""

    def forward(self, x):
        return x + 0.5 * (super().forward(x) - x)


class _HalfEager(PreActBlock):
    def forward(self, x):
        return x + 0.5 * (super().forward(x) - x)


def _edit_subclass(model, fused):
    old = model.layer2[1]
    new = (_HalfFused if fused else _HalfEager)(32, 32, 1).to(old.bn1.weight)
    new.load_state_dict(old.state_dict())
    model.layer2[1] = new


def _edit_instance_forward(model, fused):
    blk = model.layer3[1]
    plain = blk.forward
    blk.forward = lambda x: 0.5 * (plain(x) + x)  # x + 0.5·(branch + shortcut − x)


def _edit_child_forward(model, fused):  # accelerate-style: a child's forward wrapped on the instance
    conv = model.layer2[0].conv2
    plain = conv.forward
    conv.forward = lambda a: plain(a) * 0.5


def _edit_block_backward_pre_hook(model, fused):
    model.layer2[0].register_full_backward_pre_hook(lambda mod, go: tuple(g * 0.5 for g in go))


def _edit_stage_backward_hook(model, fused):
    model.layer2.register_full_backward_hook(lambda mod, gi, go: tuple(g * 0.5 for g in gi))


class _ScaledStage(torch.nn.Sequential):
    """A stage with a forward of its own."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


def _edit_stage_subclass(model, fused):
    model.layer3 = _ScaledStage(*model.layer3)


class _CallingFused(FusedPreActBlock):
    """A block class with a ``__call__`` of its own (its forward untouched)."""

    def __call__(self, x):
        return 0.5 * (super().__call__(x) + x)


class _CallingEager(PreActBlock):
    def __call__(self, x):
        return 0.5 * (super().__call__(x) + x)


def _edit_block_call(model, fused):
    old = model.layer2[1]
    new = (_CallingFused if fused else _CallingEager)(32, 32, 1).to(old.bn1.weight)
    new.load_state_dict(old.state_dict())
    model.layer2[1] = new


def _stagewise(model, x):
    """``PreActResNet.forward`` with every stage called as a module: the reference."""
    x = model.stem(x)
    for i in range(model.num_stages):
        x = getattr(model, f"layer{i + 1}")(x)
    x = F.relu(model.bn(x))
    return model.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("edit", [_edit_subclass, _edit_instance_forward, _edit_child_forward,
                                  _edit_block_backward_pre_hook, _edit_stage_backward_hook, _edit_stage_subclass,
                                  _edit_block_call],
                         ids=["subclass-forward", "instance-forward", "child-instance-forward",
                              "block-backward-pre-hook", "stage-backward-hook", "stage-subclass-forward",
                              "block-own-call"])
def test_model_honours_what_its_blocks_calls_would_run(edit):
    """``PreActResNet.forward`` chains its fused blocks without calling them (statistics handed from
    block to block); a block or stage whose call is not its plain forward — a subclass's forward, one
    set on the instance (also on a child conv), backward hooks on a block or a stage — is called, so
    the model computes what calling its stages and blocks computes (float64 eager, stage by stage).
    They were skipped: outputs off by O(1), gradients below a gradient-scaling hook off by 2×."""
    torch.manual_seed(0)
    fused = preact_resnet_cifar(14, fused=True).to(DEVICE)  # two blocks per stage
    eager = preact_resnet_cifar(14, fused=False).double()
    eager.load_state_dict(fused.state_dict())
    edit(fused, True)
    edit(eager, False)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    y_f, y_e = fused(x.float().to(DEVICE)), _stagewise(eager, x)
    assert_close(y_f, y_e, torch.float32, "output")
    y_f.square().sum().backward()
    y_e.square().sum().backward()
    for (name, p), p_ref in zip(fused.named_parameters(), eager.parameters()):
        assert_close(p.grad, p_ref.grad, torch.float32, f"grad {name}")


def test_global_backward_hooks_see_every_block():
    """A global module backward hook fires for every block of a fused model, as for its eager twin."""
    import torch.nn as nn

    seen = {}
    for fused in (True, False):
        model = preact_resnet_cifar(8, fused=fused).to(DEVICE if fused else "cpu")
        calls = []
        handle = nn.modules.module.register_module_full_backward_hook(
            lambda mod, gi, go: calls.append(type(mod).__name__))
        try:
            model(torch.randn(2, 3, 8, 8, device=DEVICE if fused else "cpu")).sum().backward()
        finally:
            handle.remove()
        seen[fused] = sum(c in ("FusedPreActBlock", "PreActBlock") for c in calls)
    assert seen[True] == seen[False] == 3


def test_a_block_compiled_in_place_is_called():
    """``block.compile()`` (``Module.compile``) inside a fused model: the model calls the block, so its
    compiled call runs (chained, it was skipped: same values, the compilation never used)."""
    torch.manual_seed(0)
    model = preact_resnet_cifar(14, fused=True).to(DEVICE)
    calls = []

    def counting(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward

    try:
        model.layer2[1].compile(backend=counting)
        model(torch.randn(2, 3, 8, 8, device=DEVICE))
    finally:
        torch._dynamo.reset()
    assert calls, "the block's compiled call did not run"
