"""Static kernel report: compile every Triton kernel launch offline for sm_90 and sm_80 and read its SASS.

``python -m tools.static_report`` (from the repository root) needs no GPU.
For each :class:`StaticJob` — exactly what a launcher passes to a kernel, ``fn[grid](*args, **kwargs)``
— it specializes the arguments the way a real launch does, compiles with ``triton.compile`` for
``GPUTarget("cuda", arch, 32)``, and reads the cubin with the ``cuobjdump``/``nvdisasm`` Triton ships. Reported per
kernel and config (units in brackets; sources: ``cuobjdump -res-usage``, SASS from ``nvdisasm``):

    regs          registers per thread (REG)
    stack_bytes   per-thread stack frame [bytes] (STACK): register spills or local arrays
    shared_bytes  shared memory per block [bytes]: Triton's dynamic request (``metadata.shared``)
                  plus the static SHARED of the cubin (for CUDA C++ cubins: static only)
    mma           tensor-core instructions: HGMMA (wgmma) on sm_90, HMMA (mma.sync) on sm_80;
                  ``mma_by_op`` counts every tensor-core opcode found; ``hgmma_a_regs``: HGMMAs
                  whose A operand comes from registers (wgmma RS form), not shared memory
    async_copies  {LDGSTS: cp.async global→shared, UTMALDG: TMA tensor loads}
    ldg_by_width  global loads by width [bits], from the LDG suffix: ``.128`` 128, ``.64`` 64, none 32
                  (``LDG.E``), ``.U16``/``.S16`` 16, ``.U8``/``.S8`` 8; likewise ``ldgsts_by_width``
                  (cp.async) and ``stg_by_width`` (global stores)
    spill_stores, spill_loads   STL / LDL instructions (local-memory traffic)
    compile_s     seconds the compilation took (for a cached entry: when it was compiled)

Argument specialization (Triton 3.9, read from ``triton/runtime/jit.py``:
``create_function_from_signature`` → ``native_specialize_impl`` (C++), ``JITFunction._pack_args`` →
``BaseBackend.parse_attr``); :func:`specialize` calls these same functions, so a job compiles to what
``fn[grid](*args, **kwargs)`` compiles on a GPU of that arch:

    int == 1                 → constexpr 1 (baked into the kernel, dropped from the signature)
    other int in [-2³¹, 2³¹) → ``i32``; ≥ 2³¹ → ``i64`` (≥ 2⁶³ → ``u64``); with attribute
                               ``tt.divisibility = 16`` when ``value % 16 == 0`` (0 and negatives too)
    tensor (``.dtype``, ``.data_ptr()``) → ``*<dtype>`` pointer, ``tt.divisibility = 16`` when
                               ``data_ptr() % 16 == 0`` (16-byte aligned); a ``const`` annotation → ``*k``
    bool → ``u1``, float → ``fp32``: runtime values, never specialized
    None → constexpr None;  ``tl.constexpr`` parameters → constexprs
    ``do_not_specialize`` / ``do_not_specialize_on_alignment`` parameters skip the 1 / %16 rules.
The divisibility attribute is what lets the compiler prove contiguity of ``ptr + i·C + arange``:
vector loads (LDG.E.128, LDGSTS.128) need it on the pointer and on every stride multiplying an index.
Launch kwargs other than constexprs (``num_warps``, ``num_stages``, ``maxnreg``, …) become
``CUDAOptions`` through ``CUDABackend.parse_options``; Triton compiles sm_90 as ``sm_90a``.

A *job provider* maps ``(units: list[UnitShape], dtypes: list[torch.dtype])`` to StaticJobs. The
report uses :func:`tools.static_report.jobs.chain_jobs` (the launches the fused chains record
on the meta device), or ``--provider module:function``. Identical compilations (same Triton cache key: function source,
signature, attributes, constexprs, options, target) are compiled once, by at most two processes;
their metrics are cached under ``--cache-dir`` by that key, so a second run compiles nothing.

Output: ``<out>/static-<triton version>-<date>.json`` (top level: ``triton``, ``date``, ``command``,
``commit``, ``archs``, ``provider``, counts, ``elapsed_s``, ``entries``; each entry: ``kind``
(``triton``/``csrc``), ``kernel``, ``config``, ``variant``, ``dtype``, ``arch``, the metrics above,
``conv``, ``shapes`` (layers that launch it), ``signature``/``constexprs`` (the specialization)) and a
table on stdout. ``--check`` exits 1 listing every entry that spills (stack_bytes > 0), exceeds the
arch's shared memory per block, failed to compile, or is a convolution (``conv``) without tensor-core
instructions, without async copies, or with 16-bit scalar operand loads; ``--cubins DIR`` adds every
``*.cubin`` there (CUDA C++ builds) as ``kind: "csrc"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from tools.static_report.jobs import StaticJob, chain_jobs

__all__ = ["specialize", "cubin_metrics", "sass_metrics", "short_name",
           "default_provider", "check_entries", "format_table", "main"]

#: Bumped when the metrics read from a cubin change (invalidates the metrics cache).
PARSER_VERSION = 2
#: Archs reported by default (compute capability × 10).
ARCHS: tuple[int, ...] = (90, 80)
#: Max shared memory per block [bytes]: CUDA C Programming Guide, "Technical Specifications per
#: Compute Capability" (8.0: 163 KB, 9.0: 227 KB, opt-in dynamic).
SMEM_LIMIT: dict[int, int] = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_MMA_OPS = ("HGMMA", "HMMA", "IMMA", "DMMA")
_WIDTH_TOKENS = {"256": "256", "128": "128", "64": "64", "U16": "16", "S16": "16", "U8": "8", "S8": "8"}
_WIDTHS = ("128", "64", "32", "16", "8")
_POOL_MIN = 8


# ------------------------------------------------------------------------------ specialization
@dataclasses.dataclass
class _Spec:
    key: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict


_BACKENDS: dict[int, Any] = {}
_BINDERS: dict[tuple[int, int], Callable] = {}


def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    if arch not in _BACKENDS:
        _BACKENDS[arch] = make_backend(GPUTarget("cuda", arch, 32))
    return _BACKENDS[arch]


def specialize(job: StaticJob, arch: int) -> _Spec:
    """Signature, constexprs, attributes and options of ``job`` as a launch on an sm_``arch`` GPU
    computes them (``JITFunction.run`` in ``triton/runtime/jit.py``, Triton 3.9), and the launch's
    Triton cache key (``triton.runtime.cache.get_cache_key``, sha256): identical keys compile to
    identical binaries.

    Raises:
        TypeError: ``job.fn`` is not a compiled-mode ``JITFunction`` (e.g. TRITON_INTERPRET was set
            when it was decorated).
        KeyError: a kwarg that is neither a parameter nor a launch option (Triton's own check).
    """
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_key
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = job.fn
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{job.kernel}: {type(fn).__name__} is not a triton JITFunction (unset TRITON_INTERPRET)")
    backend = _backend(arch)
    binder = _BINDERS.get((id(fn), arch))
    if binder is None:
        binder = _BINDERS[(id(fn), arch)] = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(job.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, options = binder(*job.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
    return _Spec(hashlib.sha256(key.encode()).hexdigest(), signature, constexprs, attrs, dict(options.__dict__))


def _describe_spec(spec: _Spec, arg_names: Sequence[str]) -> tuple[dict, dict]:
    """(signature, constexprs) for the report: ``{"C": "i32%16", "x_ptr": "*bf16%16", "H": "i32"}``
    (``%16``: divisibility attribute) and ``{"R": "3", "stride_h": "1"}``."""
    sig, const = {}, {}
    for i, name in enumerate(arg_names):
        ty = spec.signature.get(name)
        if ty == "constexpr":
            const[name] = str(spec.constexprs.get((i,)))
        elif ty is not None:
            div = any(a[0] == "tt.divisibility" for a in spec.attrs.get((i,), []))
            sig[name] = ty + ("%16" if div else "")
    return sig, const


# --------------------------------------------------------------------------------- SASS parsing
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
    by_width = {b: {w: c[w] for w in _WIDTHS} | {w: n for w, n in c.items() if w not in _WIDTHS} for b, c in widths.items()}
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


def _demangle(names: Sequence[str]) -> list[str]:
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


def csrc_entries(folder: str) -> list[dict]:
    """Report entries (``kind: "csrc"``) for every function of every ``*.cubin`` in ``folder``
    (e.g. from ``nvcc -cubin -arch=sm_90a``): ``kernel`` the short demangled name, ``config`` the
    cubin's file name, ``function`` the full demangled name, ``symbol`` the mangled one."""
    entries = []
    for path in sorted(Path(folder).glob("*.cubin")):
        funcs = cubin_metrics(str(path))
        symbols = list(funcs)
        names: Counter = Counter()
        for sym, full in zip(symbols, _demangle(symbols)):
            m = funcs[sym]
            short = short_name(full)
            names[short] += 1
            kernel = short if names[short] == 1 else f"{short}#{names[short]}"
            entries.append({"kind": "csrc", "kernel": kernel, "config": path.name, "variant": "", "dtype": "",
                            "arch": f"sm_{m['arch']}", "conv": None, "function": full[:2000], "symbol": sym,
                            **{k: v for k, v in m.items() if k != "arch"}})
    return entries


# ------------------------------------------------------------------------------------ compiling
def _import_attr(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve(module: str, qualname: str, cache_key: str):
    obj = _import_attr(module, qualname)
    if getattr(obj, "cache_key", None) != cache_key:
        raise RuntimeError(f"{module}.{qualname} in the compile worker is not the function of the job "
                           f"(imported from {sys.modules[module].__file__}; check sys.path)")
    return obj


def _compile_task(task: dict) -> dict:
    """Compile one specialization (in a worker process) and read its cubin. Returns the metrics of
    its single function, ``shared_bytes`` including Triton's dynamic shared memory, ``compile_s``;
    or ``{"error": …}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    try:
        fn = _resolve(task["module"], task["qualname"], task["fn_key"])
        src = ASTSource(fn, task["signature"], task["constexprs"], task["attrs"])
        k = triton.compile(src, target=GPUTarget("cuda", task["arch"], 32), options=task["options"])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            Path(path).write_bytes(k.asm["cubin"])
            sass_out = Path(task["sass_path"]) if task.get("sass_path") else None
            (m,) = cubin_metrics(path, sass_out).values()
    except Exception as e:  # reported per entry; --check fails on it
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "compile_s": time.perf_counter() - t0}
    m["static_shared_bytes"] = m["shared_bytes"]
    m["shared_bytes"] += int(k.metadata.shared)
    m["compile_s"] = round(time.perf_counter() - t0, 2)
    return m


def _run_tasks(tasks: list[dict], processes: int, log: Callable[[str], None]) -> list[dict]:
    """Run ``_compile_task`` over ``tasks`` in at most ``processes`` spawned processes, in order of
    submission; returns results in task order. Fewer than :data:`_POOL_MIN` tasks run inline: a
    spawned worker first imports torch and triton (5-10 s on a busy 2-core machine), more than a
    few compilations (1-3 s each) save."""
    results: list[Optional[dict]] = [None] * len(tasks)
    t0 = time.perf_counter()
    step = max(1, len(tasks) // 10)
    if processes <= 1 or len(tasks) < _POOL_MIN:
        for i, t in enumerate(tasks):
            results[i] = _compile_task(t)
            if (i + 1) % step == 0:
                log(f"  compiled {i + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)")
        return results  # type: ignore[return-value]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=processes, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_task, t): i for i, t in enumerate(tasks)}
        for n, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            if n % step == 0:
                log(f"  compiled {n}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)")
    return results  # type: ignore[return-value]


def _cache_path(cache_dir: Optional[Path], key: str) -> Optional[Path]:
    return None if cache_dir is None else cache_dir / f"v{PARSER_VERSION}" / key[:2] / f"{key}.json"


def triton_entries(jobs: Sequence[StaticJob], archs: Sequence[int], processes: int = 2,
                   cache_dir: Optional[Path] = None, sass_dir: Optional[Path] = None,
                   log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Specialize every job for every arch, compile each distinct specialization once (or take its
    metrics from ``cache_dir``), and return (entries, counts). An entry is one distinct compilation,
    labelled by its first job, with ``shapes`` listing every job's shape."""
    groups: dict[str, dict] = {}
    for job in jobs:
        for arch in archs:
            if job.archs is not None and arch not in job.archs:
                continue
            try:
                spec = specialize(job, arch)
            except Exception as e:
                raise RuntimeError(f"static: cannot specialize {job.kernel} [{job.config}] {job.variant} {job.dtype} "
                                   f"{job.shape} for sm_{arch}: {e}") from e
            g = groups.get(spec.key)
            if g is None:
                names = [p.name for p in job.fn.params]
                sig, const = _describe_spec(spec, names)
                g = groups[spec.key] = {"job": job, "arch": arch, "spec": spec, "shapes": [], "signature": sig,
                                        "constexprs": const, "jobs": 0}
            g["jobs"] += 1
            if job.shape and job.shape not in g["shapes"]:
                g["shapes"].append(job.shape)
    metrics: dict[str, dict] = {}
    todo = []
    for key, g in groups.items():
        path = _cache_path(cache_dir, key)
        if sass_dir is None and path is not None and path.is_file():
            metrics[key] = json.loads(path.read_text())
            continue
        job, spec = g["job"], g["spec"]
        sass_path = None
        if sass_dir is not None:
            stem = re.sub(r"[^\w.-]+", "_", f"{job.kernel}-{job.dtype}-{job.config}-{job.variant}-sm{g['arch']}-{key[:8]}")
            sass_path = str(sass_dir / f"{stem}.sass")
        todo.append((key, {"module": job.fn.module, "qualname": job.fn.fn.__qualname__, "fn_key": job.fn.cache_key,
                           "signature": spec.signature, "constexprs": spec.constexprs, "attrs": spec.attrs,
                           "options": spec.options, "arch": g["arch"], "sass_path": sass_path}))
    # Convolutions first: they take longest, so the two processes finish together.
    todo.sort(key=lambda kt: not groups[kt[0]]["job"].conv)
    procs = processes if len(todo) >= _POOL_MIN else 1
    log(f"static: {sum(g['jobs'] for g in groups.values())} launches → {len(groups)} distinct compilations; "
        f"{len(metrics)} cached, {len(todo)} to compile with {procs} process(es)")
    for (key, _), m in zip(todo, _run_tasks([t for _, t in todo], processes, log)):
        metrics[key] = m
        path = _cache_path(cache_dir, key)
        if path is not None and "error" not in m:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(m))
            tmp.replace(path)
    entries = []
    for key, g in groups.items():
        job, m = g["job"], metrics[key]
        entries.append({"kind": "triton", "kernel": job.kernel, "config": job.config, "variant": job.variant,
                        "dtype": job.dtype, "arch": f"sm_{g['arch']}", "conv": job.conv,
                        **{k: v for k, v in m.items() if k != "arch"},
                        "shapes": g["shapes"], "launches": g["jobs"], "signature": g["signature"],
                        "constexprs": g["constexprs"], "key": key[:16]})
    return entries, {"launches": sum(g["jobs"] for g in groups.values()), "compilations": len(groups),
                     "compiled": len(todo), "cached": len(groups) - len(todo)}


# ------------------------------------------------------------------------------ providers, check
def default_provider() -> tuple[Callable, str]:
    """:func:`tools.static_report.jobs.chain_jobs` (every launch of the fused chains), with its
    dotted name."""
    return chain_jobs, "tools.static_report.jobs.chain_jobs"


def _load_provider(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--provider wants module:function, got {spec!r}")
    return _import_attr(module, name)


def _operand_load_problems(e: dict) -> list[str]:
    """A convolution's operand tiles must reach the tensor cores through async copies (cp.async or TMA)
    or wide loads: no async copy at all, or — in a 16-bit dtype, where every sub-32-bit global load
    is an element-wise load of an activation, gradient or weight tile — any 16/8-bit LDG or LDGSTS
    fails. (32-bit loads are left alone: fp32 per-channel vectors such as scale/shift are spread one
    element per thread, and in fp32 they cannot be told apart from operand loads.)"""
    why = []
    asyncs = e.get("async_copies", {})
    if not (asyncs.get("LDGSTS", 0) or asyncs.get("UTMALDG", 0)):
        why.append("no async global→shared copies (LDGSTS/UTMALDG) for the operands")
    if e.get("dtype") in ("bf16", "fp16"):
        narrow = sum(e.get(key, {}).get(w, 0) for key in ("ldg_by_width", "ldgsts_by_width") for w in ("16", "8"))
        if narrow:
            why.append(f"{narrow} scalar 16/8-bit global loads (operand tiles must load as vectors)")
    return why


def check_entries(entries: Sequence[dict]) -> list[str]:
    """Why each failing entry fails ``--check``: compile error, stack_bytes > 0 (spills), shared
    memory over the arch's per-block limit (:data:`SMEM_LIMIT`), or a convolution (``conv`` true)
    without the arch's tensor-core instruction (HGMMA on sm_90+, HMMA below), without async copies, or
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
            if e.get("conv") and not e.get("mma"):
                op = "HGMMA" if arch >= 90 else "HMMA"
                why.append(f"no {op} (tensor-core ops found: {e.get('mma_by_op') or 'none'})")
            if e.get("conv"):
                why.extend(_operand_load_problems(e))
        if why:
            where = ", ".join(e.get("shapes", [])[:3]) + (" …" if len(e.get("shapes", [])) > 3 else "")
            problems.append(f"{e['kind']} {e['kernel']} [{e['config']}] {e.get('variant', '')} {e.get('dtype', '')} "
                            f"{e['arch']}: {'; '.join(why)}" + (f"  (e.g. {where})" if where else ""))
    return problems


# ---------------------------------------------------------------------------------------- table
def _rng(vals: Sequence[int]) -> str:
    lo, hi = min(vals), max(vals)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _widths(ds: Sequence[dict]) -> str:
    parts = []
    for w in _WIDTHS:
        vals = [d.get(w, 0) for d in ds]
        if any(vals):
            parts.append(f"{w}:{_rng(vals)}")
    return " ".join(parts) or "-"


def format_table(entries: Sequence[dict], full: bool = False) -> str:
    """Text table: one row per (kind, kernel, config, dtype, arch) with ranges over its
    compilations (``n``; every compilation with ``full``), sorted by kernel and dtype (in order of
    appearance), config, arch. Columns: regs, stack [B], smem [KiB], mma, LDGSTS, TMA, STL/LDL, LDG
    and LDGSTS widths as ``bits:count``."""
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for e in entries:
        k = (e["kind"], e["kernel"], e["config"], e["dtype"], e["arch"])
        rows[k + ((e.get("variant", ""), e.get("key", e.get("symbol", ""))) if full else ())].append(e)
    head = ["kernel", "config"] + (["variant"] if full else []) + ["dtype", "arch", "n", "regs", "stack",
                                                                   "smem KiB", "mma", "LDGSTS", "TMA", "STL/LDL",
                                                                   "LDG bits:count", "LDGSTS bits:count"]
    first = {}
    for e in entries:
        first.setdefault(e["kernel"], len(first))
        first.setdefault(e["dtype"], len(first))
    nums = lambda text: [int(x) for x in re.findall(r"\d+", text)]
    order = lambda k: (k[0], first[k[1]], first[k[3]], nums(k[2]), -int(nums(k[4])[0]) if nums(k[4]) else 0, k[5:])
    lines = []
    for k, es in sorted(rows.items(), key=lambda kv: order(kv[0])):
        ok = [e for e in es if "error" not in e]
        if not ok:
            lines.append([k[1], k[2]] + ([k[5]] if full else []) + [k[3], k[4], str(len(es)), "compile failed"])
            continue
        lines.append([k[1], k[2]] + ([k[5]] if full else []) + [
            k[3], k[4], str(len(es)), _rng([e["regs"] for e in ok]), _rng([e["stack_bytes"] for e in ok]),
            _rng([round(e["shared_bytes"] / 1024, 1) for e in ok]), _rng([e["mma"] for e in ok]),
            _rng([e["async_copies"]["LDGSTS"] for e in ok]), _rng([e["async_copies"]["UTMALDG"] for e in ok]),
            f"{_rng([e['spill_stores'] for e in ok])}/{_rng([e['spill_loads'] for e in ok])}",
            _widths([e["ldg_by_width"] for e in ok]), _widths([e["ldgsts_by_width"] for e in ok])])
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in lines + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines])


# ------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    from fused_preact.bench.shapes import MODEL_SPECS

    p = argparse.ArgumentParser(prog="python -m tools.static_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", type=int, default=list(ARCHS), help="compute capabilities (default: 90 80)")
    p.add_argument("--kernels", nargs="+", help="only jobs with these kernel names (default: all)")
    p.add_argument("--models", nargs="+", choices=sorted(MODEL_SPECS), default=["preact_resnet50", "preact_resnet164"])
    p.add_argument("--layers", nargs="+", help="only units one of whose layer names contains one of these strings")
    p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16", "fp32"], default=["bf16", "fp16", "fp32"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--provider", help="job provider module:function (default: "
                                      "tools.static_report.jobs:chain_jobs)")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernels (with --cubins)")
    p.add_argument("--cubins", metavar="DIR", help="also report every *.cubin in DIR (CUDA C++ builds)")
    p.add_argument("--check", action="store_true", help="exit 1 if any entry spills, exceeds shared memory or "
                                                        "failed, or a convolution lacks tensor-core instructions or "
                                                        "async copies or loads 16-bit operands element-wise")
    p.add_argument("--out", default="benchmarks/results", help="folder for static-<triton>-<date>.json")
    p.add_argument("--processes", type=int, default=2, help="compile processes (at most 2)")
    p.add_argument("--cache-dir", default=os.environ.get("FUSED_PREACT_STATIC_CACHE",
                                                         os.path.join(os.path.expanduser("~"), ".cache", "fused_preact", "static")),
                   help="metrics cache (default $FUSED_PREACT_STATIC_CACHE or ~/.cache/fused_preact/static)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the metrics cache")
    p.add_argument("--sass-dir", metavar="DIR", help="write each compilation's SASS there (bypasses the cache)")
    p.add_argument("--full-table", action="store_true", help="one table row per compilation")
    return p


def _dumps(obj: dict) -> str:
    """JSON with one line per top-level key and per entry (small, and diffs line up by entry)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in obj.items() if k != "entries"]
    entries = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in obj["entries"])
    return "{\n" + ",\n".join(head + [f' "entries": [\n{entries}\n ]']) + "\n}\n"


