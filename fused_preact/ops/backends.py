"""Backends of the fused chain: the plan protocol, what each backend serves, why it refuses, and the
one entry point that runs a chain (:func:`run_chain`).

Modelled on xformers' operator classes (``xformers/ops/fmha/common.py`` ``AttentionOpBase``): every
backend is a class declaring the dtypes, minimum compute capability and channel alignment it serves;
``not_supported_reasons`` explains a refusal in words (each subclass extends ``super()``'s list), and
``"auto"`` walks :data:`PRIORITY` and takes the first backend with no reasons, carrying the reasons of
those it skipped (a fallback is never silent). Fused backends build a :class:`Plan` per input
signature (quack's ``backends/protocol.py`` pattern): everything decided once, then launches.

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

from typing import ClassVar, NamedTuple, Optional, Protocol

import torch
import torch.nn.functional as F

from fused_preact.ops import library
from fused_preact.ops._common import compute_dtype, triton_mode
from fused_preact.ops.chain import ChainFunction, ChainResult, differentiable_slots, reference_chain
from fused_preact.ops.cuda import ext as cuda_ext
from fused_preact.ops.cuda.plan import CudaPlan
from fused_preact.ops.recompute.plan import RecomputePlan
from fused_preact.ops.spec import (BATCH, EXTERNAL, BNMode, ChainForward, ChainGrads, ChainSpec, ChainTensors, GradNeeds,
                                   SavedChain, StatsHandoff, chain_shapes, validate_chain)
from fused_preact.ops.triton.plan import TritonPlan

__all__ = ["Plan", "Backend", "TritonBackend", "CudaBackend", "RecomputeBackend", "ReferenceBackend", "BACKENDS",
           "PRIORITY",
           "BackendChoice", "select_backend", "PlanCache", "run_chain"]


class Plan(Protocol):
    """What a fused backend's plan provides: built once per input signature, run per call.

    Attributes:
        spec, modes: the chain and its BN modes. cdtype: compute dtype. out_shape, out_dtype: the
        output's. proj_shape: the returned projection's (``proj_out="return"``). out_stats: whether
        :meth:`forward` hands out the output's partial statistics.
    """

    spec: ChainSpec
    modes: tuple
    cdtype: torch.dtype
    out_shape: tuple
    out_dtype: torch.dtype
    out_stats: bool

    def forward(self, x: torch.Tensor, t: ChainTensors) -> ChainForward:
        """Run the chain's forward on ``x`` with the call's tensors ``t``; update running statistics."""

    def backward(self, dy: torch.Tensor, dy_proj: Optional[torch.Tensor], saved: SavedChain, weights,
                 proj_weight: Optional[torch.Tensor], needs: GradNeeds) -> ChainGrads:
        """Gradients from the output gradient(s), the forward's ``saved`` tensors and the weights."""


class Backend:
    """Base class: declared capabilities, refusal reasons, and how to build a plan.

    Class attributes:
        name: the string accepted by ``backend=``.
        dtypes: compute dtypes served (the autocast dtype under autocast).
        min_compute_capability: lowest CUDA (major, minor) served; None for device-agnostic.
        channels_multiple: every channel count must be a multiple of this (alignment; 1 = any).
        fused: runs fused kernels (a :class:`Plan` per input signature) rather than plain PyTorch.
    """

    name: ClassVar[str] = ""
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    min_compute_capability: ClassVar[Optional[tuple[int, int]]] = None
    channels_multiple: ClassVar[int] = 1
    fused: ClassVar[bool] = True

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


class ReferenceBackend(Backend):
    """Plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d``): the source of truth."""

    name = "reference"
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    fused = False


class TritonBackend(Backend):
    """The fused Triton kernels (:mod:`fused_preact.ops.triton`)."""

    name = "triton"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    min_compute_capability = (8, 0)

    @classmethod
    def runtime_mode(cls):
        """:func:`fused_preact.ops._common.triton_mode`: ``"compiled"``, ``"interpreter"`` or ``"missing"``."""
        return triton_mode()

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        reasons = super().not_supported_reasons(x, spec, dtype)
        mode = triton_mode()
        if mode == "missing":
            reasons.append("triton: the triton package is not installed")
        elif x.device.type == "cpu" and mode != "interpreter":
            reasons.append("triton: CPU tensor and Triton's interpreter is off (set TRITON_INTERPRET=1 before "
                           "fused_preact is first imported to run the kernels on CPU)")
        elif x.device.type == "cuda" and mode == "interpreter":
            reasons.append("triton: CUDA tensor but the kernels were built for Triton's interpreter")
        elif x.device.type not in ("cpu", "cuda"):
            reasons.append(f"triton: device type {x.device.type!r} not supported")
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return TritonPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, out_stats,
                          residual_dtype)


