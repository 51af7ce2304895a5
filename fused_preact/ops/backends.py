"""Backends of the fused chain: the plan protocol, what each backend serves, why it refuses, and the
one entry point that runs a chain (:func:`run_chain`).

Modelled on xformers' operator classes (``xformers/ops/fmha/common.py`` ``AttentionOpBase``): every
backend is a class declaring the dtypes, minimum compute capability and channel alignment it serves;
``not_supported_reasons`` explains a refusal in words (each subclass extends ``super()``'s list), and
``"auto"`` walks :data:`PRIORITY` and takes the first backend with no reasons, carrying the reasons of
those it skipped (a fallback is never silent). Fused backends build a :class:`Plan` per input
signature (quack's ``backends/protocol.py`` pattern): everything decided once, then launches.
:func:`fused_preact.ops.run.run_chain` runs a chain on the chosen backend.

    ``TritonBackend``     the fused Triton kernels: CUDA tensors on compute capability ≥ 8.0, or CPU
                          tensors when Triton's interpreter is active (``TRITON_INTERPRET=1`` before
                          fused_preact's kernels are first imported)
    ``CudaBackend``       the CUDA C++ extension ``fused_preact._C`` (CUTLASS; opt-in until a GPU run
                          has verified it)
    ``RecomputeBackend``  cuDNN's convolutions with BN+ReLU recomputed around them (memory of the fused
                          path, no custom GEMM): CUDA and CPU tensors
    ``ReferenceBackend``  plain PyTorch: any device and dtype PyTorch serves
"""

from __future__ import annotations

import threading
import warnings
from typing import ClassVar, NamedTuple, Optional, Protocol, runtime_checkable

import torch

from fused_preact.ops import triton_compat
from fused_preact.ops._common import LRUDict, triton_mode
from fused_preact.ops.cuda import ext as cuda_ext
from fused_preact.ops.cuda.plan import CudaPlan
from fused_preact.ops.index_range import chain_margin, range_reasons
from fused_preact.ops.recompute.plan import RecomputePlan, uses_triton
from fused_preact.ops.spec import (
    BNMode,
    ChainForward,
    ChainGrads,
    ChainSpec,
    ChainTensors,
    GradNeeds,
    SavedChain,
    chain_shapes,
)
from fused_preact.ops.triton.plan import TritonPlan

__all__ = ["Plan", "Backend", "TritonBackend", "CudaBackend", "RecomputeBackend", "ReferenceBackend", "BACKENDS",
           "PRIORITY", "LEAN_PRIORITY", "TRACEABLE", "static_order", "register", "unregister", "BackendChoice",
           "select_backend", "check_backend_name", "eager_fallback", "PlanCache", "LastCall", "MAX_PLANS"]


@runtime_checkable
class Plan(Protocol):
    """What a fused backend's plan provides: built once per input signature, run per call.

    Attributes:
        spec, modes: the chain and its BN modes. cdtype: compute dtype. out_shape, out_dtype: the
        output's. proj_shape: the projection shortcut's output shape (None without one; the returned
        projection's for ``proj_out="return"``). out_stats: whether :meth:`forward` hands out the
        output's partial statistics (then :meth:`handoff_geometry` describes their tiles).
    """

    spec: ChainSpec
    modes: tuple
    cdtype: torch.dtype
    out_shape: tuple
    out_dtype: torch.dtype
    proj_shape: Optional[tuple]
    out_stats: bool

    def forward(self, x: torch.Tensor, t: ChainTensors) -> ChainForward:
        """Run the chain's forward on ``x`` with the call's tensors ``t``; update running statistics."""

    def backward(self, dy: torch.Tensor, dy_proj: Optional[torch.Tensor], saved: SavedChain, weights,
                 proj_weight: Optional[torch.Tensor], needs: GradNeeds) -> ChainGrads:
        """Gradients from the output gradient(s), the forward's ``saved`` tensors and the weights."""

    def handoff_geometry(self) -> tuple[int, int]:
        """(rows per tile, total rows) of the output statistics' tiles (:class:`StatsHandoff`); read only
        when ``out_stats``."""


