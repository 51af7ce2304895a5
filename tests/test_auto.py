"""backend="auto" measured and validated per signature (fused_preact.ops.auto): the decision with an
injected timer, validation rejecting a wrong candidate, the memory policy, the disk cache reused by a
second process, per-rank decisions over gloo, no measuring under CUDA-graph capture or
torch.compile, the static order on request, and the reports.

Measuring is on for CUDA devices only; these tests switch it on for the CPU (``auto.measuring``),
where the Triton kernels run under the interpreter and an injected timer stands in for CUDA events.
On a GPU the same tests run with the device's own kernels (the wrong-candidate test with real timing).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import DEVICE
from helpers import assert_close

from fused_preact import FusedBNReLUConv2d, FusedPreActBlock, FusedPreActBottleneck, dispatch_report
from fused_preact.dispatch import set_memory_policy
from fused_preact.models import PreActBlock
from fused_preact.ops import auto
from fused_preact.ops.backends import BACKENDS, RecomputeBackend
from fused_preact.ops.recompute.plan import RecomputePlan
from fused_preact.ops.triton.tuning import TuneCache, _entry_file
from fused_preact.ops.validate import EAGER_FLOOR, rule_violations

ROOT = Path(__file__).resolve().parents[1]
TIMES = {"triton": 3.0, "recompute": 2.0, "reference": 2.5, "cuda": 1.0, "wrong": 0.5}


class Timer:
    """Injected timer: ``times[name]`` ms; records which candidates it was asked to time (and, with
    ``run``, runs each once, as a real timer would)."""

    def __init__(self, times=None, run=True):
        self.times = dict(TIMES if times is None else times)
        self.calls: list[str] = []
        self.run = run

    def __call__(self, name, run, device):
        self.calls.append(name)
        if self.run:
            run()
        return self.times[name]


def _forbidden(name, run, device):
    raise AssertionError(f"measured {name} where nothing may be measured")


@pytest.fixture(autouse=True)
def _measure_env(monkeypatch, tmp_path):
    """Measuring on (conftest defaults to the static order), decisions into a fresh file, none held."""
    monkeypatch.setenv("FUSED_PREACT_DISPATCH", "measure")
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CACHE", str(tmp_path / "dispatch"))
    monkeypatch.delenv("FUSED_PREACT_DISPATCH_CANDIDATES", raising=False)
    auto.forget()
    yield
    auto.forget()


def _block(cls=FusedPreActBottleneck, args=(8, 4, 2), seed=0, **kw):
    torch.manual_seed(seed)
    m = cls(*args, **kw).to(DEVICE)
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_(0.0, 0.5)
    return m


def _x(c=8, seed=1, n=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, 6, 6, generator=g) + 0.5).to(DEVICE).requires_grad_()


def _decision(m):
    (choice, _), = m._plans.values()
    return choice.decision


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# -------------------------------------------------------------------------------------- deciding
def test_a_finer_plan_key_reuses_the_process_decision():
    """Calls that differ only in what the plan key adds to the decision's signature (here x's
    requires_grad) reuse this process's decision, labelled ``process``, with nothing measured."""
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        m(_x()).sum().backward()
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        x = _x().detach()
        m(x).sum().backward()
    sources = sorted(c.decision.source for c, _ in m._plans.values())
    assert sources == ["measured", "process"]


def test_a_forward_only_decision_is_not_reused_for_training_steps():
    """An eval module first called under no_grad is decided on forward times; its first call with
    autograd is another signature (grad mode is in the plan key), decided on forward+backward."""
    m = _block().eval()
    with auto.measuring(devices=(DEVICE,), timer=Timer({"triton": 1.0, "recompute": 2.0, "reference": 3.0})):
        with torch.no_grad():
            m(_x())
    assert m.last_backend == "triton" and _decision(m).timed == "forward"
    timer = Timer({"triton": 3.0, "recompute": 1.0, "reference": 2.0})
    with auto.measuring(devices=(DEVICE,), timer=timer):
        m(_x()).sum().backward()
    assert sorted(timer.calls) == ["recompute", "reference", "triton"]
    assert m.last_backend == "recompute"
    assert sorted(c.decision.timed for c, _ in m._plans.values()) == ["forward", "forward+backward"]


