"""Backends of the fused chain: what each serves, why it refuses, and how it runs a chain.

Modelled on xformers' operator classes (``xformers/ops/fmha/common.py`` ``AttentionOpBase``,
``fmha/flash.py`` ``FwOp``): every backend is a class declaring the dtypes, minimum compute capability
and channel alignment it serves; ``not_supported_reasons`` explains a refusal in words (each subclass
extends ``super()``'s list), and ``"auto"`` walks :data:`PRIORITY` and takes the first backend with
no reasons, carrying the reasons of those it skipped (a fallback is never silent).

    ``TritonBackend``     the fused Triton kernels: CUDA tensors on compute capability ≥ 8.0, or CPU
                          tensors when Triton's interpreter is active (``TRITON_INTERPRET=1`` before
                          triton is first imported)
    ``CudaBackend``       the CUDA C++ extension ``fused_preact._C`` (CUTLASS; opt-in until a GPU run
                          has verified it)
    ``ReferenceBackend``  plain PyTorch: any device and dtype PyTorch serves
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional

import torch

from fused_preact.ops import _cuda, library
from fused_preact.ops._common import compute_dtype, triton_mode
from fused_preact.ops._cuda_chain import CudaPlan
from fused_preact.ops._triton import TritonPlan
from fused_preact.ops.chain import ChainResult, fused_chain, reference_chain
from fused_preact.ops.chain_spec import BATCH, BNMode, ChainSpec, ChainTensors, chain_shapes, validate_chain

__all__ = ["Backend", "TritonBackend", "CudaBackend", "ReferenceBackend", "BACKENDS", "PRIORITY",
           "BackendChoice", "select_backend", "PlanCache", "run_chain"]


class Backend:
    """Base class: declared capabilities, refusal reasons, and how to run a chain.

    Class attributes:
        name: the string accepted by ``backend=``.
        dtypes: compute dtypes served (the autocast dtype under autocast).
        min_compute_capability: lowest CUDA (major, minor) served; None for device-agnostic.
        channels_multiple: every channel count must be a multiple of this (alignment; 1 = any).
        fused: runs fused kernels (a plan per input signature) rather than plain PyTorch.
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
                  in_stats: bool, out_stats: bool, residual_dtype: Optional[torch.dtype]):
        """Everything decided once per input signature (None for backends that need nothing)."""
        return None

    @classmethod
    def run(cls, plan, spec: ChainSpec, x: torch.Tensor, t: ChainTensors, modes: tuple[BNMode, ...]) -> ChainResult:
        """Run the chain (forward, recorded for autograd where needed)."""
        raise NotImplementedError


class ReferenceBackend(Backend):
    """Plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d``): the source of truth."""

    name = "reference"
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    fused = False

    @classmethod
    def run(cls, plan, spec, x, t, modes):
        return reference_chain(spec, x, t, modes)


class _FusedBackend(Backend):
    """A backend whose plans implement ``forward``/``backward`` (run by one autograd node)."""

    @classmethod
    def run(cls, plan, spec, x, t, modes):
        if torch.compiler.is_compiling():
            return library.compiled_chain(cls.name, spec, x, t, modes, plan)
        return fused_chain(plan, x, t)


class TritonBackend(_FusedBackend):
    """The fused Triton kernels (:mod:`fused_preact.ops._triton`)."""

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
                           "importing triton to run the kernels on CPU)")
        elif x.device.type == "cuda" and mode == "interpreter":
            reasons.append("triton: CUDA tensor but the kernels were built for Triton's interpreter")
        elif x.device.type not in ("cpu", "cuda"):
            reasons.append(f"triton: device type {x.device.type!r} not supported")
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return TritonPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, cdtype, in_stats, out_stats,
                          residual_dtype)


