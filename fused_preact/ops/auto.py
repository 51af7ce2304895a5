"""``backend="auto"``: a measured, self-validating choice per chain signature.

On the first call of a signature (a plan-cache miss in :func:`fused_preact.ops.run.run_chain`;
the signature is that function's key: device, dtypes and autocast dtype, layout, shapes, BN modes),
:func:`decide`

1. lists the candidates — every backend of :data:`~fused_preact.ops.backends.BACKENDS` that can serve
   the input (``triton``, ``cuda`` where the extension is built, ``recompute``, and ``reference``, the
   unfused eager path);
2. validates each on the real input (:func:`fused_preact.ops.trial.run_trials`): one forward +
   backward on clones of the running buffers, outputs, input gradient, parameter gradients and running
   statistics against a float64 reference under the eager-relative rule
   (:mod:`fused_preact.ops.validate`). A failing candidate is excluded with a warning naming it and its
   error — the point of validating at first use is a GPU nobody tested;
3. times the valid ones (forward + backward, CUDA events, after warm-up: compilation and autotuning
   happen before timing);
4. takes the fastest — under ``memory="lean"`` the fastest of those that keep only the units' inputs
   for backward (the fused backends and ``recompute``, not the unfused path);
5. stores the decision in memory and on disk (JSON, :class:`~fused_preact.ops.triton.tuning.TuneCache`),
   keyed by the signature and the environment (device name and compute capability, driver, CUDA, cuDNN,
   torch, triton, this package's version and op-layer sources), so a second process reuses it without
   timing.

It never measures inside CUDA-graph capture or ``torch.compile`` tracing: there it takes a decision
this process (or, under capture, the disk cache) already holds, else the static priority, and says so
in ``fallback_reason``. Under ``torch.distributed`` every rank decides for itself, with no collective
(as ``torch.backends.cudnn.benchmark`` does): ranks reach a new signature at different calls (a batch
size of their own, an empty batch, a hook on one rank), where a collective would hang. The ranks'
winners may differ; each is validated on its rank, and no backend communicates (synchronized
statistics are computed before the chain, the same way for every backend; an eager fallback of the
module, e.g. a hook on one rank, uses torch's own exchange and must not meet a fused rank under
``nn.SyncBatchNorm``). A forced backend is never measured. Measurement is on for CUDA devices; tests
switch it on for the CPU with :func:`measuring` (and inject a timer).

Environment:
    ``FUSED_PREACT_DISPATCH``             ``measure`` (default) or ``priority`` (the static order of
                                          :data:`~fused_preact.ops.backends.PRIORITY`, nothing measured)
    ``FUSED_PREACT_DISPATCH_CACHE``       the decisions' folder (one JSON file per decision,
                                          :class:`~fused_preact.ops.triton.tuning.TuneCache`), or ``none`` (memory
                                          only). Default ``$XDG_CACHE_HOME/fused_preact/dispatch-<device>-triton<v>``
    ``FUSED_PREACT_DISPATCH_CANDIDATES``  comma-separated backend names allowed (default, or empty: all).
                                          It bounds every path: the candidates measured (one name: that
                                          backend, validated and timed alone), the static order under
                                          ``priority``, capture and compile tracing, and decisions are
                                          keyed on it. An unknown name raises ValueError. Read when a
                                          signature is first seen (modules keep their plans).

Sources: timing candidates at first use is ``torch.backends.cudnn.benchmark``'s and Inductor's
max-autotune's approach; validating them against a reference before trusting them is added here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from fused_preact.ops import backends as _backends
from fused_preact.ops._common import LRUDict
from fused_preact.ops.backends import BACKENDS, BackendChoice, ReferenceBackend, static_order
from fused_preact.ops.spec import BATCH, OP_FIELDS, BNMode, ChainSpec, ChainTensors
from fused_preact.ops.trial import Candidate, Timer, cuda_timer, host_timer, run_trials
from fused_preact.ops.triton.tuning import TuneCache, default_cache_path

__all__ = ["Decision", "Candidate", "MeasureSettings", "SETTINGS", "measuring", "decide", "traceable",
           "MEMORY_POLICIES", "check_memory", "decision_cache", "environment",
           "signature", "forget"]

logger = logging.getLogger("fused_preact")

ENV_MODE = "FUSED_PREACT_DISPATCH"
ENV_CACHE = "FUSED_PREACT_DISPATCH_CACHE"
ENV_CANDIDATES = "FUSED_PREACT_DISPATCH_CANDIDATES"
#: ``memory=`` policies: the fastest valid candidate, or the fastest that keeps only the units' inputs.
MEMORY_POLICIES = ("fastest", "lean")


@dataclasses.dataclass
class Decision:
    """What ``backend="auto"`` decided for one signature, and why.

    Attributes:
        signature: the signature in words (:func:`signature`). winner: the backend that runs.
        source: ``measured``; ``disk cache`` (a decision of an earlier process); ``process`` (another
            module of this process with the same signature); ``capture`` / ``compile`` (a held decision
            adopted where nothing may be measured); ``static`` (no decision could be made: see ``note``).
        memory: the policy. timed: ``forward+backward`` or ``forward``. candidates: :class:`Candidate`
            records (times in ms, validation errors). note: anything unusual, in words.
    """

    signature: str
    winner: str
    source: str
    memory: str = "fastest"
    timed: str = "forward+backward"
    candidates: list = dataclasses.field(default_factory=list)
    note: Optional[str] = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Decision":
        """The decision :meth:`to_json` wrote. Raises ValueError/TypeError/KeyError for anything else
        (a file from another version, or edited): a field of the wrong type, a missing one."""
        d = dict(d)
        d["candidates"] = [Candidate(**c) for c in d.get("candidates", [])]
        out = cls(**d)
        strs = (out.signature, out.winner, out.source, out.memory, out.timed)
        if not all(isinstance(v, str) for v in strs) or not isinstance(out.note, (str, type(None))):
            raise ValueError("a decision field is not a string")
        for c in out.candidates:
            if not (isinstance(c.name, str) and isinstance(c.lean, bool)
                    and (c.ms is None or (isinstance(c.ms, (int, float)) and not isinstance(c.ms, bool)))
                    and isinstance(c.valid, (bool, type(None))) and isinstance(c.errors, dict)
                    and isinstance(c.error, (str, type(None))) and isinstance(c.refused, (str, type(None)))):
                raise ValueError(f"candidate record {c.name!r} has a field of the wrong type")
        return out

    def winner_passed(self) -> bool:
        """Whether the decision's own records let its winner run: no record of it as refused or invalid."""
        return not any(c.name == self.winner and (c.refused or c.valid is False) for c in self.candidates)

    def summary(self) -> str:
        """One line: winner, source, each candidate's time or why it was not a candidate."""
        parts = []
        for c in self.candidates:
            if c.refused:
                parts.append(f"{c.name}: refused")
            elif c.valid is False:
                parts.append(f"{c.name}: INVALID ({c.error})")
            elif c.ms is not None:
                parts.append(f"{c.name} {c.ms:.3f} ms")
            else:
                parts.append(f"{c.name}: not run")
        text = f"{self.winner} [{self.source}, {self.memory}, {self.timed}]"
        text += (": " + ", ".join(parts)) if parts else ""
        return text + (f" ({self.note})" if self.note else "")


