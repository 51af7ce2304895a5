"""Job providers for tests/test_static_report.py, loaded by the static report in a subprocess
(``--provider static_fixtures:<name>``, with tests/ on PYTHONPATH and TRITON_INTERPRET unset).

Not a test module: pytest never imports it (the kernels must be decorated without the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tools.static_report.jobs import StaticJob, TensorSpec

F32 = TensorSpec(torch.float32)
BF16 = TensorSpec(torch.bfloat16)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, off_ptr, n_one, n16, n17, flag, alpha, unused, BLOCK: tl.constexpr):
    """y = x·alpha (+ off[0]·n17 when flag): elementwise, vectorizable; its arguments exercise the
    specialization rules (1, %16, other ints, bool, float, None, an unaligned pointer)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n16 * n_one
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = x * alpha
    if flag:
        y += tl.load(off_ptr) * n17
    tl.store(y_ptr + offs, y, mask=mask)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A·B for row-major bf16 A (M×K), B (K×N), fp32 C: a minimal tensor-core kernel."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _spill_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """Two BLOCK-long vectors live across a reduction: with BLOCK 4096 on one warp (256 fp32 values
    per thread) they cannot fit in 255 registers, so ptxas spills (STL/LDL, stack > 0)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = tl.load(x_ptr + BLOCK + offs)
    s = tl.sum(x * y, axis=0)
    tl.store(y_ptr + offs, x * s + y)


def _scale_job(conv: bool = False) -> StaticJob:
    args = (F32, F32, TensorSpec(torch.float32, aligned=False), 1, 4096, 17, True, 0.5, None)
    return StaticJob("scale", "1024 w4", _scale_kernel, args, dict(BLOCK=1024, num_warps=4), conv=conv,
                     dtype="fp32", shape="fixture/scale")


def clean_jobs(units, dtypes) -> list[StaticJob]:
    """A vectorizable elementwise kernel and a small bf16 GEMM (a 'convolution' with tensor cores)."""
    gemm = StaticJob("gemm", "64x64x32 w4 s3", _gemm_kernel, (BF16, BF16, F32, 512, 256, 128),
                     dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3), conv=True, dtype="bf16",
                     shape="fixture/gemm")
    return [_scale_job(), gemm]


def bad_jobs(units, dtypes) -> list[StaticJob]:
    """A spilling kernel, and the elementwise kernel mislabelled as a convolution (no MMA)."""
    spill = StaticJob("spill", "4096 w1", _spill_kernel, (F32, F32), dict(BLOCK=4096, num_warps=1), conv=False,
                      dtype="fp32", shape="fixture/spill")
    return [spill, _scale_job(conv=True)]


@triton.jit
def _div_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """The GEMM of :func:`_gemm_kernel` whose A rows are re-indexed every K step by a run-time divisor
    (``(k0 // D + rm) % M``): an integer division (reciprocal sequence) inside the main loop."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        ra = (k0 // D + rm) % M
        a = tl.load(a_ptr + ra[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def loop_jobs(units, dtypes) -> list[StaticJob]:
    """A bf16 'fprop' (so the sm_90 main-loop limits apply) with an integer division in its loop."""
    return [StaticJob("fprop", "64x64x32 w4 s3", _div_gemm_kernel, (BF16, BF16, F32, 512, 256, 128, 3),
                      dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3), conv=True, variant="div",
                      dtype="bf16", shape="fixture/div", role="default")]
