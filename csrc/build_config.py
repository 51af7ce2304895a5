"""Build settings of the ``fused_preact._C`` CUDA extension, shared by ``setup.py``, the JIT loader
(``fused_preact.ops.cuda.ext.jit_load``) and the CI compile check (``.ci/compile_csrc.sh``).

Two kinds of sources (see csrc/README.md):
    common  ``*.cpp`` and ``*.cu`` except ``sm90_*``: compiled for every architecture in the list;
    sm90    ``sm90_*.cu`` (CUTLASS 3.x, wgmma/TMA): compiled for sm_90a alone, with -DFUSED_PREACT_SM90,
            when the list names a 9.x architecture; otherwise compiled without device code for
            that target (their launchers then report "not built"). torch's extension builder
            compiles every source with the same flags, so setup.py and jit_load compile the sm90
            sources to objects themselves (compile_sm90_objects) and link them in.

Environment:
    FUSED_PREACT_CUDA_ARCHS   ";"-separated compute capabilities, e.g. "8.0;9.0a" (default), else
                              TORCH_CUDA_ARCH_LIST; entries < 8.0 are skipped ("+PTX" adds PTX).
    FUSED_PREACT_CUTLASS_INCLUDE  a CUTLASS ``include`` directory to use instead of the
                              ``nvidia-cutlass`` package's copy.
    MAX_JOBS                  parallel compile jobs (default: from cores and memory, see max_jobs()).

Run as a script to print one setting: ``python csrc/build_config.py {nvcc-flags|nvcc-flags-sm90|cxx-flags|
include-dirs|sources|max-jobs|cutlass-include}`` (space-separated, for shell use).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CSRC = os.path.dirname(os.path.abspath(__file__))
CUTLASS_REQUIREMENT = "nvidia-cutlass>=4.2,<5"
DEFAULT_ARCHS = "8.0;9.0a"
SM90_PREFIX = "sm90_"
# nvcc on one CUTLASS translation unit peaks near 1.2 GiB per architecture; leave headroom.
GIB_PER_JOB = 3


def sources() -> list[str]:
    """The extension's C++ and CUDA sources, sorted, as absolute paths."""
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.cu")))


def is_sm90_source(path: str) -> bool:
    """Whether a source holds sm_90a-only kernels (``sm90_*.cu``)."""
    name = os.path.basename(path)
    return name.startswith(SM90_PREFIX) and name.endswith(".cu")


def common_sources() -> list[str]:
    """Sources compiled for every architecture of the list."""
    return [s for s in sources() if not is_sm90_source(s)]


def sm90_sources() -> list[str]:
    """Sources compiled for sm_90a only."""
    return [s for s in sources() if is_sm90_source(s)]


def headers() -> list[str]:
    """csrc's headers (a change in any of them makes compiled objects stale)."""
    return sorted(glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "*.cuh")))


def cutlass_include_dir() -> str:
    """The CUTLASS C++ ``include`` directory (contains ``cutlass/cutlass.h``).

    Raises:
        RuntimeError: neither FUSED_PREACT_CUTLASS_INCLUDE nor the ``nvidia-cutlass`` package provides it.
    """
    override = os.environ.get("FUSED_PREACT_CUTLASS_INCLUDE")
    candidates = [override] if override else []
    try:
        import cutlass_library
    except ImportError:
        cutlass_library = None
    if cutlass_library is not None:
        candidates.append(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))
    for path in candidates:
        if os.path.isfile(os.path.join(path, "cutlass", "cutlass.h")):
            return path
    raise RuntimeError(
        "fused_preact: the CUDA extension needs the CUTLASS C++ headers. Install them with "
        f"`pip install '{CUTLASS_REQUIREMENT}'` (they land in cutlass_library/source/include), point "
        "FUSED_PREACT_CUTLASS_INCLUDE at a CUTLASS include/ directory, or set FUSED_PREACT_SKIP_CUDA=1 "
        f"to install without the extension. Looked in: {candidates or ['(cutlass_library not installed)']}"
    )


