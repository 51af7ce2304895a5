"""Fused BatchNorm → ReLU → Conv2d for training: ``y = conv2d(relu(batch_norm(x)), W, b)``.

Order: launchers → reference → custom ops and autograd → functional (kernels live in
``_conv_kernels.py``). The dataflow follows ``shared/DESIGN.md``:

forward
    ``batch_stats`` reads x once → (mean, var) fp32; ``scale = γ·invstd``, ``shift = β − mean·scale``;
    the fprop kernel's prologue turns each x tile into ``a = max(x·scale + shift, 0)`` before ``tl.dot``.
    Saved for backward: x, W and (C,) vectors only — never the BN or ReLU output.
backward
    dgrad epilogue: ``dz = da·[x·scale + shift > 0]`` and per-tile Σdz, Σdz·x̂;
    one elementwise pass: ``dx = scale·(dz − Σdz/M − x̂·Σdz·x̂/M)`` (training) — in eval mode the
    dgrad epilogue writes ``dx = scale·dz`` directly; ``dγ = Σdz·x̂``, ``dβ = Σdz``;
    wgrad prologue recomputes ``a`` from x.

Semantics copied from ``torch.nn.functional.batch_norm`` (running stats, momentum, unbiased running
variance, eval mode) followed by ``torch.nn.functional.relu`` and ``torch.nn.functional.conv2d``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from fused_preact.ops import _conv_kernels as K_
from fused_preact.ops._common import as_nhwc, conv_out_size, dot_dtype, input_precision, interpreting, triton, wants_channels_last
from fused_preact.ops.stats import batch_stats, combine_partials

__all__ = [
    "BNStats",
    "check_inputs",
    "check_training_batch",
    "bn_statistics",
    "bn_relu_conv2d",
    "bn_relu_conv2d_with_stats",
    "bn_relu_conv2d_with_stats_out",
    "bn_relu_conv2d_reference",
]

_IntOr2 = Union[int, Sequence[int]]


# -------------------------------------------------------------------------------------- launchers
def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _gemm_blocks(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Tile shape for an implicit GEMM of (m × k) · (k × n). Blocks are powers of two ≥ 16."""
    if interpreting():
        # Few, large programs: the interpreter's cost is per program and per op, not per element.
        return dict(BLOCK_M=_pow2_clamp(m, 16, 8192), BLOCK_N=_pow2_clamp(n, 16, 64), BLOCK_K=_pow2_clamp(k, 16, 8192))
    block_k = 32 if dtype == torch.float32 else 64
    block_m = 128 if m >= 128 else 64
    block_n = _pow2_clamp(n, 16, 128)
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_pow2_clamp(k, 16, block_k),
        num_warps=8 if block_m * block_n >= 128 * 128 else 4,
        num_stages=3,
    )


def _scale_shift(mean, invstd, gamma, beta):
    scale = invstd if gamma is None else invstd * gamma.float()
    shift = -mean * scale if beta is None else beta.float() - mean * scale
    return scale.contiguous(), shift.contiguous()


def _geometry(x, weight, stride, padding, dilation):
    N, C, H, W = x.shape
    Kout, Cg, R, S = weight.shape
    P = conv_out_size(H, R, stride[0], padding[0], dilation[0])
    Q = conv_out_size(W, S, stride[1], padding[1], dilation[1])
    return N, C, H, W, Kout, Cg, R, S, P, Q


