"""Jobs of the static report: the launch record it compiles, and the provider for the fused chains.

A :class:`StaticJob` is one kernel launch exactly as a launcher makes it, ``fn[grid](*args, **kwargs)``.
A *job provider* maps ``(units: list[UnitShape], dtypes: list[torch.dtype])`` to StaticJobs;
:func:`chain_jobs` is the report's default.

:func:`chain_jobs`: for each distinct pre-activation block of the requested models
(:func:`fused_preact.bench.shapes.enumerate_blocks`) and each dtype, a ``TritonPlan`` is built on the
meta device (nothing is allocated) and its forward and backward are *recorded* instead of launched
(``recording`` of the Triton backend's launchers): the records are exactly the ``fn[grid](*args, **kwargs)`` calls a GPU
would run, so the report compiles what runs. Recorded per block and dtype:

    train and eval mode (BN finalize modes, dgrad's eval epilogue), channels_last input;
    the heuristic default tiles and every autotune candidate (``TritonPlan.unit_candidates``, the
    tuner's own list per unit), each applied to every conv of the block; each job's
    ``role`` says which (``default``/``candidate``);
    the wgrad K-split a GPU of each arch would choose (132 SMs on sm_90, 108 on sm_80), and 1 (the
    staged-halo wgrad's direct store);
    the output statistics epilogue on (a block followed by another) and off (the last block);
    16-bit dtypes also under autocast: an fp32 input (and residual) and fp32 parameters with 16-bit
    compute (mixed-precision training: the plan casts the weights, wgrad stores an fp32 dW), default tiles,
    train mode; the launches that take fp32 activations are labelled ``x32`` in their variant.

Meta tensors report ``data_ptr() == 0``, i.e. 16-byte aligned, as the caching allocator's blocks are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

from fused_preact.bench.shapes import BlockShape, UnitShape, enumerate_blocks
from fused_preact.ops.dtypes import TRAITS

__all__ = ["TensorSpec", "StaticJob", "chain_jobs", "SM_COUNT"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A stand-in for a tensor argument: what Triton's specializer reads (``.dtype``, ``.data_ptr()``).

    Attributes:
        dtype: the tensor's ``torch.dtype`` (becomes the pointer type, e.g. ``*bf16``).
        aligned: whether the data pointer is 16-byte aligned (``torch.empty`` storage is; views at an
            offset may not be). Aligned pointers get ``tt.divisibility = 16``.
    """

    dtype: Any
    aligned: bool = True

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8


@dataclasses.dataclass(frozen=True)
class StaticJob:
    """One kernel launch as a launcher makes it: ``fn[grid](*args, **kwargs)``.

    Attributes:
        kernel: report name (``fprop``, ``dgrad``, …). config: tile/launch config label
            (e.g. ``128x64x64 w4 s3``).
        fn: the ``@triton.jit`` function. args: positional arguments (:class:`TensorSpec` or anything
            with ``.dtype``/``.data_ptr()``, ints, floats, bools, None). kwargs: constexprs and launch
            options (``num_warps``, ``num_stages``, …), as passed at the launch.
        conv: True for a convolution/GEMM kernel (``--check`` demands tensor-core instructions);
            False for elementwise and reduction kernels.
        variant: what else distinguishes the launch (filter size, epilogue flags), for the report.
        dtype: activation dtype label (``bf16``, ``fp16``, ``fp32``). shape: the layer it serves (a
            conv launch: the block and the conv, e.g. ``… layer1.0 [bottleneck 16→64 /1 @32²] 1x1/1
            16→16 @32x32``, so that the convs of one block launching one kernel variant count as
            layers of their own in the limits' candidate figures).
        archs: compute capabilities this launch exists on (None: all), e.g. when a launcher's choice
            depends on the device (SM count).
        role: ``"default"``: the launch with the backend's heuristic default config (what runs
            untuned); ``"candidate"``: the launch with one of the autotuner's candidate configs; ``""``:
            neither (fixtures, anchors). The main-loop limits of ``--check`` read it.
    """

    kernel: str
    config: str
    fn: Any
    args: tuple
    kwargs: dict
    conv: bool = True
    variant: str = ""
    dtype: str = ""
    shape: str = ""
    archs: Optional[tuple[int, ...]] = None
    role: str = ""