def test_fastest_valid_candidate_wins_and_state_changes_once():
    timer = Timer()
    m, twin = _block(), _block(backend="recompute")
    x = _x()
    with auto.measuring(devices=(DEVICE,), timer=timer):
        y = m(x)
    y.sum().backward()
    assert m.last_backend == "recompute" and m.fallback_reason is None
    d = _decision(m)
    assert d.source == "measured" and d.winner == "recompute" and d.timed == "forward+backward"
    by = {c.name: c for c in d.candidates}
    assert set(timer.calls) == {"triton", "recompute", "reference"}  # cuda: refused (no extension)
    assert by["cuda"].refused and by["cuda"].ms is None
    assert all(by[n].valid and by[n].ms == TIMES[n] for n in ("triton", "recompute", "reference"))
    assert set(by["triton"].errors) >= {"out", "dx", "weight0", "gamma1", "proj_weight", "running_var2"}
    # the module's state changed exactly once, as one call of the winner changes it
    ref = twin(_x())
    ref.sum().backward()
    for k, v in _state(twin).items():
        assert torch.equal(_state(m)[k], v), k
    assert int(m.bn1.num_batches_tracked) == 1
    assert_close(y, ref.double(), torch.float32, "output")
    # a second call, and a second module of the same signature, decide nothing again
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m(_x())
        other = _block()
        other(_x())
    assert other.last_backend == "recompute" and _decision(other).source == "process"


def test_lean_policy_takes_the_fastest_lean_candidate():
    timer = Timer({"triton": 3.0, "recompute": 2.0, "reference": 1.0}, run=False)
    fast, lean = _block(), _block(memory="lean")
    with auto.measuring(devices=(DEVICE,), timer=timer):
        fast(_x())
        lean(_x())
    assert fast.last_backend == "reference"
    assert lean.last_backend == "recompute" and _decision(lean).memory == "lean"
    set_memory_policy(fast, "lean")
    with auto.measuring(devices=(DEVICE,), timer=timer):
        fast(_x())
    assert fast.last_backend == "recompute"
    with pytest.raises(ValueError, match="memory='tiny'"):
        FusedPreActBlock(4, 4, memory="tiny")


class _PerturbedPlan(RecomputePlan):
    """A wrong kernel: the recompute plan with its input gradient off by 5%."""

    def backward(self, *args, **kwargs):
        g = super().backward(*args, **kwargs)
        if g.dx is not None:
            g.dx.mul_(1.05)
        return g


class WrongBackend(RecomputeBackend):
    name = "wrong"

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return _PerturbedPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, residual_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_validation_rejects_a_wrong_candidate(monkeypatch, dtype):
    """A registered backend whose dx is 5% off is excluded with a warning naming it and its error,
    however fast it is; the next fastest valid candidate runs. On a GPU the candidates are timed for
    real (the wrong one would win on speed alone only by chance; validation decides regardless)."""
    monkeypatch.setitem(BACKENDS, "wrong", WrongBackend)
    timer = Timer() if DEVICE == "cpu" else None
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=timer), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype != torch.float32):
            m(_x()).float().sum().backward()
    d = _decision(m)
    wrong = {c.name: c for c in d.candidates}["wrong"]
    assert wrong.valid is False and "dx:" in wrong.error and wrong.ms is None
    assert m.last_backend != "wrong"
    if DEVICE == "cpu":
        assert m.last_backend == "recompute" and "wrong" not in timer.calls
    msgs = [str(w.message) for w in caught if "failed validation" in str(w.message)]
    assert len(msgs) == 1 and "'wrong'" in msgs[0] and "dx:" in msgs[0]
    assert "INVALID" in str(dispatch_report(m))


def test_eager_relative_rule_can_fail():
    assert rule_violations({"dx": 3e-2}, {"dx": 1e-3}, EAGER_FLOOR[torch.bfloat16])
    assert not rule_violations({"dx": 9e-3}, {"dx": 1e-3}, EAGER_FLOOR[torch.bfloat16])
    assert rule_violations({"dx": float("nan")}, {"dx": 1.0}, 1.0)


def test_nonfinite_input_is_not_a_verdict():
    """A NaN in the first batch makes the float64 reference NaN: nothing is validated, the static
    choice runs (and says so), and nothing is stored — the next module decides on its own input."""
    m = _block()
    x = _x().detach()
    x[0, 0, 0, 0] = float("nan")
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        m(x)
        assert m.last_backend == "triton" and "inconclusive" in m.fallback_reason
        other = _block()
        other(_x())
    assert other.last_backend == "recompute" and _decision(other).source == "measured"