def _to_input_format(t_nhwc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    t = t_nhwc.permute(0, 3, 1, 2)
    return t if wants_channels_last(like) else t.contiguous()


def _fprop_triton(x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups,
                  residual=None, want_stats=False):
    """Fused fprop. Returns y, or ``(y, y_mean, y_var)`` with ``want_stats`` (fp32 (K,) statistics
    of the stored y from the epilogue); ``residual`` (y's shape) is added in the epilogue."""
    N, C, H, W, Kout, Cg, R, S, P, Q = _geometry(x, weight, stride, padding, dilation)
    Kg = Kout // groups
    y = torch.empty(N, P, Q, Kout, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        y = _to_input_format(y, x)
        return (y, *_empty_stats(Kout, x.device)) if want_stats else y
    scale, shift = _scale_shift(mean, invstd, gamma, beta)
    w_f = weight.permute(2, 3, 1, 0).contiguous()
    M = N * P * Q
    cfg = _gemm_blocks(M, Kg, Cg, x.dtype)
    if want_stats and interpreting():
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], 256)  # short tiles keep the interpreter's fp32 sums accurate
    m_tiles = triton.cdiv(M, cfg["BLOCK_M"])
    part_mean = torch.empty(m_tiles if want_stats else 0, Kout, device=x.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    res = as_nhwc(residual.to(x.dtype)) if residual is not None else y
    grid = (m_tiles, triton.cdiv(Kg, cfg["BLOCK_N"]), groups)
    K_._fprop_kernel[grid](
        as_nhwc(x), w_f, bias if bias is not None else w_f, scale, shift, y, res, part_mean, part_m2,
        N, H, W, C, P, Q, Kout, Cg, Kg,
        stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        R=R, S=S, HAS_BIAS=bias is not None, HAS_RES=residual is not None, STATS=want_stats,
        DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION=input_precision(x.dtype), **cfg,
    )
    y = _to_input_format(y, x)
    if not want_stats:
        return y
    return (y, *combine_partials(part_mean, part_m2, M, cfg["BLOCK_M"]))


def _empty_stats(C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(C, device=device, dtype=torch.float32), torch.ones(C, device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _wgrad_split(m_total: int, tiles: int, block_k: int, device: torch.device) -> int:
    """K-split of the wgrad reduction: about two programs per SM on a GPU, one under the interpreter."""
    if interpreting() or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(64, 2 * sms // max(tiles, 1), m_total // (8 * block_k)))


def _backward_triton(dy, x, weight, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats_mode, has_bias):
    N, C, H, W, Kout, Cg, R, S, P, Q = _geometry(x, weight, stride, padding, dilation)
    Kg = Kout // groups
    M = N * H * W
    scale, shift = _scale_shift(mean, invstd, gamma, beta)
    xm = as_nhwc(x)
    dym = as_nhwc(dy.to(x.dtype))
    dtype_args = dict(DOT_DTYPE=dot_dtype(x.dtype), INPUT_PRECISION=input_precision(x.dtype))
    geo = (N, H, W, C, P, Q, Kout, Cg, Kg, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1])

    out = torch.empty_like(xm)
    cfg = _gemm_blocks(M, Cg, Kg, x.dtype)
    m_tiles = triton.cdiv(M, cfg["BLOCK_M"])
    # Every (tile, channel) entry is written by the dgrad grid, so no zero-fill is needed.
    psum_dz = torch.empty(m_tiles, C, device=x.device, dtype=torch.float32)
    psum_dzx = torch.empty_like(psum_dz)
    if M > 0:
        w_d = weight.permute(2, 3, 0, 1).contiguous()
        grid = (m_tiles, triton.cdiv(Cg, cfg["BLOCK_N"]), groups)
        K_._dgrad_kernel[grid](
            dym, w_d, xm, scale, shift, mean, invstd, out, psum_dz, psum_dzx, *geo,
            R=R, S=S, WRITE_DX=not batch_stats_mode, NEED_SUMS=True, **dtype_args, **cfg,
        )
    sum_dz = psum_dz.sum(0)
    sum_dzx = psum_dzx.sum(0)
    if batch_stats_mode and M > 0:
        dx = torch.empty_like(xm)
        block_c = _pow2_clamp(C, 16, 64)
        block_m = _pow2_clamp(M, 16, 8192) if interpreting() else 64
        K_._dx_kernel[(triton.cdiv(M, block_m), triton.cdiv(C, block_c))](
            out, xm, scale, mean, invstd, sum_dz, sum_dzx, dx, M, C, BLOCK_M=block_m, BLOCK_C=block_c
        )
    else:
        dx = out

    m_total = N * P * Q
    wcfg = _gemm_blocks(Kg, Cg, m_total, x.dtype)
    tiles = R * S * triton.cdiv(Kg, wcfg["BLOCK_M"]) * triton.cdiv(Cg, wcfg["BLOCK_N"]) * groups
    split = _wgrad_split(m_total, tiles, wcfg["BLOCK_K"], x.device)
    chunk = triton.cdiv(triton.cdiv(max(m_total, 1), split), wcfg["BLOCK_K"]) * wcfg["BLOCK_K"]
    alloc = torch.empty if m_total > 0 else torch.zeros  # the wgrad grid writes every entry
    dw_part = alloc(split, Kout, Cg, R, S, device=x.device, dtype=torch.float32)
    if m_total > 0:
        grid = (R * S * triton.cdiv(Kg, wcfg["BLOCK_M"]), triton.cdiv(Cg, wcfg["BLOCK_N"]), groups * split)
        K_._wgrad_kernel[grid](
            dym, xm, scale, shift, dw_part, *geo[:9], chunk, *geo[9:],
            R=R, S=S, SPLIT=split, **dtype_args, **wcfg,
        )
    dw = dw_part.sum(0).to(weight.dtype)
    db = dym.sum((0, 1, 2), dtype=torch.float32).to(weight.dtype) if has_bias else dym.new_empty(0)
    return _to_input_format(dx, x), dw, db, sum_dzx, sum_dz


# ------------------------------------------------------------------------------------- reference
def bn_relu_conv2d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    running_mean: Optional[torch.Tensor] = None,
    running_var: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None,
    bn_bias: Optional[torch.Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stride: _IntOr2 = 1,
    padding: _IntOr2 = 0,
    dilation: _IntOr2 = 1,
    groups: int = 1,
) -> torch.Tensor:
    """Plain PyTorch ``F.conv2d(F.relu(F.batch_norm(x, ...)), weight, bias, ...)``: the source of truth.

    Arguments and semantics are exactly those of ``torch.nn.functional.batch_norm`` followed by
    ``torch.nn.functional.conv2d``; any device and float dtype.
    """
    a = F.relu(F.batch_norm(x, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps))
    return F.conv2d(a, weight, bias, stride, padding, dilation, groups)


# ---------------------------------------------------------------------------- custom ops, autograd
def _check_backend(backend: str) -> None:
    if backend not in ("triton", "cuda"):
        raise ValueError(
            f"fused_preact::bn_relu_conv2d: backend {backend!r} is not implemented by this op; expected 'triton' or 'cuda'"
        )


@torch.library.custom_op("fused_preact::bn_relu_conv2d", mutates_args=(), device_types=("cpu", "cuda"))
def _bn_relu_conv2d_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
    gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor], stride: list[int], padding: list[int],
    dilation: list[int], groups: int, batch_stats: bool, backend: str,
) -> torch.Tensor:
    _check_backend(backend)
    if backend == "cuda":
        from fused_preact.ops import _cuda

        return _cuda.fprop(x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups)
    return _fprop_triton(x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups)


@_bn_relu_conv2d_op.register_fake
def _(x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats, backend):
    N, _, H, W = x.shape
    P = conv_out_size(H, weight.shape[2], stride[0], padding[0], dilation[0])
    Q = conv_out_size(W, weight.shape[3], stride[1], padding[1], dilation[1])
    fmt = torch.channels_last if wants_channels_last(x) else torch.contiguous_format
    return torch.empty((N, weight.shape[0], P, Q), dtype=x.dtype, device=x.device, memory_format=fmt)


@torch.library.custom_op("fused_preact::bn_relu_conv2d_backward", mutates_args=(), device_types=("cpu", "cuda"))
def _bn_relu_conv2d_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor], stride: list[int], padding: list[int],
    dilation: list[int], groups: int, batch_stats: bool, has_bias: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_backend(backend)
    if backend == "cuda":
        from fused_preact.ops import _cuda

        return _cuda.backward(
            grad_out, x, weight, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats, has_bias
        )
    return _backward_triton(
        grad_out, x, weight, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats, has_bias
    )