#: SMs per GPU used for the wgrad split: H100 SXM5 (sm_90) 132, A100 (sm_80) 108 (NVIDIA data sheets).
SM_COUNT: dict[int, int] = {90: 132, 80: 108}
_NAMES = {d: t.name for d, t in TRAITS.items() if t.fused}  # the short names (fused_preact.ops.dtypes)
_CONV = {"fprop", "fprop_proj", "dgrad", "wgrad", "wgrad_proj"}


def _triton_backend():
    """(``TritonPlan``, ``recording``) of the Triton backend, imported here alone (on first use: the
    kernels must be decorated after the caller has checked TRITON_INTERPRET)."""
    from fused_preact.ops.triton.launch import recording
    from fused_preact.ops.triton.plan import TritonPlan

    return TritonPlan, recording


def _chain(b: BlockShape):
    """(ChainSpec, input shape) of block ``b`` — its units in order, then the projection shortcut."""
    from fused_preact.ops import ChainSpec, ConvGeom

    def geom(u: UnitShape) -> ConvGeom:
        return ConvGeom(u.C, u.K, (u.R, u.S), tuple(u.stride), tuple(u.padding), tuple(u.dilation), u.groups)

    convs = [u for u in b.units if not u.name.endswith("shortcut")]
    proj = [u for u in b.units if u.name.endswith("shortcut")]
    spec = ChainSpec(tuple(geom(u) for u in convs), geom(proj[0]) if proj else None, "add",
                     "none" if proj else "input")
    return spec, (b.N, b.in_planes, b.H, b.W)


def _meta_tensors(spec, dtype):
    from fused_preact.ops import ChainTensors, UnitTensors

    def vec(g):
        return torch.empty(g.in_channels, device="meta")

    t = ChainTensors([UnitTensors(torch.empty((g.out_channels, g.in_channels // g.groups, *g.kernel), device="meta",
                                              dtype=dtype).contiguous(memory_format=torch.channels_last),
                                  None, vec(g), vec(g), vec(g), vec(g), torch.empty((), device="meta", dtype=torch.int64))
                      for g in spec.convs])
    if spec.proj is not None:
        g = spec.proj
        t.proj_weight = torch.empty((g.out_channels, g.in_channels, 1, 1), device="meta", dtype=dtype).contiguous(
            memory_format=torch.channels_last)
    return t


def _record(spec, modes, x_shape, dtype, out_stats: bool, overrides=None, split: Optional[int] = None,
            x_dtype: Optional[torch.dtype] = None, arch: int = 90):
    """The Launch records of one forward + backward of the chain (meta device: nothing runs), computing
    in ``dtype`` on an input of ``x_dtype`` (default: ``dtype``; fp32 is autocast's case), with the
    tiles the plan chooses for compute capability ``arch``."""
    from fused_preact.ops.spec import GradNeeds

    TritonPlan, recording = _triton_backend()
    x = torch.empty(x_shape, device="meta", dtype=x_dtype or dtype).contiguous(memory_format=torch.channels_last)
    plan = TritonPlan(spec, modes, x.shape, x.stride(), x.dtype, x.device, dtype, False, out_stats,
                      overrides=overrides, split=split, tune=False, arch=arch)
    t = _meta_tensors(spec, x_dtype or dtype)  # autocast: fp32 parameters (and dW), as mixed precision trains
    with recording() as launches:
        fwd = plan.forward(x, t)
        dy = torch.empty(fwd.out.shape, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last)
        n = len(spec.convs)
        plan.backward(dy, None, fwd.saved, [u.weight for u in t.units], t.proj_weight,
                      GradNeeds(True, (True,) * n, (False,) * n, (torch.float32,) * n, spec.proj is not None))
    return plan, launches


def _label(rec) -> str:
    k = rec.kwargs
    if "BLOCK_N" in k and "BLOCK_K" in k:
        return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{k.get('num_warps', 4)} s{k.get('num_stages', 3)}"
                + (f" u{k['UNROLL']}" if k.get("UNROLL", 1) != 1 else "")
                + (f" t{k['SLOTS']}" if k.get("SLOTS", 1) != 1 else "") + (" h" if k.get("STAGE_ROWS") else ""))
    if "RPI" in k:  # the staged-halo wgrad: BLOCK_N is x's channels
        return (f"{k['BLOCK_M']}x{k['C']}x{k['BLOCK_R']} w{k.get('num_warps', 4)} s{k.get('num_stages', 3)} h"
                + (" splitK" if k.get("SPLIT_K") else ""))
    if "BLOCK_R" in k:
        return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_R']} w{k.get('num_warps', 4)} s{k.get('num_stages', 3)}"
                + (f" u{k['UNROLL']}" if k.get("UNROLL", 1) != 1 else "") + (" splitK" if k.get("SPLIT_K") else ""))
    return " ".join(f"{n}{v}" for n, v in sorted(k.items()) if n.startswith("BLOCK")) + f" w{k.get('num_warps', 4)}"


