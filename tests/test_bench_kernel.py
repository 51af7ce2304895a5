"""The benchmark's kernel level and enqueue mode on CPU: the task list, that the cuDNN reference calls
compute what the timed Triton kernels compute (Triton's interpreter), the glue from calls to results
entries, and the report's kernel and enqueue tables.

No timing is taken here: where the measuring code runs, CUDA events, synchronization and the sleep
kernel are host stand-ins, only to run the closures and check what they produce.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from helpers import HostEvent

from fused_preact.bench import kernels as K
from fused_preact.bench import report as bench_report
from fused_preact.bench import run as bench
from fused_preact.bench import timing as BT
from fused_preact.bench.shapes import MODES, UnitShape, enumerate_blocks, enumerate_units


# ------------------------------------------------------------------------------------- task list
def test_kernel_tasks_cover_every_unit_mode_and_provider():
    models = ["preact_resnet50", "preact_resnet164"]
    tasks = bench._plan(["kernel"], models, list(bench._ALL_PROVIDERS), 128, False, ("bf16", "fp16"))
    units = [u for m in models for u in enumerate_units(m, 128)]
    assert len(units) == 22 + 16
    assert len(tasks) == len(units) * (3 + 4)  # cudnn-fused only in fp16
    assert {t.level for t in tasks} == {"kernel"} and {t.group for t in tasks} == {0}
    assert [t.name for t in tasks if t.dtype == "bf16" and t.provider == "cudnn"] == [u.name for u in units]
    assert {t.provider for t in tasks} == set(K.KERNEL_PROVIDERS)
    assert {t.dtype for t in tasks if t.provider == "cudnn-fused"} == {"fp16"}
    assert [t.dtype for t in tasks][:1] == ["bf16"] and [t.dtype for t in tasks][-1] == "fp16"  # dtype-major
    assert all(t.item.N == 128 for t in tasks)
    # cudnn is always the reference; other kernel providers only when asked for
    few = bench._plan(["kernel"], models, ["eager", "triton"], 64, False)
    assert {t.provider for t in few} == {"cudnn", "triton"} and all(t.item.N == 64 for t in few)
    # modes: every unit has all three, cudnn-fused only its forward graph
    b = K.KernelBench(UnitShape("m", "m/l/c", 2, 8, 4, 4, 8, 1, 1), torch.float32, 1 << 20, device="cpu")
    assert b.modes("triton") == K.KERNEL_MODES == ("fprop", "dgrad", "wgrad") and b.modes("cudnn-fused") == ("fprop",)
    with pytest.raises(ValueError):
        b.call("eager", "fprop")
    with pytest.raises(ValueError):
        b.call("triton", "fwd")


def test_quick_run_includes_two_kernel_shapes():
    tasks = bench._plan(list(bench.LEVELS), ["preact_resnet50", "preact_resnet164"], list(bench._ALL_PROVIDERS), 128,
                        True, ("bf16",), MODES + ("enqueue",))
    kern = [t for t in tasks if t.level == "kernel"]
    assert len({t.name for t in kern}) == 2
    picked = {t.model: t.item for t in kern}
    assert "preact_resnet50/layer1.0/conv2" in picked["preact_resnet50"].names
    assert "preact_resnet164/layer1.1/conv2" in picked["preact_resnet164"].names
    levels = [t.level for t in tasks if t.group == 0]
    assert levels == sorted(levels, key=["unit", "block", "model", "kernel"].index)  # kernel last of the cheap group
    assert all(t.provider in K.KERNEL_PROVIDERS for t in kern)
    assert not any(t.provider in K.KERNEL_PROVIDERS and t.provider not in ("triton", "cuda") for t in tasks
                   if t.level != "kernel")


def test_enqueue_alone_keeps_enqueue_providers_of_blocks_and_models():
    tasks = bench._plan(["unit", "block", "model"], ["preact_resnet164"], list(bench._ALL_PROVIDERS), 8, False,
                        ("bf16",), ("enqueue",))
    assert {t.level for t in tasks} == {"block", "model"}
    assert {t.provider for t in tasks} == set(bench.ENQUEUE_PROVIDERS)
    n_blocks = len(enumerate_blocks("preact_resnet164", 8))
    assert len([t for t in tasks if t.level == "block"]) == n_blocks * len(bench.ENQUEUE_PROVIDERS)
    both = bench._plan(["block"], ["preact_resnet164"], ["eager", "compile"], 8, False, ("bf16",), ("fwd", "enqueue"))
    assert {t.provider for t in both} == {"eager", "compile"}


def test_cli_kernel_level_refuses_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "results"
    argv = ["--level", "kernel", "--dtype", "bf16", "fp16", "--providers", "triton", "cudnn", "--out", str(out)]
    assert bench.main(argv) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()
    a = bench._parser().parse_args(argv + ["--modes", "enqueue", "--kernel-modes", "dgrad"])
    assert a.dtype == ["bf16", "fp16"] and a.modes == ["enqueue"] and a.kernel_modes == ["dgrad"]


# ---------------------------------------------------------------- same convolution, same numbers
UNITS = {
    "3x3-stride2": (UnitShape("m", "m/l/s2", 2, 8, 6, 6, 16, 3, 3, (2, 2), (1, 1)), None),
    "1x1-splitK": (UnitShape("m", "m/l/pw", 2, 16, 5, 5, 8, 1, 1), 3),
    "3x3-groups2": (UnitShape("m", "m/l/g2", 2, 8, 5, 5, 8, 3, 3, (1, 1), (1, 1), groups=2), None),
}


@pytest.mark.parametrize("case", list(UNITS))
def test_cudnn_reference_computes_what_the_triton_kernel_computes(case):
    """The benchmark times the same convolution on both sides: F.conv2d / convolution_backward on
    a = relu(bn(x)) against the recorded Triton launches on x (interpreter on CPU, fp32)."""
    u, split = UNITS[case]
    b = K.KernelBench(u, torch.float32, 1 << 20, device="cpu", pool_cap=2, split=split)
    assert b.n == 2
    for mode in K.KERNEL_MODES:
        tri, ref = b.call("triton", mode), b.call("cudnn", mode)
        k = tri.setup(3)
        assert k == ref.setup(3) == 1
        tri.run(k)
        want = ref.run(k)
        if mode == "dgrad":  # the fused dgrad stores dz = da·[a > 0]; cuDNN's dgrad gives da
            want = want * (b.activations()[k] > 0)
        got = b.triton_result(mode, k)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if mode == "wgrad" and split:
            assert tri.launches == ["wgrad", "dx (split-K fold only)"] and "split-K 3" in tri.note
        else:
            assert tri.launches == [mode]
    # the pool entries differ: a call on entry 0 is not entry 1's
    assert not torch.equal(b.xs[0], b.xs[1])


def test_other_providers_skip_with_a_reason_on_cpu():
    b = K.KernelBench(UnitShape("m", "m/l/c", 2, 8, 4, 4, 8, 1, 1), torch.float16, 1 << 20, device="cpu")
    with pytest.raises(BT.Skip, match="cuda"):
        b.call("cuda", "fprop")
    with pytest.raises(BT.Skip, match="CUDA device"):
        b.call("cudnn-fused", "fprop")
    with pytest.raises(BT.Skip, match="only the forward graph"):
        b.call("cudnn-fused", "wgrad")
    with pytest.raises(BT.Skip, match="float16 only"):
        K.KernelBench(b.u, torch.bfloat16, 1 << 20, device="cpu").call("cudnn-fused", "fprop")


def test_kernel_cost_model():
    u = UnitShape("m", "m/x/conv", 1, 1, 4, 4, 1, 3, 3, (1, 1), (1, 1))  # x 16, W 9, y 16 elements
    assert K.kernel_flops(u) == 2 * 16 * 9
    assert [K.kernel_min_bytes(u, m, 2) for m in K.KERNEL_MODES] == [2 * (16 + 9 + 16)] * 3
    with pytest.raises(ValueError):
        K.kernel_min_bytes(u, "fwd", 2)


# --------------------------------------------------------------------------- measuring glue (host)
@pytest.fixture
def host(monkeypatch):
    sleeps = []
    monkeypatch.setattr(BT, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles))
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    return sleeps


def _fake_run(**args):
    a = dict(kernel_modes=list(K.KERNEL_MODES), warmup=1, reps=3, max_s=10.0, batch=2, modes=["enqueue"], quick=True,
             enqueue_steps=4)
    a.update(args)
    fake = SimpleNamespace(a=SimpleNamespace(**a), peaks=BT.Peaks(100.0, 1000.0, 1, 1, 1 << 12, 1))
    fake._enqueue = lambda *x, **k: bench._Run._enqueue(fake, *x, **k)
    fake.skipped = []
    fake.skip = lambda t, reason: fake.skipped.append(reason)
    return fake


def test_kernel_task_makes_valid_entries(host):
    u = UnitShape("m", "m/l/c", 2, 8, 5, 5, 16, 3, 3, (1, 1), (1, 1), names=("m/l/c", "m/l2/c"))
    task = bench._Task("kernel", "m", u, "triton", 0, 0, "fp32")
    entries = bench._Run.kernel(_fake_run(), task)
    assert [e["mode"] for e in entries] == list(K.KERNEL_MODES)
    assert host == [K.HOST_AHEAD_CYCLES] * (3 * 3)  # one sleep kernel ahead of every timed call
    for e in entries:
        assert e["level"] == "kernel" and e["provider"] == "triton" and e["dtype"] == "fp32" and e["reps"] == 3
        assert e["flops"] == K.kernel_flops(u) and e["count"] == 2 and e["launches"] == [e["mode"]]
        assert e["floor_ms"] > 0 and "sleep kernel" in e["timer"]
    ref = bench._Run.kernel(_fake_run(kernel_modes=["wgrad"]), bench._Task("kernel", "m", u, "cudnn", 0, 1, "fp32"))
    assert [e["mode"] for e in ref] == ["wgrad"] and ref[0]["launches"] == ["aten.convolution_backward"]
    obj = dict(device="cpu", driver="-", torch="-", triton="-", commit="-", date="-", command="-", results=entries + ref)
    assert bench.validate_results(obj) == []
    bench.annotate(obj["results"])
    assert entries[2]["ratio_vs_cudnn"] == pytest.approx(entries[2]["median_ms"] / ref[0]["median_ms"])
    with pytest.raises(BT.Skip, match="has no call"):
        bench._Run.kernel(_fake_run(kernel_modes=["dgrad"]), bench._Task("kernel", "m", u, "cudnn-fused", 0, 2, "fp16"))


def test_time_enqueue_counts_host_time_and_wall_time(host):
    calls = []
    enq, wall = BT.time_enqueue(lambda k: (calls.append(k), time.sleep(0.001)), lambda i: i, steps=5, repeats=3,
                                warmup=2)
    assert len(enq) == len(wall) == 3 and len(calls) == 2 + 15 and calls[-1] == 16
    assert all(0.5 < e <= w for e, w in zip(enq, wall))  # ms per step, each step sleeps 1 ms
    with pytest.raises(ValueError):
        BT.time_enqueue(lambda k: None, steps=0)


def test_block_and_model_enqueue_entries(host):
    b = enumerate_blocks("preact_resnet20", 2)[0]
    fake = _fake_run()
    (e,) = bench._Run.layer(fake, bench._Task("block", "preact_resnet20", b, "eager", 0, 0, "fp32"))
    assert (e["mode"], e["steps"], e["reps"], e["backend"]) == ("enqueue", 4, 2, "eager")
    assert 0 < e["median_ms"] <= e["wall_ms"] and len(e["wall_times_ms"]) == 2
    spec = bench.MODEL_SPECS["preact_resnet20"]
    (m,) = bench._Run.model(fake, bench._Task("model", "preact_resnet20", spec, "eager", 0, 1, "fp32"))
    assert (m["level"], m["mode"], m["reps"]) == ("model", "enqueue", 1) and m["median_ms"] <= m["wall_ms"]
    obj = dict(device="cpu", driver="-", torch="-", triton="-", commit="-", date="-", command="-", results=[e, m])
    assert bench.validate_results(obj) == []


# ------------------------------------------------------------------------------------------ report
def _k(name, provider, ms, mode="fprop", dtype="bf16", count=1):
    u = UnitShape("m", name, 8, 64, 56, 56, 64, 3, 3, (1, 1), (1, 1))
    return bench.make_entry(name=name, level="kernel", provider=provider, mode=mode, dtype=dtype, batch=8,
                            times_ms=[ms], peak_mem_bytes=0, flops=K.kernel_flops(u),
                            min_bytes=K.kernel_min_bytes(u, mode, 2), floor=0.01, shape=u.describe(), count=count)


def _q(level, name, provider, ms, wall):
    return bench.make_entry(name=name, level=level, provider=provider, mode="enqueue", dtype="bf16", batch=8,
                            times_ms=[ms], peak_mem_bytes=0, wall_ms=wall, steps=20)


def _obj(entries):
    return dict(device="NVIDIA H100", driver="1", torch="2", triton="3", commit="abc", date="2026-11-22T00:00:00Z",
                command="python -m fused_preact.bench --level kernel", dtype="bf16 fp16", batch=8, results=entries,
                skipped=[dict(name="m/a", level="kernel", provider="cuda", reason="not built")])


def test_report_renders_kernel_and_enqueue_tables(tmp_path, capsys):
    entries = [_k("m/a", "cudnn", 1.0), _k("m/a", "triton", 0.5), _k("m/a", "cuda", 0.8),
               _k("m/b", "cudnn", 1.0, count=4), _k("m/b", "triton", 2.0, count=4),
               _k("m/a", "cudnn", 2.0, dtype="fp16"), _k("m/a", "triton", 1.0, dtype="fp16"),
               _k("m/a", "cudnn", 1.0, mode="dgrad"), _k("m/a", "triton", 1.5, mode="dgrad"),
               _q("block", "m/layer1.0", "eager", 0.3, 0.6), _q("block", "m/layer1.0", "triton", 0.1, 0.5),
               _q("model", "m/train_step", "triton", 2.0, 2.1),
               bench.make_entry(name="m/train_step", level="model", provider="triton", mode="step", dtype="bf16",
                                batch=8, times_ms=[1.9], peak_mem_bytes=0)]
    obj = _obj(entries)
    assert bench.validate_results(obj) == []
    md = bench.markdown_report(obj)
    # geometric mean over shapes of fused/cudnn: sqrt(0.5 · 2.0) = 1; count-weighted (0.5 + 4·2) / (1 + 4) = 1.7
    assert "| fprop | bf16 | triton | 2 | 1.00× | 0.50× | 2.00× | 1.70× |" in md
    assert "| fprop | bf16 | cuda | 1 | 0.80× | 0.80× | 0.80× | 0.80× |" in md
    assert "| fprop | fp16 | triton | 1 | 0.50× |" in md and "| dgrad | bf16 | triton | 1 | 1.50× |" in md
    assert "| m/a (64→64 3×3/1 @56²) | bf16 | fprop | 1.0000 | 0.5000 | 0.8000 | 0.50× | 0.80× |" in md
    assert "| m/b (64→64 3×3/1 @56²) | bf16 | fprop | 1.0000 | 2.0000 | – | 2.00× | – |" in md
    assert "| block | m/layer1.0 | bf16 | triton | 20 | 0.100 | 0.500 | 0.20 | – | 3.00× |" in md
    assert "| model | m/train_step | bf16 | triton | 20 | 2.000 | 2.100 | 0.95 | 1.900 | – |" in md
    assert "| kernel |" not in md and "| enqueue |" not in md  # not in the speedup tables
    text = bench.format_table(obj)
    assert "geometric mean over shapes" in text and "enqueue ms/step" in text and "not built" in text
    path = bench.write_results(obj, tmp_path / "k.json")
    assert bench.main(["--report", str(path), "--no-chart"]) == 0
    assert "1.70×" in (tmp_path / "k.md").read_text() and "1.70×" in capsys.readouterr().out


def test_chart_ignores_enqueue_and_kernel_entries(tmp_path):
    pytest.importorskip("matplotlib")
    step = bench.make_entry(name="m/train_step", level="model", provider="eager", mode="step", dtype="bf16", batch=8,
                            times_ms=[10.0], peak_mem_bytes=1 << 30)
    obj = _obj([step, _q("model", "m/train_step", "eager", 2.0, 9.0), _k("m/a", "cudnn", 1.0), _k("m/a", "triton", 0.5)])
    assert bench.write_chart(obj, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_entries_by_dtype_and_schema_of_the_new_modes():
    def unit(provider, ms, dtype):
        return bench.make_entry(name="m/u", level="unit", provider=provider, mode="fwd", dtype=dtype, batch=8,
                                times_ms=[ms], peak_mem_bytes=1, floor=0.1)
    res = [unit("eager", 2.0, "bf16"), unit("triton", 1.0, "bf16"), unit("eager", 4.0, "fp16"),
           unit("triton", 1.0, "fp16")]
    bench.annotate(res)
    assert [e.get("speedup_vs_eager") for e in res] == [None, 2.0, None, 4.0]
    head, rows = bench_report._rows(_obj(res))
    assert [r[1] for r in rows] == ["m/u [bf16]", "m/u [fp16]"]
    with pytest.raises(ValueError):
        bench.make_entry(name="x", level="kernel", provider="triton", mode="fwd", dtype="bf16", batch=1, times_ms=[1.0],
                         peak_mem_bytes=0)
    with pytest.raises(ValueError):
        bench.make_entry(name="x", level="unit", provider="triton", mode="dgrad", dtype="bf16", batch=1, times_ms=[1.0],
                         peak_mem_bytes=0)
    bad = _obj([dict(_k("m/a", "triton", 1.0), mode="fwd"), dict(_q("block", "b", "eager", 1.0, 2.0), wall_ms=None)])
    problems = bench.validate_results(bad)
    assert any("does not belong to level 'kernel'" in p for p in problems)
    assert any("wall_ms" in p for p in problems)


def test_a_failing_mode_keeps_the_modes_measured_around_it(host, monkeypatch):
    u = UnitShape("m", "m/l/c", 2, 8, 5, 5, 16, 3, 3, (1, 1), (1, 1))
    real = K.measure

    def measure(bench_, provider, mode, *args):
        if mode == "dgrad":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return real(bench_, provider, mode, *args)

    monkeypatch.setattr(K, "measure", measure)
    run = _fake_run()
    entries = bench._Run.kernel(run, bench._Task("kernel", "m", u, "cudnn", 0, 1, "fp32"))
    assert [e["mode"] for e in entries] == ["fprop", "wgrad"]
    assert run.skipped == ["dgrad: error: RuntimeError: CUDA error: an illegal memory access was encountered"]
    with pytest.raises(BT.Skip, match="dgrad: error: RuntimeError"):
        bench._Run.kernel(_fake_run(kernel_modes=["dgrad"]), bench._Task("kernel", "m", u, "cudnn", 0, 1, "fp32"))
