"""Backends of the fused BN→ReLU→Conv op: what each supports, why it refuses, which one runs.

Modelled on xformers' operator dispatch: every backend declares the dtypes, devices and minimum
compute capability it serves and explains a refusal in words (``not_supported_reasons``); ``"auto"``
walks :data:`PRIORITY` and takes the first backend with no reasons. The reasons of the backends it
skipped travel with the choice, so a fallback is never silent.

Backends
    ``"triton"``     the fused Triton kernels (``fused_preact.ops``): CUDA tensors on compute
                     capability ≥ 8.0, or CPU tensors when Triton's interpreter is active
                     (``TRITON_INTERPRET=1`` set before ``triton`` is first imported).
    ``"reference"``  plain PyTorch (``F.batch_norm`` → ``F.relu`` → ``F.conv2d``): any device and
                     dtype PyTorch supports; the source of truth the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch

__all__ = ["Backend", "BackendChoice", "PRIORITY", "backends", "select_backend", "triton_mode"]


_TRITON_MODE: Optional[str] = None


@torch.compiler.assume_constant_result
def triton_mode() -> str:
    """How Triton kernels can run in this process.

    Returns:
        ``"missing"`` if ``triton`` cannot be imported, ``"interpreter"`` if its interpreter is active
        (the kernels were decorated while ``TRITON_INTERPRET=1``; they then run on CPU tensors only),
        otherwise ``"compiled"`` (CUDA tensors only). Fixed for the life of the process, so
        ``torch.compile`` treats it as a constant.
    """
    global _TRITON_MODE
    if _TRITON_MODE is None:
        try:
            from fused_preact.ops import _conv_kernels
        except ImportError:
            _TRITON_MODE = "missing"
        else:
            kernel_type = type(_conv_kernels._fprop_kernel).__name__
            _TRITON_MODE = "interpreter" if kernel_type == "InterpretedFunction" else "compiled"
    return _TRITON_MODE


#: ``(weight, stride, padding, dilation, groups)`` of one convolution, as ``F.conv2d`` takes them.
ConvArgs = tuple


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend's declared capabilities (xformers-style).

    Attributes:
        name: the string accepted by ``backend=``.
        dtypes: input dtypes served.
        min_compute_capability: lowest CUDA (major, minor) served; ``None`` for device-agnostic.
        channels_multiple: input channels must be a multiple of this (alignment; 1 = any).
        layouts: memory formats served without a copy (others are accepted and copied).
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    min_compute_capability: Optional[tuple[int, int]]
    channels_multiple: int = 1
    layouts: tuple[str, ...] = ("channels_last", "contiguous")

    def not_supported_reasons(self, x: torch.Tensor, convs: Optional[Sequence[ConvArgs]] = None) -> list[str]:
        """Why this backend cannot serve input ``x`` (N, C, H, W); an empty list means it can.

        ``convs``: the ``(weight, stride, padding, dilation, groups)`` of each convolution that will
        read ``relu(bn(x))``, for backends whose limits depend on the convolution (``cuda``);
        without it only the input is checked.
        """
        reasons: list[str] = []
        if x.dtype not in self.dtypes:
            reasons.append(f"{self.name}: dtype {x.dtype} not in {list(self.dtypes)}")
        if self.channels_multiple > 1 and x.dim() == 4 and x.shape[1] % self.channels_multiple:
            reasons.append(f"{self.name}: channels {x.shape[1]} not a multiple of {self.channels_multiple}")
        if self.name == "triton":
            mode = triton_mode()
            if mode == "missing":
                reasons.append("triton: the triton package is not installed")
            elif x.device.type == "cpu" and mode != "interpreter":
                reasons.append(
                    "triton: CPU tensor and Triton's interpreter is off "
                    "(set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU)"
                )
            elif x.device.type == "cuda" and mode == "interpreter":
                reasons.append("triton: CUDA tensor but the kernels were built for Triton's interpreter")
            elif x.device.type not in ("cpu", "cuda"):
                reasons.append(f"triton: device type {x.device.type!r} not supported")
        if self.name == "cuda":
            from fused_preact.ops import _cuda

            if not _cuda.available():
                reasons.append(f"cuda: the fused_preact._C extension is not available ({_cuda.load_error()})")
            for conv in convs or ():
                reasons.extend(r for r in _cuda.not_supported_reasons(x, *conv) if r not in reasons)
        if (
            self.min_compute_capability is not None
            and x.device.type == "cuda"
            and torch.cuda.get_device_capability(x.device) < self.min_compute_capability
        ):
            cc = torch.cuda.get_device_capability(x.device)
            reasons.append(f"{self.name}: compute capability {cc} < {self.min_compute_capability}")
        return reasons


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ALL_FLOATS = _FLOATS + (torch.float64,)

BACKENDS: dict[str, Backend] = {
    "cuda": Backend("cuda", (torch.float16, torch.bfloat16), (8, 0), channels_multiple=8, layouts=("channels_last",)),
    "triton": Backend("triton", _FLOATS, (8, 0)),
    "reference": Backend("reference", _ALL_FLOATS, None),
}

#: Order in which ``backend="auto"`` tries backends. ``cuda`` (the CUTLASS extension in ``csrc/``)
#: is opt-in (``backend="cuda"``) until its kernels have passed the test suite on a GPU.
PRIORITY: tuple[str, ...] = ("triton", "reference")


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend that will run and why the ones before it in the priority list did not.

    Attributes:
        name: the chosen backend's name.
        skipped: reasons of backends that were tried first and refused (empty when the first fit).
    """

    name: str
    skipped: tuple[str, ...] = ()

    @property
    def reason(self) -> Optional[str]:
        """A one-line explanation of the fallback, or ``None`` if the preferred backend ran."""
        return "; ".join(self.skipped) if self.skipped else None