def test_forced_backend_and_priority_mode_measure_nothing(monkeypatch):
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        forced = _block(backend="recompute")
        forced(_x())
        assert forced.last_backend == "recompute" and _decision(forced) is None
        monkeypatch.setenv("FUSED_PREACT_DISPATCH", "priority")
        m = _block()
        m(_x())
        assert m.last_backend == "triton" and _decision(m) is None
        assert dispatch_report(m)[0]["source"] == "priority"
        lean = _block(memory="lean", backend="auto").double()  # float64: only the reference serves
        lean(_x().double())
        assert lean.last_backend == "reference"
        monkeypatch.setenv("FUSED_PREACT_DISPATCH", "sometimes")
        with pytest.raises(ValueError, match="FUSED_PREACT_DISPATCH"):
            _block()(_x())


def test_candidates_can_be_restricted(monkeypatch):
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "triton,reference")
    timer = Timer()
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=timer):
        m(_x())
    assert sorted(timer.calls) == ["reference", "triton"] and m.last_backend == "reference"


def test_one_allowed_candidate_is_validated_and_runs(monkeypatch):
    """One name: that backend (not the static order's triton) runs, validated and timed on its own."""
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "recompute")
    timer = Timer()
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=timer):
        m(_x())
    d = _decision(m)
    assert timer.calls == ["recompute"] and m.last_backend == "recompute"
    assert d.source == "measured" and [c.name for c in d.candidates] == ["recompute"] and d.candidates[0].valid


def test_allowed_candidates_failing_validation_leave_the_unfused_path(monkeypatch):
    """The verdict is kept like any decision: another module of the signature, one under capture and
    one in a second look-up from the disk cache run the unfused path too, nothing measured again (the
    rejected backend ran under capture and was measured and warned about per module)."""
    monkeypatch.setitem(BACKENDS, "wrong", WrongBackend)
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "Wrong")  # names are case-insensitive
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=Timer()), pytest.warns(RuntimeWarning, match="'wrong'"):
        m(_x())
    assert m.last_backend == "reference" and "leaves no other" in m.fallback_reason
    for capturing, forget in ((False, False), (True, False), (True, True)):
        if forget:
            auto.forget()
        monkeypatch.setattr(auto, "_capturing", lambda device, c=capturing: c)
        m = _block()
        with auto.measuring(devices=(DEVICE,), timer=_forbidden), warnings.catch_warnings():
            warnings.simplefilter("error")
            m(_x())
        assert m.last_backend == "reference" and "leaves no other" in m.fallback_reason, (capturing, forget)


def test_decisions_are_kept_per_allowed_set(monkeypatch):
    """A decision measured under a restriction is served neither without it (memory or disk) nor under
    another; each set's decision is served to calls under that set."""
    x = _x()
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "reference")
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        _block()(x)
    monkeypatch.delenv("FUSED_PREACT_DISPATCH_CANDIDATES")
    timer = Timer()
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=timer):
        m(x)
    assert sorted(timer.calls) == ["recompute", "reference", "triton"] and m.last_backend == "recompute"
    auto.forget()  # from the disk cache now: each set gets its own decision, nothing measured
    for allowed, winner in (("reference", "reference"), (None, "recompute")):
        if allowed:
            monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", allowed)
        else:
            monkeypatch.delenv("FUSED_PREACT_DISPATCH_CANDIDATES")
        m = _block()
        with auto.measuring(devices=(DEVICE,), timer=_forbidden):
            m(x)
        assert m.last_backend == winner and _decision(m).source == "disk cache"
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "triton, recompute")
    timer = Timer()
    with auto.measuring(devices=(DEVICE,), timer=timer):
        _block()(x)
    assert sorted(timer.calls) == ["recompute", "triton"]
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", ",".join(BACKENDS))  # every one: no restriction
    m = _block()
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m(x)
    assert m.last_backend == "recompute" and _decision(m).source == "disk cache"


@pytest.mark.parametrize("names", ["tritn", "triton,cudnn"])
def test_an_unknown_candidate_name_raises(monkeypatch, names):
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", names)
    with pytest.raises(ValueError, match="FUSED_PREACT_DISPATCH_CANDIDATES"):
        _block()(_x())