@dataclasses.dataclass
class MeasureSettings:
    """Where and how :func:`decide` measures.

    Attributes:
        devices: device types measured (default CUDA only; tests add ``"cpu"``).
        timer: a :data:`fused_preact.ops.trial.Timer` replacing the default (CUDA events on CUDA, the
            host clock elsewhere). warmup, reps: of the default timers.
    """

    devices: frozenset = frozenset({"cuda"})
    timer: Optional[Timer] = None
    warmup: int = 2
    reps: int = 5

    def timer_for(self, device: torch.device) -> Timer:
        if self.timer is not None:
            return self.timer
        if device.type == "cuda":
            return cuda_timer(self.warmup, self.reps)
        return host_timer(1, self.reps)


#: The process's measurement settings (see :func:`measuring`).
SETTINGS = MeasureSettings()
#: Decisions this process holds in memory, per table below (least recently used dropped first; the disk
#: cache keeps every decision).
MAX_DECISIONS = 1024
#: Decisions of this process by (run_chain signature, allowed candidates) (what torch.compile tracing may read).
_BY_KEY: LRUDict = LRUDict(MAX_DECISIONS)
#: The same decisions by device fingerprint and signature in words: plan keys finer than it (requires_grad, grad mode
#: beside the timed mode) share one decision in a process.
_BY_SIG: LRUDict = LRUDict(MAX_DECISIONS)


