"""fused_preact.convert against blocks that only look convertible, and converted models edited later:
a forward that draws random numbers or depends on the batch, a private attribute the forward reads,
children swapped or hooked after conversion (each found by a hostile test run).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close
from test_convert import CifarPreActBlock, _fused_modules, _reasons

from fused_preact.conversion import FusedSequential, convert


class StochasticDepthBlock(CifarPreActBlock):
    """Skips itself at random in training, written into its forward (no drop-path module)."""

    def forward(self, x):
        if self.training and torch.rand(1).item() < 0.5:
            return x
        return super().forward(x)


class GhostBNBlock(CifarPreActBlock):
    """bn1 over virtual batches of 2 images: plain BatchNorm at a batch of 2, not at 5."""

    def forward(self, x):
        out = F.relu(torch.cat([self.bn1(c) for c in x.split(2)]))
        return self.conv2(F.relu(self.bn2(self.conv1(out)))) + x


class ScaledResidualBlock(CifarPreActBlock):
    """out = x + s·branch with a private ``_res_scale`` the forward reads."""

    def __init__(self, planes, scale):
        super().__init__(planes, planes)
        self._res_scale = scale

    def forward(self, x):
        out = self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))
        return x + self._res_scale * out


@pytest.mark.parametrize("block,match", [(StochasticDepthBlock, "random numbers"), (GhostBNBlock, "batch 5")],
                         ids=["stochastic-depth", "ghost-bn"])
def test_probe_refuses_a_forward_that_depends_on_randomness_or_batch(block, match):
    """The probe compares the random numbers each forward draws, and runs a training batch of 5 scaled
    by 8 besides the batch of 2: a block that skips itself at random, or normalizes in virtual batches
    of 2, is left alone (both passed a probe of one batch of 2 under one seed)."""
    torch.manual_seed(0)
    model = nn.Sequential(block(4, 4))
    _, report = convert(model, report=True)
    assert not report.replaced and not _fused_modules(model)
    assert any(match in s.reason for s in report.skipped), _reasons(report)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_probe_verdict_keyed_on_private_attributes(as_tensor):
    """Two blocks of one class differing only in a private attribute the forward reads (a number, or
    a plain tensor attribute, neither parameter nor buffer): the verdict of the first (scale 1: the
    usual layout) is not reused for the second (scale 0.2)."""
    torch.manual_seed(0)
    scales = [torch.tensor(s) if as_tensor else s for s in (1.0, 0.2)]
    model = nn.Sequential(ScaledResidualBlock(4, scales[0]), ScaledResidualBlock(4, scales[1]))
    eager = copy.deepcopy(model)
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, "output")


class NormAct(nn.BatchNorm2d):
    """timm BatchNormAct2d's layout: BatchNorm2d with ``act`` and ``drop`` children."""

    def __init__(self, c):
        super().__init__(c)
        self.act, self.drop = nn.ReLU(), nn.Identity()

    def forward(self, x):
        return self.drop(self.act(super().forward(x)))


class FrozenBN(nn.BatchNorm2d):
    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


@pytest.mark.parametrize("edit", ["frozen-bn", "bn1d", "act-hook"])
def test_fused_sequential_runs_children_edited_after_convert(edit):
    """A child swapped or hooked after ``convert()`` whose own forward (or hook) the fused run would
    bypass — a BatchNorm2d subclass with its own forward, a BatchNorm1d, a hook on a BatchNormAct's
    ``act`` — runs eagerly: eager's output, or eager's error."""
    torch.manual_seed(0)
    seq = nn.Sequential(NormAct(4) if edit == "act-hook" else nn.BatchNorm2d(4), *([] if edit == "act-hook"
                        else [nn.ReLU()]), nn.Conv2d(4, 4, 3, padding=1))
    convert(seq, backend="triton" if edit == "bn1d" else "auto")
    assert isinstance(seq, FusedSequential) and seq.fused_runs
    seen = []
    if edit == "act-hook":
        seq[0].act.register_forward_hook(lambda m, i, o: seen.append(1) or o * 2)
    else:
        seq[0] = FrozenBN(4) if edit == "frozen-bn" else nn.BatchNorm1d(4)
    eager = copy.deepcopy(seq)
    eager.__class__ = nn.Sequential
    x = torch.randn(2, 4, 6, 6)
    if edit == "bn1d":
        with pytest.raises((ValueError, RuntimeError)):
            seq(x)
        return
    assert_close(seq(x), eager(x), torch.float32, edit)
    assert seq.last_backend == "reference" and seq.fallback_reason
    assert edit != "act-hook" or len(seen) == 2