class RefusingBackend(RecomputeBackend):
    """A backend that serves nothing (as the CUDA extension where it is not built)."""

    name = "refusing"

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        return ["refusing: serves nothing"]


def test_the_restriction_holds_where_nothing_is_measured(monkeypatch):
    """priority mode and CUDA-graph capture take the static order among the allowed backends (the
    lean order under memory='lean', and say so where no allowed backend is lean); a restriction no
    backend can serve runs the unfused path and says so (it ran triton)."""
    monkeypatch.setitem(BACKENDS, "refusing", RefusingBackend)
    monkeypatch.setenv("FUSED_PREACT_DISPATCH", "priority")
    for allowed, memory, winner, reason in (("recompute", "fastest", "recompute", None),
                                            ("recompute", "lean", "recompute", None),
                                            ("recompute,reference", "fastest", "reference", None),
                                            ("recompute,reference", "lean", "recompute", None),
                                            ("reference", "lean", "reference", "memory='lean'"),
                                            ("refusing", "fastest", "reference", "no allowed backend")):
        monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", allowed)
        m = _block(memory=memory, backend="auto")
        m(_x())
        assert m.last_backend == winner, (allowed, memory)
        assert (m.fallback_reason is None) if reason is None else (reason in m.fallback_reason), (allowed, memory)
    monkeypatch.setenv("FUSED_PREACT_DISPATCH", "measure")
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "recompute")
    monkeypatch.setattr(auto, "_capturing", lambda device: True)
    m = _block(memory="lean", backend="auto")
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m(_x())
    assert m.last_backend == "recompute" and "CUDA-graph capture" in m.fallback_reason
    monkeypatch.setattr(auto, "_capturing", lambda device: False)
    for allowed in ("triton", "refusing"):  # float64 (triton refuses), and a backend that serves nothing
        monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", allowed)
        m = _block().double()
        with auto.measuring(devices=(DEVICE,), timer=_forbidden):
            m(_x().double())
        assert m.last_backend == "reference" and "no allowed backend" in m.fallback_reason
    monkeypatch.delenv("FUSED_PREACT_DISPATCH_CANDIDATES")
    m = _block().double()  # unrestricted, one backend serves (float64: the reference): nothing measured
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m(_x().double())
    assert m.last_backend == "reference" and _decision(m) is None
    monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "reference")
    m = _block(memory="lean", backend="auto")  # measured, valid, not lean: the decision's note says so
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        m(_x())
    assert m.last_backend == "reference" and _decision(m).source == "measured"
    assert "no lean candidate passed validation" in m.fallback_reason


# ---------------------------------------------------------------------------- capture and compile
def test_capture_uses_held_decisions_or_the_static_order(monkeypatch):
    """Inside CUDA-graph capture (simulated: the query patched) nothing is measured: a decision held
    by this process or the disk cache is adopted, else the static priority runs and says why."""
    monkeypatch.setattr(auto, "_capturing", lambda device: True)
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m = _block()
        m(_x())
    assert m.last_backend == "triton" and "CUDA-graph capture" in m.fallback_reason
    monkeypatch.setattr(auto, "_capturing", lambda device: False)
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        _block()(_x())
    auto.forget()  # only the disk cache holds it now
    monkeypatch.setattr(auto, "_capturing", lambda device: True)
    with auto.measuring(devices=(DEVICE,), timer=_forbidden):
        m = _block()
        m(_x())
    assert m.last_backend == "recompute" and _decision(m).source == "capture" and m.fallback_reason is None


def test_compile_never_measures_nor_breaks_the_graph():
    """Under torch.compile(fullgraph=True): a new signature takes the static order (and says so); a
    signature this process decided eagerly keeps its decision where that backend traces, else the
    fastest valid candidate that does (recompute does not trace: here the reference)."""
    x = _x(4)
    try:
        with auto.measuring(devices=(DEVICE,), timer=_forbidden):
            m = _block(FusedPreActBlock, (4, 8, 2))
            torch.compile(m, fullgraph=True, backend="aot_eager")(x).sum().backward()
        assert m.last_backend == "triton" and "torch.compile tracing" in m.fallback_reason
        torch._dynamo.reset()
        with auto.measuring(devices=(DEVICE,), timer=Timer({"triton": 3.0, "recompute": 1.0, "reference": 2.0})):
            eager = _block(FusedPreActBlock, (4, 8, 2))
            eager(x)
        assert eager.last_backend == "recompute"
        with auto.measuring(devices=(DEVICE,), timer=_forbidden):
            m = _block(FusedPreActBlock, (4, 8, 2))
            y = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
            y.sum().backward()
        assert m.last_backend == "reference" and "does not run under torch.compile" in m.fallback_reason
        twin = PreActBlock(4, 8, 2).to(DEVICE)
        twin.load_state_dict(_block(FusedPreActBlock, (4, 8, 2)).state_dict())
        assert_close(y, twin.double()(x.double()), torch.float32, "compiled output")
    finally:
        torch._dynamo.reset()