@contextlib.contextmanager
def measuring(devices: Sequence[str] = ("cpu", "cuda"), timer: Optional[Timer] = None,
              warmup: Optional[int] = None, reps: Optional[int] = None) -> Iterator[MeasureSettings]:
    """Measure on ``devices`` (e.g. the CPU, for tests; Triton kernels run there under the interpreter)
    with ``timer`` injected, inside the ``with`` block; the previous settings are restored after it."""
    global SETTINGS
    old = SETTINGS
    SETTINGS = MeasureSettings(frozenset(devices), timer, old.warmup if warmup is None else warmup,
                               old.reps if reps is None else reps)
    try:
        yield SETTINGS
    finally:
        SETTINGS = old


def forget() -> None:
    """Drop this process's decisions (the disk cache stays; modules keep their plans)."""
    _BY_KEY.clear()
    _BY_SIG.clear()
    _CACHES.clear()


def check_memory(memory: str) -> str:
    """``memory`` if it is a policy of :data:`MEMORY_POLICIES`.

    Raises:
        ValueError: another value.
    """
    if memory not in MEMORY_POLICIES:
        raise ValueError(f"fused_preact: memory={memory!r}; expected one of {list(MEMORY_POLICIES)}")
    return memory


# ------------------------------------------------------------------------------------ environment
def _nvml_driver() -> Optional[str]:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, 96) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (OSError, AttributeError):
        return None


