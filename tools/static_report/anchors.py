"""Anchors: reference GEMM main loops compiled with the report's own machinery (``--anchors``).

They put the project's issue ratios next to what a plain Triton matmul and a stock CUTLASS kernel
reach with the same compilers (entries of kind ``anchor``, never checked against limits):

    triton-matmul-<tile>   a tiled Triton matmul in the style of Triton's matmul tutorial: grouped
                           program-id order (GROUP_M = 8 rows of tiles per group), a ``tl.dot`` K loop
                           over row-major A (M×K) and B (K×N) with K-tail masks on the loads,
                           ``num_stages`` software pipelining; bf16 operands, fp32 accumulation,
                           M = N = K = 4096
    triton-atb-<tile>      the same kernel computing Aᵀ·B for a wgrad-shaped problem: A and B are
                           row-major (rows × 256) gradients/activations, the reduction runs over
                           128·56·56 rows (the 3×3 layer1 wgrad of PreActResNet-50 as a plain GEMM)
    triton-tma-<tile>      a persistent Triton matmul (one program per SM, 132, looping over tiles)
                           loading both operands with tensor descriptors (TMA), sm_90 only
    cutlass-pingpong-128x64x64, cutlass-cooperative-128x128x64
                           CUTLASS 3's sm_90 TMA warp-specialized GEMM (``CollectiveBuilder``, schedules
                           ``KernelTmaWarpSpecializedPingpong`` / ``…Cooperative``), bf16 in, fp32
                           accumulation, from ``anchor_cutlass.cu`` compiled with ``nvcc -arch=sm_90a
                           -cubin`` against the CUTLASS headers the extension's build uses
                           (``csrc/build_config.py``); skipped with a note when nvcc or the headers
                           are missing

Tiles are ``BLOCK_MxBLOCK_NxBLOCK_K w<warps> s<stages>`` (:data:`TRITON_ANCHORS`). The ones 16 columns
wide (``…x16x…``) are the narrowest layers' GEMMs without their fusions: fprop/dgrad-shaped (N = 16
output channels, K steps of 64 or of 16, one filter tap of 16 channels) and a 1×1 wgrad of 16 output
channels (Aᵀ·B, 64 × 16 per tile).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tools.static_report.jobs import StaticJob, TensorSpec

__all__ = ["ANCHOR_NAMES", "TRITON_ANCHORS", "CUTLASS_ANCHORS", "anchor_jobs", "cutlass_entries", "anchor_entries"]

_ROOT = Path(__file__).resolve().parents[2]
_CU = Path(__file__).resolve().parent / "anchor_cutlass.cu"
#: SMs of the persistent anchor's grid (H100 SXM).
_SMS = 132


@triton.jit
def _tiled_matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C (M×N, bf16) = A (M×K) · B (K×N), any strides, fp32 accumulation. Programs walk the tiles in
    groups of GROUP_M tile rows (column-major inside a group) so neighbouring programs share A and B
    tiles in L2. Operand rows and columns past M, N are wrapped by modulo (their results are masked at
    the store); the K tail is masked at the loads (zeros past K), as in Triton's tutorial kernel."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % rows
    tile_n = (pid % per_group) // rows
    rm = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_tile = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=rk[None, :] < K - k, other=0.0)
        b = tl.load(b_tile, mask=rk[:, None] < K - k, other=0.0)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    cm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + cm[:, None] * stride_cm + cn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(cm[:, None] < M) & (cn[None, :] < N))


@triton.jit
def _persistent_tma_matmul(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr):
    """C = A · Bᵀ through tensor descriptors (A: M×K, B: N×K, C: M×N, all row-major bf16): one
    program per SM takes tiles ``pid, pid + NUM_SMS, …`` in row-major tile order; each K step loads
    both operand tiles with TMA."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(pid, num_tiles, NUM_SMS):
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([off_m, off_n], acc.to(tl.bfloat16))


#: name → (kernel, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
TRITON_ANCHORS: dict[str, tuple[str, int, int, int, int, int]] = {
    "triton-matmul-128x64x64": ("matmul", 128, 64, 64, 8, 3),
    "triton-matmul-128x128x64": ("matmul", 128, 128, 64, 8, 3),
    "triton-matmul-128x256x64": ("matmul", 128, 256, 64, 8, 3),
    "triton-atb-64x64x64": ("atb", 64, 64, 64, 4, 4),
    "triton-tma-128x64x64": ("tma", 128, 64, 64, 8, 3),
    "triton-tma-128x128x64": ("tma", 128, 128, 64, 8, 3),
    # 16 columns: the width of the narrowest layers' MMAs (PreActResNet-164's 16-channel stage)
    "triton-matmul-256x16x64": ("matmul", 256, 16, 64, 4, 3),
    "triton-matmul-256x16x16": ("matmul", 256, 16, 16, 4, 3),
    "triton-atb-64x16x256": ("atb", 64, 16, 256, 4, 3),
    "triton-tma-256x16x64": ("tma", 256, 16, 64, 4, 3),
}
#: name → (tile label, schedule as it appears in the kernel's demangled name).
CUTLASS_ANCHORS: dict[str, tuple[str, str]] = {
    "cutlass-pingpong-128x64x64": ("128x64x64", "KernelTmaWarpSpecializedPingpong"),
    "cutlass-cooperative-128x128x64": ("128x128x64", "KernelTmaWarpSpecializedCooperative"),
}
ANCHOR_NAMES: tuple[str, ...] = tuple(TRITON_ANCHORS) + tuple(CUTLASS_ANCHORS)


