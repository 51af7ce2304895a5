"""The rules of ``--check``.

:func:`check_entries`: every compilation must compile, keep within the arch's shared memory per
block, use no stack (register spills), and a convolution must have tensor-core instructions, async
operand copies (but a one-step launch, which loads its operands once and has no loop to overlap them
with: :func:`~tools.static_report.loop_limits.one_step`) and no 16/8-bit scalar operand loads in a
16-bit dtype.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from tools.static_report.loop_limits import one_step

__all__ = ["SMEM_LIMIT", "check_entries"]

#: Max shared memory per block [bytes]: CUDA C Programming Guide, "Technical Specifications per
#: Compute Capability" (8.0: 163 KB, 9.0: 227 KB, opt-in dynamic).
SMEM_LIMIT: dict[int, int] = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def _operand_load_problems(e: dict) -> list[str]:
    """A convolution's operand tiles must reach the tensor cores through async copies (cp.async or TMA)
    or wide loads: no async copy at all, or — in a 16-bit dtype, where every sub-32-bit global load
    is an element-wise load of an activation, gradient or weight tile — any 16/8-bit LDG or LDGSTS
    fails (32-bit loads are left alone: fp32 per-channel vectors such as scale/shift are spread one
    element per thread, and in fp32 they cannot be told apart from operand loads). A one-step launch
    (no loop to overlap a copy with) needs no async copy."""
    why = []
    asyncs = e.get("async_copies", {})
    if not (asyncs.get("LDGSTS", 0) or asyncs.get("UTMALDG", 0) or one_step(e)):
        why.append("no async global→shared copies (LDGSTS/UTMALDG) for the operands")
    if e.get("dtype") in ("bf16", "fp16"):
        narrow = sum(e.get(key, {}).get(w, 0) for key in ("ldg_by_width", "ldgsts_by_width") for w in ("16", "8"))
        if narrow:
            why.append(f"{narrow} scalar 16/8-bit global loads (operand tiles must load as vectors)")
    return why


def _narrow_mma_sync(e: dict, arch: int) -> bool:
    """Whether a compilation for sm_90+ is one of the narrow or thin tiles that use mma.sync (HMMA)
    because no dot of them can take wgmma: a ``wgrad``/``wgrad_proj`` kernel with BLOCK_N ≤ 32
    (``configs._narrow_wgrad_tiles``; the staged-halo wgrad's C, its tile's input channels, ≤ 32) or
    BLOCK_M ≤ 16 (``configs._thin_wgrad_tile``), or the staged-halo fprop (``STAGE_ROWS``) with
    BLOCK_N ≤ 16 (``configs.halo_sync_config``), every dot of which (``mma_dots``, all of them read)
    has fewer than 64 result rows, wgmma's least M (64 per warpgroup), or runs in fewer than the 4
    warps of a warpgroup. Any other convolution on HMMA still fails."""
    dots = e.get("mma_dots") or []
    const = e.get("constexprs") or {}
    block_n = int(str(const.get("BLOCK_N", const.get("C", "0") if "RPI" in const else "0")) or 0)
    block_m = int(str(const.get("BLOCK_M", "0")) or 0)
    wgrad = e.get("kernel") in ("wgrad", "wgrad_proj") and (0 < block_n <= 32 or 0 < block_m <= 16)
    halo_fprop = e.get("kernel") == "fprop" and "STAGE_ROWS" in const and 0 < block_n <= 16
    return (arch >= 90 and (wgrad or halo_fprop)
            and bool(e.get("mma_by_op", {}).get("HMMA")) and bool(dots) and not e.get("mma_dots_unparsed")
            and all(d["op"] == "tt.dot" and (d["shape"][0] < 64 or math.prod(d.get("warps") or [4]) < 4)
                    for d in dots))


def check_entries(entries: Sequence[dict]) -> list[str]:
    """Why each failing entry fails ``--check``: compile error, stack_bytes > 0 (spills), shared
    memory over the arch's per-block limit (:data:`SMEM_LIMIT`), or a convolution (``conv`` true)
    without the arch's tensor-core instruction (HGMMA on sm_90+ — HMMA in a narrow wgrad tile whose
    dots all have fewer rows than wgmma takes, :func:`_narrow_mma_sync` —, HMMA below), without async
    copies, or
    with scalar 16-bit operand loads (:func:`_operand_load_problems`). Empty: all pass."""
    problems = []
    for e in entries:
        arch = int(re.sub(r"\D", "", e["arch"]) or 0)
        why = []
        if e.get("error"):
            why.append(f"compile failed: {e['error'][:200]}")
        else:
            if e.get("stack_bytes", 0) > 0:
                why.append(f"{e['stack_bytes']} bytes of stack (STL {e.get('spill_stores')}, LDL {e.get('spill_loads')})")
            limit = SMEM_LIMIT.get(arch)
            if limit and e.get("shared_bytes", 0) > limit:
                why.append(f"{e['shared_bytes']} bytes of shared memory > {limit} (would not launch)")
            if e.get("conv") and not e.get("mma") and not _narrow_mma_sync(e, arch):
                op = "HGMMA" if arch >= 90 else "HMMA"
                why.append(f"no {op} (tensor-core ops found: {e.get('mma_by_op') or 'none'})")
            if e.get("conv"):
                why.extend(_operand_load_problems(e))
        if why:
            where = ", ".join(e.get("shapes", [])[:3]) + (" …" if len(e.get("shapes", [])) > 3 else "")
            problems.append(f"{e['kind']} {e['kernel']} [{e['config']}] {e.get('variant', '')} {e.get('dtype', '')} "
                            f"{e['arch']}: {'; '.join(why)}" + (f"  (e.g. {where})" if where else ""))
    return problems
