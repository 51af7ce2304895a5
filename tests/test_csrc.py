"""The CUDA C++ backend (``csrc/`` → ``fused_preact._C``) and its Python glue (``fused_preact.ops.cuda.ext``).

CPU tests cover the glue where the extension is not built: lazy loading, refusal reasons, build
settings. ``gpu`` tests compare the CUTLASS kernels with a float64 PyTorch reference; they run where
a CUDA device and the built extension are present (``pip install --no-build-isolation -e .`` or
``fused_preact.ops.cuda.ext.jit_load()``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, randn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_glue():
    return importlib.import_module("fused_preact.ops.cuda.ext")


def _build_config():
    spec = importlib.util.spec_from_file_location("fused_preact_build_config", os.path.join(ROOT, "csrc", "build_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ glue, CPU
def test_import_is_lazy_and_queries_no_gpu():
    """Importing the package and the glue loads no extension and touches no CUDA API."""
    code = (
        "import torch, sys\n"
        "def boom(*a, **k): raise AssertionError('GPU queried at import')\n"
        "torch.cuda.is_available = boom; torch.cuda.get_device_capability = boom; torch.cuda.device_count = boom\n"
        "import fused_preact, fused_preact.ops.cuda.ext as cu\n"
        "assert cu._loaded is None, cu._loaded\n"
        "assert 'fused_preact._C' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only build")
def test_unavailable_without_error():
    cu = _cuda_glue()
    assert cu.available() is False
    assert cu.available() is False  # cached, still no exception
    err = cu.load_error()
    assert isinstance(err, str) and err


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only build")
def test_entry_points_raise_clearly_when_unavailable():
    cu = _cuda_glue()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float16)
    w = torch.randn(8, 8, 3, 3, dtype=torch.float16)
    v = torch.ones(8)
    with pytest.raises(RuntimeError, match="CUDA backend is not available"):
        cu.fprop(x, w, None, v, v, None, None, [1, 1], [1, 1], [1, 1], 1)
    with pytest.raises(RuntimeError, match="CUDA backend is not available"):
        cu.batch_stats(x)
    with pytest.raises(RuntimeError, match="CUDA backend is not available"):
        cu.build_info()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only build")
def test_reasons_name_the_missing_extension_device_and_dtype():
    cu = _cuda_glue()
    x = torch.randn(2, 8, 4, 4)
    w = torch.randn(8, 8, 3, 3)
    reasons = cu.not_supported_reasons(x, w, 1, 1, 1, 1)
    text = "; ".join(reasons)
    assert all(r.startswith("cuda: ") for r in reasons)
    assert "fused_preact._C extension is not available" in text
    assert "needs a CUDA tensor" in text
    assert "torch.float32 not supported" in text


@pytest.mark.parametrize(
    "shape, wshape, stride, dilation, groups, expected",
    [
        ((2, 12, 8, 8), (16, 12, 3, 3), 1, 1, 1, "input channels 12 not a multiple of 8"),
        ((2, 16, 8, 8), (20, 16, 3, 3), 1, 1, 1, "output channels 20 not a multiple of 8"),
        ((2, 16, 8, 8), (16, 8, 3, 3), 1, 1, 2, "groups=2 not supported"),
        ((2, 16, 16, 16), (16, 16, 3, 3), 2, 2, 1, "stride [2, 2] with dilation [2, 2] not supported"),
        ((1, 16, 40, 40), (16, 16, 33, 33), 1, 1, 1, "larger than 32x32"),
    ],
)
def test_reasons_for_unsupported_geometry(monkeypatch, shape, wshape, stride, dilation, groups, expected):
    cu = _cuda_glue()
    monkeypatch.setattr(cu, "available", lambda: True)
    x = torch.empty(shape, dtype=torch.float16)
    w = torch.empty(wshape, dtype=torch.float16)
    reasons = cu.not_supported_reasons(x, w, stride, 0, dilation, groups)
    assert any(expected in r for r in reasons), reasons


def test_reasons_accept_a_supported_cpu_geometry_except_for_the_device(monkeypatch):
    cu = _cuda_glue()
    monkeypatch.setattr(cu, "available", lambda: True)
    x = torch.empty(2, 16, 8, 8, dtype=torch.bfloat16)
    w = torch.empty(32, 16, 3, 3, dtype=torch.bfloat16)
    assert cu.not_supported_reasons(x, w, 1, 1, 1, 1) == ["cuda: x is on cpu; the CUDA backend needs a CUDA tensor"]


def test_reasons_for_tensors_beyond_32_bit_offsets(monkeypatch):
    cu = _cuda_glue()
    monkeypatch.setattr(cu, "available", lambda: True)
    x = torch.empty(4096, 256, 32, 32, dtype=torch.float16, device="meta")  # its fp32 da: 4 GiB
    w = torch.empty(8, 256, 1, 1, dtype=torch.float16, device="meta")
    assert any("2^31 bytes" in r for r in cu.not_supported_reasons(x, w, 1, 0, 1, 1))


# ------------------------------------------------------------------------------ build settings
def test_build_config_archs_and_gencode(monkeypatch):
    cfg = _build_config()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("FUSED_PREACT_CUDA_ARCHS", raising=False)
    assert cfg.cuda_archs() == ["80", "90a"]
    assert cfg.gencode_flags() == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;8.6+PTX")
    assert cfg.cuda_archs() == ["86+PTX"]
    assert cfg.gencode_flags() == ["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_86,code=compute_86"]
    monkeypatch.setenv("FUSED_PREACT_CUDA_ARCHS", "9.0")
    assert cfg.cuda_archs() == ["90"]
    monkeypatch.setenv("FUSED_PREACT_CUDA_ARCHS", "8.0 9.0a")
    assert cfg.cuda_archs() == ["80", "90a"]
    assert cfg.gencode_flags()[-1] == "-gencode=arch=compute_90a,code=sm_90a"
    monkeypatch.setenv("FUSED_PREACT_CUDA_ARCHS", "7.0")
    with pytest.raises(ValueError, match="no CUDA architecture >= 8.0"):
        cfg.cuda_archs()


def test_build_config_sm90_sources_get_sm90a_alone(monkeypatch):
    """csrc/sm90_*.cu are compiled for sm_90a only (with FUSED_PREACT_SM90 and NDEBUG) whenever a 9.x
    architecture is listed, and as stubs (the common flags, no define) otherwise."""
    cfg = _build_config()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    names = {os.path.basename(s) for s in cfg.sm90_sources()}
    assert {"sm90_conv_fprop.cu", "sm90_conv_dgrad.cu", "sm90_conv_wgrad.cu"} <= names
    assert not names & {os.path.basename(s) for s in cfg.common_sources()}
    assert sorted(cfg.sm90_sources() + cfg.common_sources()) == cfg.sources()
    for spec in ("8.0;9.0", "8.0;9.0a", "9.0"):
        monkeypatch.setenv("FUSED_PREACT_CUDA_ARCHS", spec)
        flags = cfg.nvcc_flags_sm90()
        assert [f for f in flags if f.startswith("-gencode")] == ["-gencode=arch=compute_90a,code=sm_90a"], spec
        assert "-DFUSED_PREACT_SM90" in flags and "-DNDEBUG" in flags
    monkeypatch.setenv("FUSED_PREACT_CUDA_ARCHS", "8.0;8.6")
    assert cfg.sm90_archs() == []
    assert cfg.nvcc_flags_sm90() == cfg.nvcc_flags()
    assert "-DFUSED_PREACT_SM90" not in cfg.nvcc_flags()


def test_build_config_jobs_and_sources(monkeypatch):
    cfg = _build_config()
    monkeypatch.delenv("MAX_JOBS", raising=False)
    assert cfg.max_jobs() >= 1
    monkeypatch.setenv("MAX_JOBS", "3")
    assert cfg.max_jobs() == 3
    names = {os.path.basename(s) for s in cfg.sources()}
    assert {"fused_preact.cpp", "ops.cu", "conv_fprop.cu", "conv_dgrad.cu", "conv_wgrad.cu", "bn_kernels.cu"} <= names


def test_build_config_missing_cutlass_says_how_to_install(monkeypatch, tmp_path):
    cfg = _build_config()
    monkeypatch.setenv("FUSED_PREACT_CUTLASS_INCLUDE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # makes `import cutlass_library` fail
    with pytest.raises(RuntimeError, match="pip install"):
        cfg.cutlass_include_dir()


def test_sm90_thread_mappings_and_padding_arithmetic_on_the_host(tmp_path):
    """csrc/checks/sm90_layout_checks.cu, compiled with nvcc and run on the CPU (no GPU needed): the
    register/smem fragments the sm90 transforms work on cover their tiles exactly once with the
    channel pairing the code assumes; the fprop's ldmatrix copy, simulated per PTX, delivers every
    element where the wgmma expects it; its row/channel slots and scale/shift table lookups give each
    register's row and channels (partial channel blocks, zeros past C); the fp32 transform of a pair
    (unpack, FMA, ReLU with NaN kept) matches its definition; the wgrad padding ballot and pixel walk
    give each thread its pixels' padding tests; the k-tile walk follows CUTLASS's (C, S, R) order, and
    the padding test agrees with the definition of the convolution (strides, dilation, padding)."""
    import shutil

    cfg = _build_config()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    try:
        includes = [f"-I{d}" for d in cfg.include_dirs()]
    except RuntimeError as exc:
        pytest.skip(f"needs the CUTLASS headers: {exc}")
    exe = tmp_path / "sm90_layout_checks"
    src = os.path.join(ROOT, "csrc", "checks", "sm90_layout_checks.cu")
    build = subprocess.run(
        [nvcc, "-std=c++20", "--expt-relaxed-constexpr", "-O1", *includes, src, "-o", str(exe)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout + run.stderr


# ------------------------------------------------------------------------------------ GPU tests
def _require_gpu_backend():
    """The glue with a loaded extension on an sm_80+ device, else skip; with
    FUSED_PREACT_REQUIRE_CUDA_EXT=1 (a GPU session that built the extension) a missing extension fails
    instead of skipping, so a broken build cannot pass as all-skipped."""
    cu = _cuda_glue()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not cu.available():
        message = f"fused_preact._C not built: {cu.load_error()}"
        if os.environ.get("FUSED_PREACT_REQUIRE_CUDA_EXT") == "1":
            pytest.fail(message)
        pytest.skip(message)
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs compute capability >= 8.0")
    return cu


# (N, C, H, W, K, R, S, stride, padding, dilation)
SHAPES = [
    (4, 16, 12, 12, 32, 3, 3, 1, 1, 1),
    (2, 32, 9, 11, 16, 1, 1, 2, 0, 1),     # projection shortcut; stride > kernel leaves untouched inputs
    (3, 24, 10, 10, 40, 3, 3, 2, 1, 1),
    (2, 16, 13, 13, 16, 3, 3, 1, 2, 2),    # dilation, unit stride
    (1, 64, 7, 7, 64, 3, 3, 1, 1, 1),
]


def _problem(shape, dtype, channels_last, seed=0, x_std=2.0):
    N, C, H, W, K, R, S, st, pd, dl = shape
    g = torch.Generator().manual_seed(seed)
    x = randn(N, C, H, W, dtype=dtype, device="cuda", mean=0.5 * x_std / 2.0, std=x_std,
              channels_last=channels_last, generator=g)
    w = randn(K, C, R, S, dtype=dtype, device="cuda", std=(C * R * S) ** -0.5, generator=g)
    b = randn(K, dtype=dtype, device="cuda", generator=g)
    gamma = randn(C, device="cuda", mean=1.0, std=0.3, generator=g)
    beta = randn(C, device="cuda", std=0.3, generator=g)
    rm = randn(C, device="cuda", mean=0.5, std=0.2, generator=g)
    rv = randn(C, device="cuda", mean=4.0, std=0.1, generator=g).abs()
    return x, w, b, gamma, beta, rm, rv, ([st, st], [pd, pd], [dl, dl])


def _reference(x, w, b, gamma, beta, rm, rv, training, conv, eps=1e-5):
    """float64 F.batch_norm → relu → conv2d and its gradients for a fixed upstream gradient."""
    st, pd, dl = conv
    xd = x.detach().double().requires_grad_(True)
    wd = w.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True)
    gd = gamma.detach().double().requires_grad_(True)
    betad = beta.detach().double().requires_grad_(True)
    a = F.relu(F.batch_norm(xd, rm.double().clone(), rv.double().clone(), gd, betad, training, 0.1, eps))
    y = F.conv2d(a, wd, bd, st, pd, dl)
    return y, (xd, wd, bd, gd, betad)


def _check_against_float64(cu, shape, dtype, training, channels_last=True, seed=0, beta_value=None, bias=True,
                           gamma_value=None, x_std=2.0, dy_scale=1.0):
    """fprop + backward of the CUDA backend against the float64 reference: y, dx, dw, db, dγ, dβ."""
    x, w, b, gamma, beta, rm, rv, conv = _problem(shape, dtype, channels_last, seed=seed, x_std=x_std)
    if beta_value is not None:
        beta = torch.full_like(beta, beta_value)
    if gamma_value is not None:
        gamma = torch.full_like(gamma, gamma_value)
        rm = torch.zeros_like(rm)
        rv = torch.full_like(rv, x_std**2)
    if not bias:
        b = torch.zeros_like(b)
    st, pd, dl = conv
    assert cu.not_supported_reasons(x, w, st, pd, dl, 1) == []
    eps = 1e-5
    if training:
        mean, var = cu.batch_stats(x)
    else:
        mean, var = rm.float(), rv.float()
    invstd = torch.rsqrt(var + eps)
    y = cu.fprop(x, w, b if bias else None, mean, invstd, gamma, beta, st, pd, dl, 1)
    y_ref, leaves = _reference(x, w, b, gamma, beta, rm, rv, training, conv, eps)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)
    assert_close(y, y_ref, dtype, "y")

    dy = randn(*y.shape, dtype=dtype, device="cuda", std=dy_scale, generator=torch.Generator().manual_seed(seed + 1))
    y_ref.backward(dy.double())
    dx, dw, db, dgamma, dbeta = cu.backward(dy, x, w, mean, invstd, gamma, beta, st, pd, dl, 1, training, bias)
    xd, wd, bd, gd, betad = leaves
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dgamma.dtype == torch.float32
    assert dx.is_contiguous(memory_format=fmt)
    assert_close(dx, xd.grad, dtype, "dx")
    assert_close(dw, wd.grad, dtype, "dw")
    if bias:
        assert_close(db, bd.grad, dtype, "db")
    else:
        assert db.numel() == 0
    assert_close(dgamma, gd.grad, dtype, "dgamma")
    assert_close(dbeta, betad.grad, dtype, "dbeta")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("channels_last", [True, False])
def test_fprop_backward_match_float64(dtype, shape, training, channels_last):
    _check_against_float64(_require_gpu_backend(), shape, dtype, training, channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 9, 9, 16, 3, 3, 1, 1, 1), (2, 16, 9, 9, 16, 3, 3, 2, 2, 1),
                                   (2, 24, 11, 13, 40, 5, 5, 1, 2, 1)])
@pytest.mark.parametrize("beta_value", [2.0, 60.0])
def test_padding_is_a_zero_activation_not_relu_shift(dtype, shape, beta_value):
    """A large β makes relu(shift) large on every channel: padded taps must be zeros of the activation
    after the transform — fprop (operand A), wgrad (operand B) and the dgrad mask; CUTLASS 2.x marks them
    with its out-of-bounds sentinel, the sm90 kernels decide from coordinates."""
    _check_against_float64(_require_gpu_backend(), shape, dtype, True, seed=3, beta_value=beta_value, bias=False)


# Shapes for the tiled sm90 kernels (128-row tiles, 64/128-channel tiles, k-tiles over (C, S, R)):
# several M tiles with a residue, channel counts that are odd multiples of 8 (partial channel blocks,
# N residues), C and K of 8, strides (fprop/wgrad on sm90, dgrad falls back), dilation, 1x1 and 5x5, and
# one large enough for split-K in wgrad. (N, C, H, W, K, R, S, stride, padding, dilation)
SM90_SHAPES = [
    (2, 72, 17, 19, 40, 3, 3, 1, 1, 1),
    (4, 136, 9, 9, 24, 3, 3, 2, 1, 1),
    (2, 64, 14, 14, 256, 1, 1, 1, 0, 1),
    (1, 8, 33, 35, 8, 5, 5, 1, 2, 1),
    (2, 40, 16, 16, 24, 3, 3, 1, 2, 2),
    (3, 24, 15, 15, 200, 3, 3, 2, 1, 1),
    (16, 64, 28, 28, 64, 3, 3, 1, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SM90_SHAPES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_tiled_shapes_match_float64(dtype, shape, training):
    """On compute capability 9.0 these run the CUTLASS 3.x kernels (csrc/sm90_*.cu), elsewhere the 2.x ones."""
    _check_against_float64(_require_gpu_backend(), shape, dtype, training)


def _require_sm90(cu):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs compute capability 9.0 (the sm_90a kernels)")
    if not cu.build_info().get("sm90a"):
        message = "fused_preact._C was built without the sm_90a kernels"
        if os.environ.get("FUSED_PREACT_REQUIRE_CUDA_EXT") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_sm90_fp16_scale_beyond_fp16_range(training):
    """γ = 300 with std(x) = 1e-3 gives scale = γ·invstd ≈ 9e4 > 65504: CUTLASS 2.x's transform rounds scale
    to fp16 (inf); the sm90 kernels keep scale/shift in fp32 and match float64. (x·scale stays in fp16's
    range, and a small dy keeps dx = scale·dz in it too.)"""
    cu = _require_gpu_backend()
    _require_sm90(cu)
    _check_against_float64(cu, (2, 16, 9, 9, 16, 3, 3, 1, 1, 1), torch.float16, training, gamma_value=300.0,
                           x_std=1e-3, dy_scale=1e-3)


@pytest.mark.gpu
def test_sm90_dispatch_runs_the_cutlass3_kernels():
    """On 9.0 fprop, dgrad (unit stride) and wgrad run the sm90 kernels, seen by name in the profiler."""
    cu = _require_gpu_backend()
    _require_sm90(cu)
    x, w, b, gamma, beta, rm, rv, (st, pd, dl) = _problem((2, 64, 14, 14, 64, 3, 3, 1, 1, 1), torch.bfloat16, True)
    mean, var = cu.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    dy = randn(2, 64, 14, 14, dtype=torch.bfloat16, device="cuda", channels_last=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cu.fprop(x, w, b, mean, invstd, gamma, beta, st, pd, dl, 1)
        cu.backward(dy, x, w, mean, invstd, gamma, beta, st, pd, dl, 1, True, True)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "FpropBnReluMainloop" in names, names
    assert "ReluBackward" in names, names  # the dgrad epilogue's visitor tree
    assert "WgradKernel" in names, names
    assert "ImplicitGemmConvolution" not in names, names  # no CUTLASS 2.x kernel


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [4096, 4104])
def test_sm90_fprop_scale_table_limit(channels):
    """The sm90 fprop keeps scale/shift of up to 4096 channels in shared memory: C = 4096 runs it, C = 4104
    falls back to the 2.x fprop; both match float64."""
    cu = _require_gpu_backend()
    _require_sm90(cu)
    shape = (1, channels, 4, 4, 8, 1, 1, 1, 0, 1)
    _check_against_float64(cu, shape, torch.bfloat16, True)
    x, w, b, gamma, beta, rm, rv, (st, pd, dl) = _problem(shape, torch.bfloat16, True)
    mean, var = cu.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cu.fprop(x, w, b, mean, invstd, gamma, beta, st, pd, dl, 1)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert ("FpropBnReluMainloop" in names) == (channels <= 4096), names


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_dgrad_stats_returns_dz_in_the_input_dtype(training):
    """cuda_dgrad_stats hands dz (training) or dx (eval) back in x's dtype on both kernel generations."""
    _require_gpu_backend()
    x, w, b, gamma, beta, rm, rv, (st, pd, dl) = _problem((2, 16, 8, 8, 16, 3, 3, 1, 1, 1), torch.bfloat16, True)
    v = torch.ones(16, device="cuda")
    dy = randn(2, 16, 8, 8, dtype=torch.bfloat16, device="cuda", channels_last=True)
    out, sum_dz, sum_dzx = torch.ops.fused_preact.cuda_dgrad_stats(dy, x, w, v, v * 0, v * 0, v, st, pd, dl, training)
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert sum_dz.dtype == sum_dzx.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_batch_stats_match_float64_and_are_deterministic(dtype):
    cu = _require_gpu_backend()
    x = randn(16, 40, 33, 17, dtype=dtype, device="cuda", mean=100.0, std=0.5, channels_last=True)
    mean, var = cu.batch_stats(x)
    xd = x.double()
    assert_close(mean, xd.mean((0, 2, 3)), dtype, "mean")
    assert_close(var, xd.var((0, 2, 3), unbiased=False), torch.float32, "var")
    mean2, var2 = cu.batch_stats(x)
    assert torch.equal(mean, mean2) and torch.equal(var, var2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_is_deterministic(dtype):
    cu = _require_gpu_backend()
    # 32x56x56 positions: wgrad splits its N·P·Q reduction over several CTAs (split-K) on both generations.
    x, w, b, gamma, beta, rm, rv, (st, pd, dl) = _problem((32, 32, 56, 56, 64, 3, 3, 1, 1, 1), dtype, True)
    mean, var = cu.batch_stats(x)
    invstd = torch.rsqrt(var + 1e-5)
    dy = randn(32, 64, 56, 56, dtype=dtype, device="cuda", channels_last=True)
    first = cu.backward(dy, x, w, mean, invstd, gamma, beta, st, pd, dl, 1, True, True)
    second = cu.backward(dy, x, w, mean, invstd, gamma, beta, st, pd, dl, 1, True, True)
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)