class TimmStyleBasic(nn.Module):
    """timm ``PreActBasic``'s layout: BatchNormAct norms, an identity ``downsample``, ``drop_path``."""

    def __init__(self, c):
        super().__init__()
        self.norm1, self.conv1 = NormAct(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm2, self.conv2 = NormAct(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.downsample, self.drop_path = nn.Identity(), nn.Identity()

    def forward(self, x):
        a = self.norm1(x)
        return self.drop_path(self.conv2(self.norm2(self.conv1(a)))) + self.downsample(x)


def _double_its_output(mod: nn.Module, how: str, seen: list) -> None:
    """Make ``mod``'s call return twice its output: a forward hook, or a ``forward`` set on the instance
    (a monkeypatch; offloading wrappers replace it so)."""
    if how == "hook":
        mod.register_forward_hook(lambda m, i, o: seen.append(1) or o * 2)
    else:
        mod.forward = (lambda f: lambda x: seen.append(1) or f(x) * 2)(mod.forward)


@pytest.mark.parametrize("how", ["hook", "instance-forward"])
@pytest.mark.parametrize("where", ["projection-container", "identity-shortcut", "drop-path"])
def test_hooks_added_after_convert_on_unfused_parts_run(where, how):
    """A hook, or a forward set on the instance, added after ``convert()`` to a module the fused
    reading does not call — the ``Sequential`` around a fused projection, an identity shortcut, an
    inactive drop path — runs, and changes the output as it does eagerly."""
    torch.manual_seed(0)
    block = {"projection-container": lambda: CifarPreActBlock(4, 8, stride=2),
             "identity-shortcut": lambda: TimmStyleBasic(4), "drop-path": lambda: TimmStyleBasic(4)}[where]()
    model = nn.Sequential(block)
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    eager = nn.Sequential(copy.deepcopy(block))
    name = {"projection-container": "shortcut", "identity-shortcut": "downsample", "drop-path": "drop_path"}[where]
    seen = []
    for m in (model, eager):
        _double_its_output(getattr(m[0], name), how, seen)
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, where)
    assert len(seen) == 2


@pytest.mark.parametrize("how", ["hook", "instance-forward"])
def test_fused_sequential_calls_a_relu_given_a_hook_or_forward(how):
    """A run's ReLU given a hook or a forward of its own after ``convert()`` is called, as eagerly."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    convert(seq)
    assert isinstance(seq, FusedSequential) and seq.fused_runs
    eager = copy.deepcopy(seq)
    eager.__class__ = nn.Sequential
    seen = []
    for m in (seq, eager):
        _double_its_output(m[1], how, seen)
    x = torch.randn(2, 4, 6, 6)
    assert_close(seq(x), eager(x), torch.float32, how)
    assert len(seen) == 2


_EDITS = {
    # a BatchNorm after the projection conv: its Sequential no longer holds the conv alone
    "projection-gets-a-norm": (lambda: CifarPreActBlock(4, 8, stride=2), lambda b: b.shortcut.append(nn.BatchNorm2d(8))),
    "projection-becomes-a-bare-conv": (lambda: CifarPreActBlock(4, 8, stride=2),
                                       lambda b: setattr(b, "shortcut", nn.Conv2d(4, 8, 1, 2, bias=False))),
    # kuangliu's forward applies a shortcut module to relu(bn1(x)) but adds x when there is none
    "identity-block-gets-a-shortcut": (lambda: CifarPreActBlock(4, 4),
                                       lambda b: setattr(b, "shortcut", nn.Sequential(nn.Conv2d(4, 4, 1, bias=False)))),
    "identity-downsample-becomes-a-conv": (lambda: TimmStyleBasic(4),
                                           lambda b: setattr(b, "downsample", nn.Conv2d(4, 4, 1, bias=False))),
    # timm's forward takes the ReLU from the norm: a plain BatchNorm2d has none
    "norm-loses-its-act": (lambda: TimmStyleBasic(4), lambda b: setattr(b, "norm2", nn.BatchNorm2d(4))),
    "act-becomes-gelu": (lambda: TimmStyleBasic(4), lambda b: setattr(b.norm2, "act", nn.GELU())),
}


@pytest.mark.parametrize("edit", list(_EDITS))
def test_converted_block_runs_its_original_forward_after_its_children_change(edit):
    """A converted block whose children change after ``convert()`` — a child replaced by one of
    another type, added or removed anywhere below it — runs the original class's forward on them
    (the fused reading was matched to the children it had): eager's output and gradients, the
    reason recorded; a forced fused backend raises. Each edit was computed wrong, or failed, before."""
    torch.manual_seed(0)
    make, apply_edit = _EDITS[edit]
    model = nn.Sequential(make())
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    eager = nn.Sequential(copy.deepcopy(model[0]))
    eager[0].__class__ = model[0]._source_cls
    for m in (model, eager):
        torch.manual_seed(1)  # the same new modules on both sides
        apply_edit(m[0])
    x = torch.randn(2, 4, 6, 6)
    xf, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ye = model(xf), eager(xe)
    assert_close(y, ye, torch.float32, edit)
    y.square().sum().backward()
    ye.square().sum().backward()
    assert_close(xf.grad, xe.grad, torch.float32, f"{edit} grad x")
    assert model[0].last_backend == "reference" and "changed since convert()" in model[0].fallback_reason
    model[0].backend = "triton"
    with pytest.raises(RuntimeError, match="changed since convert"):
        model[0](x)


def test_converted_block_stays_fused_when_a_child_is_replaced_by_one_of_its_type():
    """Replacing a conv or a norm by a new one of the same type keeps the fused reading (it reads the
    children by name on every call): the new weights are used, on the fused path."""
    torch.manual_seed(0)
    model = nn.Sequential(CifarPreActBlock(4, 8, stride=2))
    convert(model, backend="triton")
    eager = nn.Sequential(copy.deepcopy(model[0]))
    eager[0].__class__ = CifarPreActBlock
    for m in (model, eager):
        torch.manual_seed(1)
        m[0].conv2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False)
        m[0].shortcut[0] = nn.Conv2d(4, 8, 1, 2, bias=False)
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, "same-type replacement")
    assert model[0].last_backend == "triton" and model[0].fallback_reason is None


class NoneDownsampleBlock(nn.Module):
    """timm ``PreActBasic``'s identity case: ``downsample`` is a plain ``None`` attribute."""

    def __init__(self, c):
        super().__init__()
        self.norm1, self.conv1 = NormAct(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm2, self.conv2 = NormAct(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.downsample, self.drop_path = None, nn.Identity()

    def forward(self, x):
        a = self.norm1(x)
        shortcut = self.downsample(a) if self.downsample is not None else x
        return self.drop_path(self.conv2(self.norm2(self.conv1(a)))) + shortcut


def test_edited_block_reads_children_over_its_original_attributes():
    """A module assigned after ``convert()`` where the original block held a plain attribute of the
    same name (timm's ``downsample = None``) is what the original forward then reads — not the
    attribute's value at conversion (which ignored the new projection: output off by 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(NoneDownsampleBlock(4))
    eager = copy.deepcopy(model)
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    for m in (model, eager):
        torch.manual_seed(1)
        m[0].downsample = nn.Conv2d(4, 4, 1, bias=False)
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, "downsample set after convert")
    assert "changed since convert() (downsample)" in model[0].fallback_reason


def test_converted_block_stays_fused_under_sync_batchnorm_and_parametrizations():
    """``convert_sync_batchnorm`` (BatchNorm2d → SyncBatchNorm) and a parametrization added after
    ``convert()`` (spectral_norm: the conv becomes a parametrized Conv2d with a ``parametrizations``
    child) are read by the fused path as they were: the block stays fused, and computes eager's."""
    from torch.nn.utils.parametrizations import spectral_norm

    import fused_preact

    torch.manual_seed(0)
    model = nn.Sequential(CifarPreActBlock(4, 8, stride=2))
    eager = copy.deepcopy(model)
    convert(model, backend="triton")
    model = fused_preact.convert_sync_batchnorm(model)  # no process group: plain batch statistics
    assert type(model[0].bn1) is nn.SyncBatchNorm
    for m in (model, eager):
        torch.manual_seed(1)
        spectral_norm(m[0].conv2)
    x = torch.randn(2, 4, 6, 6)
    model.eval()
    eager.eval()
    with torch.no_grad():
        assert_close(model(x), eager(x), torch.float32, "sync BN + spectral_norm after convert")
    assert model[0].last_backend == "triton" and model[0].fallback_reason is None


class ScheduledBlock(CifarPreActBlock):
    """A residual scale and an inline dropout rate its forward reads (set by a training schedule)."""

    def __init__(self, planes):
        super().__init__(planes, planes)
        self.drop_rate, self.res_scale = 0.0, 1.0

    def forward(self, x):
        out = F.dropout(self.conv1(F.relu(self.bn1(x))), p=self.drop_rate, training=self.training)
        return x + self.res_scale * self.conv2(F.relu(self.bn2(out)))


@pytest.mark.parametrize("attr, value", [("res_scale", 0.2), ("drop_rate", 0.5)])
def test_converted_block_runs_its_original_forward_after_its_attributes_change(attr, value):
    """A public attribute of the original block that its forward reads, assigned after ``convert()``
    (probed at its old value): the original forward runs with the new value, the reason recorded;
    the attribute reads as on the original block, and assigning the value it had keeps the block fused
    (the fused reading ignored the change: output off by O(1), or no dropout)."""
    torch.manual_seed(0)
    model = nn.Sequential(ScheduledBlock(4)).train()
    eager = copy.deepcopy(model)
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    assert (model[0].drop_rate, model[0].res_scale) == (0.0, 1.0)
    model[0].res_scale = float("1")  # the value it had (another object): still fused
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, "unchanged")
    assert model[0].last_backend != "reference"
    for m in (model, eager):
        setattr(m[0], attr, value)
    torch.manual_seed(2)
    y = model(x)
    torch.manual_seed(2)
    assert_close(y, eager(x), torch.float32, attr)
    assert model[0].last_backend == "reference" and f"attributes changed since convert() ({attr})" in \
        model[0].fallback_reason


class InPlaceScheduledBlock(CifarPreActBlock):
    """A residual scale its forward reads from a dict, a list, a plain tensor, a list of tensors and a
    list inside a tuple (a schedule changes them in place); attributes it does not read: NaN in a
    set, a dict key and a tensor, a large tensor, an inference tensor."""

    def __init__(self, planes):
        super().__init__(planes, planes)
        self.cfg, self.scales, self.res_t = {"res_scale": 1.0}, [1.0, float("nan")], torch.ones(1)
        self.ts, self.pair = [torch.ones(1), torch.ones(2)], ("scale", [1.0])
        self.tags, self.by_key = {"a", float("nan")}, {float("nan"): 1, 2: [3.0]}
        self.nan_t, self.big = torch.tensor([float("nan"), 1.0]), torch.zeros(70000)
        self.nested = [[1.0]]
        with torch.inference_mode():
            self.frozen = torch.ones(2)

    def forward(self, x):
        scale = self.cfg["res_scale"] * self.scales[0] * self.res_t * self.ts[0] * self.pair[1][0]
        return x + scale * self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))