@_bn_relu_conv2d_backward_op.register_fake
def _(grad_out, x, weight, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats, has_bias, backend):
    fmt = torch.channels_last if wants_channels_last(x) else torch.contiguous_format
    C = x.shape[1]
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt),
        weight.new_empty(weight.shape),
        weight.new_empty((weight.shape[0],) if has_bias else (0,)),
        x.new_empty(C, dtype=torch.float32),
        x.new_empty(C, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups, batch_stats_mode, backend = inputs
    ctx.save_for_backward(x, weight, mean, invstd, gamma, beta)
    ctx.conv = (stride, padding, dilation, groups)
    ctx.batch_stats = batch_stats_mode
    ctx.has_bias = bias is not None
    ctx.backend = backend


def _backward(ctx, grad_out):
    x, weight, mean, invstd, gamma, beta = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    dx, dw, db, dgamma, dbeta = _bn_relu_conv2d_backward_op(
        grad_out, x, weight, mean, invstd, gamma, beta, stride, padding, dilation, groups,
        ctx.batch_stats, ctx.has_bias, ctx.backend,
    )
    # Gradients of the (C,) statistics themselves, for callers whose mean/invstd are differentiable
    # (synchronized BN computes them with autograd-aware collectives). With
    # a = relu(γ·invstd·(x − mean) + β):  ∂L/∂mean = −scale·Σdz,  ∂L/∂invstd = γ·Σdz·x̂ / invstd.
    g_mean = g_invstd = None
    if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
        gam = gamma.float() if gamma is not None else torch.ones_like(invstd)
        g_mean = -(gam * invstd) * dbeta
        g_invstd = gam * dgamma / invstd
    return (
        dx,
        dw,
        db if ctx.has_bias else None,
        g_mean,
        g_invstd,
        dgamma.to(gamma.dtype) if gamma is not None else None,
        dbeta.to(beta.dtype) if beta is not None else None,
        None, None, None, None, None, None,
    )


torch.library.register_autograd("fused_preact::bn_relu_conv2d", _backward, setup_context=_setup_context)


@torch.library.custom_op("fused_preact::bn_relu_conv2d_stats", mutates_args=(), device_types=("cpu", "cuda"))
def _bn_relu_conv2d_stats_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor, invstd: torch.Tensor,
    gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    stride: list[int], padding: list[int], dilation: list[int], groups: int, batch_stats: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend != "triton":
        raise ValueError(f"fused_preact::bn_relu_conv2d_stats: backend {backend!r} has no statistics epilogue; expected 'triton'")
    return _fprop_triton(x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups,
                         residual=residual, want_stats=True)


@_bn_relu_conv2d_stats_op.register_fake
def _(x, weight, bias, mean, invstd, gamma, beta, residual, stride, padding, dilation, groups, batch_stats, backend):
    K = weight.shape[0]
    N, _, H, W = x.shape
    P = conv_out_size(H, weight.shape[2], stride[0], padding[0], dilation[0])
    Q = conv_out_size(W, weight.shape[3], stride[1], padding[1], dilation[1])
    fmt = torch.channels_last if wants_channels_last(x) else torch.contiguous_format
    out = torch.empty((N, K, P, Q), dtype=x.dtype, device=x.device, memory_format=fmt)
    return out, x.new_empty(K, dtype=torch.float32), x.new_empty(K, dtype=torch.float32)


def _setup_context_stats(ctx, inputs, output):
    x, weight, bias, mean, invstd, gamma, beta, residual, stride, padding, dilation, groups, batch_stats_mode, backend = inputs
    _setup_context(ctx, (x, weight, bias, mean, invstd, gamma, beta, stride, padding, dilation, groups,
                         batch_stats_mode, backend), output[0])
    ctx.has_residual = residual is not None
    ctx.mark_non_differentiable(output[1], output[2])


def _backward_stats(ctx, grad_out, _grad_mean, _grad_var):
    """As the plain op's backward; the residual's gradient is the output's (``y = conv + residual``).
    The epilogue statistics are non-differentiable: their consumer's backward carries their terms."""
    grads = _backward(ctx, grad_out)
    return (*grads[:7], grad_out if ctx.has_residual else None, *grads[7:])


torch.library.register_autograd(
    "fused_preact::bn_relu_conv2d_stats", _backward_stats, setup_context=_setup_context_stats
)


# ------------------------------------------------------------------------------------- autocast
_AUTOCAST_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def _register_autocast(name: str, device_type: str) -> None:
    """Autocast rule for ``fused_preact::<name>`` (the fused convs): the conv runs in the autocast dtype.

    x, the conv weight and bias are cast to ``torch.get_autocast_dtype(device_type)`` (float64 is
    left alone, as autocast does); mean/invstd stay fp32 and γ/β keep their dtype, so the
    statistics and the scale/shift are fp32. ``torch.library.register_autocast`` would cast every
    floating input to one fixed dtype, hence this rule. Autograd records the casts, so gradients come
    back in the inputs' own dtypes (as for ``F.conv2d`` under autocast).
    """
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))
    op = getattr(torch.ops.fused_preact, name).default

    def cast(t, dtype):
        return t.to(dtype) if t is not None and t.dtype in _AUTOCAST_CASTABLE else t

    def rule(x, weight, bias, *rest):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(cast(x, dtype), cast(weight, dtype), cast(bias, dtype), *rest)

    if op.has_kernel_for_dispatch_key(key):
        op.py_kernels.pop(key, None)
    op.py_impl(key)(rule)  # used when the op is traced through the Python dispatcher (torch.compile)
    _LIB.impl(name, lambda _keyset, *args: rule(*args), key.name, with_keyset=True)