def test_compile_traces_an_allowed_backend(monkeypatch):
    """Under a restriction, compile tracing replaces a decision that does not trace by the fastest
    allowed candidate that does, else the unfused reference (never a disallowed triton); a signature
    nothing decided traces the static order among the allowed backends."""
    x = _x(4)
    try:
        for allowed, traced in (("recompute,triton", "triton"), ("recompute", "reference")):
            monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", allowed)
            with auto.measuring(devices=(DEVICE,), timer=Timer({"triton": 3.0, "recompute": 1.0, "reference": 2.0})):
                eager = _block(FusedPreActBlock, (4, 8, 2))
                eager(x)
            assert eager.last_backend == "recompute"
            with auto.measuring(devices=(DEVICE,), timer=_forbidden):
                m = _block(FusedPreActBlock, (4, 8, 2))
                torch.compile(m, fullgraph=True, backend="aot_eager")(x).sum().backward()
            assert m.last_backend == traced and "does not run under torch.compile" in m.fallback_reason
            torch._dynamo.reset()
        monkeypatch.setenv("FUSED_PREACT_DISPATCH_CANDIDATES", "reference")  # a signature nothing decided
        with auto.measuring(devices=(DEVICE,), timer=_forbidden):
            m = _block(FusedPreActBlock, (4, 8, 1))
            torch.compile(m, fullgraph=True, backend="aot_eager")(x).sum().backward()
        assert m.last_backend == "reference" and "torch.compile tracing" in m.fallback_reason
    finally:
        torch._dynamo.reset()


# -------------------------------------------------------------------------- across processes
_SECOND = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests")
    from test_auto import _block, _x, _decision, _forbidden
    from fused_preact.ops import auto
    with auto.measuring(devices=("cpu",), timer=_forbidden):
        m = _block()
        m(_x())
    d = _decision(m)
    print("RESULT", m.last_backend, d.source, [c.ms for c in d.candidates])
    """
)


@pytest.mark.skipif(DEVICE != "cpu", reason="the second process measures on the CPU")
def test_second_process_reuses_the_disk_cache(tmp_path):
    with auto.measuring(devices=("cpu",), timer=Timer()):
        m = _block()
        m(_x())
    assert m.last_backend == "recompute"
    cache = TuneCache.read_folder(str(tmp_path / "dispatch"))
    (key, entry), = cache.items()
    assert entry["winner"] == "recompute" and "memory:fastest" in key
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _SECOND], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][0]
    assert line.startswith("RESULT recompute disk cache"), line
    assert "3.0" in line  # the first process's times travel with the decision


def test_a_decision_serves_only_the_eps_and_dtypes_it_was_validated_for():
    """The decision's key holds each BatchNorm's eps and every parameter's and buffer's dtype: a module
    that differs only there is measured and validated itself (its numerics may differ), not handed
    the other's decision from memory or the file."""
    with auto.measuring(devices=(DEVICE,), timer=Timer()):
        first = _block()
        first(_x())
        other = _block()
        for bn in other.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.eps = 0.1
        timer = Timer()
        with auto.measuring(devices=(DEVICE,), timer=timer):
            other(_x())
    assert _decision(first).source == "measured" and _decision(other).source == "measured" and timer.calls


