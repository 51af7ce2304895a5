"""Main-loop limits of ``--check`` and their ratchet baseline.

Limits (on the main loop of :func:`tools.static_report.sass.loop_metrics`), per launch *variant* — kind,
kernel, variant string, dtype and arch, over the layers that launch it:

    Triton fprop/dgrad/wgrad (and their ``_proj`` launches), bf16/fp16, sm_90:
        issue ratio ≤ 1.0; no ``WARPGROUP.DEPBAR.LE gsb0, 0`` in the loop; no integer division by a
        run-time value in the loop; ≤ 2 BAR.SYNC/BAR.RED per iteration
    the same on sm_80: issue ratio ≤ 1.0
    fp32 (TF32): none (reported only)
    CUDA C++ (``--cubins``) sm_90 functions with an MMA loop, by the cubin's name: fprop and wgrad
        issue ratio ≤ 0.6, dgrad ≤ 0.3

A variant meets a limit when its default config does and, for every layer (a conv of a block: an
entry's ``shapes`` name both, so two convs of one block that launch one variant are two layers), at
least one autotune candidate does (the tuner can pick it). Figures per variant and limit: ``default`` = the worst figure
over the compilations whose role is ``default`` (entries without roles count as defaults);
``candidate`` = over the layers, the worst of each layer's best candidate (None without candidates).
Both only grow when more layers are added, so a run restricted to some layers never reports a larger
figure than the full run.

One-step launches (:func:`one_step`: a 1×1 whose reduction fits one iteration of the loop — one
``BLOCK_K`` step, or fprop's two unrolled ones — and its projection's one step, launched with the
kernel's ``STEPS`` > 0) have no main loop: their trip counts are constants and Triton folds the loops
away. There is no steady state to hold to these limits — such a
kernel loads its operands once, and its time is its loads, one batch of MMAs and the epilogue — so
they add no figure to ``default``, and a layer with a one-step candidate has a candidate that meets
every limit. A compilation that declares STEPS and still has a loop is judged like any other.

Ratchet: the kernels do not meet the limits yet, so the offending figures of today are committed in
a baseline file (:data:`DEFAULT_BASELINE`). ``--check`` fails on an offending (variant, limit, side)
the baseline does not list, and on one whose figure exceeds the baseline's by more than
:data:`TOLERANCE` (relative); it notes baselined figures that improved, which
``--update-loop-baseline`` then writes (:func:`update_baseline`), so the baseline only shrinks as the
kernels improve.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["LoopLimit", "limits_for", "variant_key", "one_step", "loop_figures", "check_loops", "update_baseline",
           "load_baseline", "write_baseline", "TOLERANCE", "DEFAULT_BASELINE", "NEWEST_TRITON", "default_baseline"]

#: Relative growth of a baselined figure that ``--check`` tolerates (code motion between compilers).
TOLERANCE = 0.02
#: The committed baseline of today's offenders under the newest Triton (:data:`NEWEST_TRITON`).
DEFAULT_BASELINE = Path(__file__).resolve().parent / "loop_baseline.json"
#: The Triton release whose loops the limits hold under :data:`DEFAULT_BASELINE`; older releases compile
#: the same kernels to other loops and have baselines of their own (:func:`default_baseline`).
NEWEST_TRITON = (3, 9)


def default_baseline(version: Optional[tuple] = None) -> Path:
    """The loop baseline of Triton ``version`` ((major, minor); default: the running one):
    :data:`DEFAULT_BASELINE` from :data:`NEWEST_TRITON` on, ``loop_baseline.triton<major>.<minor>.json``
    beside it for older releases (missing: an empty baseline, so every offender fails ``--check``)."""
    if version is None:
        from fused_preact.ops.triton_compat import TRITON_VERSION

        version = TRITON_VERSION
    major, minor = version[:2]
    if (major, minor) >= NEWEST_TRITON:
        return DEFAULT_BASELINE
    return DEFAULT_BASELINE.with_name(f"loop_baseline.triton{major}.{minor}.json")
_FAMILIES = ("fprop", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class LoopLimit:
    """One limit: ``figure`` (name of the figure of a main loop, :data:`FIGURES`) ≤ ``limit``."""

    figure: str
    limit: float

    def describe(self) -> str:
        return {"issue_ratio": f"issue ratio ≤ {self.limit:g}", "wait_depth0": "no wgmma wait at depth 0",
                "int_div": "no integer division", "bar_sync": f"≤ {self.limit:g} BAR.SYNC per iteration"}[self.figure]


#: Figures of a main loop (``loop`` of an entry), larger is worse.
FIGURES: dict[str, Callable[[dict], Optional[float]]] = {
    "issue_ratio": lambda lp: lp["issue_ratio"],
    "wait_depth0": lambda lp: sum(1 for w in lp["wgmma_waits"] if w == 0),
    "int_div": lambda lp: lp["int_div"],
    "bar_sync": lambda lp: lp["bar_sync"],
}
_SM90_16BIT = (LoopLimit("issue_ratio", 1.0), LoopLimit("wait_depth0", 0), LoopLimit("int_div", 0),
               LoopLimit("bar_sync", 2))
_SM80_16BIT = (LoopLimit("issue_ratio", 1.0),)
_CSRC_SM90 = {"fprop": (LoopLimit("issue_ratio", 0.6),), "wgrad": (LoopLimit("issue_ratio", 0.6),),
              "dgrad": (LoopLimit("issue_ratio", 0.3),)}


def _family(e: dict) -> Optional[str]:
    if e["kind"] == "triton":
        fam = e["kernel"].split("_")[0]
        return fam if fam in _FAMILIES else None
    if e["kind"] == "csrc":
        m = re.search(r"(fprop|dgrad|wgrad)", e.get("config", ""))
        return m.group(1) if m else None
    return None


def limits_for(e: dict) -> tuple[LoopLimit, ...]:
    """The main-loop limits that apply to report entry ``e`` (module docstring); () for none."""
    fam = _family(e)
    if fam is None:
        return ()
    if e["kind"] == "triton" and e.get("dtype") in ("bf16", "fp16"):
        return {"sm_90": _SM90_16BIT, "sm_80": _SM80_16BIT}.get(e["arch"], ())
    if e["kind"] == "csrc" and e["arch"] == "sm_90" and e.get("mma"):
        return _CSRC_SM90[fam]
    return ()


def variant_key(e: dict) -> str:
    """``triton fprop [3x3s1 STATS] bf16 sm_90``; ``csrc sm90_conv_fprop.sm_90a.cubin <kernel> bf16 sm_90``
    (a CUDA C++ kernel by its short name without the ``#n`` that tells same-named functions apart:
    those of one dtype are one variant, whatever their order in the cubin)."""
    if e["kind"] == "csrc":
        return f"csrc {e['config']} {e['kernel'].split('#')[0]} {e.get('dtype', '')} {e['arch']}"
    return f"{e['kind']} {e['kernel']} [{e.get('variant', '')}] {e.get('dtype', '')} {e['arch']}"


def one_step(e: dict) -> bool:
    """Whether report entry ``e`` is a one-step launch without a main loop (module docstring): its
    ``STEPS`` constexpr is a positive count and its SASS has no MMA loop."""
    steps = str(e.get("constexprs", {}).get("STEPS", "0"))
    return steps.isdigit() and int(steps) > 0 and e.get("loop") is None


def _worst_of_layer_bests(cands: Sequence[dict], fig: Callable[[dict], float]) -> Optional[float]:
    layers: dict[str, float] = {}
    for e in cands:
        v = 0.0 if one_step(e) else fig(e)
        for s in e.get("shapes") or [""]:
            layers[s] = min(layers.get(s, v), v)
    return max(layers.values()) if layers else None


def loop_figures(entries: Sequence[dict]) -> tuple[dict[str, dict], list[str]]:
    """(figures, problems). figures: ``{variant_key: {figure: {"limit", "default", "candidate"}}}`` for
    every variant with limits (module docstring for the sides; one-step launches count as candidates
    that meet every limit, and add nothing to ``default``, which is None where every default is one).
    problems: entries with limits that cannot be judged (no main loop and not one-step, or MMAs the
    model does not cover), which ``--check`` fails outright."""
    groups: dict[str, list[dict]] = defaultdict(list)
    problems = []
    for e in entries:
        if "error" in e or not limits_for(e):
            continue
        lp = e.get("loop")
        if one_step(e):
            groups[variant_key(e)].append(e)
            continue
        if lp is None or lp["issue_ratio"] is None:
            why = "no main loop with tensor-core instructions" if lp is None else "MMAs the model does not cover"
            problems.append(f"{variant_key(e)} [{e.get('config')}]: {why}")
            continue
        groups[variant_key(e)].append(e)
    out: dict[str, dict] = {}
    for key, es in groups.items():
        defaults = [e for e in es if (not e.get("roles") or "default" in e["roles"]) and not one_step(e)]
        cands = [e for e in es if "candidate" in e.get("roles", ())]
        out[key] = {}
        for lim in limits_for(es[0]):
            fig = lambda e, f=FIGURES[lim.figure]: f(e["loop"])
            out[key][lim.figure] = {"limit": lim.limit, "default": max((fig(e) for e in defaults), default=None),
                                    "candidate": _worst_of_layer_bests(cands, fig)}
    return out, problems


def offences(figures: dict[str, dict]) -> dict[str, dict[str, dict[str, float]]]:
    """The sides over their limit: ``{variant_key: {figure: {side: value}}}`` (side ``default`` or
    ``candidate``); the baseline file's ``offenders`` has this form."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, figs in figures.items():
        for name, f in figs.items():
            for side in ("default", "candidate"):
                if f[side] is not None and f[side] > f["limit"]:
                    out.setdefault(key, {}).setdefault(name, {})[side] = f[side]
    return out


