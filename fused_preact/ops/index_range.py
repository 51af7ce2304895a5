"""The index ranges of the Triton kernels' integer arithmetic: which launches need 64-bit offsets, and
which inputs no launch can address.

Every Triton kernel of this package (the fused chain's and the recompute backend's elementwise
steps) addresses an (N, C, H, W) operand through its (n, h, w, c) strides as

    offset = n·s_n + (h·s_h + w·s_w + c·s_c)

and numbers NHWC pixels by a row index ``m = pid·BLOCK_M + i`` (m < N·H·W). The row index and the
in-image part ``h·s_h + w·s_w + c·s_c`` are int32; with ``IDX64`` (a launch constexpr) the image
part ``n·s_n`` and the row offsets of row-major buffers (``m·C``) are int64. So:

* a launch needs ``IDX64`` when the largest offset of any operand it touches — the chain's input
  and outputs, the per-call residual and output gradients with their own strides, the
  NHWC-contiguous buffers of every unit's shape — reaches 2³¹ − 1 (:func:`needs_idx64`);
* no launch can address an operand whose in-image reach — its in-image offsets over the image
  widened by the widest kernel's taps and padding (``(R−1)·d + 2·p`` rows and columns) — reaches
  2³¹ − 1, nor count rows past :data:`ROW_LIMIT`; the backends report such an input in their
  ``not_supported_reasons`` (:func:`range_reasons`) and ``auto`` runs plain PyTorch. A per-call
  tensor (the residual, an output gradient) of such a layout is copied into the plan's layout
  first (:func:`within_reach`).

Source: PyTorch's own rule for its CUDA kernels (``canUse32BitIndexMath``: 32-bit indices where every
offset of every operand fits, 64-bit otherwise), here split into the image part and the rest.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fused_preact.ops._common import nhwc_strides, nhwc_strides_of
from fused_preact.ops.triton.configs import contig_nhwc

__all__ = ["INT32_MAX", "ROW_LIMIT", "max_offset", "image_reach", "chain_margin", "range_reasons",
           "needs_idx64", "within_reach"]

#: The largest int32.
INT32_MAX = 2**31 - 1
#: Row counts (N·H·W, N·P·Q, and N·(H + 2p)·(W + 2p) of a padded input) stay below this: a tile's
#: row index ``pid·BLOCK_M + i`` (BLOCK_M ≤ 2¹⁶) is then an int32 too.
ROW_LIMIT = 2**31 - 2**16


def max_offset(shape, strides) -> int:
    """Largest element offset of a logical (N, C, H, W) tensor with (n, h, w, c) ``strides``."""
    N, C, H, W = shape
    return sum((s - 1) * abs(st) for s, st in zip((N, H, W, C), strides))


def image_reach(shape, strides, margin: tuple[int, int] = (0, 0)) -> int:
    """Largest in-image offset ``|h·s_h| + |w·s_w| + |c·s_c|`` of a logical (N, C, H, W) tensor with
    (n, h, w, c) ``strides``, over ``margin`` = (rows, columns) more than the image has (taps and
    padding reach past its edges)."""
    _, C, H, W = shape
    _, sh, sw, sc = strides
    return (max(H - 1, 0) + margin[0]) * abs(sh) + (max(W - 1, 0) + margin[1]) * abs(sw) + max(C - 1, 0) * abs(sc)


def chain_margin(spec) -> tuple[int, int]:
    """(rows, columns) the widest conv of a :class:`~fused_preact.ops.spec.ChainSpec` reads past an
    image's edges, at most: ``(R−1)·d + 2·p`` per axis."""
    convs = list(spec.convs) + ([spec.proj] if spec.proj is not None else [])
    return tuple(max((g.kernel[a] - 1) * g.dilation[a] + 2 * g.padding[a] for g in convs) for a in (0, 1))


def range_reasons(shapes: Sequence[tuple], x_strides, margin: tuple[int, int] = (0, 0)) -> list[str]:
    """Why the kernels cannot address a chain whose tensors have the logical (N, C, H, W) ``shapes``
    (the input's first: :func:`~fused_preact.ops.spec.chain_shapes`), on an input of logical strides
    ``x_strides``, with taps reaching ``margin`` past the images (:func:`chain_margin`); empty when
    they can. Checks the row counts against :data:`ROW_LIMIT` and the in-image reach of x (its own
    strides) and of every NHWC-contiguous tensor of ``shapes`` against :data:`INT32_MAX`."""
    reasons = []
    N, _, H, W = shapes[0]
    rows = max([n * h * w for n, _, h, w in shapes] + [N * (H + margin[0]) * (W + margin[1])])
    if rows >= ROW_LIMIT:
        reasons.append(f"index range: {rows} pixel rows (N·H·W, padded) reach 2**31 - 2**16; the kernels' row "
                       "index is int32")
    reach = max([image_reach(shapes[0], nhwc_strides_of(x_strides), margin)]
                + [image_reach(s, contig_nhwc(s), margin) for s in shapes])
    if reach >= INT32_MAX:
        reasons.append(f"index range: in-image offsets up to {reach} elements reach 2**31 - 1 (one image of "
                       "over 2**31 elements, or strides that wide); the kernels' in-image offsets are int32")
    return reasons


def needs_idx64(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether any of the (N, C, H, W) ``tensors`` (None skipped) has an offset of 2³¹ − 1 or more."""
    return any(t is not None and max_offset(t.shape, nhwc_strides(t)) >= INT32_MAX for t in tensors)


def within_reach(t: Optional[torch.Tensor], margin: tuple[int, int], channels_last: bool) -> Optional[torch.Tensor]:
    """``t`` itself, or — when its in-image reach over ``margin`` is 2³¹ − 1 or more (a view with
    strides wider than its shape, e.g. a slice of a larger tensor) — a copy in channels_last
    (``channels_last``) or NCHW-contiguous format, whose reach is that of a tensor of its shape."""
    if t is None or image_reach(t.shape, nhwc_strides(t), margin) < INT32_MAX:
        return t
    return t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