def _commit() -> Optional[str]:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (module docstring). Returns 0, 1 (``--check`` found offenders) or 2 (refused:
    TRITON_INTERPRET set, bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("tools.static_report: TRITON_INTERPRET is set, so the kernels are interpreter objects and "
              "cannot be compiled; unset it.", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (True), without its warning
    import triton

    t0 = time.perf_counter()
    entries: list[dict] = []
    counts: dict = {}
    provider_name = None
    if not a.no_triton:
        from fused_preact.bench.shapes import dtype_from_name, enumerate_units

        provider, provider_name = (_load_provider(a.provider), a.provider) if a.provider else default_provider()
        units = [u for m in a.models for u in enumerate_units(m, a.batch)]
        if a.layers:
            units = [u for u in units if any(s in n for n in u.names for s in a.layers)]
        dtypes = [dtype_from_name(d) for d in a.dtypes]
        jobs = [j for j in provider(units, dtypes) if not a.kernels or j.kernel in a.kernels]
        cache = None if a.no_cache else Path(a.cache_dir)
        sass_dir = Path(a.sass_dir) if a.sass_dir else None
        if sass_dir is not None:
            sass_dir.mkdir(parents=True, exist_ok=True)
        log = lambda s: print(s, file=sys.stderr, flush=True)
        entries, counts = triton_entries(jobs, a.arch, max(1, min(2, a.processes)), cache, sass_dir, log)
    if a.cubins:
        entries += csrc_entries(a.cubins)
    elapsed = round(time.perf_counter() - t0, 1)
    obj = {"triton": triton.__version__, "date": date.today().isoformat(),
           "command": "python -m tools.static_report " + shlex.join(argv), "commit": _commit(),
           "archs": [f"sm_{x}" for x in a.arch], "provider": provider_name, **counts, "elapsed_s": elapsed,
           "entries": entries}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"static-{triton.__version__}-{obj['date']}.json"
    path.write_text(_dumps(obj))
    print(format_table(entries, a.full_table))
    print(f"\n{len(entries)} entries in {elapsed} s → {path}")
    if a.check:
        problems = check_entries(entries)
        if problems:
            print(f"\n--check: {len(problems)} entries fail:\n  " + "\n  ".join(problems))
            return 1
        print("--check: all entries pass (no spills; tensor cores, async copies and vector operand loads in every "
              "convolution)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