def _change(block, attr):
    if attr == "cfg":
        block.cfg["res_scale"] = 0.2
    elif attr == "scales":
        block.scales[0] = 0.2
    elif attr == "res_t":
        block.res_t.mul_(0.2)
    elif attr == "ts":
        block.ts[0].mul_(0.2)
    elif attr == "ts-replaced":
        block.ts[0] = torch.full((1,), 0.2)  # a new tensor at the version the old one had
    elif attr == "scales-appended":
        block.scales.append(0.2)
    elif attr == "cfg-key-added":
        block.cfg["extra"] = 0.2
    elif attr == "nested-retyped":
        block.nested[0] = (1.0,)  # same values, another container type
    elif attr == "pair-longer":
        block.pair = block.pair + ("more",)  # reassigned: a longer tuple with the same prefix
    else:
        block.pair[1][0] = 0.2


@pytest.mark.parametrize("attr", ["cfg", "scales", "res_t", "ts", "ts-replaced", "pair", "scales-appended",
                                  "cfg-key-added", "nested-retyped", "pair-longer"])
def test_converted_block_sees_attributes_changed_in_place(attr):
    """An attribute the original forward reads changed in place after ``convert()`` — a dict entry, a
    list element, a plain tensor's value, a tensor in a list (changed or replaced), a list in a tuple
    — runs the original forward with the reason recorded (the fused reading ignored it: output off by
    O(1), silently); unchanged ones, also after a deepcopy and a torch.save/load round trip (NaN in a
    list, a set, a dict key and a tensor; tensors at other versions; a large tensor and an inference
    tensor, which are not watched), stay fused."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(InPlaceScheduledBlock(4)).train()
    eager = copy.deepcopy(model)
    _, report = convert(model, report=True)
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    x = torch.randn(2, 4, 6, 6)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for m in (model, copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert_close(m(x), eager(x), torch.float32, "unchanged")
        assert m[0].last_backend != "reference", m[0].fallback_reason
        rec = m[0]._source_snaps["res_t"][1]  # renewed: later calls compare versions, not values (a sync)
        assert rec.obj is m[0].res_t and rec.version == m[0].res_t._version
    for m in (model, eager):
        _change(m[0], attr)
    assert_close(model(x), eager(x), torch.float32, attr)
    name = attr.split("-")[0]
    assert model[0].last_backend == "reference" and f"attributes changed since convert() ({name})" in \
        model[0].fallback_reason


def test_a_block_used_twice_stays_one_module():
    """A block object used twice (applied twice: shared weights) is one converted module, as it was one
    module: a hook registered on it afterwards fires at both uses, as eager's does (each use got its
    own ConvertedPreActBlock, and the hook fired once)."""
    torch.manual_seed(0)
    block = CifarPreActBlock(4, 4)
    model = nn.Sequential(block, block)
    eager = copy.deepcopy(model)
    _, report = convert(model, report=True)
    assert model[0] is model[1] and type(model[0]).__name__ == "ConvertedPreActBlock"
    assert [r.name for r in report.replaced] == ["0"], _reasons(report)
    calls = {"fused": 0, "eager": 0}
    for name, m in (("fused", model), ("eager", eager)):
        m[0].register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    x = torch.randn(2, 4, 6, 6)
    assert_close(model(x), eager(x), torch.float32, "output")
    assert calls == {"fused": 2, "eager": 2}


def test_attribute_watch_limits():
    """What a converted block watches for changes in place (documented in docs/semantics.md): tensors
    up to 65,536 elements and containers up to 256 leaves; larger ones are not watched."""
    from fused_preact.conversion.blocks import _snapshot

    assert _snapshot(torch.zeros(1 << 16)) is not None and _snapshot(torch.zeros((1 << 16) + 1)) is None
    assert _snapshot([0.0] * 255) is not None and _snapshot([0.0] * 256) is None  # the list counts as a leaf too
    assert _snapshot({"a": [torch.zeros(2)] * 3}) is not None and _snapshot([object()]) is None
    assert _snapshot((1.0, "a")) is None and _snapshot(3.0) is None  # immutable: nothing to watch
