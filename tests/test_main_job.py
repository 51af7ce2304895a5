"""The main job (``python -m fused_preact``) end to end on the bundled digits, kept small."""

from __future__ import annotations

import json

import pytest
from conftest import DEVICE

from fused_preact.experiments.main_job import main, soak_passes

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
    assert "OK: eager and fused trajectories match\npass rule: " in text
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
    assert "pass rule (--soak): tail-mean loss divergence" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a tolerance below 0 is refused, as a usage error
        main(args + ["--tolerance-soak", "-1"])
    assert e.value.code == 2
    # the rule can fail: on the loss divergence and on memory growth
    assert not soak_passes(2e-3, 1e-3, None) and not soak_passes(0.0, 1e-3, 2**21) and soak_passes(0.0, 1e-3, 0)


def test_main_job_cli_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal width (and breaks at hyphens)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--data-dir" in text and "cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in text
    assert "optimizer steps (default: " in text and "(default: 0.05)" in text  # defaults are shown


@pytest.mark.parametrize("argv,message", [
    (["--depth", "9"], "argument --depth: depth 9 invalid for basic blocks: need depth = 6·n + 2"),
    (["--depth", "nine"], "argument --depth: invalid int value: 'nine'"),
    (["--data-dir", "no-such-folder"], "argument --data-dir: 'no-such-folder' is not a CIFAR-10 python folder "
                                       "(no such folder); it comes from the python version of CIFAR-10"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--backend", "cudnn"], "argument --backend: invalid choice: 'cudnn'"),
], ids=["depth-9", "depth-not-int", "missing-data-dir", "zero-steps", "unknown-backend"])
def test_main_job_cli_errors_are_argparse_errors(argv, message, capsys):
    """Bad arguments end in argparse's usage message and status 2 before anything runs, not in a traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fused_preact") and message in err, err


def test_main_job_cli_data_dir_names_the_missing_batches(tmp_path, capsys):
    (tmp_path / "data_batch_1").write_bytes(b"")
    with pytest.raises(SystemExit):
        main(["--data-dir", str(tmp_path)])
    assert "missing data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch" in capsys.readouterr().err


def test_verdict_prints_the_pass_rule():
    """The verdict line comes with the rule and this run's numbers (accuracies are not judged)."""
    from fused_preact.experiments.main_job import verdict

    r = dict(ok=False, soak=False, tolerance=1e-2, max_rel_divergence=3e-2, fp64_noise_floor=1e-2, limit=2e-2,
             eval_rel_divergence=1e-3, eval_fp64_noise_floor=None, eval_limit=1e-2)
    lines = verdict(r)
    assert lines[0] == "FAIL: eager and fused trajectories diverge"
    assert "noise floor" in lines[1] and "accuracies are not judged" in lines[1]
    assert lines[2].endswith("3.00e-02 > 2.00e-02 = max(tolerance 1.0e-02, 2 × float64 noise floor 1.00e-02)")
    assert lines[3].endswith("1.00e-03 ≤ 1.00e-02 = max(tolerance 1.0e-02, no float64 twin)")


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


@pytest.mark.parametrize("argv,message", [
    (["--lr", "-1"], "--lr: must be > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be ≥ 0"),
    (["--device", "cuda:7" if DEVICE == "cuda" else "cuda"], "--device"),
    (["--device", "potato"], "--device: not a torch device"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
