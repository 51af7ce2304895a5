"""Helpers shared by the op files: the Triton import and mode, argument normalization, output sizes,
memory-format rules and dtype mappings. Imports nothing else of the package but
:mod:`~fused_preact.ops.triton_compat` (the Triton import and what differs between its releases)."""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import Sequence, Union

import torch

from fused_preact.ops.dtypes import traits
from fused_preact.ops.triton_compat import tl, triton

__all__ = [
    "triton", "tl", "triton_mode", "interpreting", "pair", "conv_out_size", "wants_channels_last", "nhwc_strides_of",
    "nhwc_strides", "dot_dtype", "input_precision", "compute_dtype", "autocast_enabled", "IntOr2", "LRUDict",
]

IntOr2 = Union[int, Sequence[int]]

def _probe_mode() -> str:
    if triton is None:
        return "missing"
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def _probe(x):
        pass

    return "interpreter" if isinstance(_probe, InterpretedFunction) else "compiled"


#: Decided once, when the op layer is imported — the moment its kernels are built, so the two agree:
#: ``TRITON_INTERPRET=1`` set later does not turn compiled kernels into interpreted ones.
_TRITON_MODE: str = _probe_mode()


@torch.compiler.assume_constant_result
def triton_mode() -> str:
    """How Triton kernels can run in this process.

    Returns:
        ``"missing"`` if ``triton`` cannot be imported, ``"interpreter"`` if its interpreter was active
        when fused_preact's kernels were built (``TRITON_INTERPRET=1`` set before ``fused_preact.ops``
        was first imported; kernels then run on CPU tensors only), otherwise ``"compiled"`` (CUDA
        tensors only). Fixed for the life of the process, so ``torch.compile`` treats it as a constant.
    """
    return _TRITON_MODE


def interpreting() -> bool:
    """True when the Triton kernels run under Triton's CPU interpreter."""
    return triton_mode() == "interpreter"


def pair(v: IntOr2, name: str) -> tuple[int, int]:
    """``F.conv2d``-style int-or-pair argument as a pair of ints.

    Raises:
        ValueError: ``v`` is a string.
        RuntimeError: a sequence whose length is not 1 or 2 (``F.conv2d``'s error and message).
    """
    if isinstance(v, str):
        raise ValueError(f"fused_preact: expected {name} to be an int or a pair of ints, got {v!r}")
    if not isinstance(v, (tuple, list)):
        try:  # an int-like scalar (numpy integer, 0-d integer tensor), as F.conv2d takes it
            i = operator.index(v)
        except TypeError:
            pass
        else:
            return (i, i)
    v = tuple(operator.index(i) for i in v)
    if len(v) == 1:  # F.conv2d expands a one-element list
        return (v[0], v[0])
    if len(v) != 2:
        raise RuntimeError(f"expected {name} to be a single integer value or a list of 2 values to match the "
                           f"convolution dimensions, but got {name}={list(v)}")
    return v


def conv_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output extent of a convolution along one axis (``torch.nn.Conv2d``'s formula)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def wants_channels_last(x: torch.Tensor) -> bool:
    """Whether an op's output should be channels_last: exactly when ``x`` is channels_last and not
    NCHW-contiguous (the real and fake implementations share this rule, so their strides agree)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def nhwc_strides_of(strides) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides from logical (N, C, H, W) ``strides``: the one place the kernels' argument
    order is derived."""
    sn, sc, sh, sw = strides
    return sn, sh, sw, sc


def nhwc_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The (n, h, w, c) element strides of a logical (N, C, H, W) tensor, whatever its memory format."""
    return nhwc_strides_of(t.stride())


def dot_dtype(dtype: torch.dtype):
    """Operand dtype for ``tl.dot`` given the compute dtype (:attr:`DtypeTraits.dot
    <fused_preact.ops.dtypes.DtypeTraits.dot>`), except bf16 under the interpreter.

    Triton's interpreter (seen with triton 3.9) returns wrong ``tl.dot`` results for bf16 operands,
    so there bf16 tiles are upcast to fp32 before the dot; compiled GPU kernels use bf16.

    Raises:
        TypeError: a dtype without traits (:func:`~fused_preact.ops.dtypes.traits`).
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return getattr(tl, traits(dtype).dot)


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for fp32 operands: TF32 exactly when cuDNN convolutions may use it."""
    if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 and not interpreting():
        return "tf32"
    return "ieee"


_AUTOCASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types autocast does not know
    (``meta``), where torch's own query raises."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a convolution on ``x`` runs in: the autocast dtype of x's device type when autocast
    is enabled there and x is a castable float (as ``F.conv2d`` under ``torch.autocast``), else x's."""
    dev = x.device.type
    if x.dtype in _AUTOCASTABLE and autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class LRUDict(OrderedDict):
    """A dict of at most ``maxsize`` entries that drops the least recently used (set or got) first: the
    per-signature caches (plans, ``auto``'s decisions), which otherwise grow by one entry per input shape
    for the life of the process (multi-scale training). ``get`` and setting take a lock (threads share
    these caches: ``nn.DataParallel`` replicas, serving workers); under ``torch.compile`` tracing ``get``
    only reads, without the lock (Dynamo traces it; the order is left as it is)."""

    def __init__(self, maxsize: int = 1024):
        super().__init__()
        self.maxsize = maxsize
        self._lock = threading.Lock()

    def get(self, key, default=None):
        if torch.compiler.is_compiling():
            return super().get(key, default)
        with self._lock:
            if key not in self:
                return default
            self.move_to_end(key)
            return self[key]

    def __setitem__(self, key, value) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.maxsize:
                self.popitem(last=False)

    def __reduce__(self):  # pickles and copies as an empty cache of the same size (entries are rebuilt)
        return (type(self), (self.maxsize,))