def _variant(rec) -> str:
    k = rec.kwargs
    flags = [n for n in ("HAS_PROJ", "HAS_RES", "STATS", "WRITE_DX", "HAS_JOB2", "HAS_GAMMA", "UPDATE_RUNNING")
             if k.get(n)]
    geo = f"{k['R']}x{k['S']}s{k.get('STRIDE_H', 1)}" if "R" in k else ""
    mode = f"mode{k['MODE']}" if "MODE" in k else (f"sum{k['SUM_MODE']}" if "SUM_MODE" in k else "")
    return " ".join(x for x in (geo, mode, *flags) if x)


@dataclasses.dataclass(frozen=True)
class _Run:
    """One recorded forward + backward of a chain: BN ``modes``, the output statistics epilogue,
    per-kernel tile ``overrides`` (and the kernel they make candidates, ``tuned``), a wgrad ``split``,
    the ``archs`` it is recorded for (None: every arch of :data:`SM_COUNT`), and an input dtype other
    than the compute dtype (``x_dtype``: autocast)."""

    modes: tuple
    out_stats: bool
    overrides: Optional[dict] = None
    split: Optional[int] = None
    archs: Optional[tuple[int, ...]] = None
    tuned: Optional[str] = None
    x_dtype: Optional[torch.dtype] = None