def anchor_jobs(names: Sequence[str]) -> list[StaticJob]:
    """The Triton anchors among ``names`` as jobs (``kernel`` the anchor's name; ``variant`` says what
    it computes; sm_90 only for the TMA ones)."""
    bf16 = TensorSpec(torch.bfloat16)
    jobs = []
    for name in names:
        if name not in TRITON_ANCHORS:
            continue
        kind, bm, bn, bk, warps, stages = TRITON_ANCHORS[name]
        config = f"{bm}x{bn}x{bk} w{warps} s{stages}"
        opts = dict(num_warps=warps, num_stages=stages)
        if kind == "matmul":
            n = 4096  # row-major A (M×K), B (K×N), C (M×N)
            jobs.append(StaticJob(name, config, _tiled_matmul, (bf16, bf16, bf16, n, n, n, n, 1, n, 1, n, 1),
                                  dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **opts), True,
                                  "A·B 4096³", "bf16", "anchor"))
        elif kind == "atb":
            rows, ch = 128 * 56 * 56, 256  # dW (256×256) = dYᵀ (256×rows) · X (rows×256)
            jobs.append(StaticJob(name, config, _tiled_matmul, (bf16, bf16, bf16, ch, ch, rows, 1, ch, ch, 1, ch, 1),
                                  dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **opts), True,
                                  f"Aᵀ·B 256x256, K={rows}", "bf16", "anchor"))
        else:
            n = 4096
            desc = lambda rows_, block: TensorDescriptor(bf16, [rows_, n], [n, 1], block)
            args = (desc(n, [bm, bk]), desc(n, [bn, bk]), desc(n, [bm, bn]), n, n, n)
            jobs.append(StaticJob(name, config, _persistent_tma_matmul, args,
                                  dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_SMS=_SMS, **opts), True,
                                  "A·Bᵀ 4096³ persistent TMA", "bf16", "anchor", archs=(90,)))
    return jobs


def _build_config():
    spec = importlib.util.spec_from_file_location("fused_preact_build_config", _ROOT / "csrc" / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc_command(cubin: str) -> Optional[list[str]]:
    """The nvcc command compiling :data:`_CU` to ``cubin``, or None without nvcc or CUTLASS headers."""
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME")
                                     else None)
    if not nvcc or not os.path.isfile(nvcc):
        return None
    bc = _build_config()
    try:
        include = bc.cutlass_include_dir()
    except RuntimeError:
        return None
    util = bc.cutlass_util_include_dir(include)
    return [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-arch=sm_90a", "-cubin",
            f"-I{include}"] + ([f"-I{util}"] if util else []) + ["-o", cubin, str(_CU)]


def cutlass_entries(names: Sequence[str], cache_dir: Optional[Path], log: Callable[[str], None]) -> list[dict]:
    """The CUTLASS anchors among ``names`` (kind ``anchor``, metrics as for ``--cubins``), from one
    compile of :data:`_CU`, cached under ``cache_dir`` by the hash of the source, the command and
    ``nvcc --version``. Empty, with a log line, when nvcc or the CUTLASS headers are missing.

    Raises:
        RuntimeError: nvcc failed, or the cubin lacks one of the wanted kernels.
    """
    from tools.static_report.compile import PARSER_VERSION
    from tools.static_report.sass import cubin_metrics, demangle

    wanted = [n for n in names if n in CUTLASS_ANCHORS]
    if not wanted:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "anchor_cutlass.cubin")
        cmd = _nvcc_command(cubin)
        if cmd is None:
            log("anchors: no nvcc or CUTLASS headers (csrc/build_config.py); CUTLASS anchors skipped")
            return []
        version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256(json.dumps([_CU.read_text(), cmd[1:-3], version, PARSER_VERSION]).encode()).hexdigest()
        path = None if cache_dir is None else cache_dir / f"v{PARSER_VERSION}" / "anchors" / f"{key}.json"
        if path is not None and path.is_file():
            funcs = json.loads(path.read_text())
        else:
            log(f"anchors: compiling {_CU.name} with nvcc (a few minutes)")
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"nvcc failed on {_CU.name}:\n{res.stderr[-3000:]}")
            metrics = cubin_metrics(cubin)
            funcs = {full: {**m, "compile_s": round(time.perf_counter() - t0, 1)}
                     for full, m in zip(demangle(list(metrics)), metrics.values())}
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(funcs))
    entries = []
    for name in wanted:
        tile, schedule = CUTLASS_ANCHORS[name]
        found = [(full, m) for full, m in funcs.items() if schedule in full and m.get("mma")]
        if len(found) != 1:
            raise RuntimeError(f"{_CU.name}: expected one kernel with {schedule}, found {len(found)}")
        full, m = found[0]
        entries.append({"kind": "anchor", "kernel": name, "config": tile, "variant": "CUTLASS 3 sm90 TMA WS GEMM",
                        "dtype": "bf16", "arch": f"sm_{m['arch']}", "conv": True, "function": full[:2000],
                        **{k: v for k, v in m.items() if k != "arch"}})
    return entries


def anchor_entries(names: Sequence[str], archs: Sequence[int], cache_dir: Optional[Path],
                   log: Callable[[str], None] = print) -> list[dict]:
    """Report entries of the anchors ``names`` (:data:`ANCHOR_NAMES`): the Triton ones compiled for
    ``archs`` (the TMA ones for sm_90 alone) by :func:`tools.static_report.compile.triton_entries`,
    the CUTLASS ones by :func:`cutlass_entries` when 90 is in ``archs``."""
    from tools.static_report.compile import triton_entries

    entries, _ = triton_entries(anchor_jobs(names), archs, 1, cache_dir, None, log, kind="anchor")
    if 90 in archs:
        entries += cutlass_entries(names, cache_dir, log)
    return entries
