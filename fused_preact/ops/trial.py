"""Trials of ``backend="auto"``'s candidates on one chain call: each candidate runs once on the real
input and is validated against a float64 reference under the eager-relative rule
(:mod:`fused_preact.ops.validate`), then the valid ones are timed (forward + backward).

Everything here runs on detached aliases of the call's tensors and on clones of the running buffers,
so the module's state and the caller's autograd graph are untouched: the call itself runs afterwards,
once, with the chosen backend. Used by :func:`fused_preact.ops.auto.decide` on a plan-cache miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable, Optional

import torch

from fused_preact.ops.chain import ChainFunction, reference_chain
from fused_preact.ops.spec import BATCH, CHAIN_FIELDS, GRAD_FIELDS, BNMode, ChainSpec, ChainTensors, chain_shapes
from fused_preact.ops.validate import eager_floor, rel_l2, rule_violations

__all__ = ["Candidate", "Trials", "run_trials", "cuda_timer", "host_timer", "slot_names"]

#: ``timer(name, run, device) -> ms``: the time of one ``run()`` (forward + backward of candidate
#: ``name``), after whatever warm-up the timer does.
Timer = Callable[[str, Callable[[], None], torch.device], float]


@dataclasses.dataclass
class Candidate:
    """One candidate's record in a decision.

    Attributes:
        name: backend name. lean: saves only the units' inputs and per-channel vectors (the fused
            backends; the unfused reference also keeps the BN and ReLU outputs).
        ms: median time of forward + backward (or forward alone, see ``Decision.timed``); None when
            not timed. valid: passed validation (None: not run). errors: per compared tensor,
            ``[its relative L2 error, eager's]`` against float64. error: why it is not valid (the
            tensors breaking the rule, or the exception it raised). refused: why it cannot serve the
            input at all (``not_supported_reasons``).
    """

    name: str
    lean: bool = True
    ms: Optional[float] = None
    valid: Optional[bool] = None
    errors: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None
    refused: Optional[str] = None


@dataclasses.dataclass
class Trials:
    """Outcome of :func:`run_trials`: the candidates' records (in the order given), the plans built for
    them (name → plan; the reference has none), and ``inconclusive``: why nothing could be validated
    (non-finite values in the float64 reference), else None."""

    candidates: list
    plans: dict
    inconclusive: Optional[str] = None


def slot_names(n: int) -> list[str]:
    """Names of the entries of :meth:`ChainTensors.flatten` (the differentiable tensors) for an
    ``n``-unit chain."""
    return [f"{k}{i}" for i in range(n) for k in GRAD_FIELDS] + list(CHAIN_FIELDS)


def cuda_timer(warmup: int = 2, reps: int = 5) -> Timer:
    """A :data:`Timer` with CUDA events: ``warmup`` untimed runs (compilation and autotuning happen in
    the validation run before), then the median of ``reps`` runs each between two events."""
    def timer(name: str, run: Callable[[], None], device: torch.device) -> float:
        for _ in range(warmup):
            run()
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return float(statistics.median(s.elapsed_time(e) for s, e in events))
    return timer


def host_timer(warmup: int = 1, reps: int = 3) -> Timer:
    """A :data:`Timer` on the host clock (``time.perf_counter``): for CPU measurement mode."""
    def timer(name: str, run: Callable[[], None], device: torch.device) -> float:
        for _ in range(warmup):
            run()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(times))
    return timer


# --------------------------------------------------------------------------------------- copies
def _leaf(v: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    if v is None:
        return None
    v = v.detach()
    if dtype is not None and v.is_floating_point():
        v = v.to(dtype)
    elif v.is_inference():
        v = v.clone()
    return v.requires_grad_() if v.is_floating_point() else v


def _buffer(v: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    if v is None:
        return None
    v = v.detach().clone()
    return v.to(dtype) if dtype is not None and v.is_floating_point() else v


def _copy(t: ChainTensors, dtype: Optional[torch.dtype] = None) -> tuple[ChainTensors, list]:
    """(a copy of ``t`` whose differentiable slots are fresh leaves — aliases of the call's tensors, or
    casts to ``dtype`` — and whose running buffers and counters are clones, the leaves in slot order)."""
    leaves = [_leaf(v, dtype) for v in t.flatten()]
    c = t.unflatten(leaves)
    units = [dataclasses.replace(u, running_mean=_buffer(u.running_mean, dtype), running_var=_buffer(u.running_var, dtype),
                                 num_batches=_buffer(u.num_batches)) for u in c.units]
    c = dataclasses.replace(c, units=units, in_stats=t.in_stats if dtype is None else None)
    return c, leaves


# ------------------------------------------------------------------------------------------ runs
def _forward(plan, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes):
    if plan is None:
        res = reference_chain(spec, x, t, modes)
        return res.out, res.proj_out
    if not torch.is_grad_enabled():
        fwd = plan.forward(x, t)
        return fwd.out, fwd.proj_out
    outs = ChainFunction.apply(plan, t, x, *t.flatten())
    outs = outs if isinstance(outs, tuple) else (outs,)
    proj = outs[1] if spec.proj is not None and spec.proj_out == "return" else None
    return outs[0], proj


def _run(plan, spec, x, t, modes, dy, dy_proj, leaves, backward: bool):
    """One forward (+ backward): (out, proj_out, {slot index or "x": grad})."""
    with contextlib.nullcontext() if backward else torch.no_grad():
        out, proj = _forward(plan, spec, x, t, modes)
    if not backward:
        return out, proj, {}
    outs, gouts = [out], [dy]
    if proj is not None:
        outs.append(proj)
        gouts.append(dy_proj)
    want = [("x", x)] + [(j, v) for j, v in enumerate(leaves) if v is not None and v.requires_grad]
    got = torch.autograd.grad(outs, [v for _, v in want], gouts, allow_unused=True)
    return out, proj, {k: g for (k, _), g in zip(want, got)}


def _results(spec: ChainSpec, modes, out, proj, grads: dict, t: ChainTensors) -> dict[str, torch.Tensor]:
    """Named tensors of one run: outputs, gradients (by slot name), updated running buffers."""
    names = slot_names(len(spec.convs))
    res = {"out": out}
    if proj is not None:
        res["proj_out"] = proj
    for k, g in grads.items():
        if g is not None:
            res["dx" if k == "x" else names[k]] = g
    for i, m in enumerate(modes):
        if m.update:
            res[f"running_mean{i}"] = t.units[i].running_mean
            res[f"running_var{i}"] = t.units[i].running_var
    return res


def _errors(got: dict, ref: dict, scales: dict) -> dict[str, float]:
    errs = {}
    for name, r in ref.items():
        g = got.get(name)
        errs[name] = rel_l2(g if g is not None else torch.zeros_like(r), r, scales.get(name, 0.0))
    return errs


def _counters(t: ChainTensors, ref: ChainTensors) -> list[str]:
    bad = []
    for i, (a, b) in enumerate((u.num_batches, r.num_batches) for u, r in zip(t.units, ref.units)):
        if a is not None and int(a) != int(b):
            bad.append(f"num_batches_tracked{i}: {int(a)} != {int(b)}")
    return bad


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------------------------------------- trials
def _out_shapes(spec: ChainSpec, x: torch.Tensor) -> tuple[tuple, Optional[tuple]]:
    out = tuple(chain_shapes(spec, tuple(x.shape))[-1])
    proj = None
    if spec.proj is not None and spec.proj_out == "return":
        proj = (x.shape[0], spec.proj.out_channels, *spec.proj.out_hw(x.shape[2], x.shape[3]))
    return out, proj


def run_trials(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...], cd: torch.dtype,
               candidates: list, make_plan: Callable[[str], object], timer: Timer, backward: bool,
               seed: int = 0) -> Trials:
    """Validate and time ``candidates`` (:class:`Candidate` records of backends that can serve the call)
    on the chain call ``(spec, x, t, modes)`` whose compute dtype is ``cd``; fills their ``valid``,
    ``errors``, ``error`` and ``ms`` in place.

    Validation: the float64 reference (:func:`fused_preact.ops.chain.reference_chain` on float64 copies,
    autocast off), eager (the same function in the call's dtype and autocast: the unfused path) and every
    candidate run forward + backward once with the same output gradient (normal, from a generator seeded
    with ``seed``). Each candidate's output(s), input gradient, parameter gradients and updated running
    statistics must meet the eager-relative rule against float64 (:func:`rule_violations`, floor
    :func:`eager_floor` of ``cd``; TF32's where fp32 convolutions may use it), and ``num_batches_tracked``
    must match exactly. A candidate that raises is not valid (its error is recorded); the ``reference``
    candidate is eager itself and always valid.

    Timing: each valid candidate's forward + backward (forward alone unless ``backward``) by ``timer``.
    ``make_plan(name)`` builds a candidate's plan (None for the reference).

    Raises:
        whatever eager's own run raises (the call itself would raise it too).
    """
    dev = x.device
    plans: dict = {}
    out_shape, proj_shape = _out_shapes(spec, x)
    with torch.inference_mode(False), torch.enable_grad():
        x_src = x.clone() if x.is_inference() else x
        gen = torch.Generator(device=dev).manual_seed(seed)
        dy = torch.randn(out_shape, generator=gen, device=dev, dtype=torch.float64)
        dyp = torch.randn(proj_shape, generator=gen, device=dev, dtype=torch.float64) if proj_shape else None
        with torch.autocast(dev.type, enabled=False):
            t64, leaves64 = _copy(t, torch.float64)
            ref = _results(spec, modes, *_run(None, spec, _leaf(x_src, torch.float64), t64, modes, dy, dyp, leaves64,
                                              True), t64)
        del leaves64
        bad = [k for k, v in ref.items() if not bool(torch.isfinite(v).all())]
        if bad:
            return Trials(candidates, plans, f"non-finite values in the float64 reference ({', '.join(bad)})")
        scales = {}
        for i in range(len(spec.convs) - 1):  # a conv bias feeding a batch-statistics BN has gradient ~0
            if modes[i + 1].kind == BATCH and f"bias{i}" in ref and f"weight{i}" in ref:
                scales[f"bias{i}"] = ref[f"weight{i}"].norm().item()
        tf32 = cd == torch.float32 and dev.type == "cuda" and torch.backends.cudnn.allow_tf32
        floor = eager_floor(cd, tf32)
        dy_c, dyp_c = dy.to(_eager_out_dtype(spec, x, t, cd)), dyp.to(cd) if dyp is not None else None
        del dy, dyp

        def once(plan):
            tc, leaves = _copy(t)
            xl = _leaf(x_src)
            out, proj, grads = _run(plan, spec, xl, tc, modes, dy_c, dyp_c, leaves, True)
            errs = _errors(_results(spec, modes, out, proj, grads, tc), ref, scales)
            return errs, _counters(tc, t64), (plan, tc, xl, leaves)

        eager_err, eager_problems, eager_run = once(None)  # the rule's yardstick: eager's own errors
        runs: dict = {}
        for c in candidates:
            try:
                plan = make_plan(c.name)
                if plan is None:  # the unfused backend: eager itself
                    errs, problems, runs[c.name] = eager_err, eager_problems, eager_run
                else:
                    plans[c.name] = plan
                    errs, problems, runs[c.name] = once(plan)
                    problems += rule_violations(errs, eager_err, floor)
                c.errors = {k: [v, eager_err.get(k)] for k, v in errs.items()}
                c.valid, c.error = not problems, "; ".join(problems) or None
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is not a candidate
                c.valid, c.error = False, _short(e)
                runs.pop(c.name, None)
        for c in candidates:
            if not c.valid:
                continue
            plan, tc, xl, leaves = runs[c.name]

            def step(plan=plan, tc=tc, xl=xl, leaves=leaves):
                _run(plan, spec, xl, tc, modes, dy_c, dyp_c, leaves, backward)

            try:
                c.ms = float(timer(c.name, step, dev))
            except Exception as e:  # noqa: BLE001
                c.valid, c.error = False, f"timing: {_short(e)}"
    return Trials(candidates, plans)


def _eager_out_dtype(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, cd: torch.dtype) -> torch.dtype:
    """The output dtype eager produces for this call: the compute dtype, promoted with a residual's."""
    res = {"input": x.dtype, "tensor": t.residual.dtype if t.residual is not None else None}.get(spec.residual)
    return torch.promote_types(cd, res) if res is not None else cd
