"""Benchmark machinery that needs a GPU: measured peaks, the timer, providers and harnesses.

Shared by ``python -m fused_preact.bench`` and the pytest-benchmark suite under ``benchmarks/``.
Nothing here runs at import time, so the module imports on a CPU-only machine.

Timing method (as ``triton.testing.do_bench``: CUDA events, warm-up, median; plus input rotation): every
measured call runs between two CUDA events on the current stream and the host waits for the end
event before the next call (the device is synchronized *inside* each timed call, so no call's work
overlaps the next call's setup); warm-up calls come first (Triton JIT, Inductor compilation,
autotuning, cuDNN algorithm search all happen there); the inputs rotate through a pool whose total
size is at least twice the L2 cache (at least two sets; the pool stays within 1 GiB, which only an L2
above 512 MiB would make bind: :func:`pool_count`), so a call never finds its input cached by the previous one;
the result is the median in ms. Untimed per-call setup (the forward pass whose backward is timed,
copying a batch into a CUDA graph's static input) runs before the start event.

Device time only (``host_ahead_cycles``, the kernel level): the GPU is idle when the start event is
recorded, so by default a call's time includes the host's time to enqueue its first kernel (tens of µs
for a Triton launch from Python), which dwarfs a small kernel. With ``host_ahead_cycles`` a sleep kernel
(``torch.cuda._sleep``, about that many GPU clock cycles) is enqueued before the start event: the host
enqueues start event, call and end event while the device still sleeps, so the events bracket device
work only (as long as enqueuing the call takes less than the sleep).

Enqueue time (:func:`time_enqueue`, mode ``enqueue``): consecutive steps issued with no
synchronization; the host time until the last call returns, per step, is what the host needs to
enqueue one step (its launch overhead), the time until the device has finished, per step, the wall
time of a step when the host never waits.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_preact.bench.shapes import MODES, BlockShape, ModelSpec, UnitShape, dtype_from_name

__all__ = [
    "LAYER_PROVIDERS",
    "MODEL_PROVIDERS",
    "COMPILE_MODES",
    "Peaks",
    "Measurement",
    "Skip",
    "measure_peaks",
    "pool_count",
    "time_cuda",
    "time_enqueue",
    "peak_memory",
    "configure_dynamo",
    "unit_module",
    "block_module",
    "fused_backends",
    "check_backend",
    "LayerHarness",
    "StepHarness",
    "FUSED_PROVIDERS",
    "auto_choices",
]

#: Device the harnesses allocate on. Only ever "cuda" for results; tests of the harness logic on a
#: CPU-only machine point it at "cpu" together with a stand-in for CUDA events.
DEVICE = "cuda"

#: Providers of the unit and block levels, in table order. ``auto`` / ``auto-lean``: the fused modules
#: with ``backend="auto"`` and ``memory="fastest"`` / ``"lean"`` (measured and validated per signature
#: on their first call, :mod:`fused_preact.ops.auto`; that first call is untimed setup).
LAYER_PROVIDERS: tuple[str, ...] = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "recompute", "auto",
                                    "auto-lean")
#: Providers that run fused modules, by the ``backend=`` (and ``memory=``) they build them with.
FUSED_PROVIDERS: dict[str, tuple[str, str]] = {"triton": ("triton", "fastest"), "cuda": ("cuda", "fastest"),
                                               "recompute": ("recompute", "fastest"), "auto": ("auto", "fastest"),
                                               "auto-lean": ("auto", "lean")}
#: Providers of the model level (the ``*-cudagraph`` ones only for the 32×32 CIFAR nets).
MODEL_PROVIDERS: tuple[str, ...] = LAYER_PROVIDERS + ("eager-cudagraph", "triton-cudagraph")
#: ``torch.compile`` mode per compile provider. ``max-autotune-no-cudagraphs`` autotunes exactly as
#: ``mode="max-autotune"`` but leaves out Inductor's CUDA graphs, which would copy every non-static
#: input into the graph's buffers on each call (an extra pass over x that a layer inside a network
#: never pays) and allocate from a private pool that hides peak memory; CUDA graphs are measured
#: on their own at the model level (``*-cudagraph``).
COMPILE_MODES: dict[str, Optional[str]] = {"compile": None, "compile-max-autotune": "max-autotune-no-cudagraphs"}


class Skip(Exception):
    """A provider cannot run this benchmark; the message is the recorded reason."""


@dataclasses.dataclass(frozen=True)
class Peaks:
    """Ceilings measured on this device, for the roofline floor.

    Attributes:
        tflops: bf16 matmul rate, TFLOP/s (``2·n³`` FLOPs per product, median of the timed runs).
        gbps: device-to-device copy bandwidth, GB/s (bytes read + bytes written, 1 GB = 1e9 B).
        matmul_n: n of the n×n×n matmul. copy_bytes: bytes of the copied buffer.
        l2_bytes: L2 cache size in bytes (``torch.cuda.get_device_properties().L2_cache_size``).
        sm_count: multiprocessors.
        matmul_tflops: matmul rate per dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``) measured, TFLOP/s.
        fp32_math: how the fp32 rate was measured, as the timed fp32 convolutions run: ``"tf32"`` when
            ``torch.backends.cudnn.allow_tf32`` is on (cuDNN's and the Triton kernels' fp32 convolutions
            then use TF32 tensor cores), else ``"ieee"``.
    """

    tflops: float
    gbps: float
    matmul_n: int
    copy_bytes: int
    l2_bytes: int
    sm_count: int
    matmul_tflops: dict = dataclasses.field(default_factory=dict)
    fp32_math: str = "ieee"

    def tflops_for(self, dtype: str) -> float:
        """The matmul rate (TFLOP/s) of ``dtype`` (a ``--dtype`` name): its measured rate, ``tflops``
        (bf16) where that dtype was not measured."""
        return self.matmul_tflops.get(dtype, self.tflops)

    def as_dict(self) -> dict:
        """JSON-ready copy."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Measurement:
    """One timed benchmark: per-call times (ms), their median (ms), peak memory (bytes) and extras."""

    times_ms: list[float]
    peak_mem_bytes: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        """Median of :attr:`times_ms`, in ms."""
        return statistics.median(self.times_ms)