_LIB = torch.library.Library("fused_preact", "FRAGMENT")
for _name in ("bn_relu_conv2d", "bn_relu_conv2d_stats"):
    for _device_type in ("cpu", "cuda"):
        _register_autocast(_name, _device_type)


# ------------------------------------------------------------------------------------ functional
class BNStats(NamedTuple):
    """Per-channel statistics a fused conv normalizes with.

    Attributes:
        mean: (C,) float32 — batch mean (training) or running_mean (eval).
        invstd: (C,) float32 — ``1/√(var + eps)`` with the biased batch var or running_var.
        batch_stats: True when mean/invstd were computed from this batch (the backward then carries
            the statistics' gradient terms, as in BN's training mode).
    """

    mean: torch.Tensor
    invstd: torch.Tensor
    batch_stats: bool


def _pair(v: _IntOr2, name: str) -> list[int]:
    if isinstance(v, int):
        return [v, v]
    v = list(v)
    if len(v) != 2:
        raise ValueError(f"fused_preact: expected {name} to be an int or a pair of ints, got {v}")
    return [int(i) for i in v]


def check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    stride: _IntOr2,
    padding: _IntOr2,
    dilation: _IntOr2,
    groups: int,
) -> None:
    """Validate a BN→ReLU→Conv call before anything runs or any buffer changes.

    Mirrors the checks (and exception types) of ``F.batch_norm`` / ``F.conv2d``.

    Raises:
        ValueError: ``x`` is not 4-D; malformed stride/padding/dilation.
        RuntimeError: non-floating input; input/weight/bias dtypes differ (outside autocast); tensors
            on different devices; ``groups`` does not divide the channels or does not match the weight;
            the output's spatial size would be ≤ 0.
    """
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    if not x.is_floating_point():
        raise RuntimeError(f"fused_preact: expected a floating-point input, got {x.dtype}")
    if weight.dim() != 4:
        raise RuntimeError(f"fused_preact: expected a 4D conv weight (K, C/groups, R, S), got shape {list(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {x.device} and "
                f"{t.device}! ({name})"
            )
        if t is not None and t.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise RuntimeError(f"Input type ({x.dtype}) and {name} type ({t.dtype}) should be the same")
    C = x.shape[1]
    if groups < 1 or C % groups or weight.shape[0] % groups or weight.shape[1] * groups != C:
        raise RuntimeError(
            f"Given groups={groups}, weight of size {list(weight.shape)}, expected input{list(x.shape)} to have "
            f"{weight.shape[1] * groups} channels, but got {C} channels instead"
        )
    st, pd, dl = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    if min(st) < 1 or min(dl) < 1 or min(pd) < 0:
        raise ValueError(f"fused_preact: need stride ≥ 1, dilation ≥ 1, padding ≥ 0; got {st}, {dl}, {pd}")
    P = conv_out_size(x.shape[2], weight.shape[2], st[0], pd[0], dl[0])
    Q = conv_out_size(x.shape[3], weight.shape[3], st[1], pd[1], dl[1])
    if P <= 0 or Q <= 0:
        raise RuntimeError(
            f"Calculated output size: ({P}x{Q}). Output size is too small (input {list(x.shape[2:])}, "
            f"kernel {list(weight.shape[2:])}, stride {st}, padding {pd}, dilation {dl})"
        )