def chain_jobs(units: Sequence[UnitShape], dtypes: Sequence[torch.dtype]) -> list[StaticJob]:
    """Every launch of the fused chains for the blocks that contain ``units`` (module docstring)."""
    from fused_preact.ops import BATCH, RUNNING, BNMode

    wanted = {n for u in units for n in u.names}
    batch = units[0].N if units else 128
    blocks = [b for m in sorted({u.model for u in units}) for b in enumerate_blocks(m, batch)
              if any(u_name in wanted for u in b.units for u_name in u.names)]
    jobs: list[StaticJob] = []
    for dtype in dtypes:
        for b in blocks:
            spec, x_shape = _chain(b)
            n = len(spec.convs)
            shape = f"{b.name} [{b.describe()}]"
            runs: list[_Run] = []
            for train in (True, False):
                modes = tuple(BNMode(BATCH if train else RUNNING, True, train) for _ in range(n))
                for out_stats in ((True, False) if train else (False,)):
                    runs.append(_Run(modes, out_stats))
            modes = tuple(BNMode(BATCH, True, True) for _ in range(n))
            if dtype != torch.float32:  # autocast: an fp32 input, 16-bit compute (default tiles)
                runs.append(_Run(modes, True, x_dtype=torch.float32))
            tuned: dict[tuple, list] = {}  # (kind, tiles per unit) -> the archs that list them
            for arch, sms in SM_COUNT.items():
                plan, _ = _record(spec, modes, x_shape, dtype, True, arch=arch)
                for kind in ("fprop", "dgrad", "wgrad"):
                    per_unit = [plan.unit_candidates(u, i, kind) for i, u in enumerate(plan.units)]
                    for j in range(max(len(c) for c in per_unit)):
                        tuned.setdefault((kind, tuple(c[min(j, len(c) - 1)] for c in per_unit)), []).append(arch)
                split = _gpu_split(plan, sms)
                if split > 1:
                    runs.append(_Run(modes, True, split=split, archs=(arch,)))
            # one program per wgrad (a small batch on a GPU): the staged-halo wgrad stores dW directly
            # (SPLIT_K off), where the meta device's plan gives it 3 programs
            runs.append(_Run(modes, True, split=1))
            for (kind, tiles), archs in tuned.items():
                runs.append(_Run(modes, True, {kind: list(tiles)}, tuned=kind,
                                 archs=None if len(archs) == len(SM_COUNT) else tuple(archs)))
            for run in runs:
                # Recorded for each arch (the plan's tiles depend on it); a launch alike on all of them is
                # one job for every arch.
                run_archs = run.archs or tuple(SM_COUNT)
                per_arch = [_record(spec, run.modes, x_shape, dtype, run.out_stats, run.overrides, run.split,
                                    run.x_dtype, arch=arch)[1] for arch in run_archs]
                first = per_arch[0]
                aligned = all(len(o) == len(first) for o in per_arch)
                for k in range(len(first)):
                    if aligned and all(_same_launch(o[k], first[k]) for o in per_arch[1:]):
                        targets = [(run.archs, first[k])]
                    else:
                        targets = [((arch,), o[k]) for arch, o in zip(run_archs, per_arch) if k < len(o)]
                    for archs, rec in targets:
                        # A candidate run overrides one kernel's tiles; its other launches keep their defaults.
                        role = "candidate" if rec.name == run.tuned else "default"
                        x32 = "x32" if run.x_dtype is not None and _reads_fp32(rec) else ""
                        variant = " ".join(v for v in (_variant(rec), x32) if v)
                        # a conv launch serves one conv of the block: its layer for the limits' candidates
                        where = f"{shape} {rec.conv}" if rec.conv else shape
                        jobs.append(StaticJob(rec.name, _label(rec), rec.fn, rec.args, rec.kwargs, rec.name in _CONV,
                                              variant, _NAMES[dtype], where, archs, role))
    return jobs


def _same_launch(a, b) -> bool:
    """Whether two launch records are the same launch (kernel, grid, constexprs and arguments; tensors
    by dtype, shape and strides)."""
    def key(rec):
        args = tuple((t.dtype, tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else t for t in rec.args)
        return rec.fn, rec.grid, tuple(sorted(rec.kwargs.items())), args

    return key(a) == key(b)


#: Kernel parameters that carry a chain's activations (input, residual, dx): fp32 in a 16-bit chain only
#: under autocast.
_ACTIVATIONS = ("x_ptr", "xin_ptr", "res_ptr", "dx_ptr")


def _reads_fp32(rec) -> bool:
    """Whether a launch of a 16-bit chain takes fp32 activations (autocast's fp32 input, its residual
    or its gradient), which the report labels ``x32``."""
    names = rec.fn.arg_names  # a JITFunction's, or the interpreter's InterpretedFunction's
    return any(n in _ACTIVATIONS and getattr(a, "dtype", None) == torch.float32 for n, a in zip(names, rec.args))


def _gpu_split(plan, sms: int) -> int:
    """The largest wgrad K-split a GPU with ``sms`` SMs picks for a unit of ``plan`` (``split_for``, as
    ``wgrad_split`` in the Triton backend's configs)."""
    from fused_preact.ops.triton.configs import split_for

    best = 1
    for u in plan.units:
        g = u.geom
        Cg, Kg = u.in_shape[1] // g.groups, u.out_shape[1] // g.groups
        tiles = math.ceil(Kg / u.wcfg.BLOCK_M) * math.ceil(Cg / u.wcfg.BLOCK_N) * g.kernel[0] * g.kernel[1] * g.groups
        best = max(best, split_for(u.M_out, tiles, u.wcfg.BLOCK_K * u.wcfg.unroll, sms))
    return best