def cuda_archs() -> list[str]:
    """Compute capabilities to build, as nvcc numbers with an optional "+PTX": ["80", "90"].

    Entries below 8.0 (the CUTLASS kernels use sm_80 instructions) are skipped with a warning, so a
    TORCH_CUDA_ARCH_LIST shared with other extensions still works.

    Raises:
        ValueError: an entry is malformed, or no entry is >= 8.0.
    """
    spec = os.environ.get("FUSED_PREACT_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    archs = []
    for entry in spec.replace(",", ";").replace(" ", ";").split(";"):
        if not entry:
            continue
        ptx = entry.endswith("+PTX")
        number = entry[: -len("+PTX")] if ptx else entry
        # Architecture-specific variants ("9.0a", "10.0f") keep their suffix: sm_90a, compute_90a.
        suffix = number[-1] if number[-1:] in ("a", "f") else ""
        number = number[: len(number) - len(suffix)]
        try:
            major, minor = (int(v) for v in number.split(".")) if "." in number else divmod(int(number), 10)
        except ValueError:
            raise ValueError(f"fused_preact: cannot parse CUDA architecture {entry!r} in {spec!r}") from None
        if major < 8:
            print(f"fused_preact: skipping CUDA architecture {entry} (< 8.0)", file=sys.stderr)
            continue
        archs.append(f"{major}{minor}{suffix}" + ("+PTX" if ptx else ""))
    if not archs:
        raise ValueError(f"fused_preact: no CUDA architecture >= 8.0 in {spec!r}")
    return archs


def gencode_flags(archs: list[str] | None = None) -> list[str]:
    """``-gencode`` flags: SASS for every arch, plus PTX for those marked "+PTX"."""
    flags = []
    for arch in archs if archs is not None else cuda_archs():
        number = arch.replace("+PTX", "")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def cutlass_util_include_dir(include_dir: str | None = None) -> str | None:
    """CUTLASS's ``tools/util/include`` next to its ``include`` (``cutlass/util/packed_stride.hpp``,
    used by the CUTLASS 3.x conv collectives), or None if absent."""
    include_dir = include_dir or cutlass_include_dir()
    path = os.path.normpath(os.path.join(include_dir, "..", "tools", "util", "include"))
    return path if os.path.isfile(os.path.join(path, "cutlass", "util", "packed_stride.hpp")) else None


def include_dirs() -> list[str]:
    """Include directories beyond torch's own: csrc/, CUTLASS and CUTLASS's tools/util."""
    include = cutlass_include_dir()
    util = cutlass_util_include_dir(include)
    return [CSRC, include] + ([util] if util else [])


def sm90_archs(archs: list[str] | None = None) -> list[str]:
    """Targets of the sm90 sources: ["90a"] when the list names a 9.x architecture, else []."""
    archs = archs if archs is not None else cuda_archs()
    return ["90a"] if any(a.replace("+PTX", "").startswith("9") for a in archs) else []


def cxx_flags() -> list[str]:
    """Host compiler flags (torch's extension builder adds -std=c++20 and -fPIC)."""
    return ["-O3"]


def nvcc_flags(archs: list[str] | None = None) -> list[str]:
    """nvcc flags: optimisation, the architectures, and the half/bfloat16 operators CUTLASS uses
    (torch's extension builder disables them by default with -D__CUDA_NO_HALF_OPERATORS__ etc.)."""
    return [
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        # torch's headers use C++20 default member initializers for bit-fields; nvcc warns per TU.
        "-diag-suppress=3306",
        *gencode_flags(archs),
    ]


def nvcc_flags_sm90(archs: list[str] | None = None) -> list[str]:
    """nvcc flags of the sm90 sources: sm_90a only with FUSED_PREACT_SM90 defined, and -DNDEBUG
    (a device-side assert is a call, and a call inside the mainloop makes ptxas serialize the wgmma
    pipeline, warning C7510). Without a 9.x target: the common flags (the sources compile to stubs)."""
    archs = archs if archs is not None else cuda_archs()
    if not sm90_archs(archs):
        return nvcc_flags(archs)
    return [f for f in nvcc_flags(["90a"])] + ["-DFUSED_PREACT_SM90", "-DNDEBUG"]


def _nvcc() -> str:
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        CUDA_HOME = None
    if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise RuntimeError("fused_preact: nvcc not found (set CUDA_HOME or put it on PATH)")
    return found


def compile_sm90_objects(build_dir: str, archs: list[str] | None = None, jobs: int | None = None,
                         verbose: bool = False) -> list[str]:
    """Compile the sm90 sources to position-independent objects under ``build_dir`` (skipping those
    newer than their source, every csrc header and this file) and return their paths, for linking
    into the extension next to torch's build of the common sources. The sm90 sources include no
    torch header, so only CUTLASS's and CUDA's include directories are needed.

    Raises:
        RuntimeError: nvcc is missing or a compile fails (its output is in the message).
    """
    os.makedirs(build_dir, exist_ok=True)
    flags = nvcc_flags_sm90(archs)
    includes = [f"-I{d}" for d in include_dirs()]
    deps_mtime = max(os.path.getmtime(p) for p in headers() + [os.path.abspath(__file__)])
    nvcc = _nvcc()

    def one(src: str) -> str:
        obj = os.path.join(build_dir, os.path.basename(src) + ".o")
        stamp = obj + ".flags"
        command = [nvcc, *flags, *includes, "-Xcompiler", "-fPIC", "-c", src, "-o", obj]
        fresh = (
            os.path.isfile(obj)
            and os.path.getmtime(obj) >= max(os.path.getmtime(src), deps_mtime)
            and os.path.isfile(stamp)
            and open(stamp).read() == " ".join(command)
        )
        if not fresh:
            if verbose:
                print(" ".join(command), flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"fused_preact: compiling {src} failed:\n{done.stdout}{done.stderr}")
            with open(stamp, "w") as f:
                f.write(" ".join(command))
        return obj

    with ThreadPoolExecutor(max_workers=jobs or max_jobs()) as pool:
        return list(pool.map(one, sm90_sources()))


def max_jobs() -> int:
    """Parallel compile jobs: MAX_JOBS if set, else min(cores, available memory / GIB_PER_JOB), at least 1."""
    if os.environ.get("MAX_JOBS"):
        return max(1, int(os.environ["MAX_JOBS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
        mem_gib = pages * page_size / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = GIB_PER_JOB * cores
    return max(1, min(cores, int(mem_gib // GIB_PER_JOB)))


def _main(argv: list[str]) -> int:
    commands = {
        "nvcc-flags": nvcc_flags,
        "nvcc-flags-sm90": nvcc_flags_sm90,
        "cxx-flags": cxx_flags,
        "include-dirs": include_dirs,
        "sources": sources,
        "max-jobs": lambda: [str(max_jobs())],
        "cutlass-include": lambda: [cutlass_include_dir()],
    }
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: build_config.py {{{'|'.join(commands)}}}", file=sys.stderr)
        return 2
    print(" ".join(commands[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