class Backend:
    """Base class: declared capabilities, refusal reasons, and how to build a plan.

    Class attributes (everything else reads them; nothing outside this module lists backends by name):
        name: the string accepted by ``backend=``.
        dtypes: compute dtypes served (the autocast dtype under autocast).
        devices: device types served (None: any PyTorch serves).
        min_compute_capability: lowest CUDA (major, minor) served; None for device-agnostic.
        channels_multiple: every channel count must be a multiple of this (alignment; 1 = any).
        fused: runs fused kernels (a :class:`Plan` per input signature) rather than plain PyTorch.
        lean: saves only the units' inputs for backward (no BatchNorm or ReLU output): what
            ``memory="lean"`` asks for.
        traceable: runs under ``torch.compile`` (a fused one through :meth:`compiled_plan` and the
            custom ops of :mod:`fused_preact.ops.library`; plain PyTorch as traced ATen).
        static: the ``memory=`` policies under which ``backend="auto"``'s static order (where nothing is
            measured) includes it, in :data:`BACKENDS` order (:data:`PRIORITY`, :data:`LEAN_PRIORITY`);
            empty for an opt-in backend, which runs when asked for or when a measurement picks it.
    """

    name: ClassVar[str] = ""
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    devices: ClassVar[Optional[tuple[str, ...]]] = None
    min_compute_capability: ClassVar[Optional[tuple[int, int]]] = None
    channels_multiple: ClassVar[int] = 1
    fused: ClassVar[bool] = True
    lean: ClassVar[bool] = True
    traceable: ClassVar[bool] = False
    static: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def runtime_mode(cls) -> Optional[str]:
        """How the backend's kernels run in this process, for reports (None: nothing to say)."""
        return None

    @classmethod
    def not_supported_reasons(cls, x: torch.Tensor, spec: Optional[ChainSpec] = None,
                              dtype: Optional[torch.dtype] = None) -> list[str]:
        """Why this backend cannot run ``spec`` on input ``x`` (N, C, H, W) in compute dtype ``dtype``
        (default x's); an empty list means it can. Without ``spec`` only the input is checked."""
        dtype = dtype or x.dtype
        reasons: list[str] = []
        if cls.devices is not None and x.device.type not in cls.devices:
            reasons.append(f"{cls.name}: device type {x.device.type!r} not supported")
        if dtype not in cls.dtypes:
            reasons.append(f"{cls.name}: dtype {dtype} not in {list(cls.dtypes)}")
        if cls.channels_multiple > 1:
            chans = [x.shape[1]] if x.dim() == 4 else []
            if spec is not None:
                chans += [g.out_channels for g in spec.convs]
            bad = sorted({c for c in chans if c % cls.channels_multiple})
            if bad:
                reasons.append(f"{cls.name}: channels {bad} not a multiple of {cls.channels_multiple}")
        if cls.min_compute_capability is not None and x.device.type == "cuda":
            cc = torch.cuda.get_device_capability(x.device)
            if cc < cls.min_compute_capability:
                reasons.append(f"{cls.name}: compute capability {cc} < {cls.min_compute_capability}")
        return reasons

    @classmethod
    def make_plan(cls, spec: ChainSpec, modes: tuple[BNMode, ...], x: torch.Tensor, cdtype: torch.dtype,
                  in_stats: bool, out_stats: bool, residual_dtype: Optional[torch.dtype]) -> Optional[Plan]:
        """Everything decided once per input signature (None for backends that need nothing)."""
        return None

    @classmethod
    def compiled_plan(cls, spec: ChainSpec, modes: tuple[BNMode, ...], shape: tuple, strides: tuple,
                      x_dtype: torch.dtype, device: torch.device, cdtype: torch.dtype,
                      residual_dtype: Optional[torch.dtype]) -> Plan:
        """The plan :mod:`fused_preact.ops.library`'s custom ops run under ``torch.compile``, for an input
        of concrete ``shape``/``strides`` (no statistics handed in or out). Fused backends with
        ``traceable`` implement it.

        Raises:
            NotImplementedError: the backend does not run under ``torch.compile``.
        """
        raise NotImplementedError(f"fused_preact: backend {cls.name!r} does not run under torch.compile")


def _range_reasons(name: str, x: torch.Tensor, spec: Optional[ChainSpec]) -> list[str]:
    """The Triton kernels' index-range refusals (:func:`fused_preact.ops.index_range.range_reasons`) for
    backend ``name`` running ``spec`` on x; none without a spec or a 4-D x."""
    if spec is None or x.dim() != 4 or x.numel() == 0:
        return []
    return [f"{name}: {r}" for r in range_reasons(chain_shapes(spec, x.shape), x.stride(), chain_margin(spec))]


