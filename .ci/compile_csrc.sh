#!/usr/bin/env bash
# Compile-only check of the CUDA C++ backend (csrc/) on a machine without a GPU.
#
# Every csrc/*.cu is compiled with nvcc against torch's headers and the CUTLASS headers of the
# nvidia-cutlass package — the common sources for the architectures in FUSED_PREACT_CUDA_ARCHS
# (default sm_80 and sm_90a), csrc/sm90_*.cu for sm_90a alone — and csrc/*.cpp with the host compiler,
# each to an object file under a temporary directory. Any compiler error fails the script. Flags
# mirror the real build: torch's COMMON_NVCC_FLAGS, then csrc/build_config.py's (nvcc-flags /
# nvcc-flags-sm90). The objects are then linked into one shared library with torch's and CUDA's
# symbols left unresolved (a CPU-only torch ships the headers but not the CUDA libraries): every
# fused_preact symbol must resolve (a launcher declared but not defined fails here).
#
# CSRC_CUBIN_DIR=dir keeps one cubin per (source, architecture) there, named <source>.sm_<arch>.cubin
# (e.g. sm90_conv_fprop.sm_90a.cubin): nvcc's own per-architecture cubins of the same compile
# (--keep), byte for byte what `nvcc -cubin` gives for that target, without compiling the device
# code twice. For the static SASS report (cuobjdump -res-usage / -sass).
#
# CSRC_ONLY="a.cu b.cu" compiles only the named sources (basenames) and skips the link check: for
# iterating on one kernel's SASS.
#
# Needs: nvcc on PATH (or CUDA_HOME), python with torch. Installs nvidia-cutlass (headers only,
# --no-deps) if it is missing. Jobs run in parallel: COMPILE_JOBS, default build_config.max_jobs().
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
CUTLASS_REQUIREMENT="nvidia-cutlass>=4.2,<5"
start=$(date +%s)

if ! "$PYTHON" -c "import cutlass_library" 2>/dev/null; then
  echo "compile_csrc: installing $CUTLASS_REQUIREMENT (headers only)"
  "$PYTHON" -m pip install --quiet --no-deps "$CUTLASS_REQUIREMENT"
fi

NVCC=${NVCC:-$(command -v nvcc || true)}
if [[ -z "$NVCC" && -n "${CUDA_HOME:-}" ]]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [[ -z "$NVCC" || ! -x "$NVCC" ]]; then
  echo "compile_csrc: nvcc not found (put it on PATH or set CUDA_HOME)" >&2
  exit 1
fi
# nvcc's own include directory (cuda_runtime.h), for the host-compiled .cpp; nvcc may be a wrapper
# script, so ask it rather than resolving its path.
if [[ -n "${CUDA_HOME:-}" && -f "$CUDA_HOME/include/cuda_runtime.h" ]]; then
  CUDA_INCLUDE="$CUDA_HOME/include"
else
  CUDA_INCLUDE=$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n 1)
fi
if [[ ! -f "$CUDA_INCLUDE/cuda_runtime.h" ]]; then
  echo "compile_csrc: cannot find cuda_runtime.h next to $NVCC (set CUDA_HOME)" >&2
  exit 1
fi
CXX=${CXX:-c++}

read -r -a TORCH_INCLUDES <<<"$("$PYTHON" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))')"
read -r -a TORCH_NVCC_FLAGS <<<"$("$PYTHON" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.COMMON_NVCC_FLAGS))')"
read -r -a OUR_INCLUDES <<<"$("$PYTHON" csrc/build_config.py include-dirs | sed 's/\([^ ]*\)/-I\1/g')"
read -r -a NVCC_FLAGS <<<"$("$PYTHON" csrc/build_config.py nvcc-flags)"
read -r -a NVCC_FLAGS_SM90 <<<"$("$PYTHON" csrc/build_config.py nvcc-flags-sm90)"
CUBIN_DIR=${CSRC_CUBIN_DIR:-}
if [[ -n "$CUBIN_DIR" ]]; then mkdir -p "$CUBIN_DIR"; CUBIN_DIR=$(cd "$CUBIN_DIR" && pwd); fi
JOBS=${COMPILE_JOBS:-$("$PYTHON" csrc/build_config.py max-jobs)}