class CudaBackend(Backend):
    """The CUDA C++ extension (``csrc/``, :mod:`fused_preact.ops.cuda`): CUTLASS convolutions with the
    BN+ReLU transform in the mainloop; per unit, statistics by its own kernels (no epilogue chaining)."""

    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16)
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
        if x.device.type not in ("cpu", "cuda"):
            reasons.append(f"recompute: device type {x.device.type!r} not supported")
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return RecomputePlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, residual_dtype)


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (CudaBackend, TritonBackend, RecomputeBackend,
                                                          ReferenceBackend)}

#: Order in which ``backend="auto"`` tries backends where it does not measure (see
#: :mod:`fused_preact.ops.auto`): the fused kernels, then plain PyTorch. ``recompute`` is not in it: it
#: wins only by measurement (or as the lean choice, :data:`fused_preact.ops.auto.LEAN_PRIORITY`), since
#: where triton refuses it costs an extra elementwise pass per unit over the reference path for a memory
#: saving nobody asked for. ``cuda`` is opt-in (``backend="cuda"``) until its kernels have passed the
#: test suite and the benchmark on a GPU (a measured ``auto`` validates it before it may win).
PRIORITY: tuple[str, ...] = ("triton", "reference")


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
        for name in PRIORITY:
            reasons = BACKENDS[name].not_supported_reasons(x, spec, dtype)
            if not reasons:
                return BackendChoice(BACKENDS[name], tuple(skipped))
            skipped.extend(reasons)
        raise RuntimeError("fused_preact: no backend can serve this input: " + "; ".join(skipped))
    if requested not in BACKENDS:
        raise ValueError(f"fused_preact: unknown backend {requested!r}; expected 'auto' or one of {list(BACKENDS)}")
    reasons = BACKENDS[requested].not_supported_reasons(x, spec, dtype)
    if reasons:
        raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this input: " + "; ".join(reasons))
    return BackendChoice(BACKENDS[requested])


class PlanCache(dict):
    """Plans of one owner (a module, or the functional API), keyed by input signature. Copies and
    pickles of the owner start with an empty cache (plans are cheap to rebuild, and bound to devices)."""

    def __deepcopy__(self, memo):
        return PlanCache()

    def __reduce__(self):
        return (PlanCache, ())


# ----------------------------------------------------------------------------------- running
def _sig(v) -> Optional[tuple]:
    return None if v is None else (v.dtype, v.device, v.shape, v.stride())


def _signature(requested: str, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes, cd, out_stats) -> tuple:
    """Everything a cached decision, validation and plan derive from: the chain, the BN modes and eps,
    the layout, dtype and device of x and of every tensor of the call, the compute dtype."""
    per_unit = tuple((_sig(t.weights[i]), _sig(t.biases[i]), _sig(t.gammas[i]), _sig(t.betas[i]),
                      _sig(t.running_means[i]), _sig(t.running_vars[i]), _sig(t.num_batches[i]), t.eps[i])
                     for i in range(len(t.weights)))
    extra = (_sig(t.proj_weight), _sig(t.residual), _sig(t.ext_mean), _sig(t.ext_invstd),
             None if t.in_stats is None else _sig(t.in_stats.part))
    return (requested, spec, modes, x.shape, x.stride(), x.dtype, x.device, cd, out_stats, per_unit, extra)


def _check_like_eager(spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...],
                      cd: torch.dtype) -> None:
    """Raise what eager ``F.batch_norm`` raises for each unit's arguments (eps rules, dtype mixing as the
    device allows it, …) by calling it on a 2-value-per-channel stand-in of the unit's input, with copies
    of the running buffers (nothing of the caller's changes). O(C) work, once per input signature."""
    shapes = chain_shapes(spec, x.shape)
    for i, mode in enumerate(modes):
        if mode.kind == EXTERNAL:  # statistics given from outside (synchronized BN checks its own)
            continue
        C = shapes[i][1]
        if i == 0 and x.numel() > 0:
            src = x.detach()[:1, :, :1, :1]
        else:
            src = torch.zeros(1, C, 1, 1, device=x.device, dtype=x.dtype if i == 0 else cd)
        rm, rv = t.running_means[i], t.running_vars[i]
        training = mode.kind == BATCH
        F.batch_norm(src.expand(2, C, 1, 1), rm.clone() if rm is not None else None,
                     rv.clone() if rv is not None else None, t.gammas[i], t.betas[i], training,
                     0.0 if t.momenta[i] is None else t.momenta[i], t.eps[i])