def load_baseline(path: Path) -> dict:
    """The baseline file (``{"tolerance", "offenders"}``); an empty one if ``path`` does not exist."""
    return json.loads(path.read_text()) if path.is_file() else {"tolerance": TOLERANCE, "offenders": {}}


def write_baseline(path: Path, baseline: dict) -> None:
    """Write ``baseline`` with one line per variant (diffs line up by variant)."""
    offenders = baseline["offenders"]
    lines = [f"  {json.dumps(k)}: {json.dumps(offenders[k], sort_keys=True)}" for k in sorted(offenders)]
    head = {k: v for k, v in baseline.items() if k != "offenders"}
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in head.items())
    path.write_text("{\n" + body + ',\n "offenders": {\n' + ",\n".join(lines) + "\n }\n}\n")


def check_loops(entries: Sequence[dict], baseline: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of the main-loop limits against ``baseline`` (:func:`load_baseline`).

    problems: entries that cannot be judged, offending sides the baseline does not list, and listed
    ones whose figure grew by more than the baseline's ``tolerance`` (relative). notes: one line per
    listed side, in a variant of this run, that now meets its limit or improved by more than the
    tolerance (``--update-loop-baseline`` would shrink the baseline)."""
    figures, problems = loop_figures(entries)
    tol = float(baseline.get("tolerance", TOLERANCE))
    base = baseline.get("offenders", {})
    notes = []
    now = offences(figures)
    for key, figs in sorted(now.items()):
        for name, sides in figs.items():
            lim = figures[key][name]["limit"]
            for side, value in sides.items():
                old = base.get(key, {}).get(name, {}).get(side)
                what = f"{key}: {side} config{'s' if side == 'candidate' else ''} {name} {value:g} (limit {lim:g})"
                if old is None:
                    problems.append(f"{what}, not in the baseline")
                elif value > old * (1 + tol) + 1e-9:
                    problems.append(f"{what}, worse than the baseline's {old:g}")
    for key in sorted(set(base) & set(figures)):
        for name, sides in base[key].items():
            for side, old in sides.items():
                value = now.get(key, {}).get(name, {}).get(side)
                if value is None:
                    notes.append(f"{key}: {side} {name} now meets its limit (baseline {old:g})")
                elif value < old * (1 - tol):
                    notes.append(f"{key}: {side} {name} {value:g}, better than the baseline's {old:g}")
    return problems, notes


def update_baseline(entries: Sequence[dict], baseline: dict) -> tuple[dict, list[str]]:
    """(new baseline, changes): the variants of this run get this run's offending figures (or leave
    the baseline when they meet every limit); variants the run did not cover keep their lines."""
    figures, _ = loop_figures(entries)
    now = offences(figures)
    old = baseline.get("offenders", {})
    new = {k: v for k, v in old.items() if k not in figures}
    new.update(now)
    changes = [f"- {k}" for k in sorted(set(old) - set(new))] + [f"+ {k}" for k in sorted(set(new) - set(old))]
    changes += [f"~ {k}" for k in sorted(set(new) & set(old)) if new[k] != old[k]]
    out = {k: v for k, v in baseline.items() if k != "offenders"}
    out.setdefault("tolerance", TOLERANCE)
    out["offenders"] = new
    return out, changes