class ReferenceBackend(Backend):
    """Plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d``): the source of truth."""

    name = "reference"
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    fused = False
    lean = False
    traceable = True
    static = ("fastest", "lean")


class TritonBackend(Backend):
    """The fused Triton kernels (:mod:`fused_preact.ops.triton`)."""

    name = "triton"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    devices = ("cpu", "cuda")
    min_compute_capability = (8, 0)
    traceable = True
    static = ("fastest", "lean")

    @classmethod
    def runtime_mode(cls):
        """:func:`fused_preact.ops._common.triton_mode`: ``"compiled"``, ``"interpreter"`` or ``"missing"``."""
        return triton_mode()

    #: version reasons already warned about (once per process)
    _warned: ClassVar[set] = set()
    _warn_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def version_reasons(cls) -> list[str]:
        """Why the installed Triton cannot build this backend's kernels (the release is older than
        :data:`~fused_preact.ops.triton_compat.MIN_TRITON`, or a kernel needs a newer one), each reason
        naming the kernel and both versions; warned once per process per reason (``RuntimeWarning``)."""
        if triton_mode() == "missing":
            return []
        found = [triton_compat.supported_reason()] + [triton_compat.kernel_unsupported_reason(k)
                                                      for k in sorted(triton_compat.KERNEL_REQUIREMENTS)]
        reasons = list(dict.fromkeys(f"triton: {r}" for r in found if r))
        if not reasons or torch.compiler.is_compiling():  # traced: no lock, no warning
            return reasons
        with cls._warn_lock:
            new = [r for r in reasons if r not in cls._warned]
            cls._warned.update(new)
        for r in new:
            warnings.warn(f"fused_preact: {r}; the triton backend is not used", RuntimeWarning, stacklevel=3)
        return reasons

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        reasons = super().not_supported_reasons(x, spec, dtype)
        mode = triton_mode()
        reasons.extend(cls.version_reasons())
        if mode == "missing":
            reasons.append("triton: the triton package is not installed")
        elif x.device.type == "cpu" and mode != "interpreter":
            reasons.append("triton: CPU tensor and Triton's interpreter is off (set TRITON_INTERPRET=1 before "
                           "fused_preact is first imported to run the kernels on CPU)")
        elif x.device.type == "cuda" and mode == "interpreter":
            reasons.append("triton: CUDA tensor but the kernels were built for Triton's interpreter")
        return reasons + _range_reasons(cls.name, x, spec)

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return TritonPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, out_stats,
                          residual_dtype)

    @classmethod
    def compiled_plan(cls, spec, modes, shape, strides, x_dtype, device, cdtype, residual_dtype):
        return TritonPlan(spec, modes, shape, strides, x_dtype, device, cdtype, False, False, residual_dtype)


