"""Compiling the report's jobs: Triton launches specialized and compiled offline, CUDA C++ cubins read.

For each :class:`~tools.static_report.jobs.StaticJob` — exactly what a launcher passes to a kernel,
``fn[grid](*args, **kwargs)`` — :func:`triton_entries` specializes the arguments the way a real launch
does, compiles with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` and reads the cubin
(:func:`tools.static_report.sass.cubin_metrics`). Identical compilations (same Triton cache key:
function source, signature, attributes, constexprs, options, target) are compiled once, by at most
two processes; their metrics are cached under ``cache_dir`` by that key (and :data:`PARSER_VERSION`),
so a second run compiles nothing.


Argument specialization (Triton 3.6 to 3.9, which agree on it; read from ``triton/runtime/jit.py``:
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fused_preact.ops.triton_compat import launch_knob_kwargs
from tools.static_report.jobs import StaticJob
from tools.static_report.sass import cubin_metrics, demangle, short_name
from tools.static_report.utilization import dot_replication, memory_ratio, mma_utilization

__all__ = ["specialize", "triton_entries", "csrc_entries", "import_attr", "PARSER_VERSION", "distinct_specs",
           "precompile"]

#: Bumped when the metrics read from a cubin change (invalidates the metrics cache).
PARSER_VERSION = 5
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
    computes them (``JITFunction.run`` in ``triton/runtime/jit.py``, Triton 3.6-3.9), and the launch's
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
    kwargs.update(launch_knob_kwargs())  # the knobs this Triton release passes (triton_compat)
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



def csrc_entries(folder: str) -> list[dict]:
    """Report entries (``kind: "csrc"``) for every function of every ``*.cubin`` in ``folder``
    (e.g. from ``nvcc -cubin -arch=sm_90a``): ``kernel`` the short demangled name, ``config`` the
    cubin's file name, ``function`` the full demangled name, ``symbol`` the mangled one, ``dtype``
    ``bf16``/``fp16`` by which of CUTLASS's ``bfloat16_t``/``half_t`` the name mentions more often
    ("" for neither)."""
    entries = []
    for path in sorted(Path(folder).glob("*.cubin")):
        funcs = cubin_metrics(str(path))
        symbols = list(funcs)
        names: Counter = Counter()
        for sym, full in zip(symbols, demangle(symbols)):
            m = funcs[sym]
            short = short_name(full)
            names[short] += 1
            kernel = short if names[short] == 1 else f"{short}#{names[short]}"
            bf16, fp16 = full.count("bfloat16_t"), full.count("half_t")
            dtype = "bf16" if bf16 > fp16 else "fp16" if fp16 > bf16 else ""
            entries.append({"kind": "csrc", "kernel": kernel, "config": path.name, "variant": "", "dtype": dtype,
                            "arch": f"sm_{m['arch']}", "conv": None, "function": full[:2000], "symbol": sym,
                            **{k: v for k, v in m.items() if k != "arch"}})
    return entries


# ------------------------------------------------------------------------------------ compiling
def import_attr(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve(module: str, qualname: str, cache_key: str):
    obj = import_attr(module, qualname)
    if getattr(obj, "cache_key", None) != cache_key:
        raise RuntimeError(f"{module}.{qualname} in the compile worker is not the function of the job "
                           f"(imported from {sys.modules[module].__file__}; check sys.path)")
    return obj


def _task(job: StaticJob, spec: _Spec, arch: int, **extra) -> dict:
    """What a worker process needs to compile ``job``'s specialization ``spec`` for sm_``arch``."""
    return {"module": job.fn.module, "qualname": job.fn.fn.__qualname__, "fn_key": job.fn.cache_key,
            "signature": spec.signature, "constexprs": spec.constexprs, "attrs": spec.attrs,
            "options": spec.options, "arch": arch, **extra}