# A CPU-only torch lacks the CMake-generated c10/cuda/impl/cuda_cmake_macros.h (it only defines the
# Windows DLL export switch); skip it. CUDAContext.h (cuBLAS headers) is not used by csrc/.
COMMON=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
        "${OUR_INCLUDES[@]}" "${TORCH_INCLUDES[@]}" -I"$CUDA_INCLUDE")

OUT=$(mktemp -d /tmp/compile_csrc.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

echo "compile_csrc: $("$NVCC" --version | tail -n 1); torch $("$PYTHON" -c 'import torch; print(torch.__version__)');" \
     "cutlass $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass"))'); $JOBS jobs"
echo "compile_csrc: nvcc flags: ${NVCC_FLAGS[*]}"
echo "compile_csrc: nvcc flags of sm90_*.cu: ${NVCC_FLAGS_SM90[*]}"

compile_one() {
  local src=$1 name t0 log status keep flags user sys TIMEFORMAT='%R %U %S' 
  name=$(basename "$src")
  log="$OUT/$name.log"
  t0=$(date +%s)
  if [[ "$src" == *.cu ]]; then
    if [[ "$name" == sm90_* ]]; then flags=("${NVCC_FLAGS_SM90[@]}"); else flags=("${NVCC_FLAGS[@]}"); fi
    keep=()
    if [[ -n "$CUBIN_DIR" ]]; then mkdir -p "$OUT/keep.$name"; keep=(--keep --keep-dir "$OUT/keep.$name"); fi
    { time "$NVCC" "${TORCH_NVCC_FLAGS[@]}" "${flags[@]}" "${COMMON[@]}" "${keep[@]}" -Xcompiler -fPIC -c "$src" \
        -o "$OUT/$name.o" >"$log" 2>&1; } 2>"$OUT/$name.time"
  else
    { time "$CXX" -std=c++20 -O1 -fPIC "${COMMON[@]}" -c "$src" -o "$OUT/$name.o" >"$log" 2>&1; } 2>"$OUT/$name.time"
  fi
  status=$?
  if [[ $status -ne 0 ]]; then
    cat "$log"
    echo "compile_csrc: FAILED $name ($(( $(date +%s) - t0 )) s)"
    return 1
  fi
  if [[ -n "$CUBIN_DIR" && "$src" == *.cu ]]; then
    # nvcc names them <name>.compute_<arch>.cubin, or <name>.cubin for a single target.
    local cubin arch only
    only=$(printf '%s\n' "${flags[@]}" | sed -n 's/.*code=sm_\([0-9a-z]*\).*/\1/p')
    for cubin in "$OUT/keep.$name"/*.cubin; do
      case "$cubin" in
        *.compute_*) arch=${cubin##*.compute_}; arch=${arch%.cubin} ;;
        *) [[ $(wc -l <<<"$only") -eq 1 ]] || { echo "compile_csrc: cannot tell the arch of $cubin"; return 1; }
           arch=$only ;;
      esac
      cp "$cubin" "$CUBIN_DIR/${name%.cu}.sm_$arch.cubin" || return 1
    done
    rm -rf "$OUT/keep.$name"
  fi
  if grep -q "warning" "$log"; then cat "$log"; fi
  read -r _ user sys <"$OUT/$name.time"
  echo "compile_csrc: ok $name ($(( $(date +%s) - t0 )) s wall, $(awk "BEGIN {printf \"%.0f\", $user + $sys}") s cpu," \
       "object $(( $(stat -c %s "$OUT/$name.o") / 1024 )) KiB)"
}
export -f compile_one
export OUT NVCC CXX CUBIN_DIR
export TORCH_NVCC_FLAGS_STR="${TORCH_NVCC_FLAGS[*]}" NVCC_FLAGS_STR="${NVCC_FLAGS[*]}" COMMON_STR="${COMMON[*]}"
export NVCC_FLAGS_SM90_STR="${NVCC_FLAGS_SM90[*]}"

# Largest translation units first so the parallel jobs finish together.
mapfile -t SOURCES < <("$PYTHON" -c '
import os, sys
sys.path.insert(0, "csrc")
import build_config
heavy = ["ops.cu", "sm90_conv_fprop.cu", "sm90_conv_dgrad.cu", "conv_dgrad.cu", "conv_wgrad.cu",
         "conv_fprop.cu", "sm90_conv_wgrad.cu", "fused_preact.cpp"]
rank = lambda p: heavy.index(os.path.basename(p)) if os.path.basename(p) in heavy else len(heavy)
print("\n".join(sorted(build_config.sources(), key=lambda p: (rank(p), p))))')
if [[ -n "${CSRC_ONLY:-}" ]]; then
  read -r -a ONLY <<<"$CSRC_ONLY"
  KEPT=()
  for src in "${SOURCES[@]}"; do
    for name in "${ONLY[@]}"; do [[ "$(basename "$src")" == "$name" ]] && KEPT+=("$src"); done
  done
  if [[ ${#KEPT[@]} -ne ${#ONLY[@]} ]]; then
    echo "compile_csrc: CSRC_ONLY names a source not in csrc/: $CSRC_ONLY" >&2
    exit 1
  fi
  SOURCES=("${KEPT[@]}")
fi
if [[ ${#SOURCES[@]} -eq 0 ]]; then
  echo "compile_csrc: no sources found in csrc/" >&2
  exit 1
fi
printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} bash -c '
  read -r -a TORCH_NVCC_FLAGS <<<"$TORCH_NVCC_FLAGS_STR"
  read -r -a NVCC_FLAGS <<<"$NVCC_FLAGS_STR"
  read -r -a NVCC_FLAGS_SM90 <<<"$NVCC_FLAGS_SM90_STR"
  read -r -a COMMON <<<"$COMMON_STR"
  compile_one "$1"' _ {} || { echo "compile_csrc: FAILED after $(( $(date +%s) - start )) s"; exit 1; }

echo "compile_csrc: all ${#SOURCES[@]} sources compiled in $(( $(date +%s) - start )) s"
if [[ -n "${CSRC_ONLY:-}" ]]; then
  echo "compile_csrc: CSRC_ONLY set, link check skipped"
  if [[ -n "$CUBIN_DIR" ]]; then echo "compile_csrc: cubins in $CUBIN_DIR: $(cd "$CUBIN_DIR" && ls *.cubin | tr '\n' ' ')"; fi
  exit 0
fi

# Link check: the objects into one shared library, leaving torch's and CUDA's symbols unresolved (a
# CPU-only torch has no CUDA libraries to link against); every symbol of our own must resolve, so a
# launcher declared in launchers.h but defined nowhere (or twice) fails here rather than at import.
if ! "$CXX" -shared -o "$OUT/_C.so" "$OUT"/*.o >"$OUT/link.log" 2>&1; then
  cat "$OUT/link.log"; echo "compile_csrc: FAILED to link the objects"; exit 1
fi
missing=$(nm -C --undefined-only "$OUT/_C.so" | grep -F "fused_preact::" || true)
if [[ -n "$missing" ]]; then
  echo "$missing"; echo "compile_csrc: FAILED: unresolved fused_preact symbols"; exit 1
fi
echo "compile_csrc: linked $(stat -c %s "$OUT/_C.so" | awk '{printf "%.1f", $1 / 1048576}') MiB" \
     "(the extension's size, without debug info), all fused_preact symbols resolved"
if [[ -n "$CUBIN_DIR" ]]; then echo "compile_csrc: cubins in $CUBIN_DIR: $(cd "$CUBIN_DIR" && ls *.cubin | tr '\n' ' ')"; fi
