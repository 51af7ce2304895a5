"""The static kernel report (tools.static_report, run from the repository root) on CPU.

The report compiles Triton kernels for sm_90/sm_80 offline, which needs TRITON_INTERPRET unset before
``triton`` is imported, while this suite runs with it set (conftest.py); so every compiling test runs
the CLI in a subprocess with the variable removed. Job sets are tiny (a few compilations each, both
processes of a 2-core runner). Pure helpers (SASS counting, names, the check rule, the table) are
tested in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.static_report import limits, report, sass
from tools.static_report.loop_limits import DEFAULT_BASELINE

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _triton_tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists()


needs_tools = pytest.mark.skipif(not _triton_tools(), reason="triton's NVIDIA backend tools are not installed")


def _static(tmp_path: Path, *args: str, module: str = "tools.static_report") -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    files = sorted(out.glob("static-*.json"))
    return proc, (json.loads(files[-1].read_text()) if files else {})


def _by(obj: dict, kernel: str) -> dict[str, dict]:
    return {e["arch"]: e for e in obj["entries"] if e["kernel"] == kernel}


# --------------------------------------------------------------------------- compiled (subprocess)
@needs_tools
def test_report_on_one_layer_and_cache(tmp_path):
    """The op's own jobs for one CIFAR unit (bf16, fprop and the elementwise dx): sane fields, tensor
    cores in the conv kernel on both archs, autocast's fp32-input launches among them; a second run
    takes every compilation from the metrics cache."""
    args = ["--models", "preact_resnet164", "--layers", "layer1.1/conv2", "--dtypes", "bf16",
            "--kernels", "fprop", "dx"]
    proc, obj = _static(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert obj["triton"] and obj["date"] and "--layers" in obj["command"] and obj["compiled"] == obj["compilations"]
    conv = [e for e in obj["entries"] if e["conv"]]
    other = [e for e in obj["entries"] if not e["conv"]]
    assert conv and other and {e["arch"] for e in conv} == {"sm_90", "sm_80"}
    for e in obj["entries"]:
        assert e["kind"] == "triton" and e["dtype"] == "bf16" and e["config"] and "error" not in e
        assert e["regs"] > 0 and e["stack_bytes"] >= 0 and e["shared_bytes"] >= 0 and e["instructions"] > 0
        assert set(e["ldg_by_width"]) >= {"128", "64", "32", "16", "8"} and set(e["async_copies"]) == {"LDGSTS", "UTMALDG"}
        assert e["shapes"] and all("preact_resnet164/" in s for s in e["shapes"])
    # sm_90 runs wgmma, but for the staged halo's mma.sync candidate (configs.halo_sync_config)
    sync = lambda e: e["arch"] == "sm_90" and e["config"] == "128x16x16 w2 s2 h"
    assert any(sync(e) for e in conv)
    for e in conv:
        wgmma = e["arch"] == "sm_90" and not sync(e)
        assert (e["mma"] > 0) != sync(e)  # (the arch's own instruction: HGMMA on sm_90)
        assert e["mma_by_op"].get("HGMMA" if wgmma else "HMMA") == sum(e["mma_by_op"].values()) > 0
        # the 3×3 16→16's tiles fit its channels: all of the MMA work is real, and no two warps
        # compute the same results
        assert set(e["mma_util"]) == set(e["shapes"]) and set(e["mma_util"].values()) == {1.0}
        assert e["mma_dots"] and e["mma_replication"] == 1.0
        assert {d["op"] for d in e["mma_dots"]} == {"ttng.warp_group_dot" if wgmma else "tt.dot"}
        # aligned tensors carry the divisibility attribute; autocast's launches (x32) read an fp32 input
        # or residual
        if "x32" in e["variant"]:
            assert "*fp32%16" in (e["signature"]["x_ptr"], e["signature"].get("xin_ptr")), e["signature"]
        else:
            assert e["signature"]["x_ptr"] == "*bf16%16"
    assert any("x32" in e["variant"] for e in conv) and any("x32" not in e["variant"] for e in conv)
    assert "fprop" in proc.stdout and "regs" in proc.stdout and "util" in proc.stdout  # the table
    assert obj["useful_bounds"] and all(v["utilization"] == 1.0 for v in obj["useful_bounds"].values())
    assert all(e.get("mma_util") is None and e["mma_replication"] == 1.0 for e in other)

    again, obj2 = _static(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert obj2["compiled"] == 0 and obj2["cached"] == obj["compilations"]
    strip = lambda o: [{k: v for k, v in e.items() if k != "compile_s"} for e in o["entries"]]
    assert strip(obj2) == strip(obj)


@needs_tools
def test_check_fails_on_spills_and_missing_mma(tmp_path):
    proc, obj = _static(tmp_path, "--provider", "static_fixtures:bad_jobs", "--arch", "90", "--check")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    spill = _by(obj, "spill")["sm_90"]
    assert spill["stack_bytes"] > 0 and spill["spill_stores"] > 0 and spill["spill_loads"] > 0
    assert "spill [4096 w1]" in proc.stdout and "bytes of stack" in proc.stdout
    assert "scale [1024 w4]" in proc.stdout and "no HGMMA" in proc.stdout


@needs_tools
def test_check_passes_clean_jobs_and_specialization(tmp_path):
    """Clean kernels pass ``--check``; the recorded signature follows Triton's launch rules: 1 →
    constexpr, %16 ints and aligned pointers get the divisibility attribute, bool → u1, float →
    fp32, None → constexpr; the unaligned pointer does not."""
    proc, obj = _static(tmp_path, "--provider", "static_fixtures:clean_jobs", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scale = _by(obj, "scale")
    assert scale.keys() == {"sm_90", "sm_80"}
    e = scale["sm_90"]
    assert e["signature"] == {"x_ptr": "*fp32%16", "y_ptr": "*fp32%16", "off_ptr": "*fp32", "n16": "i32%16",
                              "n17": "i32", "flag": "u1", "alpha": "fp32"}
    assert e["constexprs"] == {"n_one": "1", "unused": "None", "BLOCK": "1024"}
    assert e["ldg_by_width"]["128"] > 0  # aligned, %16 sizes: 16-byte vector loads
    gemm = _by(obj, "gemm")
    assert gemm["sm_90"]["mma_by_op"].get("HGMMA", 0) > 0 and gemm["sm_80"]["mma_by_op"].get("HMMA", 0) > 0
    assert gemm["sm_90"]["hgmma_a_regs"] == 0  # both operands straight from shared memory
    # The K loop is found, with the tile's MACs per iteration: 64·64·32 over 4 warps. sm_90: two
    # HGMMA.64x64x16 issued by each warp, 32 clocks each; sm_80: 16 HMMA.16816 per warp, 8 clocks each.
    assert (gemm["sm_90"]["loop"]["mma"], gemm["sm_90"]["loop"]["tensor_clocks"]) == (2, 64)
    assert (gemm["sm_80"]["loop"]["mma"], gemm["sm_80"]["loop"]["tensor_clocks"]) == (16, 128)
    for arch, op in (("sm_90", "HGMMA"), ("sm_80", "HMMA")):
        lp = gemm[arch]["loop"]
        assert lp and lp["mma"] > 0 and all(k.startswith(op) for k in lp["mma_shapes"])
        assert lp["instructions"] > lp["mma"] and lp["tensor_clocks"] > 0
        assert lp["issue_ratio"] == round(lp["instructions"] / lp["tensor_clocks"], 3)
        assert [x["span"] for x in gemm[arch]["mma_loops"]] == [lp["span"]]
    assert gemm["sm_90"]["loop"]["wgmma_waits"] and not gemm["sm_80"]["loop"]["wgmma_waits"]
    assert scale["sm_90"]["loop"] is None and scale["sm_90"]["mma_loops"] == []


@needs_tools
def test_check_loop_limits_and_baseline(tmp_path):
    """A bf16 'fprop' with an integer division in its loop breaks the sm_90 main-loop limits: ``--check``
    fails without a baseline, passes with a baseline listing its figures, and fails again against a
    baseline with a lower figure (the kernel regressed)."""
    args = ["--provider", "static_fixtures:loop_jobs", "--arch", "90", "--check"]
    proc, obj = _static(tmp_path, *args, "--loop-baseline", str(tmp_path / "none.json"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (e,) = obj["entries"]
    assert e["loop"]["int_div"] >= 1 and e["roles"] == ["default"]
    assert "main-loop limits broken" in proc.stdout and "int_div" in proc.stdout and "not in the baseline" in proc.stdout
    key = "triton fprop [div] bf16 sm_90"
    figs = obj["loop_figures"][key]
    offending = {name: {"default": f["default"]} for name, f in figs.items() if f["default"] > f["limit"]}
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"tolerance": 0.02, "offenders": {key: offending}}))
    proc, _ = _static(tmp_path, *args, "--loop-baseline", str(base))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    offending["int_div"]["default"] -= 1
    base.write_text(json.dumps({"tolerance": 0.02, "offenders": {key: offending}}))
    proc, _ = _static(tmp_path, *args, "--loop-baseline", str(base))
    assert proc.returncode == 1 and "worse than the baseline" in proc.stdout


def test_update_loop_baseline_refuses_a_restricted_run(tmp_path, capsys):
    """Before anything is compiled: a restricted Triton run's figures are lower bounds of the full run's."""
    base = tmp_path / "base.json"
    for extra in (["--layers", "layer1.1"], ["--arch", "90"], ["--provider", "static_fixtures:loop_jobs"],
                  ["--dtypes", "bf16"], ["--kernels", "fprop"]):
        assert report.main(["--update-loop-baseline", "--loop-baseline", str(base), *extra]) == 2
        assert "needs the whole Triton report" in capsys.readouterr().err
        # other models have a baseline of their own: still the whole report of them
        assert report.main(["--update-loop-baseline", "--loop-baseline", str(base), "--models", "preact_resnet20",
                            *extra]) == 2
        assert "needs the whole Triton report" in capsys.readouterr().err
    assert not base.exists()
    # the default baseline holds the default models' figures only
    before = DEFAULT_BASELINE.read_text()
    assert report.main(["--update-loop-baseline", "--models", "preact_resnet20"]) == 2
    assert "needs the whole Triton report" in capsys.readouterr().err
    assert DEFAULT_BASELINE.read_text() == before


@needs_tools
def test_anchor_tutorial_matmul(tmp_path):
    """``--anchors NAME``: the tutorial-style Triton matmul compiled for sm_90 as kind ``anchor``, its K
    loop found (128x128x64 with 8 warps: 4 HGMMA.64x128x16 per warp per iteration, 256 clocks)."""
    proc, obj = _static(tmp_path, "--no-triton", "--anchors", "triton-matmul-128x128x64", "--arch", "90", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (e,) = obj["entries"]
    assert (e["kind"], e["kernel"], e["config"], e["arch"]) == ("anchor", "triton-matmul-128x128x64", "128x128x64 w8 s3",
                                                                "sm_90")
    lp = e["loop"]
    assert lp["mma_shapes"] == {"HGMMA.64x128x16.F32.BF16": 4} and lp["tensor_clocks"] == 256
    assert 0 < lp["issue_ratio"] < 1 and obj["loop_figures"] == {}  # anchors are never judged
    assert "unknown anchors" in _static(tmp_path, "--no-triton", "--anchors", "nope")[0].stderr


_CU = textwrap.dedent("""
    #include <mma.h>
    #include <cuda_fp16.h>
    namespace demo {
    template <int N, typename T>
    __global__ void scale_kernel(const T* __restrict__ x, T* y, float s, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) y[i] = T(float(x[i]) * s);
    }
    template __global__ void scale_kernel<8, __half>(const __half*, __half*, float, int);
    }
    __global__ void wmma_kernel(const half* a, const half* b, float* c) {
      using namespace nvcuda;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
      wmma::fill_fragment(fc, 0.0f);
      wmma::load_matrix_sync(fa, a, 16);
      wmma::load_matrix_sync(fb, b, 16);
      wmma::mma_sync(fc, fa, fb, fc);
      wmma::store_matrix_sync(c, fc, 16, wmma::mem_row_major);
    }
    extern "C" __global__ void local_kernel(const float* x, float* y, int n) {
      float buf[512];
      for (int i = 0; i < 512; ++i) buf[i] = x[(i * n) % 4096];
      float acc = 0;
      for (int i = 0; i < 512; ++i) acc += buf[(i * 7 + n) % 512];
      y[threadIdx.x] = acc;
    }
