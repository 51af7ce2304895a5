"""Tile autotuning: the plan's tuning path (run through the interpreter with a stand-in timer), the
persistent cache, and a second process reusing it without timing anything."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICE

import fused_preact.ops.triton.plan as triton_plans
from fused_preact import FusedPreActBlock
from fused_preact.models import PreActBlock
from fused_preact.ops.triton import tuning as _tuning
from fused_preact.ops.triton.configs import GemmConfig, candidates

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="tunes through the interpreter with a stand-in timer")


def _fake_timer(monkeypatch, timed: list):
    """do_bench stand-in: runs the launch once (so its arguments are exercised) and 'times' it by its
    tile shape, preferring BLOCK_M = 64 and BLOCK_N = 32-or-less (unlike the heuristic)."""
    import triton.testing

    def fake(fn, warmup=0, rep=0, **kw):
        fn()
        kwargs = fn.kwargs
        timed.append((fn.name, kwargs.get("BLOCK_M"), kwargs.get("BLOCK_N")))
        return abs(kwargs.get("BLOCK_M", 64) - 64) + abs(kwargs.get("BLOCK_N", 32) - 32) + 1.0

    monkeypatch.setattr(triton.testing, "do_bench", fake)


def test_plan_tunes_picks_caches_and_stays_correct(monkeypatch, tmp_path):
    cache = tmp_path / "tune.json"
    monkeypatch.setenv("FUSED_PREACT_AUTOTUNE_CACHE", str(cache))
    monkeypatch.setattr(_tuning, "_caches", {})
    monkeypatch.setattr(triton_plans, "_tunes_on", lambda device: True)
    timed: list = []
    _fake_timer(monkeypatch, timed)
    torch.manual_seed(0)
    block = FusedPreActBlock(16, 16, backend="triton")
    eager = PreActBlock(16, 16)
    eager.load_state_dict(block.state_dict())
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    y = block(x)
    assert {t[0] for t in timed} == {"fprop", "dgrad", "wgrad"}
    plan = next(iter(block._plans.values()))[1]
    assert all(u.fcfg.BLOCK_M == 64 and u.dcfg.BLOCK_M == 64 for u in plan.units)  # the fake timer's choice
    entries = _tuning.TuneCache.read_folder(str(cache))
    assert len(entries) >= 3 and all(set(v) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "unroll",
                                                                   "slots", "halo"}
                                     for v in entries.values())
    # pairs keyed with a separator: stride (1, 12) and (11, 2) must not share "s112"
    assert all("|s1x1|p1x1|d1x1|" in k for k in entries if "R3S3" in k), list(entries)
    y.sum().backward()
    xe = x.detach().clone().requires_grad_()
    eager(xe).sum().backward()
    torch.testing.assert_close(y, eager(x.detach()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-4)


def test_second_process_reuses_the_cache(tmp_path):
    cache = tmp_path / "tune.json"
    cfg = GemmConfig(64, 32, 16, 4, 4)
    first = _tuning.TuneCache(str(cache))
    got = _tuning.choose(first, "k1", [GemmConfig(128, 64, 32), cfg], None, lambda c: 1.0 if c == cfg else 2.0,
                         lambda c: c.__dict__)
    assert got == cfg
    code = textwrap.dedent("""
        import sys
        from fused_preact.ops.triton import tuning as _tuning
        from fused_preact.ops.triton.configs import GemmConfig
        def never(cfg):
            raise SystemExit("timed a candidate although the cache has the key")
        cache = _tuning.cache_for("cpu")
        print(_tuning.choose(cache, "k1", [GemmConfig(128, 64, 32), GemmConfig(64, 32, 16, 4, 4)], None, never,
                             lambda c: c.__dict__))
    """)
    env = dict(os.environ, FUSED_PREACT_AUTOTUNE_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "BLOCK_M=64, BLOCK_N=32, BLOCK_K=16" in out.stdout


def _write_raw(folder, key, value):
    """An entry file as another version or an edit may have left it."""
    os.makedirs(folder, exist_ok=True)
    with open(_tuning._entry_file(str(folder), key), "w") as f:
        json.dump({"key": key, "value": value}, f)


@pytest.mark.parametrize("entry", [{"BLOCK_M": 128, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3},
                                   {"BLOCK_M": 48, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
                                   {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "splits": 2}, "64x64", None,
                                   {"BLOCK_M": 64.0, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3,
                                    "unroll": 1, "slots": 1, "halo": False},
                                   {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": True,
                                    "unroll": 1, "slots": 1, "halo": False}])
def test_a_cached_entry_that_is_not_a_candidate_is_tuned_again(tmp_path, entry):
    """A cache from another version, or edited, may name tiles this problem cannot take (the wgrad
    kernel holds four pieces of output channels: 128×16 tiles drop half of dW), or a candidate's numbers
    as floats or booleans (which compare equal to it and then break every launch): such an entry is not
    served; the candidates are timed again and the entry overwritten."""
    path = tmp_path / "tune"
    _write_raw(path, "k", entry)
    good = GemmConfig(64, 64, 64, 4, 3)
    got = _tuning.choose(_tuning.TuneCache(str(path)), "k", [good], GemmConfig(64, 64, 128, 4, 3), lambda c: 1.0,
                         dataclasses.asdict)
    assert got == good and type(got.BLOCK_M) is int
    assert _tuning.TuneCache.read_folder(str(path))["k"] == dataclasses.asdict(good)


@pytest.mark.parametrize("where", ["file-as-folder", "xdg-is-a-file", "read-only"])
def test_an_unusable_cache_location_warns_once_and_keeps_going_in_memory(tmp_path, monkeypatch, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    if where == "file-as-folder":
        path = str(blocker)
    elif where == "xdg-is-a-file":
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
        path = _tuning.default_cache_path("dev", "3.9.0")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes to read-only folders")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        path = str(ro / "cache")
    monkeypatch.setattr(_tuning.TuneCache, "_warned", set())
    cache = _tuning.TuneCache(path)
    with pytest.warns(RuntimeWarning, match="cannot write the cache folder"):
        cache.put("a", {"BLOCK_M": 64})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second cache on the same folder stays quiet
        cache.put("b", {"BLOCK_M": 32})
        _tuning.TuneCache(path).put("c", {"BLOCK_M": 16})
    assert cache.get("a") == {"BLOCK_M": 64} and cache.get("b") == {"BLOCK_M": 32}
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_single_file_cache_of_earlier_releases_is_read(tmp_path):
    """Before 2026-12 the cache was one JSON file (``<path>.json`` by default): its entries are served,
    new ones go to the folder."""
    (tmp_path / "tune.json").write_text(json.dumps({"old": {"BLOCK_M": 64}, "bad": [1]}))
    cache = _tuning.TuneCache(str(tmp_path / "tune"))
    assert cache.get("old") == {"BLOCK_M": 64} and cache.get("bad") is None
    cache.put("new", {"BLOCK_M": 32})
    assert _tuning.TuneCache.read_folder(str(tmp_path / "tune")) == {"new": {"BLOCK_M": 32}}


def test_memory_is_bounded_and_evicted_entries_come_back_from_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(_tuning, "MAX_ENTRIES", 3)
    cache = _tuning.TuneCache(str(tmp_path / "tune"))
    for i in range(10):
        cache.put(f"k{i}", {"i": i})
    assert len(cache.entries) == 3 and list(cache.entries) == ["k7", "k8", "k9"]
    assert cache.get("k0") == {"i": 0} and len(cache.entries) == 3
    (tmp_path / "tune.json").write_text(json.dumps({f"old{i}": {"i": i} for i in range(5)}))
    assert len(_tuning.TuneCache(str(tmp_path / "tune")).entries) == 3  # folder + legacy file, still bounded
    assert len(_tuning.TuneCache(None).entries) == 0


_WRITER = textwrap.dedent("""
    import sys
    from fused_preact.ops.triton import tuning
    cache = tuning.TuneCache(sys.argv[1])
    for i in range(int(sys.argv[3])):
        cache.put(f"{sys.argv[2]}-{i}", {"i": i})