def _compile(task: dict):
    """``triton.compile`` of a :func:`_task` (which also stores the binary in Triton's on-disk cache)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _resolve(task["module"], task["qualname"], task["fn_key"])
    src = ASTSource(fn, task["signature"], task["constexprs"], task["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", task["arch"], 32), options=task["options"])


def _compile_task(task: dict) -> dict:
    """Compile one specialization (in a worker process) and read its cubin. Returns the metrics of
    its single function, ``shared_bytes`` including Triton's dynamic shared memory, ``mma_dots``,
    ``mma_replication`` and ``mma_dots_unparsed`` (:func:`~tools.static_report.utilization.dot_replication`
    of its TTGIR), ``compile_s``; or ``{"error": …}``."""
    t0 = time.perf_counter()
    try:
        k = _compile(task)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            Path(path).write_bytes(k.asm["cubin"])
            sass_out = Path(task["sass_path"]) if task.get("sass_path") else None
            (m,) = cubin_metrics(path, sass_out).values()
    except Exception as e:  # reported per entry; --check fails on it
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "compile_s": time.perf_counter() - t0}
    m["static_shared_bytes"] = m["shared_bytes"]
    m["shared_bytes"] += int(k.metadata.shared)
    rep = dot_replication(k.asm["ttgir"])
    m["mma_dots"], m["mma_replication"], m["mma_dots_unparsed"] = rep["dots"], rep["replication"], rep["unparsed"]
    m["compile_s"] = round(time.perf_counter() - t0, 2)
    return m


def _run_tasks(tasks: list[dict], processes: int, log: Callable[[str], None],
               work: Callable[[dict], Any] = _compile_task) -> list:
    """Run ``work`` (default :func:`_compile_task`) over ``tasks`` in at most ``processes`` spawned processes, in order of
    submission; returns results in task order. Fewer than :data:`_POOL_MIN` tasks run inline: a
    spawned worker first imports torch and triton (5-10 s on a busy 2-core machine), more than a
    few compilations (1-3 s each) save."""
    results: list[Optional[dict]] = [None] * len(tasks)
    t0 = time.perf_counter()
    step = max(1, len(tasks) // 10)
    if processes <= 1 or len(tasks) < _POOL_MIN:
        for i, t in enumerate(tasks):
            results[i] = work(t)
            if (i + 1) % step == 0:
                log(f"  compiled {i + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)")
        return results  # type: ignore[return-value]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=processes, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(work, t): i for i, t in enumerate(tasks)}
        for n, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            if n % step == 0:
                log(f"  compiled {n}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)")
    return results  # type: ignore[return-value]


def distinct_specs(jobs: Sequence[StaticJob], arch: int) -> dict[str, tuple[StaticJob, _Spec]]:
    """Triton cache key → (first job, specialization) of every distinct compilation ``jobs`` make on an
    sm_``arch`` GPU (jobs limited to other archs are left out)."""
    out: dict[str, tuple[StaticJob, _Spec]] = {}
    for job in jobs:
        if job.archs is not None and arch not in job.archs:
            continue
        spec = specialize(job, arch)
        out.setdefault(spec.key, (job, spec))
    return out


def _warm_task(task: dict) -> Optional[str]:
    """Compile one specialization into Triton's on-disk cache (a worker process); None or the error."""
    try:
        _compile(task)
    except Exception as e:  # reported by the caller
        return f"{task['qualname']}: {type(e).__name__}: {str(e)[:300]}"
    return None


def precompile(jobs: Sequence[StaticJob], arch: int, processes: int,
               log: Callable[[str], None] = print) -> dict:
    """Compile every distinct specialization of ``jobs`` for sm_``arch`` into Triton's on-disk cache
    (``TRITON_CACHE_DIR``, default ``~/.triton/cache``) in ``processes`` spawned processes, so that the
    launches ``fn[grid](*args, **kwargs)`` that ``jobs`` record find their binaries there: the cache key
    is the one ``JITFunction.run`` computes (:func:`specialize`). Needs no GPU.

    Returns:
        ``{"compilations": n, "processes": p, "seconds": s, "errors": [...]}``.
    """
    t0 = time.perf_counter()
    tasks = [_task(job, spec, arch) for job, spec in distinct_specs(jobs, arch).values()]
    log(f"precompile: {len(jobs)} launches → {len(tasks)} distinct compilations for sm_{arch}, "
        f"{processes} process(es)")
    errors = [e for e in _run_tasks(tasks, processes, log, _warm_task) if e]
    return {"compilations": len(tasks), "processes": processes, "seconds": round(time.perf_counter() - t0, 1),
            "errors": errors}