def _cuda_driver_api() -> Optional[str]:
    try:
        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def _sources_sha() -> str:
    """sha256 (16 hex digits) of the op layer's Python sources: kernels, plans and dispatch."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def environment(device_type: str, index: Optional[int] = None) -> dict:
    """What a decision depends on besides the signature: device name and compute capability, driver
    (NVML's version, else the CUDA driver API's), CUDA runtime, cuDNN, torch, triton, this package's
    version and a hash of its op-layer sources, and whether Triton runs compiled or interpreted."""
    import fused_preact
    from fused_preact.ops._common import triton, triton_mode

    env = {"device": device_type, "torch": torch.__version__,
           "triton": getattr(triton, "__version__", None), "triton_mode": triton_mode(),
           "package": fused_preact.__version__, "sources": _sources_sha()}
    if device_type == "cuda":
        idx = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(idx)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   driver=_nvml_driver() or _cuda_driver_api() or "unknown", cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return env


def _fingerprint(device: torch.device) -> str:
    env = environment(device.type, device.index)
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:12]


_CACHES: dict[str, TuneCache] = {}


def decision_cache(device: torch.device) -> TuneCache:
    """The process's decision cache for ``device``'s kind (path from ``FUSED_PREACT_DISPATCH_CACHE``,
    ``none`` for memory only, else :func:`~fused_preact.ops.triton.tuning.default_cache_path`)."""
    env = os.environ.get(ENV_CACHE)
    name = environment(device.type, device.index)["device"]
    path = None if env == "none" else (env or default_cache_path(name, str(environment(device.type)["triton"]),
                                                                 prefix="dispatch"))
    key = f"{name}|{path}"
    if key not in _CACHES:
        _CACHES[key] = TuneCache(path)
    return _CACHES[key]


def signature(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...], cd: torch.dtype,
              out_stats: bool, memory: str, timed: str, candidates: Optional[frozenset] = None) -> str:
    """The decision's key in words: the chain (convs, shortcut, BN modes), the compute, input, residual
    and every parameter's and buffer's dtype (by slot), each BatchNorm's eps, the input's shape and
    layout, the statistics handoffs, policy, timed mode and the allowed candidates (``candidates``,
    None for all): everything the validation behind a decision depended on, so a decision is never
    served to a call it was not validated for."""
    from fused_preact.ops.library import encode_key

    rd = t.residual.dtype if t.residual is not None else None
    if x.is_contiguous():
        layout = "nchw"
    elif x.is_contiguous(memory_format=torch.channels_last):
        layout = "channels_last"
    else:
        layout = f"strides{tuple(x.stride())}"
    slots = [getattr(u, f) for f in OP_FIELDS for u in t.units] + [t.proj_weight]  # field by field
    params = ",".join("-" if v is None else str(v.dtype).replace("torch.", "") for v in slots)
    eps = ",".join(repr(float(u.eps)) for u in t.units)
    return (f"{encode_key(spec, modes, cd, rd)}|x{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}:{layout}"
            f"|params:{params}|eps:{eps}|in_stats:{int(t.in_stats is not None)}|out_stats:{int(out_stats)}"
            f"|memory:{memory}|{timed}" + (f"|candidates:{','.join(sorted(candidates))}" if candidates else ""))


# --------------------------------------------------------------------------------------- choosing
def _allowed() -> Optional[frozenset]:
    """The backend names ``FUSED_PREACT_DISPATCH_CANDIDATES`` allows (case-insensitive); None for all
    (unset, empty, or naming every backend: decisions are shared with unrestricted calls).

    Raises:
        ValueError: a name that is not a backend of :data:`~fused_preact.ops.backends.BACKENDS`.
    """
    names = frozenset(n.strip().lower() for n in os.environ.get(ENV_CANDIDATES, "").split(",") if n.strip())
    unknown = sorted(names - set(BACKENDS))
    if unknown:
        raise ValueError(f"fused_preact: {ENV_CANDIDATES} names unknown backends {unknown}; expected names of "
                         f"{list(BACKENDS)}")
    return names if names and names != set(BACKENDS) else None  # every backend: no restriction


def _restrict(static: BackendChoice, allowed: Optional[frozenset], memory: str, x: torch.Tensor, spec: ChainSpec,
              cd: torch.dtype) -> BackendChoice:
    """The static choice among the ``allowed`` backends: the first of the static order (then the other
    backends) that is allowed and serves the input; the unfused reference path, saying so, where none
    does (as where the allowed ones fail validation)."""
    if allowed is None or static.name in allowed:
        return static
    skipped: list[str] = []
    for name in dict.fromkeys((*static_order(memory), *BACKENDS)):
        if name in allowed:
            reasons = BACKENDS[name].not_supported_reasons(x, spec, cd)
            if not reasons:
                lean = () if memory != "lean" or BACKENDS[name].fused else (
                    "memory='lean': no allowed lean backend can serve this input",)
                return BackendChoice(BACKENDS[name], tuple(skipped) + lean)
            skipped.append(f"{name}: " + "; ".join(reasons))
    return BackendChoice(ReferenceBackend, static.skipped + (
        f"{ENV_CANDIDATES}: no allowed backend can serve this input ({'; '.join(skipped)}); the unfused eager "
        "path runs",))


def _candidates(x: torch.Tensor, spec: ChainSpec, cd: torch.dtype, allowed: Optional[frozenset]) -> list[Candidate]:
    out = []
    for name, cls in BACKENDS.items():
        if allowed is not None and name not in allowed:
            continue
        reasons = cls.not_supported_reasons(x, spec, cd)
        out.append(Candidate(name, lean=cls.lean,
                             refused="; ".join(reasons) if reasons else None))
    return out


def _static(static: BackendChoice, memory: str, x: torch.Tensor, spec: ChainSpec, cd: torch.dtype) -> BackendChoice:
    """The static choice under the memory policy: :data:`~fused_preact.ops.backends.LEAN_PRIORITY` for
    ``"lean"``."""
    if memory != "lean" or static.backend.fused:
        return static
    skipped: list[str] = []
    for name in static_order("lean"):
        reasons = BACKENDS[name].not_supported_reasons(x, spec, cd)
        if not reasons:
            extra = () if BACKENDS[name].fused else ("memory='lean': no lean backend can serve this input",)
            return BackendChoice(BACKENDS[name], tuple(skipped) + extra)
        skipped.extend(reasons)
    return static


def _pick(cands: list[Candidate], memory: str) -> tuple[Optional[str], Optional[str]]:
    """(winner, note): the fastest valid candidate, among the lean ones under ``memory="lean"``."""
    valid = [c for c in cands if c.valid and c.ms is not None]
    if not valid:
        return None, "no candidate passed validation"
    note = None
    if memory == "lean":
        lean = [c for c in valid if c.lean]
        if lean:
            valid = lean
        else:
            note = "memory='lean': no lean candidate passed validation; the fastest valid one runs"
    return min(valid, key=lambda c: c.ms).name, note


def _choice(d: Decision, skipped: tuple = ()) -> BackendChoice:
    """The decision's backend, its note (a policy it could not honour: no lean candidate valid, every
    allowed candidate invalid) as the reason."""
    return BackendChoice(BACKENDS[d.winner], tuple(skipped) + ((d.note,) if d.note else ()), d)


def _held(key, sig: str, x: torch.Tensor, eligible: set, disk: bool) -> Optional[Decision]:
    """A decision this process holds for ``key`` (run_chain's signature and the allowed candidates) or
    ``sig`` (or, with ``disk``, the disk cache for ``sig``) whose winner can still serve the input."""
    d = _BY_KEY.get(key) or _BY_SIG.get(f"{_fingerprint(x.device)}|{sig}")
    if d is not None and d.source == "measured":
        d = dataclasses.replace(d, source="process")
    if d is None and disk:
        hit = decision_cache(x.device).get(f"{_fingerprint(x.device)}|{sig}")
        if hit is not None:
            try:
                d = dataclasses.replace(Decision.from_json(hit), source="disk cache")
            except (TypeError, ValueError, KeyError) as e:
                logger.warning("fused_preact: ignoring an unreadable dispatch decision (%s)", e)
    runs = eligible | {ReferenceBackend.name}  # the unfused path: what a restriction whose backends all failed runs
    return d if d is not None and d.winner in runs and d.winner_passed() else None


def _measure(static: BackendChoice, spec, x, t, modes, cd, out_stats, memory, sig, timed, cands):
    """Run the trials; (decision, plan of the winner or None, conclusive)."""
    in_stats = t.in_stats is not None and modes[0].kind == BATCH
    rd = t.residual.dtype if t.residual is not None else None

    def make_plan(name):
        return BACKENDS[name].make_plan(spec, modes, x, cd, in_stats, out_stats, rd)

    runnable = [c for c in cands if c.refused is None]
    trials = run_trials(spec, x, t, modes, cd, runnable, make_plan, SETTINGS.timer_for(x.device),
                        timed == "forward+backward")
    if trials.inconclusive:
        return Decision(sig, static.name, "static", memory, timed, cands,
                        f"validation inconclusive: {trials.inconclusive}; static priority, not stored"), None, False
    for c in runnable:
        if c.valid is False:
            warnings.warn(f"fused_preact: backend {c.name!r} failed validation against float64 and is excluded from "
                          f"backend='auto' for this signature: {c.error}", RuntimeWarning, stacklevel=2)
    winner, note = _pick(cands, memory)
    if winner is None and not any(c.name == ReferenceBackend.name for c in runnable):  # the allowed ones failed: kept,
        return Decision(sig, ReferenceBackend.name, "measured", memory, timed, cands,  # as any verdict of validation
                        f"{note} ({ENV_CANDIDATES} leaves no other): the unfused eager path runs"), None, True
    if winner is None:  # eager itself failed: nothing can be trusted, run the static choice and say so
        return Decision(sig, static.name, "static", memory, timed, cands, note), None, False
    return Decision(sig, winner, "measured", memory, timed, cands, note), trials.plans.get(winner), True


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never for other devices)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def decide(static: BackendChoice, key, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...],
           cd: torch.dtype, out_stats: bool, memory: str = "fastest") -> tuple[BackendChoice, Optional[object]]:
    """``backend="auto"``'s choice for a new signature (see the module docstring).

    Args:
        static: the static priority's choice (:func:`fused_preact.ops.backends.select_backend`).
        key: :func:`fused_preact.ops.run.run_chain`'s signature of the call. spec, x, t, modes,
            cd, out_stats: the call (``cd`` its compute dtype). memory: ``"fastest"`` or ``"lean"``.

    Returns:
        ``(choice, plan)``: the :class:`~fused_preact.ops.backends.BackendChoice` (its ``decision`` the
        :class:`Decision`, None where nothing was decided beyond the static order) and the winner's plan
        when the trials built it (else None: the caller builds it).

    Raises:
        ValueError: unknown ``memory`` policy or ``FUSED_PREACT_DISPATCH`` value.
    """
    check_memory(memory)
    allowed = _allowed()
    key = (key, allowed)
    if torch.compiler.is_compiling():  # nothing measured, nothing read from disk while tracing
        d = _BY_KEY.get(key)
        if d is not None:
            return _choice(d), None
        choice = _restrict(_static(static, memory, x, spec, cd), allowed, memory, x, spec, cd)
        return BackendChoice(choice.backend, choice.skipped + (
            "torch.compile tracing: backend='auto' does not measure here and this process holds no decision for "
            "this signature (run it once eagerly first); static priority",)), None
    mode = (os.environ.get(ENV_MODE) or "measure").strip().lower()
    if mode not in ("measure", "priority"):
        raise ValueError(f"fused_preact: {ENV_MODE}={mode!r}; expected 'measure' or 'priority'")
    static = _restrict(_static(static, memory, x, spec, cd), allowed, memory, x, spec, cd)
    if mode == "priority" or x.device.type not in SETTINGS.devices:
        return static, None
    cands = _candidates(x, spec, cd, allowed)
    eligible = {c.name for c in cands if c.refused is None}
    if len(eligible) < (1 if allowed else 2):  # one allowed candidate is still validated before it runs
        return static, None
    timed = "forward+backward" if torch.is_grad_enabled() or any(m.kind == BATCH for m in modes) else "forward"
    sig = signature(spec, x, t, modes, cd, out_stats, memory, timed, allowed)
    if _capturing(x.device):
        d = _held(key, sig, x, eligible, disk=True)
        if d is not None:
            return _choice(dataclasses.replace(d, source="capture")), None
        return BackendChoice(static.backend, static.skipped + (
            "CUDA-graph capture: backend='auto' does not measure during capture and holds no decision for this "
            "signature (run a step before capturing); static priority",)), None
    plan = None
    d = _held(key, sig, x, eligible, disk=True)
    if d is None:
        d, plan, conclusive = _measure(static, spec, x, t, modes, cd, out_stats, memory, sig, timed, cands)
        if conclusive:
            decision_cache(x.device).put(f"{_fingerprint(x.device)}|{sig}", d.to_json())
    if d.source != "static":
        _BY_KEY[key] = d
        _BY_SIG[f"{_fingerprint(x.device)}|{sig}"] = d
        logger.info("fused_preact: auto for %s: %s", sig, d.summary())
        return _choice(d), plan
    return BackendChoice(static.backend, static.skipped + (d.note,), d), None


def traceable(choice: BackendChoice, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...],
              cd: torch.dtype) -> tuple[BackendChoice, Optional[object]]:
    """Under ``torch.compile``, the choice to trace in place of an ``auto`` decision whose backend does
    not run there (a backend without ``traceable``): the fastest valid traceable candidate of the
    decision (:data:`~fused_preact.ops.backends.TRACEABLE`), else the first traceable fused backend of
    the static order that serves and was not rejected, else the reference.
    Returns ``(choice, plan)`` (plan None for the reference); the choice's reason says what happened."""
    d = choice.decision
    allowed = _allowed()
    rejected = {c.name for c in (d.candidates if d else []) if c.valid is False}
    if allowed is not None:  # the restriction holds here too, but for the reference: something must trace
        rejected |= set(_backends.TRACEABLE) - allowed
    timed = sorted((c for c in (d.candidates if d else []) if c.valid and c.ms is not None
                    and c.name in _backends.TRACEABLE
                    and c.name not in rejected), key=lambda c: c.ms)
    if timed:
        name = timed[0].name
    else:
        name = next((n for n in dict.fromkeys((*static_order(), *BACKENDS)) if BACKENDS[n].traceable and BACKENDS[n].fused
                     and n not in rejected and not BACKENDS[n].not_supported_reasons(x, spec, cd)),
                    ReferenceBackend.name)
    reason = (f"torch.compile: {choice.name!r} does not run under torch.compile; tracing {name!r}"
              + (" (the fastest valid candidate that does)" if timed else ""))
    backend, plan = BACKENDS[name], None
    if backend.fused:
        in_stats = t.in_stats is not None and modes[0].kind == BATCH
        rd = t.residual.dtype if t.residual is not None else None
        plan = backend.make_plan(spec, modes, x, cd, in_stats, False, rd)
    return BackendChoice(backend, choice.skipped + (reason,), d), plan

