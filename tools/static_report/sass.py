"""Reading cubins: resources (``cuobjdump -res-usage``), SASS (``nvdisasm``), instruction counts and
the main-loop analysis.

The tools are those Triton ships (``triton.knobs.nvidia``): they read sm_80 and sm_90a cubins of
Triton and of nvcc alike. Kernel names of CUDA C++ cubins are demangled with the first of
``cu++filt``, ``llvm-cxxfilt``, ``c++filt`` found on PATH.

Main loop (:func:`loop_metrics`): the innermost loop holding tensor-core instructions, with its
per-iteration instructions, MMAs and the issue ratio = instructions / tensor-core clocks at peak rate
(:func:`mma_clocks`, :data:`MAC_RATE`); a warp scheduler issues at most one instruction per clock, so
a ratio above 1 bounds the loop below the tensor-core peak. The model and its assumptions are
written out in ``docs/static-report.md``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

__all__ = ["sass_metrics", "cubin_metrics", "short_name", "demangle"]

_MMA_OPS = ("HGMMA", "HMMA", "IMMA", "DMMA")
_WIDTH_TOKENS = {"256": "256", "128": "128", "64": "64", "U16": "16", "S16": "16", "U8": "8", "S8": "8"}
#: Load/store widths reported [bits], in table order.
WIDTHS = ("128", "64", "32", "16", "8")


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_FUNC = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_TARGET = re.compile(r"\.target\s+(sm_\w+)")
_HEADER = re.compile(r"EF_CUDA_SM(\d+)\b")  # sm_80 cubins carry no .target line, only header flags
#: One instruction line of ``nvdisasm -c``: ``/*2330*/  @!P0 LDS.128 R64, [R115] ;`` → address,
#: predicate, opcode, operands.
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_[\w.]+):")
#: HGMMA whose A operand is a register (``HGMMA.64x64x16.F32.BF16 R56, R132, gdesc[UR20]…``), not a
#: shared-memory descriptor (``HGMMA… R24, gdesc[UR4], R24``).
_HGMMA_REG_A = re.compile(r"^R\d+,\s*R\d+")


class Insn(NamedTuple):
    """One SASS instruction: ``addr`` (byte offset in the function), ``pred`` (``@P0``, ``@!UPT``, or
    ""), ``op`` (full opcode, ``LDG.E.128``), ``args`` (operand text), ``labels`` (labels naming it)."""

    addr: int
    pred: str
    op: str
    args: str
    labels: tuple[str, ...] = ()

    @property
    def base(self) -> str:
        return self.op.split(".", 1)[0]


def parse_sass(text: str) -> dict[str, list[Insn]]:
    """The instructions of every function in ``nvdisasm -c`` output, in address order:
    ``{symbol: [Insn, ...]}`` (functions start at ``.section .text.<symbol>``)."""
    funcs: dict[str, list[Insn]] = {}
    cur: Optional[list[Insn]] = None
    pending: list[str] = []
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            pending = []
            continue
        if cur is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(line)
        if m:
            cur.append(Insn(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip(),
                            tuple(pending)))
            pending = []
    return funcs


def _width(op: str) -> str:
    for tok in op.split(".")[1:]:
        if tok in _WIDTH_TOKENS:
            return _WIDTH_TOKENS[tok]
    return "32"


def _by_width(ops: Iterable[str]) -> dict[str, int]:
    c = Counter(_width(op) for op in ops)
    return {w: c[w] for w in WIDTHS} | {w: n for w, n in c.items() if w not in WIDTHS}


def sass_metrics(opcodes: Iterable[str], arch: int) -> dict:
    """Instruction counts of one function's SASS (full opcodes such as ``LDG.E.128``,
    ``HGMMA.64x64x16.F32.BF16``): ``mma`` (HGMMA if ``arch`` ≥ 90 else HMMA), ``mma_by_op``,
    ``async_copies`` (LDGSTS, UTMALDG), ``ldg_by_width``/``ldgsts_by_width``/``stg_by_width``
    (bits → count), ``spill_stores`` (STL), ``spill_loads`` (LDL), ``instructions``."""
    ops = list(opcodes)
    base = Counter(op.split(".")[0] for op in ops)
    return {
        "mma": base["HGMMA" if arch >= 90 else "HMMA"],
        "mma_by_op": {op: base[op] for op in _MMA_OPS if base[op]},
        "async_copies": {"LDGSTS": base["LDGSTS"], "UTMALDG": base["UTMALDG"]},
        "ldg_by_width": _by_width(op for op in ops if op.split(".")[0] == "LDG"),
        "ldgsts_by_width": _by_width(op for op in ops if op.split(".")[0] == "LDGSTS"),
        "stg_by_width": _by_width(op for op in ops if op.split(".")[0] == "STG"),
        "spill_stores": base["STL"],
        "spill_loads": base["LDL"],
        "instructions": len(ops),
    }


def function_metrics(insns: Sequence[Insn], arch: int) -> dict:
    """:func:`sass_metrics` of one function, ``hgmma_a_regs`` (HGMMAs in wgmma's RS form) and its
    main-loop analysis (:func:`loop_metrics`: ``loop``, ``mma_loops``)."""
    return {**sass_metrics((i.op for i in insns), arch),
            "hgmma_a_regs": sum(1 for i in insns if i.base == "HGMMA" and _HGMMA_REG_A.match(i.args)),
            **loop_metrics(insns, arch)}


def _tool(name: str, *args: str) -> str:
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    return subprocess.run([path, *args], check=True, capture_output=True, text=True).stdout


def sass_arch(sass: str) -> tuple[str, int]:
    """(target, arch) of ``nvdisasm`` output: ``("sm_90a", 90)``; ``("sm_?", 0)`` if it names none."""
    m, flags = _TARGET.search(sass), _HEADER.search(sass)
    target = m.group(1) if m else f"sm_{flags.group(1)}" if flags else "sm_?"
    return target, int(re.sub(r"\D", "", target) or 0)


def cubin_metrics(path: str, sass_out: Optional[Path] = None) -> dict[str, dict]:
    """Metrics of every function in the cubin at ``path``: ``{symbol: {target, arch, regs,
    stack_bytes, shared_bytes, local_bytes, **function_metrics}}`` (``target`` as ``sm_90a``, ``arch``
    the number, 90). SASS from ``nvdisasm -c -ndf`` (code only, no dataflow pass: half the time of
    ``cuobjdump -sass``), resources from ``cuobjdump -res-usage``. ``sass_out``: write the SASS there."""
    sass = _tool("nvdisasm", "-c", "-ndf", path)
    if sass_out is not None:
        sass_out.write_text(sass)
    target, arch = sass_arch(sass)
    out: dict[str, dict] = {}
    for name, insns in parse_sass(sass).items():
        out[name] = {"target": target, "arch": arch, **function_metrics(insns, arch)}
    for name, reg, stack, shared, local in _RES.findall(_tool("cuobjdump", "-res-usage", path)):
        out.setdefault(name, {"target": target, "arch": arch, **function_metrics((), arch)})
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



# ----------------------------------------------------------------------------------- main loop
#: Dense tensor-core multiply-accumulates per clock per SM sub-partition (SMSP), by arch family and
#: operand class ("16": bf16/fp16, "tf32", "8": fp8/int8). sm_90 from the H100 SXM data sheet
#: (989.4 dense bf16 TFLOP/s at 1830 MHz on 132 SMs × 4 SMSPs: 989.4e12 / (2 · 132 · 4 · 1.83e9) = 512;
#: TF32 494.7 TFLOP/s: half; fp8 1979 TFLOP/s: double); sm_80 from the A100 data sheet (312 bf16
#: TFLOP/s at 1410 MHz on 108 SMs × 4 SMSPs = 256; TF32 156: half; int8 624 TOPS: double).
MAC_RATE: dict[int, dict[str, int]] = {90: {"16": 512, "tf32": 256, "8": 1024},
                                        80: {"16": 256, "tf32": 128, "8": 512}}
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = re.compile(r"^HMMA\.168(\d+)")
_TARGET_LABEL = re.compile(r"`\((\.L_[\w.]+)\)")
_IMM = re.compile(r"(0x[0-9a-f]+|\d+)\s*$")
_TERMINATORS = ("EXIT", "RET", "KILL", "BRA", "JMP", "BRX", "JMX")


def mma_clocks(op: str, arch: int) -> Optional[float]:
    """Tensor-core clocks one warp's issue of the MMA ``op`` occupies on its sub-partition at peak
    rate (:data:`MAC_RATE`), or None for an opcode the model does not cover (IMMA, DMMA, sparse).

    ``HGMMA.64xNxK`` (wgmma, sm_90): each of the warpgroup's 4 warps issues it; its 64·N·K MACs are
    spread over the 4 sub-partitions, so one issue stands for 16·N·K MACs: N/2 clocks for bf16/fp16
    (K=16, 512 MAC/clk), tf32 (K=8, 256) and fp8 (K=32, 1024) alike. ``HMMA.168K`` (mma.sync
    m16n8kK): 128·K MACs on the issuing warp's sub-partition: ``HMMA.16816`` 8 clocks and
    ``HMMA.1688`` 4 on sm_80 (16-bit), ``HMMA.1688.F32.TF32`` 8 (TF32 at half rate); on sm_90 at the
    sm_90 rates (an assumption: Hopper's mma.sync rate is not published; this is the fastest it can be).
    """
    fam = 90 if arch >= 90 else 80
    m = _HGMMA_SHAPE.match(op)
    if m and ".SP" not in op:
        mm, n, k = map(int, m.groups())
        kind = {16: "16", 8: "tf32", 32: "8"}.get(k)
        return None if kind is None else mm * n * k / 4 / MAC_RATE[90][kind]
    m = _HMMA_SHAPE.match(op)
    if m and ".SP" not in op:
        k = int(m.group(1))
        tokens = op.split(".")
        kind = "tf32" if "TF32" in tokens else "16" if k in (8, 16) else None
        return None if kind is None else 16 * 8 * k / MAC_RATE[fam][kind]
    return None


def _is_mma(op: str) -> bool:
    return op.split(".", 1)[0] in _MMA_OPS


def _targets(insns: Sequence[Insn]) -> list[Optional[int]]:
    """Index of each instruction's branch target (None: not a branch with a label target, or never
    taken: ``@!PT``)."""
    labels = {lb: k for k, ins in enumerate(insns) for lb in ins.labels}
    out: list[Optional[int]] = []
    for ins in insns:
        m = _TARGET_LABEL.search(ins.args) if ins.base in ("BRA", "JMP") and ins.pred != "@!PT" else None
        out.append(labels.get(m.group(1)) if m else None)
    return out


def _falls_through(ins: Insn) -> bool:
    """False for an unconditional terminator: EXIT/RET/KILL, or a branch without a predicate (neither
    ``@P…`` nor a predicate operand such as ``BRA.U !UP0, `(…)``)."""
    if ins.base not in _TERMINATORS or ins.pred not in ("", "@PT"):
        return True
    return ins.base in ("BRA", "JMP") and not ins.args.startswith("`")


def find_loops(insns: Sequence[Insn]) -> list[tuple[int, int]]:
    """Loops of one function as (first, last) instruction indices, in order of their back edge.

    A loop is a branch at index ``j`` to a label at index ``i ≤ j`` (a backward branch) that closes a
    cycle inside its address range: ``j`` is reachable from ``i`` through fall-throughs and branches
    whose targets lie in ``[i, j]``, and the range holds no unconditional EXIT/RET. This keeps the
    jumps back from out-of-line blocks (mbarrier retry loops that ptxas places after the function's
    end) from counting as loops over everything in between.
    """
    tgt = _targets(insns)
    loops = []
    for j, t in enumerate(tgt):
        if t is None or t > j:
            continue
        if any(not _falls_through(x) and x.base not in ("BRA", "JMP") for x in insns[t:j]):
            continue  # spans a function exit
        seen, todo = set(), [t]
        while todo:
            k = todo.pop()
            if k == j:
                loops.append((t, j))
                break
            if k in seen or not t <= k < j:
                continue
            seen.add(k)
            if tgt[k] is not None:
                todo.append(tgt[k])
            if _falls_through(insns[k]):
                todo.append(k + 1)
    return loops


def _imm(args: str) -> Optional[int]:
    m = _IMM.search(args)
    return None if m is None else int(m.group(1), 16 if m.group(1).startswith("0x") else 10)


def _nonzero(c: Counter) -> dict[str, int]:
    return {k: c[k] for k in sorted(c) if c[k]}


def loop_stats(insns: Sequence[Insn], first: int, last: int, arch: int) -> dict:
    """Per-iteration figures of the loop ``insns[first:last + 1]`` (one warp executes every instruction
    of the body once per iteration; branches inside it are counted in ``inner_branches``, the body is
    still counted whole):

        span            byte offsets of its first and last instruction (``0x2240-0x4140``)
        instructions    instructions per iteration (the backward branch included)
        mma, mma_shapes tensor-core instructions, by full opcode
        tensor_clocks   sum of :func:`mma_clocks` (clocks per warp at peak tensor rate)
        issue_ratio     instructions / tensor_clocks (None without modelled MMAs)
        wgmma_waits     N of every ``WARPGROUP.DEPBAR.LE gsb0, N`` (0: waits for every wgmma in flight)
        cp_async_waits  N of every ``DEPBAR.LE SB0, N`` (cp.async groups left in flight)
        barriers        ``BAR.SYNC``/``BAR.ARV``/``BAR.RED``… counts; ``bar_sync``: BAR.SYNC + BAR.RED
        mbarrier        ``SYNCS.*`` (mbarrier arrive/wait) counts
        int_div         integer divisions by a run-time divisor: reciprocal sequences
                        (``I2F[.U32].RP`` → ``MUFU.RCP`` → ``F2I…TRUNC`` → multiply-high), one per I2F.RP
        mem             loads/stores by kind: ``LDG``/``LDGSTS``/``LDS``/``STS``/``STG`` by width [bits],
                        ``LDSM`` by shape (``16.M88.4``: four 8×8 matrices), ``UTMALDG`` by dimension
        sts, ldsm       operand staging through shared memory: STS and LDSM instructions
        hgmma_rs        HGMMAs taking A from registers
        inner_branches  branches inside the body other than the back edge; predicated_off: ``@!PT``
    """
    body = insns[first:last + 1]
    by: dict[str, list[Insn]] = defaultdict(list)
    for ins in body:
        by[ins.base].append(ins)
    shapes = Counter(i.op for b in _MMA_OPS for i in by[b])
    clocks = [mma_clocks(op, arch) for op in shapes]
    tclk = sum(c * shapes[op] for op, c in zip(shapes, clocks) if c is not None)
    unmodelled = sum(shapes[op] for op, c in zip(shapes, clocks) if c is None)
    two = lambda kind: Counter(".".join(i.op.split(".")[:2]) for i in by[kind])
    bars = two("BAR")
    mem: dict[str, dict] = {}
    for kind in ("LDG", "LDGSTS", "LDS", "STS", "STG"):
        if by[kind]:
            mem[kind] = {w: n for w, n in _by_width(i.op for i in by[kind]).items() if n}
    for kind in ("LDSM", "UTMALDG"):
        if by[kind]:
            mem[kind] = _nonzero(Counter(i.op.split(".", 1)[1] if "." in i.op else "" for i in by[kind]))
    n = len(body)
    return {
        "span": f"{body[0].addr:#x}-{body[-1].addr:#x}",
        "instructions": n,
        "mma": sum(shapes.values()),
        "mma_shapes": _nonzero(shapes),
        "tensor_clocks": tclk,
        "issue_ratio": round(n / tclk, 3) if tclk else None,
        **({"unmodelled_mma": unmodelled} if unmodelled else {}),
        "wgmma_waits": [_imm(i.args) for i in by["WARPGROUP"] if i.op == "WARPGROUP.DEPBAR.LE"],
        "cp_async_waits": [_imm(i.args) for i in by["DEPBAR"] if i.op == "DEPBAR.LE" and i.args.startswith("SB0")],
        "bar_sync": bars["BAR.SYNC"] + bars["BAR.RED"],
        "barriers": _nonzero(bars),
        "mbarrier": _nonzero(two("SYNCS")),
        "int_div": sum(1 for i in by["I2F"] if "RP" in i.op.split(".")),
        "mem": mem,
        "sts": len(by["STS"]),
        "ldsm": len(by["LDSM"]),
        "hgmma_rs": sum(1 for i in by["HGMMA"] if _HGMMA_REG_A.match(i.args)),
        "inner_branches": sum(1 for i in body[:-1] if i.base in ("BRA", "JMP")),
        "predicated_off": sum(1 for i in body if i.pred == "@!PT"),
    }


def loop_metrics(insns: Sequence[Insn], arch: int) -> dict:
    """The main-loop analysis of one function: ``loop``, the :func:`loop_stats` of its main loop (None
    without a loop holding tensor-core instructions), and ``mma_loops``, a summary (span,
    instructions, mma, tensor_clocks, issue_ratio) of every innermost loop holding MMAs, in address
    order (two for a kernel with a second GEMM loop, e.g. a projection).

    The main loop is the innermost loop (:func:`find_loops`; one that contains no other MMA loop)
    with the most MMAs; ties go to the shorter body, then to the first.
    """
    loops = [(i, j) for i, j in find_loops(insns) if any(_is_mma(x.op) for x in insns[i:j + 1])]
    inner = [(i, j) for i, j in loops if not any((a, b) != (i, j) and i <= a and b <= j for a, b in loops)]
    if not inner:
        return {"loop": None, "mma_loops": []}
    nmma = {lp: sum(1 for x in insns[lp[0]:lp[1] + 1] if _is_mma(x.op)) for lp in inner}
    main = min(inner, key=lambda lp: (-nmma[lp], lp[1] - lp[0], lp[0]))
    stats = {lp: loop_stats(insns, *lp, arch) for lp in sorted(inner)}
    summary = [{k: st[k] for k in ("span", "instructions", "mma", "tensor_clocks", "issue_ratio")} for st in stats.values()]
    return {"loop": stats[main], "mma_loops": summary}