def check_training_batch(x: torch.Tensor) -> None:
    """Raise ``ValueError`` if (N, C, H, W) ``x`` has one value per channel (N·H·W == 1), as
    ``F.batch_norm`` does in training: "Expected more than 1 value per channel when training"."""
    if x.shape[0] * x.shape[2] * x.shape[3] == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")


def bn_statistics(
    x: torch.Tensor,
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    batch_mean_var: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> BNStats:
    """BN statistics with ``F.batch_norm``'s semantics, computed by the Triton statistics kernels.

    Args:
        x: (N, C, H, W) float32/float16/bfloat16 activation, NCHW or channels_last.
        running_mean, running_var: (C,) buffers or ``None``. In training they are updated in place:
            ``r ← (1 − momentum)·r + momentum·batch`` with the unbiased batch variance for running_var.
        training: use batch statistics (True) or the running buffers (False; then both are required).
        momentum: the exponential-average factor (the caller resolves ``momentum=None`` to
            ``1/num_batches_tracked``, as ``nn.BatchNorm2d`` does).
        eps: added to the variance.
        batch_mean_var: the batch's (mean, biased var), fp32 (C,), when a producer's epilogue already
            computed them (:func:`bn_relu_conv2d_with_stats_out`); training only.

    Returns:
        :class:`BNStats` with fp32 (C,) vectors.

    Raises:
        ValueError: training with one value per channel ("Expected more than 1 value per channel when
            training", as PyTorch); eval mode without running statistics.
    """
    if training:
        check_training_batch(x)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        if count == 0:  # empty batch: PyTorch returns an empty output and leaves running stats alone
            ones = torch.ones(x.shape[1], device=x.device, dtype=torch.float32)
            return BNStats(torch.zeros_like(ones), ones, True)
        mean, var = batch_mean_var if batch_mean_var is not None else batch_stats(x)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_((var * (count / max(count - 1, 1))).to(running_var.dtype), momentum)
        return BNStats(mean, torch.rsqrt(var + eps), True)
    if running_mean is None or running_var is None:
        raise ValueError("fused_preact: running_mean and running_var are required when training=False")
    return BNStats(running_mean.detach().float(), torch.rsqrt(running_var.detach().float() + eps), False)


def bn_relu_conv2d_with_stats(
    x: torch.Tensor,
    stats: BNStats,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None,
    bn_bias: Optional[torch.Tensor] = None,
    stride: _IntOr2 = 1,
    padding: _IntOr2 = 0,
    dilation: _IntOr2 = 1,
    groups: int = 1,
    backend: str = "triton",
) -> torch.Tensor:
    """``conv2d(relu(x·scale + shift), weight, bias)`` with precomputed :class:`BNStats`, fused in one kernel.

    Lets one set of BN statistics feed several convolutions (a block's conv1 and its projection
    shortcut) while each fused conv still saves only x for backward.

    Args:
        x: (N, C, H, W) float32/float16/bfloat16, NCHW or channels_last; CUDA, or CPU under Triton's
            interpreter.
        stats: from :func:`bn_statistics` on this same ``x``.
        weight: (K, C/groups, R, S), same dtype as ``x``. bias: (K,) or None.
        bn_weight, bn_bias: BN's γ and β, (C,), or None (``affine=False``).
        stride, padding, dilation, groups: as ``F.conv2d`` (padding is an int or pair of ints).
        backend: the op backend: ``"triton"`` or ``"cuda"`` (the CUTLASS extension, when built).

    Returns:
        (N, K, P, Q) tensor of ``x``'s dtype, channels_last if ``x`` is, otherwise contiguous.

    Raises:
        ValueError: ``backend`` is not one the op implements, or a malformed stride/padding/dilation.
    """
    return _bn_relu_conv2d_op(
        x, weight, bias, stats.mean, stats.invstd, bn_weight, bn_bias,
        _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), groups, stats.batch_stats, backend,
    )