""")


def test_two_processes_writing_one_cache_lose_nothing(tmp_path):
    folder = str(tmp_path / "shared")
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, folder, name, "150"]) for name in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = _tuning.TuneCache.read_folder(folder)
    assert len(entries) == 300 and entries["a-149"] == {"i": 149} and entries["b-0"] == {"i": 0}


def test_candidates_are_clamped_and_unique():
    c = candidates("fprop", 10_000, 24, 8, torch.bfloat16)
    assert all(cfg.BLOCK_N <= 32 and cfg.BLOCK_K == 16 for cfg in c) and len(c) == len(set(c))
    assert all(cfg.BLOCK_K <= 32 for cfg in candidates("dgrad", 10_000, 256, 256, torch.float32))


def test_wgrad_rows_follow_the_arch(monkeypatch):
    """256-row wgrad tiles (≤ 64 output channels) only where they compile without spills: sm_90,
    16-bit activations (not autocast's fp32 input), stride 1, not fp16's 32-wide tiles; as default
    and as a candidate. A plan
    takes the arch it is given (the static report's) or its device's (0 off CUDA)."""
    from fused_preact.ops import BATCH, BNMode, ChainSpec, ConvGeom
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's rules
    wgrad_config = configs.wgrad_config
    wide = GemmConfig(64, 64, 256, 4, 2)
    assert wgrad_config(64, 64, 10**6, torch.bfloat16, arch=90) == wide
    # fp16: the same rule, then the running Triton's replacement where it lists one (triton_compat)
    assert wgrad_config(64, 64, 10**6, torch.float16, arch=90) == configs.for_this_triton("wgrad", wide, torch.float16, 90)
    assert wgrad_config(16, 64, 10**6, torch.bfloat16, arch=90).BLOCK_K == 256
    assert wgrad_config(32, 64, 10**6, torch.bfloat16, arch=90).BLOCK_K == 256
    assert wgrad_config(32, 64, 10**6, torch.float16, arch=90).BLOCK_K == 128  # spills with an fp32 dW
    for kw in (dict(arch=80), dict(arch=0), dict(arch=90, strided=True)):
        assert wgrad_config(64, 64, 10**6, torch.bfloat16, **kw) == GemmConfig(64, 64, 128, 4, 3), kw
    # fp32 activations: 128 rows, unrolled (wgrad_unroll)
    assert wgrad_config(64, 64, 10**6, torch.bfloat16, arch=90, x32=True) == GemmConfig(64, 64, 128, 4, 2, unroll=2)
    assert wgrad_config(128, 64, 10**6, torch.bfloat16, arch=90).BLOCK_K == 64
    assert wgrad_config(64, 64, 10**6, torch.float32, arch=90).BLOCK_K == 32
    assert wide in candidates("wgrad", 64, 64, 10**6, torch.bfloat16, arch=90)
    for kw in (dict(arch=80), dict(arch=90, x32=True), dict(arch=90, strided=True)):
        assert all(c.BLOCK_K <= 128 for c in candidates("wgrad", 64, 64, 10**6, torch.bfloat16, **kw)), kw
    assert all(c.BLOCK_K <= 128 for c in candidates("wgrad", 128, 64, 10**6, torch.bfloat16, arch=90))

    spec = ChainSpec((ConvGeom(64, 64, (3, 3), (1, 1), (1, 1)), ConvGeom(64, 64, (3, 3), (2, 2), (1, 1))))
    modes = (BNMode(BATCH, True),) * 2
    x = torch.empty(8, 64, 16, 16, device="meta").contiguous(memory_format=torch.channels_last)

    def rows(x_dtype, **kw):
        plan = triton_plans.TritonPlan(spec, modes, x.shape, x.stride(), x_dtype, x.device, torch.bfloat16, False,
                                       False, tune=False, **kw)
        return [u.wcfg.BLOCK_K for u in plan.units]

    assert rows(torch.bfloat16, arch=90) == [256, 128]  # the second conv has stride 2
    assert rows(torch.bfloat16, arch=80) == rows(torch.bfloat16) == [128, 128]
    assert rows(torch.float32, arch=90) == [64, 128]  # autocast: the first conv reads fp32 (3×3: 64-row blocks)


def test_narrow_fprop_rows(monkeypatch):
    """fprop over ≤ 16 output and input channels per group takes 256-row tiles on sm_90 and 512-row
    ones on sm_80-class GPUs (256 there too for a chain reading fp32 activations; unrolled, as every
    16-deep step), as default and among the candidates, where the pixels fill 8 of them; wider
    layers, fewer pixels, fp32 and an unknown arch keep theirs."""
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    M = 128 * 32 * 32
    for arch, rows in ((90, 256), (80, 512), (86, 512)):
        for dtype in (torch.bfloat16, torch.float16):
            cfg = configs.fprop_config(M, 16, 16, dtype, True, arch=arch)
            assert cfg == GemmConfig(rows, 16, 16, 4, 3, unroll=2), (arch, cfg)
            assert cfg in candidates("fprop", M, 16, 16, dtype, arch=arch)
            assert configs.fprop_config(8 * rows, 16, 16, dtype, False, arch=arch).BLOCK_M == rows
            assert configs.fprop_config(8 * rows - 1, 16, 16, dtype, False, arch=arch).BLOCK_M == 128
            for kg, cg in ((32, 16), (16, 32), (64, 64)):
                assert configs.fprop_config(M, kg, cg, dtype, False, arch=arch).BLOCK_M <= 128
                assert all(c.BLOCK_M <= 128 for c in candidates("fprop", M, kg, cg, dtype, arch=arch))
        assert configs.fprop_config(M, 16, 16, torch.float32, False, arch=arch).BLOCK_M == 64
        # fp32 activations under 16-bit compute (autocast): 256 rows (512 spill on sm_80)
        assert configs.fprop_config(M, 16, 16, torch.bfloat16, True, arch=arch, x32=True).BLOCK_M == 256
        assert GemmConfig(256, 16, 16, 4, 3, unroll=2) in candidates("fprop", M, 16, 16, torch.bfloat16, arch=arch, x32=True)
    assert configs.fprop_config(M, 16, 16, torch.bfloat16, False, arch=0).BLOCK_M == 128


def test_fprop_unrolls_where_the_arch_allows(monkeypatch):
    """fprop's main loop runs unrolled twice (two accumulators) in 16-bit compute on sm_90 for output
    tiles of at most 64×64 or 16-deep steps (a second 128×64 or 64×128 accumulator spills), on sm_80
    for output tiles at most 32 channels wide; candidates alike."""
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    fprop_config = configs.fprop_config
    # (Kg, Cg) → tiles: (256, 64) 64×128×64; (64, 64) 128×64×64; (16, 64) 128×16×64; (32, 32) 128×32×32;
    # (64, 16) 128×64×16 (16-deep steps)
    for kg, cg, unroll, unroll80 in ((256, 64, 1, 1), (64, 64, 1, 1), (16, 64, 2, 2), (32, 32, 2, 2), (64, 16, 2, 1)):
        for dtype in (torch.bfloat16, torch.float16):
            assert fprop_config(10**6, kg, cg, dtype, True, arch=90).unroll == unroll, (kg, cg, dtype)
            assert fprop_config(10**6, kg, cg, dtype, True, arch=80).unroll == unroll80, (kg, cg, dtype)
        assert fprop_config(10**6, kg, cg, torch.bfloat16, True, arch=0).unroll == 1
        assert fprop_config(10**6, kg, cg, torch.float32, True, arch=90).unroll == 1
    assert fprop_config(10**6, 64, 16, torch.bfloat16, True, arch=90).num_stages == 3  # one stage less
    for kg, cg in ((256, 64), (64, 16), (16, 64)):
        cands = candidates("fprop", 10**6, kg, cg, torch.bfloat16, arch=90)
        assert any(c.unroll == 2 for c in cands)
        assert all((c.unroll == 2) == (c.BLOCK_M * c.BLOCK_N <= 64 * 64 or c.BLOCK_K == 16) for c in cands)
        assert all((c.unroll == 2) == (c.BLOCK_N <= 32) for c in candidates("fprop", 10**6, kg, cg, torch.bfloat16, arch=80))


def test_narrow_wgrad_tiles(monkeypatch):
    """On sm_80 and sm_90 wgrad over ≤ 32 input channels per group takes tiles of 16 or 32 channels on
    mma.sync (16 rows at a time), not 64 of which a half or three quarters multiply zeros (wgmma's 64
    rows per warpgroup; those stay candidates), in BLOCK_N / 16 warps so that no two warps compute
    the same results: one output-channel piece unrolled over two row blocks of 128 rows, several
    pieces over 128 rows (bf16's 256, and 512 with 16 channels, as candidates; fp32 activations 256);
    as default and among the candidates; a 1×1 of ≤ 16 output channels over 16 input channels 512 rows.
    ≤ 16 output channels over wider inputs take the 2-warp thin tile (sm_80's default, sm_90's with
    fp32 activations, a candidate on both). Otherwise wider inputs, fp32 and an unknown arch keep 64-channel tiles."""
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    wgrad_config = configs.wgrad_config
    big = 10**6
    for arch, st in ((80, 3), (86, 3), (90, 2)):
        # a 1×1 of ≤ 16 output channels over 16: 512 rows rolled (128 unrolled a candidate); fp32
        # activations or several taps: 128 unrolled
        for dtype in (torch.bfloat16, torch.float16):
            assert wgrad_config(16, 16, big, dtype, arch=arch) == GemmConfig(16, 16, 512, 1, 2)
            assert GemmConfig(16, 16, 128, 1, 2, unroll=2) in candidates("wgrad", 16, 16, big, dtype, arch=arch)
            assert wgrad_config(16, 16, big, dtype, arch=arch, taps=9) == GemmConfig(16, 16, 128, 1, 2, unroll=2)
            assert GemmConfig(16, 16, 512, 1, 2) not in candidates("wgrad", 16, 16, big, dtype, arch=arch, taps=9)
        assert wgrad_config(16, 16, big, torch.float16, arch=arch, x32=True) == GemmConfig(16, 16, 128, 1, 2, unroll=2)
        # ≤ 16 output channels over more than 32 input channels: the 2-warp tile, sm_80's default and a
        # candidate on both (sm_90's default stays on wgmma for 16-bit activations, not for fp32 ones);
        # not with 32 output channels or fp32 compute
        thin = GemmConfig(16, 64, 128, 2, 2, unroll=2)
        for dtype in (torch.bfloat16, torch.float16):
            assert (wgrad_config(16, 64, big, dtype, arch=arch) == thin) == (arch < 90)
            assert wgrad_config(16, 256, big, dtype, arch=arch, x32=True) == thin
            assert thin in candidates("wgrad", 16, 64, big, dtype, arch=arch)
            assert thin in candidates("wgrad", 8, 128, big, dtype, arch=arch)
            assert thin not in candidates("wgrad", 32, 64, big, dtype, arch=arch)
        assert wgrad_config(16, 64, big, torch.bfloat16, arch=90).num_warps == 4
        assert all(c.BLOCK_N == 64 and c.num_warps == 4 for c in candidates("wgrad", 16, 64, big, torch.float32, arch=arch))
        assert wgrad_config(32, 32, big, torch.float16, arch=arch) == GemmConfig(32, 32, 128, 2, 2, unroll=2)
        assert wgrad_config(16, 32, big, torch.bfloat16, arch=arch, strided=True) == GemmConfig(16, 32, 128, 2, 2,
                                                                                                unroll=2)
        assert wgrad_config(64, 16, big, torch.bfloat16, arch=arch) == GemmConfig(64, 16, 128, 1, st)
        assert wgrad_config(64, 16, big, torch.float16, arch=arch) == GemmConfig(64, 16, 128, 1, st)
        for dtype in (torch.bfloat16, torch.float16):  # a projection's: 256 rows on sm_90
            assert wgrad_config(64, 16, big, dtype, arch=arch, proj=True).BLOCK_K == (256 if arch >= 90 else 128)
        assert wgrad_config(64, 16, big, torch.bfloat16, arch=arch, x32=True) == GemmConfig(64, 16, 256, 1, st)
        assert wgrad_config(128, 32, big, torch.bfloat16, arch=arch, x32=True) == GemmConfig(128, 32, 128, 2, st)
        # strided: 128 rows (256 a bf16 candidate over 16 channels), with fp32 activations 64
        assert wgrad_config(32, 16, big, torch.bfloat16, arch=arch, strided=True) == GemmConfig(32, 16, 128, 1, st)
        assert GemmConfig(32, 16, 256, 1, st) in candidates("wgrad", 32, 16, big, torch.bfloat16, arch=arch, strided=True)
        assert [c for c in candidates("wgrad", 64, 32, big, torch.bfloat16, arch=arch, strided=True) if c.BLOCK_N == 32] == [
            GemmConfig(64, 32, 128, 2, st)]
        assert wgrad_config(32, 16, big, torch.bfloat16, arch=arch, x32=True, strided=True) == GemmConfig(32, 16, 64, 1, st)
        assert wgrad_config(256, 32, big, torch.bfloat16, arch=arch) == GemmConfig(128, 32, 128, 2, st)
        assert wgrad_config(24, 24, big, torch.bfloat16, arch=arch) == GemmConfig(32, 32, 128, 2, 2, unroll=2)
        cands = candidates("wgrad", 64, 16, big, torch.bfloat16, arch=arch)
        assert {GemmConfig(64, 16, 128, 1, st), GemmConfig(64, 16, 256, 1, st), GemmConfig(64, 16, 512, 1, 2)} <= set(cands)
        assert any(c.BLOCK_N == 64 for c in cands)
        assert [c for c in candidates("wgrad", 64, 16, big, torch.float16, arch=arch) if c.BLOCK_N == 16] == [
            GemmConfig(64, 16, 128, 1, st)]
        assert [c for c in candidates("wgrad", 128, 32, big, torch.bfloat16, arch=arch) if c.BLOCK_N == 32] == [
            GemmConfig(128, 32, 128, 2, st), GemmConfig(128, 32, 256, 2, st)]  # 512 rows spill
        assert all(c.BLOCK_N == 64 for c in candidates("wgrad", 16, 16, big, torch.float32, arch=arch))
    for args, kw in (((16, 64), dict(arch=80)), ((16, 64), dict(arch=90)), ((16, 16), dict(arch=0))):
        assert wgrad_config(*args, big, torch.bfloat16, **kw).BLOCK_N == 64, (args, kw)
    assert wgrad_config(16, 16, big, torch.float32, arch=80).BLOCK_N == 64  # TF32 tiles unchanged


def test_wgrad_unrolls_where_the_arch_allows(monkeypatch):
    """wgrad's loop runs two row blocks per iteration (two accumulators) only on sm_80 and later, in
    16-bit compute, with one output-channel piece, at most 128 rows per block, and at most 32 output
    channels or fp32 activations (x32), on sm_80 not fp16's 32-channel tiles; candidates alike."""
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    wgrad_config = configs.wgrad_config
    big = 10**6
    assert wgrad_config(32, 64, big, torch.float16, arch=90).unroll == 2  # 32×64×128
    assert wgrad_config(32, 64, big, torch.bfloat16, arch=90, strided=True).unroll == 2
    assert wgrad_config(64, 64, big, torch.bfloat16, arch=90, x32=True).unroll == 2  # 64×64×128, fp32 x
    assert wgrad_config(64, 64, big, torch.bfloat16, arch=90, strided=True).unroll == 1  # 64 channels, 16-bit x
    assert wgrad_config(64, 64, big, torch.bfloat16, arch=90).unroll == 1  # 256-row blocks
    assert wgrad_config(128, 64, big, torch.bfloat16, arch=90, x32=True).unroll == 1  # two output pieces
    assert wgrad_config(32, 64, big, torch.float16, arch=0, x32=True).unroll == 1
    assert wgrad_config(32, 64, big, torch.float32, arch=90).unroll == 1
    # sm_80: 16 channels, bf16's 32, fp32 activations; not fp16's 32 (spills)
    assert wgrad_config(16, 64, big, torch.float16, arch=80).unroll == 2
    assert wgrad_config(32, 64, big, torch.bfloat16, arch=80).unroll == 2
    assert wgrad_config(32, 64, big, torch.float16, arch=80, x32=True).unroll == 2
    assert wgrad_config(64, 64, big, torch.bfloat16, arch=80, x32=True).unroll == 2
    assert wgrad_config(32, 64, big, torch.float16, arch=80).unroll == 1
    assert wgrad_config(64, 64, big, torch.bfloat16, arch=80).unroll == 1
    cfg = wgrad_config(32, 64, big, torch.float16, arch=90)
    assert (cfg.BLOCK_K, cfg.num_stages) == (128, 2)  # one stage less
    cands = candidates("wgrad", 32, 64, big, torch.float16, arch=90)
    assert any(c.unroll == 2 for c in cands)
    assert all(c.unroll == 1 for c in candidates("wgrad", 32, 64, big, torch.float16, arch=80))
    assert any(c.unroll == 2 for c in candidates("wgrad", 32, 64, big, torch.bfloat16, arch=80))


def test_tiles_of_fp32_activations_over_several_taps(monkeypatch):
    """Tiles that spilled where a launch reads fp32 activations (autocast) of a 3×3, adds a projection
    beside a 3×3 in fp16 (static, PreActResNet-20/110's 64-channel layers) or the identity shortcut's
    gradient beside a 3×3 dgrad (PreActResNet-18), and which the plan now picks from the filter's taps:
    sm_90 fprop 64 rows over 64 channels, wgrad 64-row blocks unrolled, fp16's 64×64×64 fprop beside a
    projection in 2 stages, dgrad 64 channels wide. The 1×1s (PreActResNet-50's x32 units) keep theirs."""
    from fused_preact.ops import BATCH, RUNNING, BNMode, ChainSpec, ConvGeom
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    big = 10**6
    for dtype in (torch.bfloat16, torch.float16):
        assert configs.fprop_config(big, 64, 64, dtype, True, arch=90, x32=True, taps=9) == GemmConfig(64, 64, 64, 4, 2, unroll=2)
        assert configs.fprop_config(big, 64, 64, dtype, True, arch=90, x32=True) == GemmConfig(128, 64, 64, 4, 3)
        assert configs.fprop_config(big, 64, 64, dtype, True, arch=80, x32=True, taps=9) == GemmConfig(128, 64, 64, 4, 3)
        assert configs.fprop_config(big, 64, 32, dtype, True, arch=90, x32=True, taps=9).BLOCK_M == 128
        for arch in (80, 90):
            assert configs.wgrad_config(64, 64, big, dtype, arch=arch, x32=True, taps=9) == GemmConfig(64, 64, 64, 4, 2,
                                                                                                      unroll=2)
            assert configs.wgrad_config(64, 64, big, dtype, arch=arch, x32=True) == GemmConfig(64, 64, 128, 4, 2, unroll=2)
            assert configs.wgrad_config(32, 64, big, dtype, arch=arch, x32=True, taps=9) == GemmConfig(32, 64, 128, 4, 2,
                                                                                                      unroll=2)
            assert all(c.unroll == 1 or c.BLOCK_K <= 64 or c.BLOCK_M <= 32
                       for c in candidates("wgrad", 64, 64, big, dtype, arch=arch, x32=True, taps=9))
    proj = [c for c in candidates("fprop", big, 64, 64, torch.float16, arch=90, taps=9, proj=True) if c.unroll == 2]
    assert proj and all(c.num_stages == 2 for c in proj if c.BLOCK_M * c.BLOCK_N * c.BLOCK_K == 64 ** 3)
    assert GemmConfig(64, 64, 64, 4, 3, unroll=2) in candidates("fprop", big, 64, 64, torch.bfloat16, arch=90, taps=9,
                                                                 proj=True)

    # the plan hands the rules its filters' taps and the projection of the last unit's launch
    spec = ChainSpec((ConvGeom(32, 64, (3, 3), (2, 2), (1, 1)), ConvGeom(64, 64, (3, 3), (1, 1), (1, 1))),
                     proj=ConvGeom(32, 64, (1, 1), (2, 2), (0, 0)))
    x = torch.empty(128, 32, 16, 16, device="meta").contiguous(memory_format=torch.channels_last)
    plan = triton_plans.TritonPlan(spec, (BNMode(BATCH, True),) * 2, x.shape, x.stride(), torch.float32, x.device,
                                   torch.float16, False, False, tune=False, arch=90)
    assert plan.tile_args(1, spec.convs[1], "fprop") == dict(arch=90, x32=False, taps=9, proj=True, halo=True)
    assert plan.tile_args(0, spec.convs[0], "fprop") == dict(arch=90, x32=True, taps=9, proj=False, halo=True)
    assert plan.tile_args(0, spec.proj, "fprop")["proj"] is False
    assert plan.tile_args(0, spec.convs[0]) == dict(arch=90, x32=True, strided=True, taps=9, halo=64, proj=False)
    assert plan.tile_args(0, spec.proj)["halo"] == 0 and plan.tile_args(0, spec.proj)["proj"]  # (no halo wgrad for it)

    # dgrad adding the identity shortcut's gradient (eval mode) over a 3×3: 64 channels wide on sm_90
    # (64×128×64 spills 8 bytes, PreActResNet-18's 3×3 128→128)
    for dtype in (torch.bfloat16, torch.float16):
        assert configs.dgrad_config(big, 128, 128, dtype, arch=90, taps=9, res=True).BLOCK_N == 64
        assert configs.dgrad_config(big, 128, 128, dtype, arch=90, taps=9).BLOCK_N == 128
        assert configs.dgrad_config(big, 128, 128, dtype, arch=90, res=True).BLOCK_N == 128
        assert configs.dgrad_config(big, 128, 128, dtype, arch=80, taps=9, res=True).BLOCK_N == 128
        assert all(c.BLOCK_N <= 64 for c in candidates("dgrad", big, 128, 128, dtype, arch=90, taps=9, res=True))
    block = ChainSpec((ConvGeom(128, 128, (3, 3), (1, 1), (1, 1)),) * 2, residual="input")
    x = torch.empty(128, 128, 16, 16, device="meta").contiguous(memory_format=torch.channels_last)
    for mode, res in ((BNMode(BATCH, True), False), (BNMode(RUNNING, False), True)):
        plan = triton_plans.TritonPlan(block, (mode,) * 2, x.shape, x.stride(), torch.bfloat16, x.device,
                                       torch.bfloat16, False, False, tune=False, arch=90)
        assert [plan.tile_args(i, g, "dgrad")["res"] for i, g in enumerate(block.convs)] == [res, False]
        assert plan.units[0].dcfg.BLOCK_N == (64 if res else 128)


def test_dgrad_takes_a_filter_row_per_step_for_narrow_outputs(monkeypatch):
    """dgrad's taps per reduction step (``dgrad_slots``): a filter row, padded to a power of two ≤ 4,
    for ≤ 32 output channels per group in 16-bit (stride 1, or phases: ⌈S/stride⌉ taps), one tap
    elsewhere; the tiles then span slots × p2(Kg) channels; tiles of ≤ 32 input channels take more rows
    (``_narrow_rows``), in the default and in every candidate."""
    import torch.nn as nn

    from fused_preact.ops.spec import ConvGeom
    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)

    def slots(k, stride=1, dilation=1, Kg=16, dtype=torch.bfloat16):
        conv = nn.Conv2d(16, Kg, k, stride=stride, padding=dilation * (k // 2), dilation=dilation)
        return configs.dgrad_slots(ConvGeom.of(conv), Kg, dtype)

    assert [slots(3), slots(3, Kg=32), slots(3, stride=2), slots(3, dilation=2)] == [4, 4, 2, 4]
    assert [slots(1), slots(3, Kg=64), slots(5), slots(3, stride=2, dilation=2), slots(3, dtype=torch.float32)] == [1] * 5
    def tile(Cg, Kg, slots, arch, M=10**6, dtype=torch.bfloat16):
        cfg = configs.dgrad_config(M, Cg, Kg, dtype, slots, arch)
        return cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.slots

    assert tile(16, 16, 4, 90) == (256, 16, 64, 4)
    assert tile(16, 16, 4, 80) == (128, 16, 64, 4)  # 256 rows spill on sm_80
    assert tile(32, 32, 4, 90) == (128, 32, 128, 4)  # 256 × 32 with 128-deep steps spills
    assert tile(32, 64, 1, 90) == (256, 32, 64, 1)  # a narrow 1×1: more rows, one tap per step
    assert tile(16, 16, 4, 90, M=8 * 256 - 1) == (128, 16, 64, 4)
    assert tile(64, 16, 4, 90)[0] == 64 and tile(32, 32, 1, 90, dtype=torch.float32)[0] == 64
    cands = candidates("dgrad", 10**6, 32, 32, torch.bfloat16, arch=90, slots=2)
    assert cands and all(c.slots == 2 and c.BLOCK_K == 64 and c.BLOCK_M == 256 for c in cands)
    # two pipeline stages for sm_80-class filter-row steps over 16 output channels, also a candidate there
    stages = lambda Cg, slots, arch: configs.dgrad_config(10**6, Cg, 16, torch.float16, slots, arch).num_stages  # noqa: E731
    assert [stages(16, 4, 80), stages(16, 4, 86), stages(16, 4, 90), stages(32, 4, 80), stages(16, 1, 80)] == [2, 2, 3, 3, 3]
    assert configs.dgrad_config(10**6, 16, 16, torch.bfloat16, 4, 80) in candidates("dgrad", 10**6, 16, 16, torch.bfloat16,
                                                                                     arch=80, slots=4)


def test_tuning_can_be_disabled(monkeypatch):
    monkeypatch.setenv("FUSED_PREACT_AUTOTUNE", "0")
    assert not _tuning.tuning_enabled()


def test_plan_and_decision_caches_are_bounded_lru(monkeypatch):
    """A module called with ever new shapes (multi-scale training) keeps the most recently used
    MAX_PLANS plans, not one per shape for the life of the process."""
    import copy

    from fused_preact import FusedBNReLUConv2d
    from fused_preact.ops import auto, backends
    from fused_preact.ops._common import LRUDict

    monkeypatch.setattr(backends, "MAX_PLANS", 4)
    m = FusedBNReLUConv2d(4, 4, 1, backend="reference")
    for size in range(2, 11):
        m(torch.randn(1, 4, size, size))
    assert m._plans.maxsize == 4 and len(m._plans) == 4
    first = next(iter(m._plans))
    m._plans.get(first)  # a hit makes it the most recent
    m(torch.randn(1, 4, 12, 12))
    assert first in m._plans and len(m._plans) == 4
    assert len(copy.deepcopy(m)._plans) == 0 and copy.deepcopy(m)._plans.maxsize == 4
    assert isinstance(auto._BY_KEY, LRUDict) and auto._BY_KEY.maxsize == auto.MAX_DECISIONS