class CudaBackend(_FusedBackend):
    """The CUDA C++ extension (``csrc/``, :mod:`fused_preact.ops._cuda`): CUTLASS convolutions with the
    BN+ReLU transform in the mainloop; per unit, statistics by its own kernels (no epilogue chaining)."""

    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16)
    min_compute_capability = (8, 0)
    channels_multiple = 8

    @classmethod
    def not_supported_reasons(cls, x, spec=None, dtype=None):
        reasons = super().not_supported_reasons(x, spec, dtype)
        missing = not _cuda.available()
        if missing:
            reasons.append(f"cuda: the fused_preact._C extension is not available ({_cuda.load_error()}); build it "
                           "with `pip install --no-build-isolation -e .` (CUDA torch, nvcc, nvidia-cutlass) or "
                           "fused_preact.ops._cuda.jit_load()")
        if spec is not None and x.dim() == 4:
            # The extension's own checks, on stride-0 stand-ins of each conv's input in the compute dtype.
            shapes = chain_shapes(spec, x.shape)
            convs = [(g, shapes[i]) for i, g in enumerate(spec.convs)] + ([(spec.proj, shapes[0])] if spec.proj else [])
            for g, shape in convs:
                stand_in = torch.empty(1, device=x.device, dtype=dtype or x.dtype).expand(shape)
                w = torch.empty((g.out_channels, g.in_channels // g.groups, *g.kernel), device="meta")
                reasons.extend(r for r in _cuda.not_supported_reasons(stand_in, w, g.stride, g.padding, g.dilation,
                                                                      g.groups)
                               if r not in reasons and not (missing and "extension is not available" in r))
        return reasons

    @classmethod
    def make_plan(cls, spec, modes, x, cdtype, in_stats, out_stats, residual_dtype):
        return CudaPlan(spec, modes, x.shape, x.dtype, cdtype, residual_dtype)


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (CudaBackend, TritonBackend, ReferenceBackend)}

#: Order in which ``backend="auto"`` tries backends. ``cuda`` is opt-in (``backend="cuda"``) until its
#: kernels have passed the test suite and the benchmark on a GPU.
PRIORITY: tuple[str, ...] = ("triton", "reference")


class BackendChoice(NamedTuple):
    """The backend that will run and why the ones before it in the priority list did not.

    Attributes:
        backend: the chosen backend class. skipped: reasons of backends tried first (empty when the
        first fit).
    """

    backend: type[Backend]
    skipped: tuple[str, ...] = ()

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


def run_chain(requested: str, cache: PlanCache, spec: ChainSpec, x: torch.Tensor, t: ChainTensors,
              modes: tuple[BNMode, ...], out_stats: bool = False) -> tuple[ChainResult, BackendChoice]:
    """Run a chain with the backend ``requested`` (``"auto"`` or a name in :data:`BACKENDS`).

    On the first call with a new input signature (spec, BN modes, x's shape/strides/dtype/device, the
    compute dtype, the weights' dtypes and shapes, whether statistics are handed in or wanted) the
    inputs are validated, the backend chosen and its plan built, all cached in ``cache``; later calls
    look the entry up and launch. An empty batch (N = 0) runs the reference path, as PyTorch.

    Returns:
        ``(result, choice)``: the :class:`ChainResult` and the :class:`BackendChoice` that ran.

    Raises:
        ValueError / RuntimeError: invalid inputs (:func:`validate_chain`); a forced backend that
            cannot serve them; an unknown backend name.
    """
    cd = compute_dtype(x)
    rd = t.residual.dtype if t.residual is not None else None
    key = (requested, spec, modes, x.shape, x.stride(), x.dtype, cd, x.device, t.in_stats is not None, out_stats,
           rd, tuple((w.dtype, w.shape) for w in t.weights))
    entry = cache.get(key)
    if entry is None:
        validate_chain(spec, x, t, modes)
        choice = select_backend(requested, x, spec, cd)
        plan = None
        if choice.backend.fused and x.shape[0] > 0:
            in_stats = t.in_stats is not None and modes[0].kind == BATCH
            plan = choice.backend.make_plan(spec, modes, x, cd, in_stats, out_stats, rd)
        entry = cache[key] = (choice, plan)
    choice, plan = entry
    if plan is None:
        return ReferenceBackend.run(None, spec, x, t, modes), choice
    return choice.backend.run(plan, spec, x, t, modes), choice