""")


@needs_tools
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cubins_from_nvcc(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(_CU)
    cubins = tmp_path / "cubins"
    cubins.mkdir()
    for arch in ("sm_80", "sm_90a"):
        subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-o", str(cubins / f"k_{arch}.cubin"), str(src)],
                       check=True, capture_output=True, timeout=240)
    proc, obj = _static(tmp_path, "--no-triton", "--cubins", str(cubins), "--check")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # local_kernel's stack
    es = [e for e in obj["entries"] if e["kind"] == "csrc"]
    assert {(e["kernel"], e["arch"]) for e in es} == {(k, a) for k in ("scale_kernel<8, __half>", "wmma_kernel", "local_kernel")
                                                     for a in ("sm_80", "sm_90")}
    by = {(e["kernel"], e["arch"]): e for e in es}
    for e in es:
        assert e["regs"] > 0 and e["config"] in ("k_sm_80.cubin", "k_sm_90a.cubin")
    assert by[("scale_kernel<8, __half>", "sm_80")]["ldg_by_width"]["16"] == 1  # LDG.E.U16: one half
    assert by[("wmma_kernel", "sm_80")]["mma"] > 0 and by[("wmma_kernel", "sm_90")]["mma_by_op"]["HMMA"] > 0
    assert by[("wmma_kernel", "sm_90")]["target"] == "sm_90a"
    assert by[("local_kernel", "sm_90")]["stack_bytes"] >= 2048
    assert "local_kernel" in proc.stdout.split("--check")[-1] and "wmma_kernel" not in proc.stdout.split("--check")[-1]


# ------------------------------------------------------------------------------------- in-process
def test_sass_metrics_opcodes():
    ops = ["LDG.E.128", "LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E", "LDG.E.LTC128B", "LDG.E.U16", "LDG.E.S8",
           "LDGSTS.E.BYPASS.128", "LDGSTS.E", "UTMALDG.2D", "HGMMA.64x64x16.F32.BF16", "HMMA.16816.F32.BF16",
           "STL", "STL.128", "LDL.LU", "STG.E.U16", "FFMA"]
    m90, m80 = sass.sass_metrics(ops, 90), sass.sass_metrics(ops, 80)
    assert m90["ldg_by_width"] == {"128": 2, "64": 1, "32": 2, "16": 1, "8": 1}
    assert m90["ldgsts_by_width"]["128"] == 1 and m90["ldgsts_by_width"]["32"] == 1
    assert m90["async_copies"] == {"LDGSTS": 2, "UTMALDG": 1}
    assert (m90["mma"], m80["mma"]) == (1, 1) and m90["mma_by_op"] == {"HGMMA": 1, "HMMA": 1}
    assert (m90["spill_stores"], m90["spill_loads"], m90["stg_by_width"]["16"]) == (2, 1, 1)
    assert m90["instructions"] == len(ops)


def test_sass_line_pattern():
    lines = ["\t.section\t.text.k,\"ax\",@progbits",
             "        /*5d00*/                   HGMMA.64x64x16.F32.BF16 R56, R132, gdesc[UR20].tnspB, R56 ;",
             "        /*07e0*/               @P2 VIADD R8, R8, 0x1 ;",
             "        /*07f0*/              @!UP0 LDG.E.U16 R3, desc[UR4][R2.64] ;",
             "        /*0044*/ \t.dword\t_fprop_kernel",
             "        /*0800*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;"]
    insns = sass.parse_sass("\n".join(lines))["k"]
    assert [(i.pred, i.op) for i in insns] == [("", "HGMMA.64x64x16.F32.BF16"), ("@P2", "VIADD"), ("@!UP0", "LDG.E.U16"),
                                               ("", "HGMMA.64x64x16.F32.BF16")]
    assert sass.function_metrics(insns, 90)["hgmma_a_regs"] == 1  # the first takes A from registers


def test_short_name():
    assert sass.short_name("void demo::scale_kernel<8, __half>(__half const*, __half*, float, int)") == "scale_kernel<8, __half>"
    assert sass.short_name("spill_kernel") == "spill_kernel"
    long = ("void cutlass::Kernel2<cutlass::conv::kernel::ImplicitGemmConvolution<cutlass::conv::threadblock::Mma<A<1>, B>, "
            "cutlass::epilogue::E<2> > >(cutlass::conv::kernel::ImplicitGemmConvolution<X>::Params)")
    assert sass.short_name(long) == "Kernel2<ImplicitGemmConvolution<…> >"
    assert sass.short_name("void (anonymous namespace)::bn_fwd<float, 4>(float*)") == "bn_fwd<float, 4>"
    assert len(sass.short_name("k<" + ", ".join(["int"] * 100) + ">")) == 90


def _entry(**kw) -> dict:
    e = {"kind": "triton", "kernel": "fprop", "config": "128x64x64 w4 s3", "variant": "3x3", "dtype": "bf16",
         "arch": "sm_90", "conv": True, "regs": 128, "stack_bytes": 0, "shared_bytes": 1024, "mma": 8,
         "mma_by_op": {"HGMMA": 8}, "async_copies": {"LDGSTS": 6, "UTMALDG": 0},
         "ldg_by_width": {"128": 4, "64": 0, "32": 2, "16": 0, "8": 0}, "ldgsts_by_width": {"128": 6},
         "spill_stores": 0, "spill_loads": 0, "shapes": ["m/layer1.0/conv2"], "key": "k"}
    e.update(kw)
    return e


def test_check_rules_and_table():
    ok = _entry()
    assert limits.check_entries([ok, _entry(conv=False, mma=0, mma_by_op={})]) == []
    bad = limits.check_entries([_entry(stack_bytes=16, spill_stores=3, spill_loads=2), _entry(mma=0, mma_by_op={"HMMA": 4}),
                            _entry(arch="sm_80", shared_bytes=200 * 1024), _entry(error="CompilationError: x")])
    assert len(bad) == 4
    assert "16 bytes of stack (STL 3, LDL 2)" in bad[0] and "m/layer1.0/conv2" in bad[0]
    assert "no HGMMA" in bad[1] and "HMMA" in bad[1]
    assert "shared memory" in bad[2] and "compile failed" in bad[3]
    table = report.format_table([ok, _entry(regs=200, key="k2")])
    row = table.splitlines()[2].split()
    assert row[:6] == ["fprop", "128x64x64", "w4", "s3", "bf16", "sm_90"] and "128-200" in row and "32:2" in table
    # the mma column counts tensor-core instructions of any kind (sm_90's narrow tiles run HMMA)
    narrow = report.format_table([_entry(kernel="wgrad", config="16x16x128 w1 s2", mma=0, mma_by_op={"HMMA": 32})])
    assert narrow.splitlines()[2].split()[10] == "32"


def test_check_accepts_mma_sync_only_where_wgmma_cannot_run():
    """On sm_90 a convolution on HMMA passes only as a narrow (wgrad or wgrad_proj, BLOCK_N ≤ 32) or thin
    (BLOCK_M ≤ 16) wgrad tile or a staged-halo fprop tile of ≤ 16 output channels whose dots all have
    fewer rows than wgmma's 64 or run in fewer than a warpgroup's 4 warps (``_narrow_mma_sync``); a
    64-row dot in 4 warps, another kernel, a wider tile, unread dots or no dot records fail; sm_80's
    HMMA is judged as before."""
    dot = lambda rows, op="tt.dot", warps=(4, 1): {"op": op, "shape": [rows, 16], "warps": list(warps),
                                                   "instr": [16, 8], "replication": 1.0}
    hmma = dict(kernel="wgrad", mma=0, mma_by_op={"HMMA": 32}, constexprs={"BLOCK_N": "16"})
    assert limits.check_entries([_entry(**hmma, mma_dots=[dot(16)]), _entry(**hmma, mma_dots=[dot(32), dot(16)]),
                                 _entry(**dict(hmma, kernel="wgrad_proj", constexprs={"BLOCK_N": "32"}),
                                        mma_dots=[dot(32)]),
                                 _entry(**dict(hmma, constexprs={"C": "32", "RPI": "4"}), mma_dots=[dot(32)])]) == []
    # (the staged-halo wgrad: C, its tile's input channels; C alone is a layer's, not a tile's)
    assert len(limits.check_entries([_entry(**dict(hmma, constexprs={"C": "16"}), mma_dots=[dot(16)]),
                                     _entry(**dict(hmma, constexprs={"C": "64", "RPI": "4"}), mma_dots=[dot(16)])])) == 2
    bad = limits.check_entries([_entry(**hmma, mma_dots=[dot(64)]), _entry(**hmma, mma_dots=[dot(16), dot(64)]),
                                _entry(**hmma), _entry(**hmma, mma_dots=[dot(16, "ttng.warp_group_dot")]),
                                _entry(**dict(hmma, kernel="fprop"), mma_dots=[dot(16)]),
                                _entry(**dict(hmma, constexprs={"BLOCK_N": "64"}), mma_dots=[dot(16)]),
                                _entry(**hmma, mma_dots=[dot(16)], mma_dots_unparsed=1)])
    assert len(bad) == 7 and all("no HGMMA" in b for b in bad)
    # the thin tile: 16 output channels, dWᵀ's 64 rows in 2 warps (no warpgroup)
    thin = dict(hmma, constexprs={"BLOCK_M": "16", "BLOCK_N": "64"})
    assert limits.check_entries([_entry(**thin, mma_dots=[dot(64, warps=(2, 1))])]) == []
    bad = limits.check_entries([_entry(**thin, mma_dots=[dot(64)]),
                                _entry(**dict(thin, constexprs={"BLOCK_M": "32", "BLOCK_N": "64"}),
                                       mma_dots=[dot(64, warps=(2, 1))])])
    assert len(bad) == 2 and all("no HGMMA" in b for b in bad)
    # the staged-halo fprop's 2-warp tile over 16 output channels; not in 4 warps, not 32 wide, not
    # the implicit-GEMM fprop
    halo = dict(hmma, kernel="fprop", constexprs={"BLOCK_M": "128", "BLOCK_N": "16", "STAGE_ROWS": "128"})
    assert limits.check_entries([_entry(**halo, mma_dots=[dot(128, warps=(2, 1))])]) == []
    bad = limits.check_entries([_entry(**halo, mma_dots=[dot(128)]),
                                _entry(**dict(halo, constexprs={"BLOCK_N": "32", "STAGE_ROWS": "128"}),
                                       mma_dots=[dot(128, warps=(2, 1))]),
                                _entry(**dict(halo, constexprs={"BLOCK_M": "128", "BLOCK_N": "16"}),
                                       mma_dots=[dot(128, warps=(2, 1))])])
    assert len(bad) == 3 and all("no HGMMA" in b for b in bad)
    assert limits.check_entries([_entry(arch="sm_80", mma=32, mma_by_op={"HMMA": 32})]) == []


def test_check_rules_on_operand_loads():
    """The measured failure of the first GPU run (96 scalar LDG.E.U16 of the activation tile) and a
    mainloop without async copies fail; fp32's 32-bit loads and a non-convolution pass."""
    scalar = _entry(ldg_by_width={"128": 0, "64": 0, "32": 0, "16": 96, "8": 0})
    bad = limits.check_entries([scalar, _entry(dtype="fp16", ldgsts_by_width={"128": 4, "16": 2}),
                            _entry(async_copies={"LDGSTS": 0, "UTMALDG": 0})])
    assert len(bad) == 3
    assert "96 scalar 16/8-bit" in bad[0] and "2 scalar 16/8-bit" in bad[1] and "no async" in bad[2]
    assert limits.check_entries([_entry(async_copies={"LDGSTS": 0, "UTMALDG": 3}),
                             _entry(dtype="fp32", ldg_by_width={"32": 40}),
                             _entry(conv=False, async_copies={}, ldg_by_width={"16": 8})]) == []