def bn_relu_conv2d_with_stats_out(
    x: torch.Tensor,
    stats: BNStats,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None,
    bn_bias: Optional[torch.Tensor] = None,
    stride: _IntOr2 = 1,
    padding: _IntOr2 = 0,
    dilation: _IntOr2 = 1,
    groups: int = 1,
    residual: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bn_relu_conv2d_with_stats` (Triton backend) whose epilogue also adds ``residual`` and
    returns the batch statistics of its own output — the next BatchNorm's input — so that BN needs no
    statistics pass over it.

    Args:
        x, stats, weight, bias, bn_weight, bn_bias, stride, padding, dilation, groups: as
            :func:`bn_relu_conv2d_with_stats`.
        residual: None or a tensor of the output's shape and ``x``'s dtype, added before the store
            (a residual block's shortcut); its gradient is the output's.

    Returns:
        ``(y, y_mean, y_var)``: y as :func:`bn_relu_conv2d_with_stats` (plus ``residual``) and the
        (K,) float32 per-channel mean and biased variance of the stored y (detached: a consumer
        using them with ``batch_stats=True`` folds their gradient terms into its own backward).

    Raises:
        ValueError: malformed stride/padding/dilation.
    """
    y, y_mean, y_var = _bn_relu_conv2d_stats_op(
        x, weight, bias, stats.mean, stats.invstd, bn_weight, bn_bias, residual,
        _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation"), groups, stats.batch_stats,
        "triton",
    )
    return y, y_mean, y_var


def bn_relu_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    running_mean: Optional[torch.Tensor] = None,
    running_var: Optional[torch.Tensor] = None,
    bn_weight: Optional[torch.Tensor] = None,
    bn_bias: Optional[torch.Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stride: _IntOr2 = 1,
    padding: _IntOr2 = 0,
    dilation: _IntOr2 = 1,
    groups: int = 1,
    backend: str = "auto",
) -> torch.Tensor:
    """Fused ``conv2d(relu(batch_norm(x)))`` with the arguments of ``F.batch_norm`` and ``F.conv2d``.

    Args:
        x: (N, C, H, W); NCHW or channels_last (the output follows x's memory format).
        weight: (K, C/groups, R, S) conv weight; bias: (K,) or None.
        running_mean, running_var, bn_weight, bn_bias, training, momentum, eps: as ``F.batch_norm``
            (running buffers are updated in place in training).
        stride, padding, dilation, groups: as ``F.conv2d``.
        backend: ``"auto"`` (first backend in ``fused_preact.dispatch.PRIORITY`` that can serve x),
            ``"triton"``, ``"cuda"`` (CUTLASS extension, opt-in) or ``"reference"`` (plain PyTorch).

    Returns:
        (N, K, P, Q) tensor of x's dtype.

    Raises:
        RuntimeError: a forced backend cannot serve x (the message says why).
        ValueError: training with one value per channel; unknown backend name.
    """
    from fused_preact.dispatch import select_backend

    check_inputs(x, weight, bias, stride, padding, dilation, groups)
    choice = select_backend(backend, x, [(weight, stride, padding, dilation, groups)])
    if choice.name == "reference":
        return bn_relu_conv2d_reference(
            x, weight, bias, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps,
            stride, padding, dilation, groups,
        )
    stats = bn_statistics(x, running_mean, running_var, training, momentum, eps)
    return bn_relu_conv2d_with_stats(x, stats, weight, bias, bn_weight, bn_bias, stride, padding, dilation, groups, choice.name)