#: Most bytes an input pool may hold (:func:`pool_count`); 2·L2 stays below it for any L2 up to 512 MiB.
POOL_MAX_BYTES = 1 << 30


def pool_count(set_bytes: int, l2_bytes: int, cap: Optional[int] = None, factor: float = 2.0,
               max_bytes: int = POOL_MAX_BYTES) -> int:
    """How many input sets of ``set_bytes`` bytes to rotate so the pool holds ≥ ``factor``·L2 bytes.

    At least 2 (consecutive calls never share an input), also under ``cap``. Memory bounds it: no more
    sets than fit in ``max_bytes`` (but still 2), so the pool falls short of ``factor``·L2 only when that
    exceeds ``max_bytes``; and at most ``cap`` sets where one is given (tests keep their pools small with
    it). The bound counts the sets' bytes only: a harness that keeps per-set outputs too (the kernel
    benchmark's y, dW and split-K partials) holds more, e.g. about 2.5 GiB for PreActResNet-50's
    layer4 3×3 at batch 4 with a 50 MiB L2.
    """
    if set_bytes <= 0:
        return 2
    n = max(2, min(math.ceil(factor * l2_bytes / set_bytes), max_bytes // set_bytes))
    return n if cap is None else max(2, min(cap, n))


def time_cuda(run: Callable[[Any], Any], setup: Callable[[int], Any] = lambda i: i, *, warmup: int = 3,
              reps: int = 25, max_s: float = 2.0, host_ahead_cycles: int = 0) -> list[float]:
    """Time ``run(setup(i))`` with CUDA events; return the per-call device times in ms.

    ``warmup`` untimed calls first; then up to ``reps`` timed calls, stopping early (after at least 3)
    once ``max_s`` seconds of wall time have passed. Each call: ``setup(i)`` (untimed), with
    ``host_ahead_cycles`` > 0 a ``torch.cuda._sleep(host_ahead_cycles)`` kernel (GPU clock cycles; the
    module docstring says why), start event, ``run``, end event, host waits for the end event.
    Requires CUDA.
    """
    for i in range(warmup):
        run(setup(i))
    torch.cuda.synchronize()
    times: list[float] = []
    t0 = time.perf_counter()
    for i in range(reps):
        state = setup(warmup + i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if host_ahead_cycles > 0:
            torch.cuda._sleep(int(host_ahead_cycles))
        start.record()
        run(state)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) >= 3 and time.perf_counter() - t0 > max_s:
            break
    return times


def time_enqueue(run: Callable[[Any], Any], setup: Callable[[int], Any] = lambda i: i, *, steps: int = 20,
                 repeats: int = 3, warmup: int = 1) -> tuple[list[float], list[float]]:
    """Host enqueue time and wall time per step of ``steps`` consecutive ``run(setup(i))`` calls.

    ``warmup`` untimed calls, then ``repeats`` times: synchronize, ``setup`` of all ``steps`` calls
    (untimed), ``t0 = time.perf_counter()``, the ``steps`` calls back to back with no synchronization,
    ``t1`` when the last call returns, synchronize, ``t2``. Requires CUDA.

    Returns:
        ``(enqueue_ms, wall_ms)``, one value per repeat: ``(t1 − t0)/steps`` and ``(t2 − t0)/steps``
        in ms per step. Enqueue ≈ wall means the host was the bottleneck, or something in the step
        synchronized (or the launch queue filled up and the host had to wait for the device).
    """
    if steps < 1 or repeats < 1:
        raise ValueError(f"steps and repeats must be ≥ 1, got {steps}, {repeats}")
    for i in range(warmup):
        run(setup(i))
    enqueue, wall = [], []
    for r in range(repeats):
        torch.cuda.synchronize()
        states = [setup(warmup + r * steps + i) for i in range(steps)]
        t0 = time.perf_counter()
        for state in states:
            run(state)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enqueue.append((t1 - t0) * 1e3 / steps)
        wall.append((t2 - t0) * 1e3 / steps)
    return enqueue, wall


def peak_memory(run: Callable[[Any], Any], setup: Callable[[int], Any] = lambda i: i) -> int:
    """Bytes one call of ``run(setup(0))`` needs beyond what was allocated when it started:
    ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus
    ``memory_allocated()`` before the call (setup's own allocations count as already there)."""
    state = setup(0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(state)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def measure_peaks(matmul_n: int = 8192, copy_bytes: int = 1 << 30, reps: int = 10,
                  dtypes: Sequence[str] = ("bf16",)) -> Peaks:
    """Measure the matmul rate (TFLOP/s) of bf16 and of each of ``dtypes`` (``--dtype`` names) and the
    device copy bandwidth (GB/s) of the current GPU.

    Random operands (zeros run faster than real data), 3 warm-ups, median of ``reps`` event-timed runs.
    fp32 runs with TF32 exactly when ``torch.backends.cudnn.allow_tf32`` is on, as the timed fp32
    convolutions do (:attr:`Peaks.fp32_math`). These measured ceilings, not datasheet numbers, set the
    roofline floor of each dtype (Williams et al. 2009).
    """
    def matmul(name: str) -> float:
        a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=dtype_from_name(name))
        b = torch.randn_like(a)
        ms = statistics.median(time_cuda(lambda _: torch.mm(a, b), warmup=3, reps=reps, max_s=5.0))
        return 2 * matmul_n**3 / (ms * 1e-3) / 1e12

    tf32 = torch.backends.cudnn.allow_tf32
    old, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, tf32
    try:
        rates = {name: matmul(name) for name in dict.fromkeys(("bf16", *dtypes))}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    src = torch.randn(copy_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    cp_ms = statistics.median(time_cuda(lambda _: dst.copy_(src), warmup=3, reps=reps, max_s=5.0))
    src = dst = None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    torch.cuda.empty_cache()
    return Peaks(tflops=rates["bf16"], gbps=2 * copy_bytes / (cp_ms * 1e-3) / 1e9,
                 matmul_n=matmul_n, copy_bytes=copy_bytes, l2_bytes=int(getattr(props, "L2_cache_size", 50 << 20)),
                 sm_count=props.multi_processor_count, matmul_tflops=rates, fp32_math="tf32" if tf32 else "ieee")


def configure_dynamo() -> None:
    """Let Dynamo compile many distinct modules in one process and fail loudly instead of silently
    running eager when it would give up (``recompile_limit``/``fail_on_recompile_limit_hit``; older
    torch: ``cache_size_limit``). Call ``torch._dynamo.reset()`` between benchmarks as well."""
    cfg = torch._dynamo.config
    for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024), ("accumulated_recompile_limit", 8192),
                        ("accumulated_cache_size_limit", 8192), ("fail_on_recompile_limit_hit", True)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)


def _compile(module: nn.Module, provider: str) -> nn.Module:
    configure_dynamo()
    torch._dynamo.reset()
    mode = COMPILE_MODES[provider]
    return torch.compile(module, dynamic=False, **({"mode": mode} if mode else {}))


def _unit_spec(u: UnitShape):
    """Unit ``u`` as a one-conv chain (:class:`fused_preact.ops.ChainSpec`), as the dispatcher takes it."""
    from fused_preact.ops import ChainSpec, ConvGeom

    return ChainSpec((ConvGeom(u.C, u.K, (u.R, u.S), tuple(u.stride), tuple(u.padding), tuple(u.dilation),
                               u.groups),))


def _first_bn_units(b: BlockShape) -> list[UnitShape]:
    """The units of block ``b`` that read its first BN→ReLU: conv1 and the projection shortcut."""
    return [u for u in b.units if u.name.rsplit("/", 1)[-1] in ("conv1", "shortcut")]


def cuda_backend_reason(x: torch.Tensor, units: Sequence[UnitShape] = ()) -> Optional[str]:
    """Why the fused ``cuda`` backend cannot serve ``x``, or None when it can.

    The backend must be listed in ``fused_preact.dispatch.BACKENDS`` and ``select_backend("cuda", x,
    spec)`` must accept ``x`` together with each convolution of ``units`` (those that read
    ``relu(bn(x))``), so that the device, dtype, alignment, groups and filter limits of the CUTLASS
    kernels are all checked, whether or not ``fused_preact._C`` is built. Without ``units`` only what
    the dispatcher checks from ``x`` alone is checked, plus the device: the backend serves CUDA tensors
    only.
    """
    from fused_preact.dispatch import BACKENDS, select_backend

    if "cuda" not in BACKENDS:
        return "backend 'cuda' is not registered in fused_preact.dispatch.BACKENDS (extension not built)"
    try:
        for spec in [_unit_spec(u) for u in units] or [None]:
            select_backend("cuda", x, spec)
    except (RuntimeError, ValueError) as e:
        return str(e)
    if x.device.type != "cuda":
        return f"backend 'cuda' serves CUDA tensors only; the input is on {x.device}"
    return None


def fused_backends(module: nn.Module) -> set:
    """``last_backend`` of every fused module inside ``module`` (``None`` for one that never ran);
    empty when ``module`` holds no fused module (eager and compiled twins)."""
    return {m.last_backend for m in module.modules() if hasattr(m, "last_backend") and hasattr(m, "fallback_reason")}


def check_backend(module: nn.Module, provider: str) -> str:
    """After at least one forward: make sure ``module`` ran what ``provider`` promises and say what.

    triton / cuda / recompute (and ``*-cudagraph`` of them): every fused module's ``last_backend`` is
    that backend (the fused modules are forced to it, so a fallback would have raised; this catches a
    module built with the wrong backend or never run). auto / auto-lean: every fused module ran
    (whatever its decision; :func:`auto_choices` says what). Other providers: no fused module at all.

    Returns:
        The backend that ran: ``"triton"``, ``"cuda"``, ``"recompute"``, ``"auto"`` (the choices per
        module: :func:`auto_choices`), or ``"eager"`` for PyTorch's own ops.

    Raises:
        RuntimeError: the module did not run as the provider promises.
    """
    want = provider.split("-")[0]
    ran = fused_backends(module)
    if want == "auto":
        if not ran or None in ran:
            raise RuntimeError(f"provider {provider!r}: fused modules ran {sorted(map(str, ran)) or 'nothing'}")
        return "auto"
    if want in ("triton", "cuda", "recompute"):
        if ran != {want}:
            reasons = {getattr(m, "fallback_reason", None) for m in module.modules() if hasattr(m, "fallback_reason")}
            raise RuntimeError(f"provider {provider!r}: fused modules ran {sorted(map(str, ran)) or 'nothing'} "
                               f"instead of only {want!r} (fallback reasons: {sorted(map(str, reasons))})")
        return want
    if ran:
        raise RuntimeError(f"provider {provider!r} must run PyTorch's own ops but holds fused modules ({sorted(map(str, ran))})")
    return "eager"


def auto_choices(module: nn.Module) -> list[dict]:
    """For ``auto`` providers: per fused module and signature, the backend ``backend="auto"`` chose,
    where the choice came from, and each candidate's measured ms (``"invalid: <error>"`` for one that
    failed validation) — :func:`fused_preact.dispatch.dispatch_report` in the results' JSON."""
    from fused_preact.dispatch import dispatch_report

    out = []
    for e in dispatch_report(module):
        cands = {c["name"]: (c["ms"] if c["valid"] else f"invalid: {c['error']}") for c in e["candidates"]
                 if not c["refused"]}
        out.append(dict(module=e["module"], runs=e["runs"], source=e["source"], memory=e["memory"],
                        reason=e["reason"], candidates=cands))
    return out


def _forward_or_skip(fn: Callable[[], Any], provider: str) -> Any:
    """``fn()``; for the opt-in ``cuda`` backend a forced-backend refusal (a shape its kernels do not
    serve) becomes :class:`Skip` with the dispatcher's reason. Any other error propagates."""
    try:
        return fn()
    except RuntimeError as e:
        if provider.split("-")[0] == "cuda" and "cannot serve" in str(e):
            raise Skip(str(e).splitlines()[0][:500]) from e
        raise


def _prepare(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Move to CUDA, channels_last, training mode; weights in ``dtype``, but for a 16-bit ``dtype`` every
    BatchNorm's γ, β and running statistics kept in float32 — the usual 16-bit training setup (as AMP keeps BN in fp32),
    under which eager BatchNorm takes cuDNN's mixed-precision kernels rather than the slower native
    all-bf16 path, so the eager baseline is the fast one."""
    module = module.to(device=DEVICE, dtype=dtype, memory_format=torch.channels_last).train()
    if dtype not in (torch.float16, torch.bfloat16):
        return module
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
    return module


def _probe(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)


def unit_module(provider: str, u: UnitShape, dtype: torch.dtype) -> nn.Module:
    """The BN→ReLU→Conv module of ``provider`` for unit ``u``, on CUDA in ``dtype``, channels_last,
    training mode; the same seed gives every provider the same initial weights.

    eager: ``nn.Sequential(BatchNorm2d, ReLU, Conv2d)`` (cuDNN). compile / compile-max-autotune: that
    module under ``torch.compile`` (:data:`COMPILE_MODES`). triton / cuda:
    ``FusedBNReLUConv2d(backend=...)``.

    Raises:
        Skip: the provider cannot serve this input (reason recorded). ValueError: unknown provider.
    """
    from fused_preact.modules import FusedBNReLUConv2d

    if provider not in LAYER_PROVIDERS:
        raise ValueError(f"unknown unit provider {provider!r}; expected one of {LAYER_PROVIDERS}")
    if provider == "cuda":
        reason = cuda_backend_reason(_probe((u.N, u.C, u.H, u.W), dtype), [u])
        if reason:
            raise Skip(reason)
    torch.manual_seed(0)
    backend, memory = FUSED_PROVIDERS.get(provider, ("reference", "fastest"))
    fused = FusedBNReLUConv2d(u.C, u.K, (u.R, u.S), u.stride, u.padding, u.dilation, u.groups, backend=backend,
                              memory=memory)
    if provider in FUSED_PROVIDERS:
        return _prepare(fused, dtype)
    eager = _prepare(nn.Sequential(OrderedDict(bn=fused.bn, relu=nn.ReLU(), conv=fused.conv)), dtype)
    return eager if provider == "eager" else _compile(eager, provider)


def block_module(provider: str, b: BlockShape, dtype: torch.dtype) -> nn.Module:
    """The pre-activation block of ``provider`` for block ``b`` (CUDA, ``dtype``, channels_last,
    training): eager ``fused_preact.models.PreActBottleneck``/``PreActBlock``, compile providers that
    module under ``torch.compile``, triton/cuda ``FusedPreActBottleneck``/``FusedPreActBlock``.

    Raises:
        Skip: the provider cannot serve this input. ValueError: unknown provider.
    """
    from fused_preact.models import PreActBlock, PreActBottleneck
    from fused_preact.modules import FusedPreActBlock, FusedPreActBottleneck

    if provider not in LAYER_PROVIDERS:
        raise ValueError(f"unknown block provider {provider!r}; expected one of {LAYER_PROVIDERS}")
    if provider == "cuda":
        reason = cuda_backend_reason(_probe((b.N, b.in_planes, b.H, b.W), dtype), _first_bn_units(b))
        if reason:
            raise Skip(reason)
    torch.manual_seed(0)
    bottleneck = b.kind == "bottleneck"
    kw = dict(groups=b.groups, base_width=b.base_width) if bottleneck else {}
    if provider in FUSED_PROVIDERS:
        cls = FusedPreActBottleneck if bottleneck else FusedPreActBlock
        backend, memory = FUSED_PROVIDERS[provider]
        return _prepare(cls(b.in_planes, b.planes, b.stride, backend=backend, memory=memory, **kw), dtype)
    eager = _prepare((PreActBottleneck if bottleneck else PreActBlock)(b.in_planes, b.planes, b.stride, **kw), dtype)
    return eager if provider == "eager" else _compile(eager, provider)


def _randn(shape, dtype, channels_last=True) -> torch.Tensor:
    t = torch.randn(shape, device=DEVICE, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t


class LayerHarness:
    """Setup/run closures that time a unit or block module in each mode (see the module docstring).

    The first forward runs in the constructor, with grad as in training (it compiles the training
    graph, which ``fwd`` then reuses, and gives the output shape). The pool
    holds ``pool_count`` input sets (x requiring grad, channels_last; dy of the output's shape).

    Modes, each in training mode (BN uses batch statistics and updates its running stats):
        fwd      ``y = module(x)`` with x requiring grad (autograd saves what backward needs)
        bwd      ``torch.autograd.grad(y, [x, *params], dy)``; the forward is untimed setup
        fwd+bwd  both in one timed call
    ``torch.autograd.grad`` returns fresh gradients, so no call pays for accumulating into ``.grad``.
    """

    def __init__(self, module: nn.Module, x_shape: tuple, dtype: torch.dtype, l2_bytes: int, pool_cap: Optional[int] = None,
                 provider: Optional[str] = None):
        self.module = module
        self.provider = provider
        self.params = [p for p in module.parameters() if p.requires_grad]
        x0 = _randn(x_shape, dtype).requires_grad_()
        y0 = _forward_or_skip(lambda: module(x0), provider or "")
        #: what ran (``check_backend``), checked again after every measurement; None without a provider
        self.backend = check_backend(module, provider) if provider else None
        self.out_shape = tuple(y0.shape)
        elem = x0.element_size()
        self.n = pool_count(elem * (x0.numel() + y0.numel()), l2_bytes, pool_cap)
        del y0
        self.xs = [x0] + [_randn(x_shape, dtype).requires_grad_() for _ in range(self.n - 1)]
        self.dys = [_randn(self.out_shape, dtype) for _ in range(self.n)]

    def _grad(self, y: torch.Tensor, k: int):
        return torch.autograd.grad(y, [self.xs[k]] + self.params, self.dys[k])

    def fns(self, mode: str) -> tuple[Callable[[int], Any], Callable[[Any], Any]]:
        """(setup, run) for ``mode``; ``run(setup(i))`` is one call.

        Raises:
            ValueError: unknown mode.
        """
        n = self.n
        if mode == "fwd":
            return (lambda i: i % n), (lambda k: self.module(self.xs[k]))
        if mode == "bwd":
            return (lambda i: (self.module(self.xs[i % n]), i % n)), (lambda s: self._grad(*s))
        if mode == "fwd+bwd":
            return (lambda i: i % n), (lambda k: self._grad(self.module(self.xs[k]), k))
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def measure(self, mode: str, warmup: int, reps: int, max_s: float) -> Measurement:
        """Time ``mode`` (:func:`time_cuda`) and measure one call's peak memory (:func:`peak_memory`)."""
        setup, run = self.fns(mode)
        times = time_cuda(run, setup, warmup=warmup, reps=reps, max_s=max_s)
        extra: dict[str, Any] = {"pool": self.n}
        if self.provider:
            extra["backend"] = check_backend(self.module, self.provider)
            if extra["backend"] == "auto":
                extra["auto"] = auto_choices(self.module)
        return Measurement(times, peak_memory(run, setup), extra)


class StepHarness:
    """One training step of a whole model: ``zero_grad(set_to_none=True)``, forward, cross-entropy,
    backward, ``SGD(lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True).step()``.

    Providers: eager (the eager twin), compile / compile-max-autotune (the eager twin under
    ``torch.compile``; the optimizer stays eager), triton / cuda (``fused=True`` with that backend),
    ``eager-cudagraph`` / ``triton-cudagraph`` (the whole step captured in one CUDA graph and
    replayed: warm-up steps on a side stream first, gradients set to None before capture so backward
    allocates them in the graph's pool; SGD keeps no host-side step counter, so its captured update
    is replay-safe; the batch is copied into the static input as untimed setup).

    The model runs in ``dtype`` (parameters too, no autocast), channels_last, from one seed, the
    fused build loading the eager build's state_dict. A fused build takes one untimed step in the
    constructor, after which (and after every measurement) :func:`check_backend` confirms that every
    fused module ran the provider's backend; ``backend`` and each measurement's extra record it.
    ``peak_mem_bytes`` of a measurement is the memory a step needs beyond parameters, gradients,
    optimizer state and the batch (for the graph variants: what the capture allocated, gradients
    included).

    Raises (constructor):
        Skip: the provider cannot run this model. ValueError: unknown provider.
    """

    def __init__(self, spec: ModelSpec, provider: str, batch: int, dtype: torch.dtype, l2_bytes: int,
                 pool_cap: Optional[int] = None, graph_warmup: int = 3):
        if provider not in MODEL_PROVIDERS:
            raise ValueError(f"unknown model provider {provider!r}; expected one of {MODEL_PROVIDERS}")
        if provider.endswith("-cudagraph") and not spec.cifar:
            raise Skip("CUDA-graph capture is benchmarked for the 32×32 CIFAR nets only")
        backend = provider.split("-")[0]
        fused = backend in ("triton", "cuda", "recompute", "auto")
        self.provider = provider
        shape = (batch, 3, spec.image_size, spec.image_size)
        if backend == "cuda":
            # probe with the first block's input: the 3-channel image feeds the stem conv, not a fused unit
            from fused_preact.bench.shapes import enumerate_blocks

            first = enumerate_blocks(spec.name, batch)[0]
            reason = cuda_backend_reason(_probe((first.N, first.in_planes, first.H, first.W), dtype),
                                         _first_bn_units(first))
            if reason:
                raise Skip(reason)
        torch.manual_seed(0)
        eager = spec.factory(False, "reference")
        if fused:
            model = spec.factory(True, backend)
            if provider == "auto-lean":
                from fused_preact.dispatch import set_memory_policy

                set_memory_policy(model, "lean")
            model.load_state_dict(eager.state_dict())
            del eager
        else:
            model = eager
        self.model = _prepare(model, dtype)
        self.forward = _compile(self.model, provider) if provider in COMPILE_MODES else self.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True)
        self.n = pool_count(torch.finfo(dtype).bits // 8 * math.prod(shape), l2_bytes, pool_cap)
        self.xs = [_randn(shape, dtype) for _ in range(self.n)]
        self.ys = [torch.randint(0, spec.num_classes, (batch,), device=DEVICE) for _ in range(self.n)]
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.capture_peak: Optional[int] = None
        self.backend: Optional[str] = None
        if fused:  # one step first: a cuda-backend refusal becomes Skip, and the backend is checked up front
            _forward_or_skip(lambda: self._step(self.xs[0], self.ys[0]), provider)
            self.backend = check_backend(self.model, provider)
        if provider.endswith("-cudagraph"):
            self._capture(graph_warmup)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.forward(x).float(), y)
        loss.backward()
        self.opt.step()
        return loss

    def _capture(self, warmup: int) -> None:
        self.static_x, self.static_y = self.xs[0].clone(), self.ys[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                self._step(self.xs[i % self.n], self.ys[i % self.n])
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self._step_captured()
        torch.cuda.synchronize()
        self.capture_peak = int(torch.cuda.max_memory_allocated() - base)

    def _step_captured(self) -> torch.Tensor:
        loss = F.cross_entropy(self.forward(self.static_x).float(), self.static_y)
        loss.backward()
        self.opt.step()
        return loss

    def fns(self) -> tuple[Callable[[int], Any], Callable[[Any], Any]]:
        """(setup, run) for one step; ``run(setup(i))`` is one call."""
        n = self.n
        if self.graph is not None:
            def setup(i):
                self.static_x.copy_(self.xs[i % n])
                self.static_y.copy_(self.ys[i % n])
            return setup, (lambda _: self.graph.replay())
        return (lambda i: i % n), (lambda k: self._step(self.xs[k], self.ys[k]))

    def measure(self, warmup: int, reps: int, max_s: float) -> Measurement:
        """Time one step (:func:`time_cuda`) and its peak memory; loss must stay finite."""
        setup, run = self.fns()
        times = time_cuda(run, setup, warmup=warmup, reps=reps, max_s=max_s)
        peak = self.capture_peak if self.graph is not None else peak_memory(run, setup)
        loss = self.static_loss if self.graph is not None else self._step(self.xs[0], self.ys[0])
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"training step produced a non-finite loss ({loss.item()})")
        self.backend = check_backend(self.model, self.provider)
        extra = {"pool": self.n, "backend": self.backend}
        if self.backend == "auto":
            extra["auto"] = auto_choices(self.model)
        return Measurement(times, peak, extra)