class CudaBackend(Backend):
    """The CUDA C++ extension (``csrc/``, :mod:`fused_preact.ops.cuda`): CUTLASS convolutions with the
    BN+ReLU transform in the mainloop; per unit, statistics by its own kernels (no epilogue chaining)."""

    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16)
    devices = ("cuda",)
    min_compute_capability = (8, 0)
    channels_multiple = 8

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        reasons = super().not_supported_reasons(x, spec, dtype)
        missing = not cuda_ext.available()
        if missing:
            reasons.append(f"cuda: the fused_preact._C extension is not available ({cuda_ext.load_error()}); build "
                           "it with `pip install --no-build-isolation -e .` (CUDA torch, nvcc, nvidia-cutlass) or "
                           "fused_preact.ops.cuda.ext.jit_load()")
        if spec is not None and x.dim() == 4:
            # The extension's own checks, on stride-0 stand-ins of each conv's input in the compute dtype.
            shapes = chain_shapes(spec, x.shape)
            convs = [(g, shapes[i]) for i, g in enumerate(spec.convs)] + ([(spec.proj, shapes[0])] if spec.proj else [])
            for g, shape in convs:
                stand_in = torch.empty(1, device=x.device, dtype=dtype or x.dtype).expand(shape)
                w = torch.empty((g.out_channels, g.in_channels // g.groups, *g.kernel), device="meta")
                reasons.extend(r for r in cuda_ext.not_supported_reasons(stand_in, w, g.stride, g.padding,
                                                                         g.dilation, g.groups)
                               if r not in reasons and not (missing and "extension is not available" in r))
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return CudaPlan(spec, modes, x.shape, x.dtype, cdtype, residual_dtype)


class RecomputeBackend(Backend):
    """cuDNN's convolutions with BatchNorm+ReLU recomputed from the saved BN input
    (:mod:`fused_preact.ops.recompute`): saves what the fused kernels save, runs no custom GEMM. Its
    elementwise steps are Triton kernels on CUDA and on CPU under Triton's interpreter, ATen ops
    elsewhere (``runtime_mode``)."""

    name = "recompute"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    devices = ("cpu", "cuda")
    static = ("lean",)

    @classmethod
    def runtime_mode(cls):
        """Where the elementwise steps are Triton kernels and where ATen ops: ``"triton on CUDA, aten on
        CPU"`` (compiled Triton), ``"interpreter on CPU, aten on CUDA"`` (Triton's interpreter), or
        ``"aten"`` (no triton)."""
        return {"compiled": "triton on CUDA, aten on CPU",
                "interpreter": "interpreter on CPU, aten on CUDA"}.get(triton_mode(), "aten")

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        reasons = super().not_supported_reasons(x, spec, dtype)
        if x.device.type in cls.devices and uses_triton(x.device):
            reasons += _range_reasons(cls.name, x, spec)
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return RecomputePlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, residual_dtype)


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (CudaBackend, TritonBackend, RecomputeBackend,
                                                          ReferenceBackend)}

#: Order in which ``backend="auto"`` tries backends where it does not measure (see
#: :mod:`fused_preact.ops.auto`), from the backends' ``static``: the fused kernels, then plain PyTorch.
#: ``recompute`` is not in it: it wins only by measurement (or as the lean choice, :data:`LEAN_PRIORITY`),
#: since where triton refuses it costs an extra elementwise pass per unit over the reference path for a
#: memory saving nobody asked for. ``cuda`` is opt-in (``backend="cuda"``) until its kernels have passed
#: the test suite and the benchmark on a GPU (a measured ``auto`` validates it before it may win).
PRIORITY: tuple[str, ...] = ()
#: The static order under ``memory="lean"``: the lean backends first.
LEAN_PRIORITY: tuple[str, ...] = ()
#: Backends that run under ``torch.compile``.
TRACEABLE: tuple[str, ...] = ()


def _derive() -> None:
    global PRIORITY, LEAN_PRIORITY, TRACEABLE
    PRIORITY = tuple(n for n, b in BACKENDS.items() if "fastest" in b.static)
    LEAN_PRIORITY = tuple(n for n, b in BACKENDS.items() if "lean" in b.static)
    TRACEABLE = tuple(n for n, b in BACKENDS.items() if b.traceable)


_derive()


def static_order(memory: str = "fastest") -> tuple[str, ...]:
    """:data:`PRIORITY` (``memory="fastest"``) or :data:`LEAN_PRIORITY` (``"lean"``), as registered now."""
    return LEAN_PRIORITY if memory == "lean" else PRIORITY


def register(backend: type[Backend]) -> type[Backend]:
    """Enrol ``backend`` in :data:`BACKENDS` — before the reference backend, so that plain PyTorch stays
    the static orders' last resort — and in the orders its class attributes ask for (``static``,
    ``traceable``): ``backend=`` accepts its name, ``auto`` measures and validates it, ``torch.compile``
    refuses or traces it as declared. Usable as a class decorator; returns ``backend``.

    Raises:
        ValueError: its ``name`` is empty, ``"auto"``, or taken by another class.
    """
    name = backend.name
    if not name or name == "auto" or (name in BACKENDS and BACKENDS[name] is not backend):
        raise ValueError(f"fused_preact: cannot register a backend named {name!r}")
    items = [(n, b) for n, b in BACKENDS.items() if n != name]
    last = [i for i, (_, b) in enumerate(items) if not b.fused]
    items.insert(last[0] if last else len(items), (name, backend))
    BACKENDS.clear()
    BACKENDS.update(items)
    _derive()
    return backend


def unregister(name: str) -> None:
    """Remove a backend :func:`register` enrolled (plans cached for it stay with their owners)."""
    BACKENDS.pop(name, None)
    _derive()