def test_static_refuses_under_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert report.main(["--no-triton"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


def test_bench_static_flag_points_to_the_tool(capsys):
    """The installed benchmark runner no longer carries the static report: ``--static`` names the tool."""
    from fused_preact.bench import run

    assert run.main(["--static", "--arch", "90"]) == 2
    assert "python -m tools.static_report" in capsys.readouterr().err


@needs_tools
def test_recompute_kernels_compile_without_spills(tmp_path):
    """The recompute backend's own launches (pre-activation pass, BN backward reduction, and the fold it
    borrows from the wgrad kernel, launched without a weight gradient) compile for sm_90 in NCHW and
    channels_last without spills. The fold's compilation is the one a None weight-gradient pointer
    broke (only a GPU compile shows it: the interpreter never reaches the wgrad tiles)."""
    proc, obj = _static(tmp_path, "--provider", "tools.static_report.recompute_jobs:recompute_jobs", "--arch", "90",
                        "--models", "preact_resnet164", "--layers", "layer1.1/conv2", "--dtypes", "bf16",
                        "--kernels", "preact", "mask_sums", "fold", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = {e["kernel"] for e in obj["entries"]}
    assert kernels == {"preact", "mask_sums", "fold"}
    assert any("nchw" in e["variant"] for e in obj["entries"])
    assert all("error" not in e and e["stack_bytes"] == 0 for e in obj["entries"])
