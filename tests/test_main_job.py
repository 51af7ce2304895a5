"""The main job (``python -m fused_preact``) end to end on the bundled digits, kept small."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

from fused_preact.experiments import main_job
from fused_preact.experiments.main_job import main, max_rel_divergence, soak_passes, verdict

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
    # depths from 164 on are built with bottlenecks (9n+2), below with basic blocks (6n+2)
    assert "6n+2 below 164 (basic blocks), 9n+2 from 164 on (bottlenecks)" in text


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
    (["--lr", "inf"], "--lr: must be > 0, got inf"),
    (["--momentum", "nan"], "--momentum: must be ≥ 0, got nan"),
    (["--batch-size", "1", "--image-size", "1"], "would see one value per channel"),
    pytest.param(["--backend", "cuda"], "argument --backend: 'cuda' cannot run here: cuda: ",
                 marks=pytest.mark.skipif(DEVICE == "cuda", reason="the CPU refusal")),
    (["--weight-decay", "-0.1"], "--weight-decay: must be ≥ 0"),
    (["--device", "cuda:7" if DEVICE == "cuda" else "cuda"], "--device"),
    (["--device", "potato"], "--device: not a torch device"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# a fast run: the reference backend, no float64 twin, 8×8 digits
FAST = ["--depth", "8", "--image-size", "8", "--eval-size", "8", "--backend", "reference", "--no-fp64-reference"]


def test_soak_verdict_names_memory_only_where_measured():
    r = dict(ok=True, soak=True, tail_rel_divergence=1e-4, tolerance_soak=0.05, mem_growth_bytes=None)
    assert verdict(r)[1].endswith("≤ 5.0e-02; device memory not measured (CPU)")
    assert "1 MiB (this run: 4096 bytes)" in verdict(dict(r, mem_growth_bytes=4096))[1]


def test_batch_larger_than_the_split_is_capped_and_recorded(tmp_path, capsys):
    """--batch-size above the training split trains on the whole split: the run says so and records the
    batch it used (as --eval-size records the test images it used)."""
    out = tmp_path / "r.json"
    assert main(FAST + ["--steps", "1", "--batch-size", "100000", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 1500 and r["batch_size_requested"] == 100000 and r["eval_size"] == 8
    assert "batch 1500 (--batch-size 100000 capped at the 1500-image training split)" in capsys.readouterr().out


def test_nan_loss_at_any_step_fails_the_divergence_check(tmp_path, monkeypatch):
    """A NaN loss after the first step makes the divergence NaN and the run fail (max() skipped it)."""
    assert math.isnan(max_rel_divergence([1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]))
    assert math.isnan(max_rel_divergence([1.0, 1.0], [1.0, float("nan")]))
    assert max_rel_divergence([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1) and max_rel_divergence([], []) == 0.0
    real, calls = main_job._step, []

    def step(model, opt, x, y, device):
        loss, dt, peak = real(model, opt, x, y, device)
        fused = any(hasattr(m, "last_backend") for m in model.modules())
        calls.append(fused)
        return (float("nan") if fused and calls.count(True) == 2 else loss), dt, peak

    monkeypatch.setattr(main_job, "_step", step)
    out = tmp_path / "r.json"
    assert main(FAST + ["--steps", "3", "--batch-size", "4", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert math.isnan(r["max_rel_divergence"]) and not r["ok"]


@pytest.mark.parametrize("where", ["missing-folder", "folder", "parent-is-a-file"])
def test_json_path_is_checked_before_the_run(tmp_path, capsys, where):
    """An unwritable --json is a usage error up front, not an exception after the whole run."""
    (tmp_path / "a-file").write_text("")
    path = {"missing-folder": tmp_path / "no-such-folder" / "r.json", "folder": tmp_path,
            "parent-is-a-file": tmp_path / "a-file" / "sub" / "r.json"}[where]
    with pytest.raises(SystemExit) as e:
        main(FAST + ["--steps", "1", "--batch-size", "4", "--json", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    expected = {"missing-folder": "no such folder", "folder": "is a folder",
                "parent-is-a-file": "a-file' is a file, not a folder"}[where]
    assert "argument --json: " in err and expected in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for runs without CUDA")
@pytest.mark.parametrize("value,off", [("false", True), ("0", True), ("yes", False)])
def test_interpreter_switch_is_read_as_triton_reads_it(value, off):
    """enable_triton_interpreter warns exactly when Triton will not interpret (any value it reads as off)."""
    code = "from fused_preact.experiments.main_job import enable_triton_interpreter as f; print(repr(f()))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TRITON_INTERPRET=value))
    assert p.returncode == 0, p.stderr
    assert ("which Triton reads as off" in p.stdout) == off, p.stdout


def test_kernels_built_compiled_before_main_warn_and_say_what_ran():
    """Called in a process that built the kernels compiled (no TRITON_INTERPRET), the job cannot switch
    to the interpreter: it warns, and its CPU note names the fallback that ran, not the interpreter."""
    code = ("import sys, fused_preact.ops._common; from fused_preact.experiments.main_job import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--depth", "8", "--image-size", "8", "--eval-size", "8", "--no-fp64-reference", "--steps", "1",
            "--batch-size", "4"]
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                       env=dict(env, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    assert "warning: fused_preact's Triton kernels were built compiled" in p.stderr, p.stderr
    assert "note: these are CPU timings (the fused build ran reference)" in p.stdout, p.stdout
    assert "in Triton's interpreter" not in p.stdout


def test_no_progress_bar_between_log_lines_when_output_is_not_a_terminal(capsys):
    """Piped or logged output (not a terminal) gets plain lines: no tqdm bar interleaved with them."""
    assert main(FAST + ["--steps", "2", "--batch-size", "4"]) == 0
    captured = capsys.readouterr()
    assert "step/s" not in captured.err and "it/s" not in captured.err and "training:" not in captured.err
