#!/usr/bin/env bash
# One device-tool call for a session lent a GPU: environment, the test suite on CUDA (no
# interpreter), compute-sanitizer on one small fused unit, the main job, and the unit benchmarks.
# Everything is written under $OUT (the device tool brings it back). Run from the repository root:
#   bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0
python -m pytest tests -q -p no:cacheprovider -n 8 2>&1 | tee "$OUT/tests.log" | tail -15 || status=1
compute-sanitizer --tool memcheck --print-limit 20 python - <<'PY' > "$OUT/sanitizer.log" 2>&1 || status=1
import torch
from fused_preact import FusedBNReLUConv2d
m = FusedBNReLUConv2d(24, 40, 3, stride=2, padding=1, backend="triton").cuda().to(torch.bfloat16)
x = torch.randn(3, 24, 13, 11, device="cuda", dtype=torch.bfloat16, requires_grad=True)
m(x).float().square().sum().backward()
torch.cuda.synchronize()
print("sanitized run done")
PY
tail -3 "$OUT/sanitizer.log"
python -m fused_preact --json "$OUT/main_job.json" > "$OUT/main_job.log" 2>&1 || status=1
grep -v "training:" "$OUT/main_job.log" | tail -12
python -m pytest benchmarks --benchmark-only -q -p no:cacheprovider --benchmark-json "$OUT/bench.json" \
  --benchmark-columns=median,iqr,rounds 2>&1 | tee "$OUT/bench.log" | tail -20 || status=1
exit $status
