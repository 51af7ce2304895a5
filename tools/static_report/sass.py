"""Reading cubins: resources (``cuobjdump -res-usage``), SASS (``nvdisasm``) and instruction counts.

The tools are those Triton ships (``triton.knobs.nvidia``): they read sm_80 and sm_90a cubins of
Triton and of nvcc alike. Kernel names of CUDA C++ cubins are demangled with the first of
``cu++filt``, ``llvm-cxxfilt``, ``c++filt`` found on PATH.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = ["sass_metrics", "cubin_metrics", "short_name", "demangle"]

_MMA_OPS = ("HGMMA", "HMMA", "IMMA", "DMMA")
_WIDTH_TOKENS = {"256": "256", "128": "128", "64": "64", "U16": "16", "S16": "16", "U8": "8", "S8": "8"}
#: Load/store widths reported [bits], in table order.
WIDTHS = ("128", "64", "32", "16", "8")


_SASS_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")
#: HGMMA whose A operand is a register (``HGMMA.64x64x16.F32.BF16 R56, R132, gdesc[UR20]…``), not a
#: shared-memory descriptor (``HGMMA… R24, gdesc[UR4], R24``).
_HGMMA_REG_A = re.compile(r"HGMMA\.[\w.]+\s+R\d+,\s*R\d+")
_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_FUNC = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)", re.M)
_TARGET = re.compile(r"\.target\s+(sm_\w+)")
_HEADER = re.compile(r"EF_CUDA_SM(\d+)\b")  # sm_80 cubins carry no .target line, only header flags


def _width(op: str) -> str:
    for tok in op.split(".")[1:]:
        if tok in _WIDTH_TOKENS:
            return _WIDTH_TOKENS[tok]
    return "32"


def sass_metrics(opcodes: Iterable[str], arch: int) -> dict:
    """Instruction counts of one function's SASS (full opcodes such as ``LDG.E.128``,
    ``HGMMA.64x64x16.F32.BF16``): ``mma`` (HGMMA if ``arch`` ≥ 90 else HMMA), ``mma_by_op``,
    ``async_copies`` (LDGSTS, UTMALDG), ``ldg_by_width``/``ldgsts_by_width``/``stg_by_width``
    (bits → count), ``spill_stores`` (STL), ``spill_loads`` (LDL), ``instructions``."""
    ops = list(opcodes)
    base = Counter(op.split(".")[0] for op in ops)
    widths: dict[str, Counter] = {"LDG": Counter(), "LDGSTS": Counter(), "STG": Counter()}
    for op in ops:
        b = op.split(".")[0]
        if b in widths:
            widths[b][_width(op)] += 1
    by_width = {b: {w: c[w] for w in WIDTHS} | {w: n for w, n in c.items() if w not in WIDTHS} for b, c in widths.items()}
    return {
        "mma": base["HGMMA" if arch >= 90 else "HMMA"],
        "mma_by_op": {op: base[op] for op in _MMA_OPS if base[op]},
        "async_copies": {"LDGSTS": base["LDGSTS"], "UTMALDG": base["UTMALDG"]},
        "ldg_by_width": by_width["LDG"],
        "ldgsts_by_width": by_width["LDGSTS"],
        "stg_by_width": by_width["STG"],
        "spill_stores": base["STL"],
        "spill_loads": base["LDL"],
        "instructions": len(ops),
    }


def _tool(name: str, *args: str) -> str:
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    return subprocess.run([path, *args], check=True, capture_output=True, text=True).stdout


def cubin_metrics(path: str, sass_out: Optional[Path] = None) -> dict[str, dict]:
    """Metrics of every function in the cubin at ``path``: ``{symbol: {target, arch, regs,
    stack_bytes, shared_bytes, local_bytes, **sass_metrics}}`` (``target`` as ``sm_90a``, ``arch`` the
    number, 90). SASS from ``nvdisasm -c -ndf`` (code only, no dataflow pass: half the time of
    ``cuobjdump -sass``), resources from ``cuobjdump -res-usage``. ``sass_out``: write the SASS there."""
    sass = _tool("nvdisasm", "-c", "-ndf", path)
    if sass_out is not None:
        sass_out.write_text(sass)
    m, flags = _TARGET.search(sass), _HEADER.search(sass)
    target = m.group(1) if m else f"sm_{flags.group(1)}" if flags else "sm_?"
    arch = int(re.sub(r"\D", "", target) or 0)
    heads = list(_FUNC.finditer(sass))
    out: dict[str, dict] = {}
    for i, h in enumerate(heads):
        body = sass[h.end(): heads[i + 1].start() if i + 1 < len(heads) else len(sass)]
        out[h.group(1)] = {"target": target, "arch": arch, **sass_metrics(_SASS_INSN.findall(body), arch),
                           "hgmma_a_regs": len(_HGMMA_REG_A.findall(body))}
    for name, reg, stack, shared, local in _RES.findall(_tool("cuobjdump", "-res-usage", path)):
        out.setdefault(name, {"target": target, "arch": arch, **sass_metrics((), arch)})
        out[name].update(regs=int(reg), stack_bytes=int(stack), shared_bytes=int(shared), local_bytes=int(local))
    return out


def demangle(names: Sequence[str]) -> list[str]:
    """Demangled names (a name no tool can read stays mangled). Tools in order: ``cu++filt`` (CUDA's),
    ``llvm-cxxfilt``, ``c++filt`` (binutils' gives up on CUTLASS's 2,000-character names)."""
    out = list(names)
    for tool in filter(None, map(shutil.which, ("cu++filt", "llvm-cxxfilt", "c++filt"))):
        todo = [i for i, n in enumerate(out) if n.startswith("_Z")]
        if not todo:
            break
        res = subprocess.run([tool], input="\n".join(out[i] for i in todo), capture_output=True, text=True).stdout
        lines = res.splitlines()
        if len(lines) == len(todo):
            for i, line in zip(todo, lines):
                out[i] = line
    return out


def short_name(demangled: str, depth: int = 1, limit: int = 90) -> str:
    """A readable kernel name: no return type, parameter list or namespaces, template arguments
    nested deeper than ``depth`` shown as ``…``, at most ``limit`` characters.
    ``void demo::scale_kernel<8, __half>(__half const*, float)`` → ``scale_kernel<8, __half>``."""
    s = demangled.strip()
    if s.endswith(")"):  # drop the parameter list: the last top-level parenthesis group
        level = 0
        for i in range(len(s) - 1, -1, -1):
            level += {")": 1, "(": -1}.get(s[i], 0)
            if level == 0:
                s = s[:i]
                break
    level, cut = 0, 0
    for i, ch in enumerate(s):  # drop a return type: up to the last space outside template brackets
        level += {"<": 1, "(": 1, ">": -1, ")": -1}.get(ch, 0)
        if ch == " " and level == 0:
            cut = i + 1
    s = s[cut:]
    s = re.sub(r"\b[A-Za-z_]\w*::|\(anonymous namespace\)::", "", s)
    out, level = [], 0
    for ch in s:  # keep template arguments up to `depth` levels deep; deeper ones become <…>
        if ch == "<":
            level += 1
            out.append(ch if level <= depth else "<…" if level == depth + 1 else "")
        elif ch == ">":
            out.append(ch if level <= depth + 1 else "")
            level -= 1
        elif level <= depth:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= limit else s[: limit - 1] + "…"

