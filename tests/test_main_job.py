"""The main job (``python -m fused_preact``) end to end on the bundled digits, kept small."""

from __future__ import annotations

import json

import pytest

from conftest import DEVICE
from fused_preact.experiments.main_job import main

pytest.importorskip("sklearn")


def test_main_job_small(tmp_path, capsys):
    out = tmp_path / "result.json"
    args = ["--steps", "3", "--depth", "8", "--batch-size", "8", "--image-size", "16", "--backend", "triton",
            "--device", DEVICE, "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["ok"] and len(r["losses"]["fused"]) == 3
    assert r["fused_paths"] == [{"backend": "triton", "fallback_reason": None}]
    assert r["max_rel_divergence"] < 1e-3
    text = capsys.readouterr().out
    assert "OK: eager and fused trajectories match" in text
    assert "fused build ran the triton path" in text


def test_soak_rule_small(tmp_path, capsys):
    """--soak judges the tail-mean loss (and memory growth on CUDA); a tiny run exercises it."""
    out = tmp_path / "soak.json"
    args = ["--steps", "3", "--depth", "8", "--batch-size", "4", "--image-size", "8", "--backend", "triton",
            "--device", DEVICE, "--no-fp64-reference", "--soak", "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["soak"] and r["ok"] and r["tail_rel_divergence"] < 1e-3
    assert (r["mem_growth_bytes"] is None) == (DEVICE == "cpu")
    assert "soak rule" in capsys.readouterr().out
    assert main(args + ["--tolerance-soak", "-1"]) == 1  # the rule can fail


def test_main_job_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--data-dir" in capsys.readouterr().out


def test_cifar10_pickle_folder(tmp_path):
    """A CIFAR-10-format folder (python pickles) loads with the right shapes, labels and normalization."""
    import pickle

    import numpy as np

    from fused_preact.experiments.data import load_cifar10

    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 6))}
        with open(tmp_path / name, "wb") as f:
            pickle.dump(batch, f)
    d = load_cifar10(str(tmp_path))
    assert d.train_x.shape == (30, 3, 32, 32) and d.test_x.shape == (6, 3, 32, 32)
    assert d.train_y.dtype.is_floating_point is False and int(d.train_y.max()) < 10
    assert abs(float(d.train_x.mean())) < 1e-5
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        load_cifar10(str(tmp_path / "missing"))
