"""The benchmark machinery on CPU: shape enumeration, FLOP/byte/floor arithmetic, the results format,
report rendering, the harness closures, and the CLI's refusal to time anything without CUDA.

No timing is taken here (CPU timings of GPU kernels mean nothing); the harness test swaps CUDA
events for a host clock only to run the setup/run closures and check what they compute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import HostEvent

from fused_preact.bench import run as bench
from fused_preact.bench import timing as BT
from fused_preact.bench.report import chart_series
from fused_preact.bench.shapes import (
    UnitShape,
    block_flops,
    block_min_bytes,
    dtype_from_name,
    enumerate_blocks,
    enumerate_units,
    floor_ms,
    pct_of_floor,
    quick_units,
    unit_flops,
    unit_min_bytes,
)

R50_3X3 = UnitShape("preact_resnet50", "preact_resnet50/layer1.0/conv2", 128, 64, 56, 56, 64, 3, 3, (1, 1), (1, 1))


def _by_name(units):
    return {n: u for u in units for n in u.names}


# ------------------------------------------------------------------------------------------- shapes
def test_resnet50_units():
    units = enumerate_units("preact_resnet50", 128)
    assert sum(u.count for u in units) == 16 * 3 + 4  # 16 bottlenecks × 3 convs + 4 projection shortcuts
    assert len(units) == 22
    assert len({u.key() for u in units}) == len(units)
    by = _by_name(units)
    c1 = by["preact_resnet50/layer1.0/conv1"]
    assert (c1.N, c1.C, c1.K, c1.R, c1.S, c1.H, c1.W, c1.stride) == (128, 64, 64, 1, 1, 56, 56, (1, 1))
    s2 = by["preact_resnet50/layer2.0/conv2"]  # stride on the 3×3 (torchvision v1.5 / timm)
    assert (s2.C, s2.K, s2.R, s2.stride, s2.padding, s2.H, s2.P, s2.Q) == (128, 128, 3, (2, 2), (1, 1), 56, 28, 28)
    sc = by["preact_resnet50/layer3.0/shortcut"]
    assert (sc.C, sc.K, sc.R, sc.stride, sc.H, sc.P) == (512, 1024, 1, (2, 2), 28, 14)
    # layer1.0's projection has conv3's shape (64→256 1×1 at 56²): one benchmark, both names
    assert by["preact_resnet50/layer1.0/shortcut"] is by["preact_resnet50/layer1.0/conv3"]
    assert by["preact_resnet50/layer1.0/conv3"].count == 4
    assert by["preact_resnet50/layer4.1/conv2"].describe() == "512→512 3×3/1 @7²"


def test_resnet164_units_at_32():
    units = enumerate_units("preact_resnet164", 128)
    assert sum(u.count for u in units) == 54 * 3 + 3
    assert len(units) == 16
    assert {u.H for u in units} == {32, 16, 8}
    by = _by_name(units)
    assert by["preact_resnet164/layer1.5/conv2"].key() == (128, 16, 32, 32, 16, 3, 3, (1, 1), (1, 1), (1, 1), 1)
    assert by["preact_resnet164/layer1.0/conv2"].count == 18
    assert by["preact_resnet164/layer3.0/conv2"].P == 8
    assert enumerate_units("preact_resnet164", 7)[0].N == 7


def test_blocks():
    r50 = enumerate_blocks("preact_resnet50", 128)
    assert [b.count for b in r50] == [1, 2, 1, 3, 1, 5, 1, 2]
    b = r50[2]
    assert (b.name, b.kind, b.in_planes, b.planes, b.stride, b.H) == ("preact_resnet50/layer2.0", "bottleneck", 256, 128, 2, 56)
    assert [u.name.rsplit("/", 1)[1] for u in b.units] == ["conv1", "conv2", "conv3", "shortcut"]
    assert len(r50[1].units) == 3  # identity shortcut: no projection unit
    r164 = enumerate_blocks("preact_resnet164", 128)
    assert len(r164) == 6 and sum(b.count for b in r164) == 54
    basic = enumerate_blocks("preact_resnet20", 4)
    assert basic[0].kind == "basic" and [u.R for u in basic[0].units] == [3, 3]
    assert b.describe() == "bottleneck 256→512 /2 @56²"
    example = re.search(r"``(.+?)``", type(b).describe.__doc__).group(1)  # the docstring's example is real
    assert example in {x.describe() for x in r50}


def test_quick_subset_is_a_subset():
    full = {u.key() for u in enumerate_units("preact_resnet50", 128)}
    quick = quick_units("preact_resnet50", 128)
    assert 1 < len(quick) < len(full) and {u.key() for u in quick} <= full
    assert any(u.stride == (2, 2) and u.R == 3 for u in quick)


# ------------------------------------------------------------------------------------ cost model
def test_flops_and_bytes_tiny_unit():
    u = UnitShape("m", "m/x/conv", 1, 1, 4, 4, 1, 3, 3, (1, 1), (1, 1))  # x 16, W 9, y 16 elements
    assert unit_flops(u, "fwd") == 2 * 16 * 9 == 288
    assert unit_flops(u, "bwd") == 576 and unit_flops(u, "fwd+bwd") == 864
    assert unit_min_bytes(u, "fwd", 4) == 4 * (16 + 9 + 16) == 164
    assert unit_min_bytes(u, "bwd", 4) == 4 * (16 + 32 + 18) == 264
    assert unit_min_bytes(u, "fwd+bwd", 4) == 428
    g = UnitShape("m", "m/x/g", 2, 8, 5, 5, 16, 3, 3, (2, 2), (1, 1), groups=4)  # P = Q = 3, C/g = 2
    assert unit_flops(g, "fwd") == 2 * 2 * 9 * 16 * 2 * 9
    with pytest.raises(ValueError):
        unit_flops(u, "step")


def test_floor_resnet50_3x3_is_compute_bound():
    assert unit_flops(R50_3X3, "fwd") == 29_595_009_024
    assert unit_min_bytes(R50_3X3, "fwd", 2) == 102_834_176
    assert unit_min_bytes(R50_3X3, "bwd", 2) == 154_288_128
    f = floor_ms(unit_flops(R50_3X3, "fwd"), unit_min_bytes(R50_3X3, "fwd", 2), 800.0, 3000.0)
    assert f == pytest.approx(0.03699376128, rel=1e-12)  # 29.6 GFLOP at 800 TFLOP/s > 102.8 MB at 3 TB/s
    assert pct_of_floor(f, 2 * f) == pytest.approx(50.0)
    assert pct_of_floor(None, 1.0) is None


def test_floor_cifar_1x1_is_memory_bound():
    u = UnitShape("m", "m/x/c3", 128, 16, 32, 32, 64, 1, 1)
    assert unit_flops(u, "fwd") == 268_435_456
    assert unit_min_bytes(u, "fwd", 2) == 20_973_568
    assert floor_ms(268_435_456, 20_973_568, 800.0, 3000.0) == pytest.approx(20_973_568 / 3e12 * 1e3, rel=1e-12)
    with pytest.raises(ValueError):
        floor_ms(1, 1, 0.0, 1.0)


def test_block_costs_sum_units():
    blocks = enumerate_blocks("preact_resnet50", 128)
    b = blocks[2]  # layer2.0: conv1 and the projection shortcut read the same x
    assert b.units[-1].name.endswith("/shortcut")
    assert block_flops(b, "fwd+bwd") == sum(3 * unit_flops(u, "fwd") for u in b.units)
    x = 128 * 256 * 56 * 56  # |x| of the shared input, counted once: read (fwd), read + dx written (bwd)
    for mode, shared in (("fwd", 1), ("bwd", 2), ("fwd+bwd", 3)):
        assert block_min_bytes(b, mode, 2) == sum(unit_min_bytes(u, mode, 2) for u in b.units) - 2 * shared * x
    plain = blocks[1]  # layer1.1: identity shortcut, a plain sum of its units
    assert block_min_bytes(plain, "bwd", 2) == sum(unit_min_bytes(u, "bwd", 2) for u in plain.units)
    with pytest.raises(ValueError):
        block_min_bytes(b, "step", 2)


def test_pool_count_and_dtype_names():
    l2 = 50 << 20
    assert BT.pool_count(30 << 20, l2) == 4  # ceil(100 / 30)
    assert BT.pool_count(256 << 20, l2) == 2  # never fewer than 2
    for set_bytes in (1 << 10, 100_000, 4 << 20, 7 << 20, 30 << 20):  # small sets too: the pool holds ≥ 2·L2
        assert BT.pool_count(set_bytes, l2) * set_bytes >= 2 * l2, set_bytes
    assert BT.pool_count(4 << 20, l2) == 25
    assert BT.pool_count(1 << 20, 1 << 30) == 1024  # 2·L2 above the memory bound: the pool stays within 1 GiB
    assert BT.pool_count(4 << 20, l2, cap=3) == 3
    assert dtype_from_name("bf16") is torch.bfloat16 and dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_name("int8")


# --------------------------------------------------------------------------------- results format
def _entry(provider, ms, name="preact_resnet50/layer1.0/conv2", level="unit", mode="fwd+bwd", mem=1000):
    fl = unit_flops(R50_3X3, "fwd+bwd") if level != "model" else None
    nb = unit_min_bytes(R50_3X3, "fwd+bwd", 2) if level != "model" else None
    return bench.make_entry(name=name, level=level, provider=provider, mode=mode, dtype="bf16", batch=128,
                            times_ms=[ms * 1.1, ms, ms * 0.95], peak_mem_bytes=mem, flops=fl, min_bytes=nb,
                            floor=floor_ms(fl, nb, 800.0, 3000.0) if fl else None)


def _results(entries):
    return dict(device="NVIDIA H100 80GB HBM3", driver="580.159.04", torch="2.11.0", triton="3.6.0", commit="abc123",
                date="2026-11-20T15:30:00Z", command="python -m fused_preact.bench", results=entries,
                skipped=[dict(name="x", level="unit", provider="cuda", reason="not built")], peaks=dict(tflops=800, gbps=3000))


def test_entry_fields_from_explicit_timing():
    e = bench.make_entry(name="m/l/c", level="unit", provider="triton", mode="fwd", dtype="bf16", batch=128,
                         times_ms=[3.0, 1.0, 2.0], peak_mem_bytes=5, flops=4e12, min_bytes=6e9, floor=1.5)
    assert e["median_ms"] == 2.0 and e["min_ms"] == 1.0 and e["reps"] == 3
    assert e["tflops"] == pytest.approx(2000.0) and e["gbps"] == pytest.approx(3000.0)
    assert e["floor_ms"] == 1.5 and e["pct_of_floor"] == pytest.approx(75.0)
    with pytest.raises(ValueError):
        bench.make_entry(name="x", level="unit", provider="p", mode="fwd", dtype="bf16", batch=1, times_ms=[],
                         peak_mem_bytes=0)


def test_results_file_schema(tmp_path):
    obj = _results([_entry("eager", 2.0, mem=4000), _entry("triton", 1.0, mem=1000),
                    _entry("eager", 50.0, name="preact_resnet50/train_step", level="model", mode="step")])
    path = bench.results_path(tmp_path, obj["device"], obj["date"])
    assert path.name == "nvidia-h100-80gb-hbm3-2026-11-20-15-30-00.json"
    bench.annotate(obj["results"])
    bench.write_results(obj, path)
    back = json.loads(path.read_text())
    assert bench.validate_results(back) == []
    for key in ("device", "driver", "torch", "triton", "commit", "date", "command", "results"):
        assert key in back
    tri = back["results"][1]
    for key in ("name", "level", "provider", "mode", "dtype", "batch", "median_ms", "peak_mem_bytes", "floor_ms"):
        assert key in tri
    assert tri["speedup_vs_eager"] == pytest.approx(2.0) and tri["mem_vs_eager"] == pytest.approx(0.25)
    assert "floor_ms" not in back["results"][2]


def test_validation_rejects_bad_results(tmp_path):
    bad = _results([_entry("triton", 1.0)])
    del bad["results"][0]["floor_ms"]
    bad["results"].append(dict(bad["results"][0], level="layer", median_ms=0.0))
    del bad["driver"]
    problems = bench.validate_results(bad)
    assert any("driver" in p for p in problems)
    assert any("floor_ms" in p for p in problems)
    assert any("level" in p for p in problems) and any("median_ms" in p for p in problems)
    with pytest.raises(ValueError):
        bench.write_results(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_table_and_markdown_show_speedups():
    obj = _results([_entry("eager", 2.0), _entry("compile", 1.5), _entry("triton", 1.0)])
    text = bench.format_table(obj)
    assert "2.00×" in text and "1.50×" in text  # triton vs eager, vs compile
    assert "H100" in text and "580.159.04" in text and "not built" in text
    md = bench.markdown_report(obj)
    assert md.count("| unit | fwd+bwd | triton | 1 | 2.00× | 1.50× |") == 1


def test_chart_keeps_every_dtype(tmp_path, monkeypatch):
    """A run of several dtypes charts one row per name and dtype: no dtype's value replaces another's."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    entries = []
    for dtype, triton_ms in (("bf16", 2.0), ("fp16", 0.25)):
        for provider, ms in (("eager", 1.0), ("triton", triton_ms)):
            entries.append(bench.make_entry(name="m/layer1.0", level="block", provider=provider, mode="fwd+bwd",
                                            dtype=dtype, batch=8, times_ms=[ms], peak_mem_bytes=10))
            entries.append(bench.make_entry(name="m/train_step", level="model", provider=provider, mode="step",
                                            dtype=dtype, batch=8, times_ms=[10 * ms],
                                            peak_mem_bytes=(2 << 30 if dtype == "bf16" else 4 << 30) >> (provider != "eager")))
    bench.annotate(entries)
    blocks = [e for e in entries if e["level"] == "block"]
    labels, series = chart_series(blocks, "speedup_vs_eager")
    assert labels == ["m/layer1.0 [bf16]", "m/layer1.0 [fp16]"] and series == {"triton": [0.5, 4.0]}
    drawn = []
    real = matplotlib.axes.Axes.barh

    def barh(self, y, width, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(width)))
        return real(self, y, width, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", barh)
    bench.write_chart(_results(entries), tmp_path / "chart.png")
    assert ("triton", [0.5, 4.0]) in drawn  # block speedups, and the step's: one bar per dtype
    assert ("eager", [2.0, 4.0]) in drawn and ("triton", [1.0, 2.0]) in drawn  # step memory (GiB)


def test_chart_png(tmp_path):
    pytest.importorskip("matplotlib")
    obj = _results([_entry("eager", 2.0), _entry("triton", 1.0),
                    _entry("eager", 50.0, name="preact_resnet164/train_step", level="model", mode="step", mem=8 << 30),
                    _entry("triton-cudagraph", 30.0, name="preact_resnet164/train_step", level="model", mode="step",
                           mem=4 << 30)])
    path = bench.write_chart(obj, tmp_path / "chart.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_report_rerenders_existing_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = bench.write_results(_results([_entry("eager", 2.0), _entry("triton", 1.0)]), tmp_path / "r.json")
    assert bench.main(["--report", str(path)]) == 0
    assert (tmp_path / "r.md").exists() and (tmp_path / "r.png").exists()
    assert "2.00×" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["missing", "folder", "not-json"])
def test_report_of_an_unreadable_file_is_refused(tmp_path, capsys, kind):
    """--report of a missing file, a folder or malformed JSON: a message and exit 2, as the docstring says."""
    path = {"missing": tmp_path / "none.json", "folder": tmp_path, "not-json": tmp_path / "bad.json"}[kind]
    (tmp_path / "bad.json").write_text("{not json")
    assert bench.main(["--report", str(path)]) == 2
    assert f"cannot read --report {path}" in capsys.readouterr().err


def test_report_of_results_that_are_not_a_list_is_refused(tmp_path, capsys):
    path = tmp_path / "odd.json"
    path.write_text('{"results": 5}')
    assert bench.main(["--report", str(path)]) == 2
    assert "not a valid results file" in capsys.readouterr().err  # was a TypeError traceback, exit 1


@pytest.mark.parametrize("field", ["skipped", "peaks", "peaks-rates", "auto", "infinite-median"])
def test_report_of_malformed_optional_fields_is_refused(tmp_path, capsys, field):
    """Fields the report reads beyond the required ones (skipped tasks, peaks, auto records) and a
    non-finite time: a message and exit 2, not a traceback or a table of Infinity."""
    obj = _results([_entry("eager", 2.0), _entry("auto", 1.0)])
    if field == "skipped":
        obj["skipped"] = [{"name": "x"}]
    elif field == "peaks":
        obj["peaks"] = {"tflops": "fast"}
    elif field == "peaks-rates":
        obj["peaks"] = {"tflops": 800, "matmul_tflops": [800]}
    elif field == "auto":
        obj["results"][1]["auto"] = [{"runs": "triton"}]
    else:
        obj["results"][0]["median_ms"] = float("inf")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(obj))  # Infinity is what json writes for inf
    assert bench.main(["--report", str(path), "--no-chart"]) == 2
    assert "not a valid results file" in capsys.readouterr().err
    assert bench.validate_results(_results([_entry("eager", 2.0)])) == []


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--batch", "-4"], "argument --batch: must be at least 1, got -4"),
    (["--reps", "0"], "argument --reps: must be at least 1, got 0"),
    (["--model-reps", "0"], "argument --model-reps: must be at least 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    (["--time-limit", "0"], "argument --time-limit: must be a number > 0, got 0"),
    (["--level", "unit", "--providers", "cudnn"], "nothing to run: no task for --providers cudnn at --level unit"),
    (["--level", "unit", "--modes", "enqueue"], "the unit level has no enqueue mode"),
])
def test_bench_cli_errors_are_argparse_errors(argv, message, capsys):
    """Invalid counts and a plan without a task end in argparse's usage error (exit 2) before anything runs."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--out", "/nonexistent/never-written"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fused_preact.bench") and message in err, err


def test_unwritable_out_is_refused_before_any_gpu_work(tmp_path, capsys):
    """``--out`` under a file: argparse's usage error (exit 2) before the CUDA check and any run."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        bench.main(["--level", "unit", "--quick", "--out", str(blocker / "results")])
    assert e.value.code == 2
    assert f"argument --out: {str(blocker)!r} is a file, not a folder" in capsys.readouterr().err


