"""Build settings of the ``fused_preact._C`` CUDA extension, shared by ``setup.py``, the JIT loader
(``fused_preact.ops._cuda.jit_load``) and the CI compile check (``.ci/compile_csrc.sh``).

Environment:
    FUSED_PREACT_CUDA_ARCHS   ";"-separated compute capabilities, e.g. "8.0;9.0" (default), else
                              TORCH_CUDA_ARCH_LIST; entries < 8.0 are skipped ("+PTX" adds PTX).
    FUSED_PREACT_CUTLASS_INCLUDE  a CUTLASS ``include`` directory to use instead of the
                              ``nvidia-cutlass`` package's copy.
    MAX_JOBS                  parallel compile jobs (default: from cores and memory, see max_jobs()).

Run as a script to print one setting: ``python csrc/build_config.py {nvcc-flags|cxx-flags|include-dirs|
sources|max-jobs}`` (space-separated, for shell use).
"""

from __future__ import annotations

import glob
import os
import sys

CSRC = os.path.dirname(os.path.abspath(__file__))
CUTLASS_REQUIREMENT = "nvidia-cutlass>=4.2,<5"
DEFAULT_ARCHS = "8.0;9.0"
# nvcc on one CUTLASS translation unit peaks near 1.2 GiB per architecture; leave headroom.
GIB_PER_JOB = 3


def sources() -> list[str]:
    """The extension's C++ and CUDA sources, sorted, as absolute paths."""
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.cu")))


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


def include_dirs() -> list[str]:
    """Include directories beyond torch's own: csrc/ and CUTLASS."""
    return [CSRC, cutlass_include_dir()]


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