@pytest.mark.parametrize("edit", ["winner-list", "ms-string", "winner-invalid", "top-level-list"])
def test_a_corrupt_or_contradictory_decision_file_is_measured_again(tmp_path, edit):
    """Entries of the decision file that another version or an edit left malformed, or whose own
    records reject their winner, are not served (nor crash the call): the signature is measured again."""
    with auto.measuring(devices=("cpu",), timer=Timer()):
        _block()(_x())
    path = tmp_path / "dispatch"
    cache = TuneCache.read_folder(str(path))
    (key, entry), = cache.items()
    if edit == "winner-list":
        entry["winner"] = ["recompute"]
    elif edit == "ms-string":
        entry["candidates"][0]["ms"] = "fast"
    else:
        for c in entry["candidates"]:
            c["valid"] = False if c["name"] == entry["winner"] else c["valid"]
    record = [entry] if edit == "top-level-list" else {"key": key, "value": entry}
    with open(_entry_file(str(path), key), "w") as f:
        json.dump(record, f)
    auto.forget()
    timer = Timer()
    with auto.measuring(devices=("cpu",), timer=timer):
        m = _block()
        m(_x())
    assert _decision(m).source == "measured" and timer.calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, world: int, port: int, out: str, cache: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FUSED_PREACT_DISPATCH="measure",
                      FUSED_PREACT_DISPATCH_CACHE=cache + f".{rank}")
    # a collective one rank never joins fails after this long instead of hanging the suite
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        # rank 0 finds recompute fastest, rank 1 triton: each runs its own winner
        times = {"triton": 3.0, "recompute": 1.0, "reference": 2.0} if rank == 0 else \
            {"triton": 1.0, "recompute": 3.0, "reference": 2.0}
        timer = Timer(times)
        with auto.measuring(devices=("cpu",), timer=timer):
            m = _block()
            m(_x(seed=2 + rank)).sum().backward()
            first = dict(backend=m.last_backend, source=_decision(m).source, calls=list(timer.calls))
            # ranks reaching a new signature at different calls: a batch size of rank 1's own, then
            # an empty batch on rank 0 only (a collective in the decision would hang here)
            m(_x(seed=4, n=2 + rank)).sum().backward()
            m(_x(seed=5, n=3 * rank)).sum().backward()
        done = torch.ones(1)
        dist.all_reduce(done)  # both ranks got here, still in step
        torch.save(dict(first=first, calls=timer.calls, done=float(done)), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU")
def test_every_rank_decides_for_itself_without_collectives(tmp_path):
    """Under torch.distributed each rank measures and runs its own winner (as cudnn.benchmark
    chooses per process); a rank that meets a new signature alone (its own batch size, an empty
    batch on the other) does not wait for the others."""
    mp.spawn(_rank_worker, args=(2, _free_port(), str(tmp_path / "res"), str(tmp_path / "cache")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"res.{r}") for r in range(2))
    assert r0["first"]["backend"] == "recompute" and r1["first"]["backend"] == "triton"
    assert r0["first"]["source"] == r1["first"]["source"] == "measured"
    for r in (r0, r1):
        assert sorted(r["first"]["calls"]) == ["recompute", "reference", "triton"]
        assert r["done"] == 2.0
    # rank 1's batch of 3 was a signature of its own: measured there; rank 0's batch of 2 was its first
    assert len(r1["calls"]) == 6 and len(r0["calls"]) == 3


# ------------------------------------------------------------------------------------- reports
def test_reports_name_candidates_times_and_winner():
    from fused_preact import convert
    from fused_preact.models import preact_resnet_cifar

    eager = preact_resnet_cifar(8, fused=False).to(DEVICE)
    model, report = convert(eager, report=True, memory="lean", verify=False)
    assert not report.dispatch()
    with auto.measuring(devices=(DEVICE,), timer=Timer({"triton": 3.0, "recompute": 2.0, "reference": 1.0}, run=False)):
        model(torch.randn(2, 3, 8, 8, device=DEVICE))
    entries = dispatch_report(model)
    assert entries and all(e["runs"] == "recompute" and e["memory"] == "lean" for e in entries)
    measured = [e for e in entries if e["source"] == "measured"]
    assert measured and {c["name"]: c["ms"] for c in measured[0]["candidates"]}["reference"] == 1.0
    text = str(report)
    assert "dispatch_report" in text and "recompute 2.000 ms" in text
    fused = [m for m in model.modules() if hasattr(m, "_plans") and m._plans]
    assert all(m.last_backend == "recompute" for m in fused)


def test_unit_module_decides_too():
    m = FusedBNReLUConv2d(6, 8, 3, padding=1).to(DEVICE)
    with auto.measuring(devices=(DEVICE,), timer=Timer({"triton": 1.0, "recompute": 2.0, "reference": 3.0})):
        m(_x(6))
    assert m.last_backend == "triton" and _decision(m).winner == "triton"
