"""Check a benchmark results file against issue 20's GPU targets for ``backend="auto"``.

    python benchmarks/check_auto.py RESULTS.json [--min-speedup 0.98] [--max-lean-mem 0.6]

For every block (``fwd+bwd``) and model (``step``) entry of provider ``auto``: speedup vs eager ≥
``--min-speedup``; of provider ``auto-lean``: peak memory vs eager ≤ ``--max-lean-mem`` (the targets
are per block and training step, docs/dispatch.md; unit entries and other modes are not judged).
Prints one line per entry with the backends auto chose (from the entry's ``auto`` field) and exits 1
if any entry misses its target, 2 if the file has no such entries.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from fused_preact.bench.run import annotate

#: The (level, mode) pairs the targets are set for: a block's fwd+bwd, a model's training step.
JUDGED = (("block", "fwd+bwd"), ("model", "step"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("--min-speedup", type=float, default=0.98)
    p.add_argument("--max-lean-mem", type=float, default=0.6)
    a = p.parse_args(argv)
    with open(a.results) as f:
        obj = json.load(f)
    annotate(obj["results"])
    checked = failed = 0
    for e in obj["results"]:
        if e["provider"] not in ("auto", "auto-lean") or (e["level"], e["mode"]) not in JUDGED:
            continue
        runs = Counter(c["runs"] for c in e.get("auto", []))
        invalid = sorted({n for c in e.get("auto", []) for n, v in c["candidates"].items() if isinstance(v, str)})
        speed, mem = e.get("speedup_vs_eager"), e.get("mem_vs_eager")
        if e["provider"] == "auto":
            ok = speed is not None and speed >= a.min_speedup
            target = f"speedup {speed:.3f}× (≥ {a.min_speedup})" if speed is not None else "no eager entry"
        else:
            ok = mem is not None and mem <= a.max_lean_mem
            target = f"memory {mem:.3f}× eager (≤ {a.max_lean_mem})" if mem is not None else "no eager entry"
        checked += 1
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {e['level']:5s} {e['name']:40s} {e['provider']:9s} {target}; "
              f"runs {dict(runs)}" + (f"; invalid: {', '.join(invalid)}" if invalid else ""))
    if not checked:
        print("no auto / auto-lean block fwd+bwd or model step entries in", a.results)
        return 2
    print(f"{checked - failed} of {checked} entries meet their targets")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