@pytest.mark.gpu
def test_reports_build_info_and_device_support():
    cu = _require_gpu_backend()
    info = cu.build_info()
    assert info["archs"] and all(a >= 80 for a in info["archs"])
    assert info["dtypes"] == ["float16", "bfloat16"]
    assert isinstance(info["sm90a"], bool)
    x = torch.empty(2, 16, 8, 8, dtype=torch.float16, device="cuda")
    w = torch.empty(16, 16, 3, 3, dtype=torch.float16, device="cuda")
    assert cu.not_supported_reasons(x, w, 1, 1, 1, 1) == []


# ------------------------------------------------------------------------- NaN / Inf semantics
def _special_pattern(t: torch.Tensor) -> dict[str, torch.Tensor]:
    t = t.detach().double().cpu()
    return {"nan": torch.isnan(t), "+inf": torch.isposinf(t), "-inf": torch.isneginf(t)}


def _assert_same_special_pattern(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Exactly the same NaN, +inf and -inf positions as the reference (finite values are not compared)."""
    g, r = _special_pattern(got), _special_pattern(ref)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    for kind in g:
        differ = (g[kind] != r[kind]).sum().item()
        assert differ == 0, (
            f"{what}: {kind} at {g[kind].sum().item()} positions, eager at {r[kind].sum().item()} "
            f"({differ} differ)"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_nan_and_inf_follow_eager(dtype, special, training):
    """One NaN / +inf / -inf in x: output, all gradients and the batch statistics have exactly eager's
    NaN/Inf pattern (issue 10, item A). Eager: relu(NaN) = NaN, relu(+inf) = inf, relu(-inf) = 0, and
    ReLU's backward passes the gradient where relu(z) is NaN; in training the channel's mean is non-finite
    and so is everything normalized with it. Padded taps stay zeros of the activation."""
    cu = _require_gpu_backend()
    shape = (2, 16, 6, 6, 16, 3, 3, 1, 1, 1)
    x, w, b, gamma, beta, rm, rv, conv = _problem(shape, dtype, True, seed=7)
    gamma[3] = 1.0  # a positive scale: -inf stays -inf before the ReLU in eval mode
    x[0, 3, 2, 2] = special
    st, pd, dl = conv
    eps = 1e-5
    if training:
        mean, var = cu.batch_stats(x)
        xd = x.double()
        _assert_same_special_pattern(mean, xd.mean((0, 2, 3)), "batch mean")
        _assert_same_special_pattern(var, xd.var((0, 2, 3), unbiased=False), "batch var")
    else:
        mean, var = rm.float(), rv.float()
    invstd = torch.rsqrt(var + eps)
    y = cu.fprop(x, w, b, mean, invstd, gamma, beta, st, pd, dl, 1)
    y_ref, (xd, wd, bd, gd, betad) = _reference(x, w, b, gamma, beta, rm, rv, training, conv, eps)
    _assert_same_special_pattern(y, y_ref, "y")
    assert torch.isfinite(y_ref).sum() < y_ref.numel() or special == float("-inf")  # the test bites

    dy = randn(*y.shape, dtype=dtype, device="cuda", channels_last=True, generator=torch.Generator().manual_seed(8))
    y_ref.backward(dy.double())
    dx, dw, db, dgamma, dbeta = cu.backward(dy, x, w, mean, invstd, gamma, beta, st, pd, dl, 1, training, True)
    _assert_same_special_pattern(dx, xd.grad, "dx")
    _assert_same_special_pattern(dw, wd.grad, "dw")
    _assert_same_special_pattern(db, bd.grad, "db")
    _assert_same_special_pattern(dgamma, gd.grad, "dgamma")
    _assert_same_special_pattern(dbeta, betad.grad, "dbeta")
