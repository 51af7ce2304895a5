#!/usr/bin/env bash
# What a session lent a GPU runs, one stage per device-tool call (each fits the 10-minute limit;
# every step has its own timeout, and the logs and results land under $OUT, at most 8 files):
#
#   bash benchmarks/gpu_session.sh first   the first stage to run on a new GPU (≤ 8 min; torch 2.11 +
#                                          Triton 3.6 is enough, no registry needed): environment, every
#                                          Triton kernel precompiled in parallel, bf16 correctness of every
#                                          PreActResNet-50 block and four -164 blocks against float64,
#                                          block fwd+bwd time and memory (eager, triton, recompute, auto,
#                                          torch.compile), layer1.1's kernels vs cuDNN: first.json and
#                                          first.md (benchmarks/first_stage.py; --dry-run on a CPU)
#   bash benchmarks/gpu_session.sh check   environment, test suite on CUDA (no interpreter) without
#                                          the `slow` tests (-m "not slow", 240 s at most),
#                                          compute-sanitizer on one small fused unit, the main job, then
#                                          the `slow` tests and the pytest-benchmark quick set with the
#                                          time left (~9.5 min)
#   bash benchmarks/gpu_session.sh bench   "$PY" -m fused_preact.bench (full, --time-limit ~470 s):
#                                          <device>-<date>.json/.md/.png (~9.5 min). It runs eager,
#                                          fused and CUDA graphs everywhere first, then torch.compile
#                                          for PreActResNet-50, and records what the budget left out
#                                          as skipped; a second call can take those, e.g.
#     BENCH_ARGS="--models preact_resnet164 --providers eager triton compile" bash benchmarks/gpu_session.sh bench
#     BENCH_ARGS="--level unit block --models preact_resnet50 --providers eager triton compile-max-autotune" ...
#   bash benchmarks/gpu_session.sh csrc    builds fused_preact._C for sm_90a (the nvidia-cutlass wheel
#                                          carried in .whl/, or installed), then tests/test_csrc.py on
#                                          CUDA with FUSED_PREACT_REQUIRE_CUDA_EXT=1 (~5 min)
#   bash benchmarks/gpu_session.sh kernels "$PY" -m fused_preact.bench --level kernel (each fused
#                                          kernel vs cuDNN's convolution; KERNEL_ARGS, default
#                                          "--models preact_resnet50 --dtype bf16"; ~9.5 min)
#   bash benchmarks/gpu_session.sh enqueue --level block model --modes enqueue: host enqueue time vs
#                                          wall time per block fwd+bwd and training step (~9.5 min)
#   bash benchmarks/gpu_session.sh auto    backend="auto" and the recompute backend on the GPU: the
#                                          auto/recompute tests on CUDA (validation rejecting an injected
#                                          wrong kernel with real timing; recompute against float64),
#                                          then block fwd+bwd and model steps for eager, triton,
#                                          recompute, auto, auto-lean (AUTO_ARGS, default
#                                          "--models preact_resnet50 preact_resnet164 --dtype bf16") and
#                                          benchmarks/check_auto.py on the results: auto ≥ 0.98× eager,
#                                          auto-lean ≤ 0.6× eager's peak memory (~9.5 min)
#   bash benchmarks/gpu_session.sh quick   "$PY" -m fused_preact.bench --quick (~2.5 min)
#   bash benchmarks/gpu_session.sh pytest  pytest benchmarks --benchmark-only
#                                          (FUSED_PREACT_BENCH=quick unless set; ~9.5 min at most)
#
# Run from the repository root. The device machine has no .git: pass the commit in, e.g.
#   FUSED_PREACT_COMMIT=<sha> bash benchmarks/gpu_session.sh bench
# Results come back in $OUT; copy <device>-<date>.* into benchmarks/results/ (the script also
# writes them there on the device, where they vanish with the machine).
set -uo pipefail
STAGE=${1:-check}
case "$STAGE" in first|check|bench|quick|pytest|csrc|kernels|enqueue|auto) ;; *) echo "unknown stage '$STAGE' (first, check, bench, quick, pytest, csrc, kernels, enqueue, auto)"; exit 2 ;; esac
# the device image's interpreter is python3 (a venv's; a bare `python` may be missing there)
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
SECONDS=0
status=0