def _cache_path(cache_dir: Optional[Path], key: str) -> Optional[Path]:
    return None if cache_dir is None else cache_dir / f"v{PARSER_VERSION}" / key[:2] / f"{key}.json"


def element_bytes(fn, args: Sequence) -> dict[str, int]:
    """Element size in bytes of a launch's tensor arguments ``args`` by the parameter names of the
    kernel ``fn`` (a Triton JIT function, compiled or interpreted)."""
    return {n: a.dtype.itemsize for n, a in zip(fn.arg_names, args)
            if isinstance(getattr(getattr(a, "dtype", None), "itemsize", None), int)}


def triton_entries(jobs: Sequence[StaticJob], archs: Sequence[int], processes: int = 2,
                   cache_dir: Optional[Path] = None, sass_dir: Optional[Path] = None,
                   log: Callable[[str], None] = print, kind: str = "triton") -> tuple[list[dict], dict]:
    """Specialize every job for every arch, compile each distinct specialization once (or take its
    metrics from ``cache_dir``), and return (entries, counts). An entry (``kind`` as given) is one
    distinct compilation, labelled by its first job, with ``shapes`` listing every job's shape and
    ``roles`` every job's non-empty :attr:`StaticJob.role` (sorted: a config can be the default and a
    candidate at once); a convolution's entry also has ``mma_util``, per shape the smallest
    :func:`~tools.static_report.utilization.mma_utilization` of its launches there divided by the
    compilation's ``mma_replication`` (its warps computing the same MMA results),
    ``default_shapes``, the shapes where it runs untuned (a default or a role-less job), and
    ``mem_ratio``, per shape the largest :func:`~tools.static_report.utilization.memory_ratio` of
    its launches there (where it is defined)."""
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
                                        "constexprs": const, "jobs": 0, "roles": set(), "util": {},
                                        "mem": {}, "default_shapes": set()}
            g["jobs"] += 1
            u = mma_utilization(job.kernel, job.kwargs)
            if u is not None:
                g["util"][job.shape] = min(g["util"].get(job.shape, 1.0), round(u, 3))
                if job.role in ("default", ""):
                    g["default_shapes"].add(job.shape)
                m = memory_ratio(job.kernel, job.kwargs, element_bytes(job.fn, job.args), f"sm_{arch}")
                if m is not None:
                    g["mem"][job.shape] = max(g["mem"].get(job.shape, 0.0), round(m, 3))
            if job.role:
                g["roles"].add(job.role)
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
        todo.append((key, _task(job, spec, g["arch"], sass_path=sass_path)))
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
        rep = m.get("mma_replication") or 1.0
        util = {shape: round(u / rep, 3) for shape, u in g["util"].items()}
        entries.append({"kind": kind, "kernel": job.kernel, "config": job.config, "variant": job.variant,
                        "dtype": job.dtype, "arch": f"sm_{g['arch']}", "conv": job.conv,
                        **{k: v for k, v in m.items() if k != "arch"},
                        "shapes": g["shapes"], "roles": sorted(g["roles"]), "launches": g["jobs"],
                        "signature": g["signature"],
                        "constexprs": g["constexprs"], "key": key[:16],
                        **({"mma_util": util, "default_shapes": sorted(g["default_shapes"])}
                           if util else {}),
                        **({"mem_ratio": g["mem"]} if g["mem"] else {})})
    return entries, {"launches": sum(g["jobs"] for g in groups.values()), "compilations": len(groups),
                     "compiled": len(todo), "cached": len(groups) - len(todo)}