def select_backend(requested: str, x: torch.Tensor, convs: Optional[Sequence[ConvArgs]] = None) -> BackendChoice:
    """Pick the backend for input ``x`` (N, C, H, W).

    Args:
        requested: ``"auto"`` or a name in :data:`BACKENDS`.
        x: the activation tensor the op will read.
        convs: ``(weight, stride, padding, dilation, groups)`` of the convolutions reading
            ``relu(bn(x))`` (see :meth:`Backend.not_supported_reasons`).

    Raises:
        ValueError: ``requested`` is not a known backend name.
        RuntimeError: a backend was forced and cannot serve ``x`` (the message lists why).
    """
    if requested == "auto":
        skipped: list[str] = []
        for name in PRIORITY:
            reasons = BACKENDS[name].not_supported_reasons(x, convs)
            if not reasons:
                return BackendChoice(name, tuple(skipped))
            skipped.extend(reasons)
        raise RuntimeError("fused_preact: no backend can serve this input: " + "; ".join(skipped))
    if requested not in BACKENDS:
        raise ValueError(f"fused_preact: unknown backend {requested!r}; expected 'auto' or one of {list(BACKENDS)}")
    reasons = BACKENDS[requested].not_supported_reasons(x, convs)
    if reasons:
        raise RuntimeError(f"fused_preact: backend={requested!r} cannot serve this input: " + "; ".join(reasons))
    return BackendChoice(requested)


def backends(devices: Optional[Sequence[str]] = None) -> dict[str, dict[str, object]]:
    """Report every backend's availability per device and dtype.

    Args:
        devices: device strings to probe (default: ``"cpu"`` and, if available, ``"cuda"``).

    Returns:
        ``{backend: {"priority": int, "dtypes": [...], "min_compute_capability": ..., "<device>/<dtype>":
        "ok" or the refusal reason}}``. Probes use empty (N=1, C=8, H=W=1) tensors; nothing is launched.
    """
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report: dict[str, dict[str, object]] = {}
    for name, backend in BACKENDS.items():
        entry: dict[str, object] = {
            "priority": PRIORITY.index(name) if name in PRIORITY else None,
            "dtypes": [str(d) for d in backend.dtypes],
            "min_compute_capability": backend.min_compute_capability,
            "triton_mode": triton_mode() if name == "triton" else None,
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        }
        for dev in devices:
            for dtype in _ALL_FLOATS:
                probe = torch.empty(1, 8, 1, 1, device=dev, dtype=dtype)
                reasons = backend.not_supported_reasons(probe)
                entry[f"{dev}/{str(dtype).replace('torch.', '')}"] = "; ".join(reasons) if reasons else "ok"
        report[name] = entry
    return report