# run NAME LIMIT_S CMD...: run CMD with SIGINT after LIMIT_S seconds (timeout signals its whole process
# group, Inductor's compile workers too; Python saves what it has and pytest-benchmark writes its JSON
# on interrupt), SIGKILL 30 s later; record a failure (exit 124: timed out).
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, t=${SECONDS}s)"
  timeout -s INT -k 30 "$limit" "$@"
  local rc=$?
  [ $rc -eq 0 ] || { echo "=== $name: exit $rc"; status=1; }
  return 0
}

{
  date -u +%FT%TZ
  echo "stage: $STAGE"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)"
  "$PY" -c "import matplotlib, pytest_benchmark; print('matplotlib', matplotlib.__version__, 'pytest-benchmark', pytest_benchmark.__version__)"
  echo "commit: ${FUSED_PREACT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

pytest_bench() {  # $1: time limit in seconds (skipped under 60: the call's 600 s would cut it anyway)
  if [ "$1" -lt 60 ]; then echo "=== pytest-benchmark: skipped, only ${1}s left"; return 0; fi
  FUSED_PREACT_BENCH=${FUSED_PREACT_BENCH:-quick} run pytest-benchmark "$1" \
    "$PY" -m pytest benchmarks --benchmark-only -q -p no:cacheprovider -p no:xdist \
    --benchmark-json "$OUT/pytest_bench.json" --benchmark-columns=median,iqr,rounds --benchmark-sort=name \
    > "$OUT/pytest_bench.log" 2>&1
  tail -25 "$OUT/pytest_bench.log"
}