class BackendChoice(NamedTuple):
    """The backend that will run and why the ones before it in the priority list did not.

    Attributes:
        backend: the chosen backend class. skipped: reasons of backends tried first (empty when the
        first fit).
    """

    backend: type[Backend]
    skipped: tuple[str, ...] = ()
    #: for ``backend="auto"``: the :class:`fused_preact.ops.auto.Decision` behind the choice (candidates,
    #: times, validation errors, where it came from), or None where nothing was decided beyond the
    #: static priority
    decision: Optional[object] = None

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def reason(self) -> Optional[str]:
        """A one-line explanation of the fallback, or None if the preferred backend runs."""
        return "; ".join(self.skipped) if self.skipped else None


def check_backend_name(requested: str) -> str:
    """``requested`` if it is ``"auto"`` or a name in :data:`BACKENDS`.

    Raises:
        ValueError: another value.
    """
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"fused_preact: unknown backend {requested!r}; expected 'auto' or one of {list(BACKENDS)}")
    return requested


def select_backend(requested: str, x: torch.Tensor, spec: Optional[ChainSpec] = None,
                   dtype: Optional[torch.dtype] = None) -> BackendChoice:
    """Pick the backend for input ``x`` (N, C, H, W) running ``spec`` in compute dtype ``dtype``
    (default: x's; pass the autocast dtype under autocast).

    Raises:
        ValueError: ``requested`` is not ``"auto"`` or a name in :data:`BACKENDS`.
        RuntimeError: a backend was forced and cannot serve ``x`` (the message lists why).
    """
    if requested == "auto":
        skipped: list[str] = []
        for name in static_order():
            reasons = BACKENDS[name].not_supported_reasons(x, spec, dtype)
            if not reasons:
                return BackendChoice(BACKENDS[name], tuple(skipped))
            skipped.extend(reasons)
        raise RuntimeError("fused_preact: no backend can serve this input: " + "; ".join(skipped))
    check_backend_name(requested)
    reasons = BACKENDS[requested].not_supported_reasons(x, spec, dtype)
    if reasons:
        raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this input: " + "; ".join(reasons))
    return BackendChoice(BACKENDS[requested])


def eager_fallback(requested: str, why: str, what: str = "call") -> BackendChoice:
    """The one answer to "plain PyTorch, and why" for a call no fused backend may serve (a hook, a
    transform, an input the kernels cannot address, …): the reference backend with ``why`` as the
    reason, under ``"auto"`` or a requested unfused backend. ``what``: the refused thing, in the error.

    Raises:
        ValueError: ``requested`` is not ``"auto"`` or a name in :data:`BACKENDS`.
        RuntimeError: ``requested`` names a fused backend (a forced backend never falls back); the
            message says why.
    """
    if check_backend_name(requested) != "auto" and BACKENDS[requested].fused:
        raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this {what}: {why}")
    return BackendChoice(ReferenceBackend, (why,))


class LastCall(NamedTuple):
    """The latest call of a plan cache's owner: its signature (None for a call that ran eagerly before
    any lookup: hooks, child module types, a shortcut the chains do not take), the backend and memory
    policy requested, the backend that ran (it differs from the cached entry's when the call overruled
    it, e.g. forward-mode AD) and why the preferred one did not."""

    key: Optional[tuple]
    requested: str
    memory: str
    runs: str
    reason: Optional[str]


#: Input signatures whose plans one owner keeps (least recently used dropped first): a module called
#: with many shapes (multi-scale training) holds this many plans and rebuilds the others when they return.
MAX_PLANS = 64


class PlanCache(LRUDict):
    """Plans of one owner (a module, or the functional API), keyed by input signature, at most
    :data:`MAX_PLANS` (:class:`~fused_preact.ops._common.LRUDict`). Copies and pickles of the owner
    start with an empty cache (plans are cheap to rebuild, and bound to devices).

    ``last``: the owner's latest call outside ``torch.compile`` since the cache was last cleared
    (:class:`LastCall`), or None."""

    last: Optional[LastCall] = None

    def __init__(self, maxsize: Optional[int] = None):
        super().__init__(MAX_PLANS if maxsize is None else maxsize)

    def clear(self) -> None:
        super().clear()
        self.last = None

    def __deepcopy__(self, memo):
        return PlanCache(self.maxsize)

    def __reduce__(self):
        return (PlanCache, (self.maxsize,))