def test_static_flag_abbreviated(capsys):
    """argparse takes --stat for --static: it prints where the static report lives, like --static."""
    for flag in ("--static", "--stat"):
        assert bench.main([flag, "--arch", "sm_90"]) == 2
        assert "python -m tools.static_report" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- running
def test_plan_runs_cheap_providers_first():
    tasks = bench._plan(["unit", "model"], ["preact_resnet50", "preact_resnet164"], list(bench._ALL_PROVIDERS), 128, True)
    groups = [t.group for t in tasks]
    assert groups == sorted(groups)
    first_compile = next(i for i, t in enumerate(tasks) if t.provider == "compile")
    assert all(t.provider not in bench._COMPILE for t in tasks[:first_compile])
    assert tasks[-1].provider == "compile-max-autotune"
    assert (tasks[first_compile].level, tasks[first_compile].model) == ("model", "preact_resnet50")
    assert tasks[first_compile + 1].level == "unit"
    graphs = [t for t in tasks if t.provider.endswith("-cudagraph")]
    assert {(t.level, t.model) for t in graphs} == {("model", "preact_resnet164")}


def test_source_sha256_hashes_the_package_sources(tmp_path):
    """``source_sha256`` covers the package's Python files and csrc/ beside it: an edit to either changes it."""
    empty = "e3b0c44298fc1c14"  # sha256 of nothing
    assert bench._source_sha256() != empty
    pkg = tmp_path / "fused_preact"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "kernel.py").write_text("x = 1\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "kernel.cpython-312.pyc").write_bytes(b"cache")
    first = bench._source_sha256(pkg)
    assert first != empty
    (pkg / "__pycache__" / "kernel.cpython-312.pyc").write_bytes(b"other cache")
    assert bench._source_sha256(pkg) == first  # caches do not count
    (pkg / "ops" / "kernel.py").write_text("x = 2\n")
    edited = bench._source_sha256(pkg)
    assert edited != first
    (tmp_path / "csrc" / "checks").mkdir(parents=True)
    (tmp_path / "csrc" / "checks" / "k.cu").write_text("// kernel\n")
    assert bench._source_sha256(pkg) not in (first, edited)


def test_floor_uses_the_timed_dtypes_matmul_peak(host_harness, monkeypatch):
    """An fp32 (or fp16) entry's roofline floor comes from that dtype's measured matmul rate, not bf16's,
    and the report's header names each rate (fp32 with the math it ran: TF32 or IEEE)."""
    monkeypatch.setattr(BT, "peak_memory", lambda run, setup: 0)
    run = object.__new__(bench._Run)
    run.a = argparse.Namespace(modes=["fwd"], warmup=0, reps=1, max_s=10.0, batch=2, quick=False)
    run.peaks = BT.Peaks(tflops=1000.0, gbps=1e6, matmul_n=8, copy_bytes=8, l2_bytes=1 << 10, sm_count=1,
                         matmul_tflops={"bf16": 1000.0, "fp32": 1e-3}, fp32_math="tf32")
    u = UnitShape("m", "m/l/c", 2, 8, 5, 5, 8, 3, 3, (1, 1), (1, 1))
    (e,) = run.layer(bench._Task("unit", "m", u, "eager", 0, 0, "fp32"))
    fl = unit_flops(u, "fwd")
    assert e["floor_ms"] == pytest.approx(floor_ms(fl, unit_min_bytes(u, "fwd", 4), 1e-3, 1e6))
    assert e["floor_ms"] == pytest.approx(fl / 1e6)  # compute-bound at the fp32 rate (1e9 FLOP/s)
    obj = dict(_results([e]), dtype="bf16 fp32", peaks=run.peaks.as_dict())
    assert "measured peaks 1000 TFLOP/s bf16, 0 TFLOP/s fp32 (TF32), 1000000 GB/s" in bench.format_table(obj)
    old = dict(obj, peaks=dict(tflops=800, gbps=3000))  # a file from before per-dtype peaks
    assert "800 TFLOP/s bf16 (the fp32 floors use the bf16 rate)" in bench.format_table(old)


def test_cli_refuses_without_cuda(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, "-m", "fused_preact.bench", "--quick", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no CUDA device" in p.stderr
    assert not out.exists()


@pytest.fixture
def host_harness(monkeypatch):
    monkeypatch.setattr(BT, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return BT


def test_layer_harness_computes_the_unit_and_its_gradients(host_harness):
    u = UnitShape("m", "m/l/c", 3, 4, 6, 5, 8, 3, 3, (2, 2), (1, 1))
    mod = BT.unit_module("eager", u, torch.float64)
    assert [type(m) for m in mod] == [nn.BatchNorm2d, nn.ReLU, nn.Conv2d]
    h = BT.LayerHarness(mod, (3, 4, 6, 5), torch.float64, l2_bytes=50 << 20, pool_cap=3)
    assert h.n == 3 and h.out_shape == (3, 8, 3, 3) and len(h.xs) == len(h.dys) == 3
    assert h.xs[0].is_contiguous(memory_format=torch.channels_last)
    setup, run = h.fns("fwd+bwd")
    k = setup(4)
    grads = run(k)
    x = h.xs[k].detach().clone().requires_grad_()
    ref_mod = nn.Sequential(OrderedDict(bn=nn.BatchNorm2d(4), relu=nn.ReLU(), conv=nn.Conv2d(4, 8, 3, 2, 1, bias=False)))
    ref_mod = ref_mod.double()
    ref_mod.load_state_dict(mod.state_dict())
    ref = torch.autograd.grad(ref_mod(x), [x, *ref_mod.parameters()], h.dys[k])
    assert len(grads) == 4
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    y, kb = h.fns("bwd")[0](1)
    assert y.shape == (3, 8, 3, 3) and [g.shape for g in h.fns("bwd")[1]((y, kb))] == [r.shape for r in ref]
    times = BT.time_cuda(run, setup, warmup=1, reps=4, max_s=10.0)
    assert len(times) == 4 and all(t > 0 for t in times)


@pytest.fixture(params=["extension-built", "extension-missing"])
def cuda_extension(request, monkeypatch):
    """Either state of ``fused_preact._C`` whatever this machine has: loaded or not (the dispatcher asks
    ``fused_preact.ops.cuda.ext.available()``)."""
    from fused_preact.ops.cuda import ext as _cuda

    built = request.param == "extension-built"
    monkeypatch.setattr(_cuda, "available", lambda: built)
    monkeypatch.setattr(_cuda, "load_error", lambda: None if built else "ImportError: fused_preact._C is not built")
    return built


def test_unavailable_providers_skip_with_a_reason(host_harness, cuda_extension):
    """On a CPU tensor the cuda provider is skipped, with the extension built (the tensor is on the CPU)
    or not (the extension is missing); a shape the CUTLASS kernels do not serve is skipped by its reason."""
    u = UnitShape("m", "m/l/c", 2, 8, 4, 4, 8, 1, 1)
    with pytest.raises(BT.Skip, match="cuda") as skip:
        BT.unit_module("cuda", u, torch.bfloat16)
    assert ("is on cpu" if cuda_extension else "not available") in str(skip.value)
    grouped = UnitShape("m", "m/l/c", 2, 8, 4, 4, 8, 3, 3, (1, 1), (1, 1), (1, 1), 2)
    with pytest.raises(BT.Skip, match="groups=2 not supported"):
        BT.unit_module("cuda", grouped, torch.bfloat16)
    with pytest.raises(BT.Skip, match="CIFAR"):
        BT.StepHarness(bench.MODEL_SPECS["preact_resnet50"], "triton-cudagraph", 2, torch.float32, 50 << 20)
    with pytest.raises(ValueError):
        BT.unit_module("tensorrt", u, torch.bfloat16)
    # the model-level probe uses the first block's input (16 channels), not the 3-channel image
    with pytest.raises(BT.Skip) as skip:
        BT.StepHarness(bench.MODEL_SPECS["preact_resnet164"], "cuda", 2, torch.bfloat16, 50 << 20)
    assert "cuda" in str(skip.value) and "channels 3" not in str(skip.value)


@pytest.fixture
def native_device(monkeypatch):
    """Harness device: CUDA where there is one, else CPU with Triton's interpreter (tests/conftest.py)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(BT, "DEVICE", "cpu")
    return BT.DEVICE


def test_fused_provider_really_runs_the_fused_backend(native_device):
    u = UnitShape("m", "m/l/c", 2, 8, 5, 5, 8, 3, 3, (1, 1), (1, 1))
    mod = BT.unit_module("triton", u, torch.float32)
    h = BT.LayerHarness(mod, (2, 8, 5, 5), torch.float32, l2_bytes=1 << 20, pool_cap=2, provider="triton")
    assert h.backend == "triton" and BT.fused_backends(mod) == {"triton"}
    wrong = BT.unit_module("triton", u, torch.float32)
    wrong.backend = "reference"  # a fused module that does not run the promised backend
    with pytest.raises(RuntimeError, match="instead of only 'triton'"):
        BT.LayerHarness(wrong, (2, 8, 5, 5), torch.float32, l2_bytes=1 << 20, pool_cap=2, provider="triton")
    eager = BT.unit_module("eager", u, torch.float32)
    assert BT.LayerHarness(eager, (2, 8, 5, 5), torch.float32, 1 << 20, 2, provider="eager").backend == "eager"
    with pytest.raises(RuntimeError, match="fused modules"):
        BT.check_backend(mod, "eager")
    with pytest.raises(RuntimeError, match=r"ran \['None'\]"):  # built but never run
        BT.check_backend(BT.unit_module("triton", u, torch.float32), "triton")


def test_step_harness_trains_and_records_what_ran(host_harness, monkeypatch):
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    h = BT.StepHarness(bench.MODEL_SPECS["preact_resnet20"], "eager", 4, torch.float32, l2_bytes=1 << 20)
    assert h.n == 43 and h.xs[0].is_contiguous(memory_format=torch.channels_last)  # ⌈2 MiB / 48 KiB batches⌉: 2·L2
    before = [p.detach().clone() for p in h.model.parameters()]
    m = h.measure(warmup=1, reps=2, max_s=10.0)
    assert len(m.times_ms) == 2 and m.extra == {"pool": 43, "backend": "eager"}
    assert all(not torch.equal(a, b) for a, b in zip(before, h.model.parameters()))  # SGD stepped every weight


@pytest.mark.skipif(torch.cuda.is_available(), reason="harness on the CPU with Triton's interpreter")
def test_recompute_and_auto_providers_record_what_ran(host_harness, monkeypatch):
    """recompute runs the recompute backend; auto / auto-lean run backend="auto" (measured here on the
    CPU with an injected timer) and their measurements carry each fused module's choice, its source and
    the candidates' times, which the report's auto table summarizes."""
    from fused_preact.bench.shapes import BlockShape
    from fused_preact.ops import auto

    monkeypatch.setenv("FUSED_PREACT_DISPATCH", "measure")
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CACHE", "none")
    monkeypatch.setattr(BT, "peak_memory", lambda run, setup: 0)
    auto.forget()
    u = UnitShape("m", "m/l/c", 2, 8, 5, 5, 8, 3, 3, (1, 1), (1, 1))
    h = BT.LayerHarness(BT.unit_module("recompute", u, torch.float32), (2, 8, 5, 5), torch.float32, 1 << 20, 2,
                        provider="recompute")
    assert h.backend == "recompute"
    times = {"triton": 2.0, "recompute": 3.0, "reference": 1.0}
    b = BlockShape("m", "m/b", "basic", 2, 5, 5, 8, 8, 1)
    entries = []
    try:
        with auto.measuring(devices=("cpu",), timer=lambda name, run, dev: times[name]):
            for provider, winner in (("auto", "reference"), ("auto-lean", "triton")):
                mod = BT.block_module(provider, b, torch.float32)
                lh = BT.LayerHarness(mod, (2, 8, 5, 5), torch.float32, 1 << 20, 2, provider=provider)
                assert lh.backend == "auto"
                m = lh.measure("fwd+bwd", warmup=0, reps=1, max_s=60.0)
                (choice,) = m.extra["auto"]
                assert choice["runs"] == winner and choice["source"] in ("measured", "process")
                assert choice["candidates"]["reference"] == 1.0
                entries.append(bench.make_entry(name="m/b", level="block", provider=provider, mode="fwd+bwd",
                                                dtype="fp32", batch=2, times_ms=m.times_ms, peak_mem_bytes=0, **m.extra))
    finally:
        auto.forget()
    obj = _results(entries)
    text = bench.format_table(obj)
    assert "auto: backends chosen" in text and "reference×1" in text and "triton×1" in text


def test_check_auto_applies_the_gpu_targets(tmp_path, capsys):
    """benchmarks/check_auto.py: auto must reach 0.98× eager's speed, auto-lean at most 0.6× its memory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import check_auto
    finally:
        sys.path.pop(0)

    def entry(provider, ms, mem):
        e = bench.make_entry(name="m/b", level="block", provider=provider, mode="fwd+bwd", dtype="bf16", batch=2,
                             times_ms=[ms], peak_mem_bytes=mem)
        e["auto"] = [dict(module="", runs="recompute", source="measured", memory="fastest", reason=None,
                          candidates={"triton": "invalid: dx: 3e-02 > ...", "recompute": ms})]
        return e

    path = tmp_path / "r.json"
    path.write_text(json.dumps(_results([entry("eager", 1.0, 100), entry("auto", 1.01, 90),
                                         entry("auto-lean", 1.2, 55)])))
    assert check_auto.main([str(path)]) == 0
    path.write_text(json.dumps(_results([entry("eager", 1.0, 100), entry("auto", 1.1, 90),
                                         entry("auto-lean", 1.2, 70)])))
    assert check_auto.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "invalid: triton" in out
    path.write_text(json.dumps(_results([entry("eager", 1.0, 100)])))
    assert check_auto.main([str(path)]) == 2
    # the targets are per block and training step: a unit's fwd+bwd entry is not judged
    unit = [dict(e, level="unit", name="m/b/conv1") for e in (entry("eager", 1.0, 100), entry("auto", 2.0, 90))]
    path.write_text(json.dumps(_results([entry("eager", 1.0, 100), entry("auto", 1.01, 90)] + unit)))
    assert check_auto.main([str(path)]) == 0
    assert "m/b/conv1" not in capsys.readouterr().out