bench() {  # extra arguments for "$PY" -m fused_preact.bench; results into $OUT, then benchmarks/results
  run bench "$@" > "$OUT/bench.log" 2>&1
  tail -60 "$OUT/bench.log"
  mkdir -p benchmarks/results && cp "$OUT"/*-20*.json "$OUT"/*-20*.md "$OUT"/*-20*.png benchmarks/results/ 2>/dev/null
}

case "$STAGE" in
  first)
    # its steps keep their own limits inside a 440 s budget; this limit only catches a hung driver
    run first 470 "$PY" benchmarks/first_stage.py --out "$OUT" --budget 440
    ;;
  check)
    # every kernel path, without the tests marked slow (more shapes and depths of the same paths; see
    # pyproject.toml); Triton's on-disk cache is shared by the 8 workers
    run tests 240 "$PY" -m pytest tests -n 8 -q -p no:cacheprovider -m "not slow" > "$OUT/tests.log" 2>&1
    tail -15 "$OUT/tests.log"
    run sanitizer 90 "$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)" --tool memcheck --print-limit 20 "$PY" - > "$OUT/sanitizer.log" 2>&1 <<'PYEOF'
import torch
from fused_preact import FusedBNReLUConv2d
m = FusedBNReLUConv2d(24, 40, 3, stride=2, padding=1, backend="triton").cuda().to(torch.bfloat16)
x = torch.randn(3, 24, 13, 11, device="cuda", dtype=torch.bfloat16, requires_grad=True)
m(x).float().square().sum().backward()
torch.cuda.synchronize()
print("sanitized run done")
PYEOF
    tail -3 "$OUT/sanitizer.log"
    run main-job 120 "$PY" -m fused_preact --json "$OUT/main_job.json" > "$OUT/main_job.log" 2>&1
    grep -v "training:" "$OUT/main_job.log" | tail -12
    left=$((420 - SECONDS))  # the slow tests first, leaving ~2 min for the benchmark quick set
    if [ "$left" -ge 60 ]; then
      run tests-slow "$left" "$PY" -m pytest tests -n 8 -q -p no:cacheprovider -m slow > "$OUT/tests_slow.log" 2>&1
      tail -8 "$OUT/tests_slow.log"
    else
      echo "=== tests-slow: skipped, only ${left}s left"
    fi
    pytest_bench $((540 - SECONDS))
    ;;
  bench)
    # hard limit so that limit + 30 s of SIGKILL grace ends inside the call's 600 s; the benchmark's own
    # budget (its clock starts after Python's imports) leaves ~70 s for a task that overruns its estimate
    # and for the final report
    limit=$((555 - SECONDS))
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    bench "$limit" "$PY" -m fused_preact.bench --out "$OUT" --time-limit $((limit - 70)) ${FUSED_PREACT_COMMIT:+--commit "$FUSED_PREACT_COMMIT"} ${BENCH_ARGS:-}
    ;;
  csrc)
    if ! "$PY" -c "import cutlass_library" 2>/dev/null; then
      ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1 || { echo "csrc: carry the nvidia-cutlass wheel in .whl/"; exit 2; }
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl
      export PYTHONPATH="/tmp/site:$PYTHONPATH"
    fi
    FUSED_PREACT_CUDA_ARCHS=${FUSED_PREACT_CUDA_ARCHS:-9.0a} MAX_JOBS=${MAX_JOBS:-12} \
      run build 300 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
    tail -3 "$OUT/build.log"
    FUSED_PREACT_REQUIRE_CUDA_EXT=1 run csrc-tests $((560 - SECONDS)) "$PY" -m pytest tests/test_csrc.py -n 4 -q \
      -p no:cacheprovider -rf > "$OUT/csrc_tests.log" 2>&1
    tail -15 "$OUT/csrc_tests.log"
    ;;
  kernels)
    # shellcheck disable=SC2086  # KERNEL_ARGS is a list of arguments
    bench $((555 - SECONDS)) "$PY" -m fused_preact.bench --level kernel --out "$OUT" --no-chart \
      --time-limit $((555 - SECONDS - 70)) ${FUSED_PREACT_COMMIT:+--commit "$FUSED_PREACT_COMMIT"} \
      ${KERNEL_ARGS:---models preact_resnet50 --dtype bf16}
    ;;
  enqueue)
    # host enqueue vs wall time per block fwd+bwd and per training step, eager vs fused (no chart: it
    # plots speedups of the other modes only)
    bench $((555 - SECONDS)) "$PY" -m fused_preact.bench --level block model --modes enqueue --providers eager triton \
      --out "$OUT" --no-chart --time-limit $((555 - SECONDS - 70)) ${FUSED_PREACT_COMMIT:+--commit "$FUSED_PREACT_COMMIT"}
    ;;
  auto)
    # the decision machinery and the recompute backend on CUDA (the CPU-only cases skip), Triton's
    # compilations shared with the benchmark below through its on-disk cache
    run auto-tests 180 "$PY" -m pytest tests/test_auto.py tests/test_recompute.py tests/test_saved_tensors.py -q \
      -p no:cacheprovider -rs > "$OUT/auto_tests.log" 2>&1
    tail -12 "$OUT/auto_tests.log"
    # shellcheck disable=SC2086  # AUTO_ARGS is a list of arguments
    bench $((520 - SECONDS)) "$PY" -m fused_preact.bench --level block model --modes fwd+bwd \
      --providers eager triton recompute auto auto-lean --out "$OUT" --no-chart \
      --time-limit $((520 - SECONDS - 70)) ${FUSED_PREACT_COMMIT:+--commit "$FUSED_PREACT_COMMIT"} \
      ${AUTO_ARGS:---models preact_resnet50 preact_resnet164 --dtype bf16}
    for f in "$OUT"/*-20*.json; do
      run check-auto 30 "$PY" benchmarks/check_auto.py "$f" > "$OUT/auto_check.txt" 2>&1
      cat "$OUT/auto_check.txt"
    done
    ;;
  quick)
    bench 200 "$PY" -m fused_preact.bench --quick --out "$OUT" ${FUSED_PREACT_COMMIT:+--commit "$FUSED_PREACT_COMMIT"}
    ;;
  pytest)
    pytest_bench $((560 - SECONDS))
    ;;
  *)
    echo "unknown stage '$STAGE' (first, check, bench, quick, pytest, csrc, kernels, enqueue, auto)"
    exit 2
    ;;
esac
echo "=== done in ${SECONDS}s, status $status"
exit $status