def _vector_reasons(t: ChainTensors) -> list[str]:
    """Per-channel vectors the fused kernels cannot address (they read ``ptr + c``)."""
    bad = []
    for i in range(len(t.weights)):
        for name in ("gammas", "betas", "running_means", "running_vars"):
            v = getattr(t, name)[i]
            if v is not None and not v.is_contiguous():
                bad.append(f"{name[:-1]} of unit {i}")
    return [f"fused kernels: non-contiguous per-channel vector ({', '.join(bad)})"] if bad else []


_EMPTY = BackendChoice(ReferenceBackend, ("empty batch (N = 0): plain PyTorch, as nn.BatchNorm2d/nn.Conv2d",))
_META = BackendChoice(ReferenceBackend, ("meta tensors: shapes only (plain PyTorch's meta kernels)",))


def run_chain(requested: str, cache: PlanCache, spec: ChainSpec, x: torch.Tensor, t: ChainTensors,
              modes: tuple[BNMode, ...], out_stats: bool = False,
              memory: str = "fastest") -> tuple[ChainResult, BackendChoice]:
    """Run a chain with the backend ``requested`` (``"auto"`` or a name in :data:`BACKENDS`).

    The call's signature (:func:`_signature`: chain, BN modes and eps, x's shape/strides/dtype/device,
    the compute dtype, and dtype/device/shape/strides of every weight, BN vector and buffer) keys
    ``cache``: on a miss the inputs are validated (:func:`validate_chain` and eager ``F.batch_norm``'s
    own checks), the backend chosen and its plan built; a hit has met all of that with tensors of the
    same signature. An empty batch (N = 0) and meta tensors run the reference path, as PyTorch.
    For ``"auto"`` the choice on a miss is :func:`fused_preact.ops.auto.decide`'s (measured and
    validated on CUDA, under the ``memory`` policy ``"fastest"`` or ``"lean"``).

    Returns:
        ``(result, choice)``: the :class:`ChainResult` and the :class:`BackendChoice` that ran.

    Raises:
        ValueError / RuntimeError: invalid inputs, with eager PyTorch's types and messages; a forced
            backend that cannot serve them; an unknown backend name.
    """
    cd = compute_dtype(x)
    key = _signature(requested if memory == "fastest" else (requested, memory), spec, x, t, modes, cd, out_stats)
    entry = cache.get(key)
    if entry is None:
        validate_chain(spec, x, t, modes)
        if x.device.type != "meta" and not torch.compiler.is_compiling():
            _check_like_eager(spec, x, t, modes, cd)
        if x.device.type == "meta":
            choice = _META
        else:
            choice = select_backend(requested, x, spec, cd)
        vector_reasons = _vector_reasons(t) if choice.backend.fused else []
        if vector_reasons:
            if requested != "auto":
                raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this input: "
                                   + "; ".join(vector_reasons))
            choice = BackendChoice(ReferenceBackend, choice.skipped + tuple(vector_reasons))
        plan = None
        if x.shape[0] == 0 and choice.backend.fused:
            choice = _EMPTY
        elif requested == "auto" and not vector_reasons and x.device.type != "meta" and x.shape[0] > 0:
            choice, plan = _auto.decide(choice, key, spec, x, t, modes, cd, out_stats, memory)
        if plan is None and choice.backend.fused:
            in_stats = t.in_stats is not None and modes[0].kind == BATCH
            rd = t.residual.dtype if t.residual is not None else None
            plan = choice.backend.make_plan(spec, modes, x, cd, in_stats, out_stats, rd)
        entry = cache[key] = (choice, plan)
    choice, plan = entry
    if plan is None:
        return reference_chain(spec, x, t, modes), choice
    if torch.compiler.is_compiling():
        if requested == "auto" and choice.name != "triton":  # a decision of a backend that does not trace
            choice, plan = _auto.traceable(choice, spec, x, t, modes, cd)
            if plan is None:
                return reference_chain(spec, x, t, modes), choice
        return library.compiled_chain(choice.name, spec, x, t, modes, plan), choice
    flat = differentiable_slots(t)
    if torch.is_grad_enabled() and (x.requires_grad or any(f is not None and f.requires_grad for f in flat)):
        outs = ChainFunction.apply(plan, t, x, *flat)
        outs = outs if isinstance(outs, tuple) else (outs,)
        proj_out = outs[1] if spec.proj is not None and spec.proj_out == "return" else None
        stats = StatsHandoff(outs[-1], *plan.handoff_geometry()) if plan.out_stats else None
        return ChainResult(outs[0], proj_out, stats), choice
    fwd = plan.forward(x, t)
    return ChainResult(fwd.out, fwd.proj_out, fwd.stats), choice


# The measured dispatch builds on everything above (and imports it): bound last, used at call time only.
from fused_preact.ops import auto as _auto  # noqa: E402
