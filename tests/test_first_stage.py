"""The GPU stage ``first`` (benchmarks/first_stage.py): its CPU dry run, its time plan and its summary."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "first_stage.py")


def _module():
    spec = importlib.util.spec_from_file_location("first_stage", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_plans_the_stage_within_eight_minutes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the count needs compiled-mode kernels
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path), "--processes", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    obj = json.loads((tmp_path / "first.json").read_text())
    assert obj["dry_run"] and obj["budget_s"] <= 450
    assert sum(p["limit_s"] for p in obj["plan"]) <= 450
    assert [p["step"] for p in obj["plan"]][:3] == ["environment", "precompile", "correctness"]
    blocks = obj["blocks"]
    assert sum(b.startswith("preact_resnet50/") for b in blocks) == 8  # every distinct block of R50
    assert "preact_resnet164/layer1.0" in blocks and "preact_resnet164/layer2.0" in blocks
    # every fprop/dgrad/wgrad/statistics launch of those blocks on default tiles, and the recompute kernels
    assert 150 <= obj["compilations_sm90"] <= obj["launches"]
    md = (tmp_path / "first.md").read_text()
    assert f"{obj['compilations_sm90']} distinct Triton compilations" in md


def test_plan_scales_every_limit_to_the_budget():
    mod = _module()
    total = sum(s for _, s in mod.STEPS)
    assert [p["limit_s"] for p in mod.plan(total + 100)] == [s for _, s in mod.STEPS]  # never stretched
    half = mod.plan(total / 2)
    assert sum(p["limit_s"] for p in half) <= total / 2
    assert [p["limit_s"] for p in half] == [int(s / 2) for _, s in mod.STEPS]


def test_steps_are_skipped_or_cut_by_their_limits(tmp_path, monkeypatch):
    mod = _module()
    assert mod._step("x", mod.MIN_STEP_S - 1, tmp_path, ["true"])["status"].startswith("skipped")
    monkeypatch.setattr(mod, "MIN_STEP_S", 0)
    monkeypatch.setattr(mod, "GRACE_S", 1)
    r = mod._step("slow", 1, tmp_path, [sys.executable, "-c", "import time; time.sleep(30)"])
    assert r["status"] == "timed out" and r["seconds"] < 10
    assert mod._step("fine", 30, tmp_path, [sys.executable, "-c", "print('hi')"])["status"] == "ok"
    assert (tmp_path / "fine.log").read_text() == "hi\n"


def test_correctness_records_each_block_as_it_goes(tmp_path):
    """Every block's result lands in the step's file as soon as it is known (a time limit keeps them);
    without CUDA each block fails with its reason, and the step still finishes."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the failure path without CUDA")
    mod = _module()
    mod.correctness_step(tmp_path)
    obj = json.loads((tmp_path / "correctness.json").read_text())
    assert obj["status"] == "done" and obj["failed"] == len(mod.stage_blocks()) and obj["passed"] == 0
    assert all("\n" not in v for r in obj["blocks"] for v in r["violations"])
    md = mod.markdown({"environment": {}, "steps": {"correctness": {"status": "ok", "result": obj}}})
    assert "| preact_resnet50/layer1.0 | NO: " in md and "| – | – | – |" in md


def test_summary_reads_the_bench_results_and_reports_failures(tmp_path):
    mod = _module()
    folder = tmp_path / "bench-blocks"
    folder.mkdir()
    results = [{"name": "preact_resnet50/layer1.0", "provider": p, "mode": "fwd+bwd", "median_ms": ms,
                "peak_mem_bytes": mem, **extra}
               for p, ms, mem, extra in (("eager", 2.0, 100, {}),
                                         ("triton", 1.0, 60, {"speedup_vs_eager": 2.0, "mem_vs_eager": 0.6}))]
    (folder / "h200-2026-12-02.json").write_text(json.dumps({"results": results, "skipped": [{"name": "x"}]}))
    summary = mod._bench_summary(folder)
    assert [e["provider"] for e in summary["entries"]] == ["eager", "triton"]
    assert summary["entries"][1]["speedup_vs_eager"] == 2.0 and len(summary["skipped"]) == 1
    obj = {"environment": {"gpu": "H200", "triton": "3.6.0"},
           "steps": {"precompile": {"status": "ok", "seconds": 40.0},
                     "correctness": {"status": "ok", "seconds": 50.0, "result": {
                         "passed": 1, "failed": 1,
                         "blocks": [{"block": "a", "ok": True, "violations": [],
                                     "worst": {"tensor": "dx", "fused": 1e-3, "eager": 1e-3}},
                                    {"block": "b", "ok": False, "violations": ["dx: 1e-1 > 2 × eager 1e-3"]}]}},
                     "blocks": {"status": "ok", "seconds": 100.0, "result": summary},
                     "kernels": {"status": "timed out", "seconds": 55.0, "result": {"entries": []}},
                     "csrc": {"status": "skipped: 10 s left"}}}
    md = mod.markdown(obj)
    assert "1 passed, 1 failed" in md and "NO: dx: 1e-1" in md
    assert "| preact_resnet50/layer1.0 | triton | 1.000 | 2.0 | 0.6 |" in md
    assert "| kernels | timed out | 55.0 |" in md and "1 tasks skipped" in md
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    (work / "blocks.log").write_text("\n".join(f"line {i}" for i in range(100)))
    mod._write(out, work, obj)  # what comes back from the device: three files, the logs' ends
    assert sorted(p.name for p in out.iterdir()) == ["first.json", "first.log", "first.md"]
    log = (out / "first.log").read_text()
    assert "=== blocks (100 lines, last 60)" in log and "line 99" in log and "line 39\n" not in log


def test_the_stage_refuses_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert _module().main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "first.json").exists()


@pytest.mark.parametrize("kind,stride", [("bottleneck", 2), ("basic", 1)])
def test_block_check_passes_the_fused_block_and_catches_a_wrong_one(monkeypatch, kind, stride):
    """The stage's correctness check, run on the CPU through the interpreter (fp32 here: the GPU runs
    bf16) on a small block: the fused block passes; a fused block whose conv weight gradient is off by
    1% fails, naming the tensor."""
    import torch
    from conftest import DEVICE

    from fused_preact.bench import timing
    from fused_preact.bench.shapes import BlockShape

    mod = _module()
    monkeypatch.setattr(timing, "DEVICE", DEVICE)
    monkeypatch.setattr(mod, "_DEVICE", DEVICE)
    b = BlockShape("m", "m/layer1.0", kind, 4, 6, 6, 8, 4, stride)
    r = mod.check_block(b, torch.float32)
    assert r["ok"], r
    assert r["backends"] == ["triton"]

    real = mod._tensors

    def wrong(m, x, dy=None):
        out, dy = real(m, x, dy)
        if any(getattr(sub, "last_backend", None) == "triton" for sub in m.modules()):
            out["d.conv1.weight"] = out["d.conv1.weight"] * 1.01
        return out, dy

    monkeypatch.setattr(mod, "_tensors", wrong)
    r = mod.check_block(b, torch.float32)
    assert not r["ok"] and any(v.startswith("d.conv1.weight") for v in r["violations"]), r
