"""Gradient-flow diagnostics (fused_preact.experiments.gradient_flow): per-block numbers against a hand-run
backward pass, no side effects on the model, the PNG plot and the command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.experiments.gradient_flow import (
    METRICS,
    gradient_flow,
    main,
    parse_args,
    plot_gradient_flow,
    residual_blocks,
)
from fused_preact.experiments.variants import preact_resnet_cifar_variant
from fused_preact.models import preact_resnet18, preact_resnet_cifar

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def batch(n=4, size=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=gen), torch.randint(0, 10, (n,), generator=gen)


MODELS = {
    "models-cifar8": lambda: preact_resnet_cifar(8, fused=False),
    "original-14": lambda: preact_resnet_cifar_variant(14, "original"),
    "bn_after_add-11-bottleneck": lambda: preact_resnet_cifar_variant(11, "bn_after_add", bottleneck=True),
    "full_preact-gating-14": lambda: preact_resnet_cifar_variant(14, "full_preact", "exclusive_gating"),
    "relu_only-dropout-8": lambda: preact_resnet_cifar_variant(8, "relu_only_preact", "dropout"),
}


@pytest.mark.parametrize("key", list(MODELS))
def test_one_entry_per_block_with_positive_finite_norms(key):
    torch.manual_seed(0)
    model = MODELS[key]()
    x, y = batch()
    res = gradient_flow(model, x, y)
    per_stage = len(model.layer1)
    assert [r["name"] for r in res] == [f"layer{s}.{j}" for s in (1, 2, 3) for j in range(per_stage)]
    assert [(r["stage"], r["index"]) for r in res] == [(s, j) for s in (1, 2, 3) for j in range(per_stage)]
    assert [r["type"] for r in res] == [type(b).__name__ for _, _, _, b in residual_blocks(model)]
    for r in res:
        for k in METRICS:
            assert math.isfinite(r[k]) and r[k] > 0, (r["name"], k, r[k])
        assert r["grad_weight_ratio"] == pytest.approx(r["weight_grad_norm"] / r["weight_norm"])


@pytest.mark.parametrize("key", ["models-cifar8", "bn_after_add-11-bottleneck"])
def test_numbers_match_a_plain_backward_pass(key):
    """Output/input activation gradients and conv-weight gradients as loss.backward() computes them."""
    torch.manual_seed(0)
    model = MODELS[key]()
    x, y = batch(seed=1)
    res = gradient_flow(model, x, y)
    acts = {}

    def keep(name):
        def fn(m, args, out):
            args[0].retain_grad()
            out.retain_grad()
            acts[name] = (args[0], out)
        return fn

    for name, _, _, b in residual_blocks(model):
        b.register_forward_hook(keep(name))
    F.cross_entropy(model(x), y).backward()
    for r in res:
        inp, out = acts[r["name"]]
        assert r["grad_output_norm"] == pytest.approx(out.grad.norm().item(), rel=1e-5)
        assert r["grad_input_norm"] == pytest.approx(inp.grad.norm().item(), rel=1e-5)
        block = model.get_submodule(r["name"])
        ws = [m.weight for m in block.modules() if isinstance(m, nn.Conv2d)]
        assert r["weight_grad_norm"] == pytest.approx(math.sqrt(sum(w.grad.double().pow(2).sum() for w in ws)),
                                                      rel=1e-5)
        assert r["weight_norm"] == pytest.approx(math.sqrt(sum(w.detach().double().pow(2).sum() for w in ws)),
                                                 rel=1e-6)
    for a, b in zip(res, res[1:]):
        assert a["grad_output_norm"] == pytest.approx(b["grad_input_norm"], rel=1e-6)


def test_no_side_effects_on_the_model():
    torch.manual_seed(0)
    model = preact_resnet_cifar_variant(14, "original", "conv1x1")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch()
    gradient_flow(model, x, y)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m._forward_hooks for m in model.modules())


def test_imagenet_model_has_four_stages():
    model = preact_resnet18(num_classes=10, fused=False)
    res = gradient_flow(model, *batch(n=2, size=32))
    assert [r["name"] for r in res] == [f"layer{s}.{j}" for s in (1, 2, 3, 4) for j in (0, 1)]
    assert all(r["grad_output_norm"] > 0 for r in res)


def test_errors():
    with pytest.raises(ValueError, match="no 'layerN'"):
        gradient_flow(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), *batch())
    model = preact_resnet_cifar(8, fused=False)
    before = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(ValueError, match="scalar"):
        gradient_flow(model, *batch(), loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"))
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    x, y = batch()
    results = {
        "original d8": gradient_flow(preact_resnet_cifar_variant(8, "original"), x, y),
        "full_preact d14": gradient_flow(preact_resnet_cifar(14, fused=False), x, y),
    }
    path = tmp_path / "flow.png"
    assert plot_gradient_flow(results, str(path)) == str(path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    with pytest.raises(ValueError, match="at least one"):
        plot_gradient_flow({}, str(tmp_path / "empty.png"))


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    res = [{"name": "layer1.0", "stage": 1, "index": 0, **{k: 1.0 for k in METRICS}}]
    with pytest.raises(ImportError, match="needs matplotlib: pip install"):
        plot_gradient_flow({"m": res}, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_help_says_eager_by_default(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "eager (fused=False) unless --fused" in text and "TRITON_INTERPRET=1" in text
    args = parse_args([])
    assert args.depth == [164] and args.units == ["original", "full_preact"] and not args.fused
    with pytest.raises(SystemExit):
        parse_args(["--units", "preact"])


def test_main_in_process_on_digits(tmp_path, capsys):
    pytest.importorskip("sklearn")
    out = tmp_path / "r.json"
    assert main(["--depth", "8", "--units", "relu_before_add", "--shortcuts", "constant_scaling", "dropout",
                 "--batch", "3", "--image-size", "8", "--data", "digits", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["results"]) == {"relu_before_add+constant_scaling d8", "relu_before_add+dropout d8"}
    assert r["config"]["data"] == "digits" and all(len(v) == 3 for v in r["results"].values())
    assert "relu_before_add+dropout d8: 3 residual blocks" in capsys.readouterr().out


def test_cli_subprocess(tmp_path):
    try:
        import matplotlib  # noqa: F401
        png = tmp_path / "flow.png"
    except ImportError:
        png = None
    js = tmp_path / "flow.json"
    cmd = [sys.executable, "-m", "fused_preact.experiments.gradient_flow", "--depth", "8", "14", "--units", "original",
           "full_preact", "--batch", "2", "--image-size", "8", "--json", str(js), "--rows", "2"]
    if png is not None:
        cmd += ["--out", str(png)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "models built eager (fused=False)" in proc.stdout
    assert "full_preact+identity d14: 6 residual blocks" in proc.stdout
    r = json.loads(js.read_text())
    assert list(r["results"]) == ["original+identity d8", "full_preact+identity d8", "original+identity d14",
                                  "full_preact+identity d14"]
    assert r["results"]["full_preact+identity d8"][0]["type"] == "PreActBlock"
    if png is not None:
        assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("argv,message", [
    (["--depth", "10"], "argument --depth: depth 10 invalid for basic blocks: need depth = 6·n + 2"),
    (["--depth", "8", "--bottleneck", "yes"], "argument --depth: depth 8 invalid for bottleneck blocks"),
    (["--depth", "8", "--bottleneck", "yes"], "(e.g. 11, 20, 29, 56, 110, 164, 1001 (9n+2) with bottlenecks)"),
    (["--device", "potato"], "argument --device: not a torch device"),
    (["--device", "cuda:9"], "argument --device: "),
    (["--json", "/proc/version/r.json"], "argument --json: '/proc/version' is a file, not a folder"),
    (["--depth", "170"], "argument --depth: depth 170 invalid for bottleneck blocks"),
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--image-size", "-1"], "argument --image-size: must be at least 1, got -1"),
])
def test_cli_errors_are_argparse_errors(argv, message, capsys):
    """A depth that does not fit the unit form and counts below 1 end in argparse's usage error."""
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fused_preact.experiments.gradient_flow") and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for runs without CUDA")
def test_cli_fused_on_cpu_runs_the_triton_kernels(tmp_path):
    """--fused without CUDA: TRITON_INTERPRET is set before the kernels are built (parsing the arguments
    builds nothing), so the fused modules run Triton in its interpreter, and the run says which backend ran."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "fused_preact.experiments.gradient_flow", "--fused", "--depth", "8", "--units",
           "full_preact", "--batch", "2", "--image-size", "8", "--rows", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "full_preact+identity d8: fused modules ran triton\n" in proc.stdout, proc.stdout + proc.stderr
    assert "warning" not in proc.stderr
