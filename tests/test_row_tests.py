"""The wgrad kernel's row arithmetic (``fused_preact/ops/triton/kernels_grad.py``), against integer
arithmetic in Python:

1. ``_frac_range`` + ``_both_below``: the fixed-point range tests ``a <= n mod d < b`` (one unsigned
   compare each, no complement case) for ranges that are full, empty, start at 0, reach d, or are
   interior; divisors of the models' images (Q and P·Q) and awkward ones; rows from 0 up to the
   largest the launcher allows (``(n + d)·d < 2**32``), stepped as the kernel steps them (``L(n) + it·c``).
   The PTX form of ``_both_below`` runs where a GPU is present.
2. ``magic`` + ``_udiv``: ``n // d`` by multiply-high and shift.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, HAS_CUDA

from fused_preact.ops._common import tl, triton
from fused_preact.ops.triton.kernels_grad import _both_below, _frac_range, _udiv
from fused_preact.ops.triton.launch import frac, magic

_BLOCK = 1024


# Ints stay runtime values on a GPU (Triton would make a 1 a constexpr), as in the wgrad kernel.
@triton.jit(do_not_specialize=("n0", "step", "c_p", "a_p", "b_p", "d_p", "c_q", "a_q", "b_q", "d_q"))
def _range_kernel(n0, step, c_p, a_p, b_p, d_p, c_q, a_q, b_q, d_q, out_ptr, PTX: tl.constexpr,
                  BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    cp, offp, spanp = _frac_range(c_p.to(tl.uint32, bitcast=True), a_p, b_p, d_p)
    cq, offq, spanq = _frac_range(c_q.to(tl.uint32, bitcast=True), a_q, b_q, d_q)
    lu = (n0 + lanes).to(tl.uint32, bitcast=True)
    it = step.to(tl.uint32, bitcast=True)  # the kernel's row-block step: L(n + it) = L(n) + it·c
    ok = _both_below(lu * cp + offp + it * cp, spanp, lu * cq + offq + it * cq, spanq, PTX)
    tl.store(out_ptr + lanes, ok.to(tl.int8))


@triton.jit(do_not_specialize=("mul", "shr"))
def _udiv_kernel(n_ptr, mul, shr, out_ptr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    n = tl.load(n_ptr + lanes)
    tl.store(out_ptr + lanes, _udiv(n, mul.to(tl.uint32, bitcast=True), shr.to(tl.uint32, bitcast=True)))


def _ranges(d: int) -> list[tuple[int, int]]:
    """(a, b) pairs as the kernel forms them (a may be < 0 and b > d before clamping)."""
    pairs = {(0, d), (-1, d + 1), (1, d), (0, d - 1), (1, d - 1), (2, d), (d // 2, d // 2 + 1), (3, 3), (d, d),
             (0, 1), (d - 1, d)}
    return sorted((a, b) for a, b in pairs if a <= d)


_PTX = [False] + ([True] if HAS_CUDA else [])
# (d_q, d_p): Q and P·Q of PreActResNet-50's and -164's images, and awkward divisors
_DIVISORS = [(56, 56 * 56), (7, 49), (32, 1024), (1, 1), (3, 3 * 5), (97, 97 * 31)]


@pytest.mark.parametrize("ptx", _PTX, ids=lambda p: "ptx" if p else "plain")
@pytest.mark.parametrize("dq,dp", _DIVISORS, ids=lambda v: str(v))
def test_range_tests_match_integer_modulo(dq, dp, ptx):
    rows_max = min(2**31 - 1, (2**32 - 1) // dp - dp)  # the launcher's bound: (rows + d)·d < 2**32
    rng = np.random.default_rng(dq * 7919 + dp)
    # (first row of the block, rows stepped): row 0 itself, and blocks reached by stepping
    starts = [(0, 0), (max(0, dp - 3), _BLOCK), (rows_max - 3 * _BLOCK, _BLOCK),
              (int(rng.integers(0, rows_max - 3 * _BLOCK)), 2 * _BLOCK)]
    out = torch.empty(_BLOCK, dtype=torch.int8, device=DEVICE)
    for ap, bp in _ranges(dp):
        for aq, bq in _ranges(dq):
            for n0, step in starts:
                _range_kernel[(1,)](n0, step, frac(dp), ap, bp, dp, frac(dq), aq, bq, dq, out, PTX=ptx, BLOCK=_BLOCK)
                n = np.arange(n0 + step, n0 + step + _BLOCK, dtype=np.int64)
                want = (n % dp >= ap) & (n % dp < bp) & (n % dq >= aq) & (n % dq < bq)
                got = out.cpu().numpy().astype(bool)
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, (f"d_p={dp} [{ap},{bp}) d_q={dq} [{aq},{bq}) n={n[bad[0]]}: got {got[bad[0]]}, "
                                       f"want {want[bad[0]]}")


@pytest.mark.parametrize("d", [1, 2, 3, 7, 56, 3136, 12544, 50176, 2**20 + 1, 2**31 - 1])
def test_udiv_matches_floor_division(d):
    mul, shr = magic(d)
    rng = np.random.default_rng(d)
    n = np.concatenate([np.arange(0, 300), rng.integers(0, 2**31, _BLOCK - 600), np.arange(2**31 - 300, 2**31)])
    nt = torch.tensor(n, dtype=torch.int32, device=DEVICE)
    out = torch.empty(_BLOCK, dtype=torch.int32, device=DEVICE)
    _udiv_kernel[(1,)](nt, mul, shr, out, BLOCK=_BLOCK)
    np.testing.assert_array_equal(out.cpu().numpy(), n // d)
