"""Kernel level of ``python -m fused_preact.bench``: each fused convolution kernel alone, against cuDNN
doing the same convolution.

For every distinct BN→ReLU→Conv unit of the chosen models (:func:`fused_preact.bench.shapes.
enumerate_units`), each dtype and each mode, one timed call is (x: the BN input, channels_last; a =
relu(bn(x)) with batch statistics; dy: the gradient of the conv output; W: the weight):

=====  ==============================================  ==============================================
mode   ``cudnn`` (the reference)                       ``triton`` (one launch of the fused kernel)
=====  ==============================================  ==============================================
fprop  ``F.conv2d(a, W)``; a is made once, untimed     ``_fprop_kernel``: prologue relu(x·scale+shift)
                                                       on every x tile; epilogue: the tile statistics
                                                       of y (``STATS``, see :data:`FPROP_STATS`)
dgrad  ``aten.convolution_backward(dy, a, W, …,        ``_dgrad_kernel``: epilogue recomputes the ReLU
       output_mask=(True, False, False))``: da          mask from x, stores dz, writes per-tile Σdz and
                                                       Σdz·x̂ (BN's backward sums)
wgrad  the same with ``output_mask=(False, True,        ``_wgrad_kernel``: prologue recomputes a from x;
       False)``: dW                                    with a split-K > 1 also the launch that folds
                                                       its fp32 partials into dW (``note`` says so)
=====  ==============================================  ==============================================

``cuda`` times the extension's op for the mode as the CUDA backend calls it: ``cuda_fprop``,
``cuda_dgrad_stats`` (dz, Σdz, Σdz·x̂), ``cuda_wgrad`` (fp32 dW) — one CUTLASS 3.x kernel each on
sm_90a, while the CUTLASS 2.x path's dgrad is a plain dgrad plus a masking/reduction kernel; the
entry's ``note`` says that the op, the smallest thing that contains the kernel, is timed. It is skipped
with the dispatcher's reason where the backend cannot serve the unit
(:func:`fused_preact.bench.timing.cuda_backend_reason`). ``cudnn-fused`` (float16, fprop only) runs
cuDNN's runtime-fusion graph scale→bias→relu→conv_fprop→genstats through the ``cudnn`` module of
nvidia-cudnn-frontend (``import cudnn``), skipped with the reason where that fails; there is no
backward graph.

The Triton launches are the records of a one-unit :class:`fused_preact.ops.triton.plan.TritonPlan`
(:func:`fused_preact.ops.triton.launch.recording`, as the static report and the tile tuner use
them): exactly the ``fn[grid](*args)`` the op makes, with the tiles the op's plan picks (tuned on a
GPU unless ``FUSED_PREACT_AUTOTUNE=0``). What a kernel reads that other launches make — the BN pack
(scale, shift, mean, invstd) from the statistics and finalize launches — is made once, untimed.
Every provider gets the same inputs (one seed); inputs rotate through a pool of at least twice the L2
cache (at most 1 GiB of inputs, which binds only above a 512 MiB L2; the outputs kept per set come on
top: :func:`fused_preact.bench.timing.pool_count`);
the weight is shared.

Timing (:func:`fused_preact.bench.timing.time_cuda`): CUDA events around one call, warm-up, median,
and the GPU held busy by a sleep kernel while the call is enqueued (:data:`HOST_AHEAD_CYCLES`), so a
time is device time only: Python's launch overhead is the enqueue mode's business, not this level's.

Cost (per call, every mode): FLOPs ``2·N·P·Q·K·(C/g)·R·S`` (:func:`kernel_flops`); minimum bytes
those of the plain convolution, each tensor once: ``e·(|x| + |W| + |y|)`` (:func:`kernel_min_bytes`),
which the fused kernels exceed by design (dgrad reads x besides dy and W, for the ReLU mask and x̂).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from fused_preact.bench.shapes import UnitShape, enumerate_units, unit_flops, unit_min_bytes

__all__ = ["KERNEL_MODES", "KERNEL_PROVIDERS", "FUSED_KERNEL_PROVIDERS", "FPROP_STATS", "HOST_AHEAD_CYCLES",
           "QUICK_KERNEL_LAYERS", "kernel_flops", "kernel_min_bytes", "quick_kernel_units", "KernelCall",
           "KernelBench", "measure", "kernel_tables"]

#: Modes of the kernel level.
KERNEL_MODES: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
#: Providers of the kernel level, in table order; ``cudnn`` is the reference of every ratio.
KERNEL_PROVIDERS: tuple[str, ...] = ("cudnn", "triton", "cuda", "cudnn-fused")
#: The providers compared with ``cudnn`` (ratio = their ms / cudnn's ms).
FUSED_KERNEL_PROVIDERS: tuple[str, ...] = ("triton", "cuda", "cudnn-fused")
#: The Triton fprop writes its output's per-tile statistics (mean, M2) in its epilogue, as it does in a
#: network for every conv followed by another BatchNorm (all but the last): what the kernel costs in
#: training. cuDNN's and the extension's fprop do not (``cudnn-fused``'s genstats does).
FPROP_STATS: bool = True
#: GPU clock cycles of the sleep kernel enqueued before each timed call (~0.5 ms at 2 GHz, far more
#: than enqueuing one call takes), so the CUDA events time device work only.
HOST_AHEAD_CYCLES: int = 1_000_000
#: Units of the ``--quick`` kernel run (name suffixes after the model name): a 3×3 at 56² and the
#: CIFAR 16-channel 3×3.
QUICK_KERNEL_LAYERS: dict[str, tuple[str, ...]] = {
    "preact_resnet50": ("layer1.0/conv2",),
    "preact_resnet164": ("layer1.1/conv2",),
}
_ATEN_NOTE = "ATen → cuDNN (cudnn.benchmark algorithm search during warm-up); a = relu(bn(x)) made once, untimed"


def kernel_flops(u: UnitShape) -> int:
    """FLOPs of one fprop, dgrad or wgrad of unit ``u``: ``2·N·P·Q·K·(C/g)·R·S`` (the same GEMM size)."""
    return unit_flops(u, "fwd")


def kernel_min_bytes(u: UnitShape, mode: str, elem_bytes: int) -> int:
    """Minimum bytes of the plain convolution in ``mode``: each of x (or dx), W (or dW) and y (or dy)
    read or written once, ``elem_bytes·(|x| + |W| + |y|)``.

    Raises:
        ValueError: unknown mode.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"mode must be one of {KERNEL_MODES}, got {mode!r}")
    return unit_min_bytes(u, "fwd", elem_bytes)


def quick_kernel_units(model_name: str, batch: int = 128) -> list[UnitShape]:
    """The ``--quick`` subset of the kernel level (:data:`QUICK_KERNEL_LAYERS`; the first unit of a
    model without a listed subset)."""
    units = enumerate_units(model_name, batch)
    names = {f"{model_name}/{w}" for w in QUICK_KERNEL_LAYERS.get(model_name, ())}
    return [u for u in units if names & set(u.names)] or units[:1]


@dataclasses.dataclass
class KernelCall:
    """One provider's call for one mode: ``run(setup(i))`` is the timed call (``setup`` picks the pool
    entry, untimed). ``launches``: what one call launches (kernel names where known); ``note``: what
    else the entry should say (e.g. that an op rather than a single kernel is timed)."""

    setup: Callable[[int], Any]
    run: Callable[[Any], Any]
    launches: list[str]
    note: str = ""


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


class KernelBench:
    """The inputs of one unit in one dtype, and every provider's call per mode (module docstring).

    Args:
        u: the unit. dtype: activations' and weight's dtype (BN's γ, β and statistics are fp32).
        l2_bytes: L2 cache size; the pool holds ≥ 2·L2 bytes of (x, dy) sets (:func:`~fused_preact.bench.timing.
            pool_count`: at least 2 sets, at most 1 GiB of (x, dy), and at most ``pool_cap`` sets where given;
            the outputs kept per set come on top).
        device: default ``fused_preact.bench.timing.DEVICE`` ("cuda"; tests use "cpu" with Triton's
            interpreter). seed: every provider built from the same seed sees the same data.
        split: force the Triton wgrad's K-split (tests of the fold path; default: the plan's choice).
    """

    def __init__(self, u: UnitShape, dtype: torch.dtype, l2_bytes: int, device=None, pool_cap: Optional[int] = None,
                 seed: int = 0, split: Optional[int] = None):
        from fused_preact.bench import timing as BT

        self.u, self.dtype = u, dtype
        self.device = torch.device(device if device is not None else BT.DEVICE)
        self.stride, self.padding, self.dilation = tuple(u.stride), tuple(u.padding), tuple(u.dilation)
        self.groups = u.groups
        nx, nw, ny = u.numel()
        elem = torch.finfo(dtype).bits // 8
        self.n = BT.pool_count(elem * (nx + ny), l2_bytes, pool_cap)
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)  # on the device: no host RNG over large tensors

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, device=dev) * scale

        x_shape, y_shape = (u.N, u.C, u.H, u.W), (u.N, u.K, u.P, u.Q)
        fan_in = (u.C // u.groups) * u.R * u.S
        self.weight = _cl(randn(u.K, u.C // u.groups, u.R, u.S, scale=fan_in ** -0.5).to(dtype))
        self.gamma = torch.rand(u.C, generator=gen, device=dev) + 0.5
        self.beta = randn(u.C, scale=0.5)
        self.eps = 1e-5
        self.xs = [_cl(randn(*x_shape).to(dtype)) for _ in range(self.n)]
        self.dys = [_cl(randn(*y_shape).to(dtype)) for _ in range(self.n)]
        self.device = self.weight.device  # with its index ("cuda:0"), as an op sees its input's device
        # batch statistics of each x in fp32 and the BN transform a = relu(x·scale + shift)
        self.stats = []
        for x in self.xs:
            var, mean = torch.var_mean(x.float(), dim=(0, 2, 3), unbiased=False)
            invstd = torch.rsqrt(var + self.eps)
            scale = self.gamma * invstd
            self.stats.append(dict(mean=mean.contiguous(), invstd=invstd.contiguous(), scale=scale.contiguous(),
                                   shift=(self.beta - mean * scale).contiguous()))
        self._triton_sets: Optional[list[dict]] = None
        self._triton_split = split or 1
        self._forced_split = split
        self._acts: Optional[list[torch.Tensor]] = None

    # ----------------------------------------------------------------------------- providers
    def modes(self, provider: str) -> tuple[str, ...]:
        """The modes ``provider`` has a call for (``cudnn-fused``: fprop only)."""
        return ("fprop",) if provider == "cudnn-fused" else KERNEL_MODES

    def call(self, provider: str, mode: str) -> KernelCall:
        """``provider``'s call for ``mode`` (builds what it needs on first use).

        Raises:
            Skip (:class:`fused_preact.bench.timing.Skip`): the provider cannot run here (reason).
            ValueError: unknown provider or mode.
        """
        if provider not in KERNEL_PROVIDERS:
            raise ValueError(f"unknown kernel provider {provider!r}; expected one of {KERNEL_PROVIDERS}")
        if mode not in KERNEL_MODES:
            raise ValueError(f"mode must be one of {KERNEL_MODES}, got {mode!r}")
        return {"cudnn": self._cudnn, "triton": self._triton, "cuda": self._cuda,
                "cudnn-fused": self._cudnn_fused}[provider](mode)

    def _setup(self) -> Callable[[int], int]:
        n = self.n
        return lambda i: i % n

    def activations(self) -> list[torch.Tensor]:
        """a = relu(x·scale + shift) of every pool entry, in the dtype, channels_last (cuDNN's input)."""
        if self._acts is None:
            acts = []
            for x, st in zip(self.xs, self.stats):
                a = torch.relu(x.float() * st["scale"].view(1, -1, 1, 1) + st["shift"].view(1, -1, 1, 1))
                acts.append(_cl(a.to(self.dtype)))
            self._acts = acts
        return self._acts

    def _cudnn(self, mode: str) -> KernelCall:
        acts, w, dys = self.activations(), self.weight, self.dys
        st, pd, dl, g = self.stride, self.padding, self.dilation, self.groups
        if mode == "fprop":
            return KernelCall(self._setup(), lambda k: F.conv2d(acts[k], w, None, st, pd, dl, g), ["aten.convolution"],
                              _ATEN_NOTE)
        mask = [True, False, False] if mode == "dgrad" else [False, True, False]
        out = 0 if mode == "dgrad" else 1

        def run(k):
            return torch.ops.aten.convolution_backward(dys[k], acts[k], w, None, list(st), list(pd), list(dl), False,
                                                       [0, 0], g, mask)[out]

        return KernelCall(self._setup(), run, ["aten.convolution_backward"], _ATEN_NOTE)

    # -------------------------------------------------------------------------------- triton
    def triton_sets(self) -> list[dict]:
        """Per pool entry, the recorded launches of a one-unit :class:`TritonPlan` (module docstring):
        ``{"fprop": [Launch], "dgrad": [Launch], "wgrad": [Launch, (fold)], "y", "dw", "x", "dy"}``. The
        statistics and finalize launches of each entry run once here, so the pack holds real values."""
        if self._triton_sets is not None:
            return self._triton_sets
        from fused_preact.ops.spec import BATCH, BNMode, ChainSpec, ChainTensors, ConvGeom, GradNeeds, UnitTensors
        from fused_preact.ops.triton.launch import recording
        from fused_preact.ops.triton.plan import TritonPlan

        u = self.u
        spec = ChainSpec((ConvGeom(u.C, u.K, (u.R, u.S), self.stride, self.padding, self.dilation, self.groups),))
        x0 = self.xs[0]
        plan = TritonPlan(spec, (BNMode(BATCH, True, False),), tuple(x0.shape), tuple(x0.stride()), self.dtype,
                          self.device, self.dtype, False, FPROP_STATS, split=self._forced_split)
        self._triton_split = plan.units[0].split
        t = ChainTensors([UnitTensors(self.weight, None, self.gamma, self.beta, eps=self.eps)])
        sets = []
        for x, dy in zip(self.xs, self.dys):
            with recording() as fwd:
                out = plan.forward(x, t)
            for launch in fwd:  # statistics → finalize → fprop: the pack the backward kernels read
                launch()
            with recording() as bwd_dx:  # dx wanted, no dW: dgrad (+ the sums' fold and the dx pass)
                plan.backward(dy, None, out.saved, [self.weight], None, GradNeeds(True, (False,), (False,), (torch.float32,)))
            with recording() as bwd_w:  # dW only: wgrad (+ the split-K fold), nothing else
                grads = plan.backward(dy, None, out.saved, [self.weight], None, GradNeeds(False, (True,), (False,), (None,)))
            sets.append(dict(fprop=_only(fwd, "fprop"), dgrad=_only(bwd_dx, "dgrad"), wgrad=list(bwd_w), y=out.out,
                             dw=grads.units[0].weight, x=x, dy=dy))
            names = [launch.name for launch in bwd_w]
            if names not in (["wgrad"], ["wgrad", "dx"]):
                raise RuntimeError(f"fused_preact.bench: a dW-only backward recorded {names}, expected the wgrad "
                                   f"launch and at most the split-K fold")
        self._triton_sets = sets
        return sets

    def _triton(self, mode: str) -> KernelCall:
        sets = self.triton_sets()
        runs = [s[mode] for s in sets]
        names = [launch.name for launch in runs[0]]
        note = ""
        if mode == "wgrad" and len(names) > 1:
            names = ["wgrad", "dx (split-K fold only)"]
            note = (f"split-K {self._triton_split}: the wgrad launch writes fp32 partials; the timed call adds the "
                    f"launch that folds them into dW (the dx kernel's fold programs, no dx work)")
        elif mode == "fprop":
            note = "with the output-statistics epilogue (STATS), as in a network" if FPROP_STATS else ""
        elif mode == "dgrad":
            note = "epilogue: ReLU mask from x, dz stored, per-tile Σdz and Σdz·x̂"

        def run(k):
            for launch in runs[k]:
                launch()

        return KernelCall(self._setup(), run, names, note)

    def triton_result(self, mode: str, k: int = 0) -> torch.Tensor:
        """What the Triton call of ``mode`` on pool entry ``k`` computed (after it ran): fprop y,
        dgrad dz as a logical (N, C, H, W) tensor, wgrad dW."""
        s = self.triton_sets()[k]
        if mode == "fprop":
            return s["y"]
        if mode == "wgrad":
            return s["dw"]
        x, dy = s["x"], s["dy"]
        (launch,) = s["dgrad"]
        skip = {x.data_ptr(), dy.data_ptr(), self.weight.data_ptr()}
        found = [a for a in launch.args if isinstance(a, torch.Tensor) and a.dtype == x.dtype
                 and a.numel() == x.numel() and a.data_ptr() not in skip]
        if len(found) != 1:
            raise RuntimeError(f"fused_preact.bench: cannot tell the dgrad launch's dz among {len(found)} candidates")
        N, C, H, W = x.shape
        return found[0].view(N, H, W, C).permute(0, 3, 1, 2)

    # ---------------------------------------------------------------------------------- cuda
    def _cuda(self, mode: str) -> KernelCall:
        from fused_preact.bench.timing import Skip, cuda_backend_reason

        reason = cuda_backend_reason(self.xs[0], [self.u])
        if reason:
            raise Skip(reason)
        ops = torch.ops.fused_preact
        xs, dys, w, stats = self.xs, self.dys, self.weight, self.stats
        st, pd, dl = list(self.stride), list(self.padding), list(self.dilation)
        if mode == "fprop":
            def run(k):
                return ops.cuda_fprop(xs[k], w, None, stats[k]["scale"], stats[k]["shift"], st, pd, dl)
            name, note = "fused_preact::cuda_fprop", "the extension op (CUTLASS fprop with the BN+ReLU transform)"
        elif mode == "dgrad":
            def run(k):
                s = stats[k]
                return ops.cuda_dgrad_stats(dys[k], xs[k], w, s["scale"], s["shift"], s["mean"], s["invstd"], st, pd,
                                            dl, True)
            name = "fused_preact::cuda_dgrad_stats"
            note = ("the extension op: dz, Σdz, Σdz·x̂ (sm_90a: one CUTLASS 3.x kernel for unit stride; "
                    "CUTLASS 2.x: a plain dgrad into fp32 plus a masking/reduction kernel)")
        else:
            def run(k):
                s = stats[k]
                return ops.cuda_wgrad(dys[k], xs[k], s["scale"], s["shift"], list(w.shape), st, pd, dl)
            name = "fused_preact::cuda_wgrad"
            note = "the extension op (fp32 dW; the cast to the weight's dtype is not timed)"
        return KernelCall(self._setup(), run, [name], note)

    # --------------------------------------------------------------------------- cudnn-fused
    def _cudnn_fused(self, mode: str) -> KernelCall:
        from fused_preact.bench.timing import Skip

        if mode != "fprop":
            raise Skip(f"cudnn-fused: only the forward graph (scale→bias→relu→conv_fprop→genstats) is built, "
                       f"no {mode}")
        if self.dtype != torch.float16:
            raise Skip(f"cudnn-fused: float16 only (the runtime-fusion graph's io type), not {self.dtype}")
        if self.device.type != "cuda":
            raise Skip(f"cudnn-fused: needs a CUDA device, the inputs are on {self.device}")
        if self.groups != 1:
            raise Skip(f"cudnn-fused: groups={self.groups} not built")
        try:
            import cudnn
        except Exception as e:  # ImportError, or a library load error inside the module
            raise Skip(f"cudnn-fused: `import cudnn` failed ({type(e).__name__}: {e}); pip install "
                       f"nvidia-cudnn-frontend") from e
        return self._cudnn_graph(cudnn)

    def _cudnn_graph(self, cudnn) -> KernelCall:
        from fused_preact.bench.timing import Skip

        half = cudnn.data_type.HALF
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        u, x0, w = self.u, self.xs[0], self.weight
        vec = [_cl(s[k].view(1, -1, 1, 1).to(torch.float16)) for s in self.stats for k in ("scale", "shift")]
        try:
            graph = cudnn.pygraph(io_data_type=half, intermediate_data_type=half,
                                  compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            X = graph.tensor(name="X", dim=list(x0.shape), stride=list(x0.stride()), data_type=half)
            Wt = graph.tensor(name="W", dim=list(w.shape), stride=list(w.stride()), data_type=half)
            S = graph.tensor(name="S", dim=list(vec[0].shape), stride=list(vec[0].stride()), data_type=half)
            B = graph.tensor(name="B", dim=list(vec[1].shape), stride=list(vec[1].stride()), data_type=half)
            a = graph.relu(name="relu", input=graph.bias(name="bias", input=graph.scale(name="scale", input=X, scale=S),
                                                        bias=B))
            Y = graph.conv_fprop(image=a, weight=Wt, padding=list(self.padding), stride=list(self.stride),
                                 dilation=list(self.dilation))
            Y.set_output(True)
            SUM, SQ = graph.genstats(name="genstats", input=Y)
            SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
            SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception as e:  # cudnnGraphNotSupportedError and friends: recorded as the reason
            raise Skip(f"cudnn-fused: cuDNN did not build the graph ({type(e).__name__}: {str(e)[:300]})") from e
        workspace = torch.empty(max(1, graph.get_workspace_size()), device=self.device, dtype=torch.uint8)
        packs = []
        for i, x in enumerate(self.xs):
            y = torch.empty((u.N, u.K, u.P, u.Q), device=self.device, dtype=torch.float16,
                            memory_format=torch.channels_last)
            sums = [torch.empty((1, u.K, 1, 1), device=self.device, dtype=torch.float32) for _ in range(2)]
            packs.append({X: x, Wt: w, S: vec[2 * i], B: vec[2 * i + 1], Y: y, SUM: sums[0], SQ: sums[1]})

        def run(k):
            graph.execute(packs[k], workspace, handle=handle)

        return KernelCall(self._setup(), run, ["cudnn graph: scale→bias→relu→conv_fprop→genstats"],
                          "cuDNN runtime fusion (nvidia-cudnn-frontend), float16 io and intermediates")


def _only(launches: Sequence, name: str) -> list:
    picked = [launch for launch in launches if launch.name == name]
    if len(picked) != 1:
        raise RuntimeError(f"fused_preact.bench: expected one {name!r} launch, the plan recorded "
                           f"{[launch.name for launch in launches]}")
    return picked


def measure(bench: KernelBench, provider: str, mode: str, warmup: int, reps: int, max_s: float):
    """Time ``provider``'s ``mode`` call of ``bench`` (device time, :data:`HOST_AHEAD_CYCLES`) and the
    memory one call allocates.

    Returns:
        :class:`fused_preact.bench.timing.Measurement`: times in ms, peak bytes, extra ``pool``,
        ``launches``, ``timer`` and (when there is one) ``note``.

    Raises:
        Skip: the provider cannot run this call (reason).
    """
    from fused_preact.bench import timing as BT

    c = bench.call(provider, mode)
    times = BT.time_cuda(c.run, c.setup, warmup=warmup, reps=reps, max_s=max_s, host_ahead_cycles=HOST_AHEAD_CYCLES)
    extra: dict[str, Any] = dict(pool=bench.n, launches=c.launches,
                                 timer=f"cuda events, device time (sleep kernel of {HOST_AHEAD_CYCLES} cycles ahead)")
    if c.note:
        extra["note"] = c.note
    return BT.Measurement(times, BT.peak_memory(c.run, c.setup), extra)


# ------------------------------------------------------------------------------------------- report
def _f(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def kernel_tables(results: Sequence[dict]) -> list[tuple[str, list[str], list[tuple]]]:
    """The kernel level's report tables from results entries (others are ignored), as
    ``(title, head, rows)``; empty without kernel entries.

    1. per shape, dtype and mode: each provider's median ms and, for the fused ones, the ratio
       fused ms / cudnn ms (below 1: faster than cuDNN);
    2. per mode, dtype and fused provider: the geometric mean of that ratio over the shapes, its
       range, and the count-weighted ratio Σ count·ms / Σ count·cudnn ms (``count``: layers of the
       model with that shape, i.e. the ratio of the models' total time in these convolutions).
    """
    ks = [e for e in results if e.get("level") == "kernel"]
    if not ks:
        return []
    by = {(e["name"], e.get("dtype"), e["mode"], e["provider"]): e for e in ks}
    present = [p for p in KERNEL_PROVIDERS if any(e["provider"] == p for e in ks)]
    fused = [p for p in present if p in FUSED_KERNEL_PROVIDERS]
    keys = list(dict.fromkeys((e["name"], e.get("dtype"), e["mode"]) for e in ks))
    order = {n: i for i, n in enumerate(dict.fromkeys(e["name"] for e in ks))}
    dorder = {d: i for i, d in enumerate(dict.fromkeys(e.get("dtype") for e in ks))}  # as run
    keys.sort(key=lambda k: (dorder[k[1]], KERNEL_MODES.index(k[2]) if k[2] in KERNEL_MODES else 9, order[k[0]]))
    head = ["shape", "dtype", "mode"] + [f"{p} ms" for p in present] + [f"{p}/cudnn" for p in fused]
    rows = []
    for name, dtype, mode in keys:
        any_e = next(by[(name, dtype, mode, p)] for p in present if (name, dtype, mode, p) in by)
        shape = name + (f" ({any_e['shape']})" if any_e.get("shape") else "")
        ref = by.get((name, dtype, mode, "cudnn"))
        row = [shape, str(dtype), mode]
        row += [_f(by[(name, dtype, mode, p)]["median_ms"] if (name, dtype, mode, p) in by else None, ".4f")
                for p in present]
        for p in fused:
            e = by.get((name, dtype, mode, p))
            row.append(_f(e["median_ms"] / ref["median_ms"] if (e and ref) else None, ".2f", "×"))
        rows.append(tuple(row))
    shead = ["mode", "dtype", "provider", "shapes", "geomean fused/cudnn", "min", "max", "count-weighted"]
    srows = []
    for dtype in dict.fromkeys(k[1] for k in keys):
        for mode in KERNEL_MODES:
            for p in fused:
                pairs = [(by[(n, d, m, p)], by[(n, d, m, "cudnn")]) for n, d, m in keys
                         if d == dtype and m == mode and (n, d, m, p) in by and (n, d, m, "cudnn") in by]
                if not pairs:
                    continue
                ratios = [e["median_ms"] / r["median_ms"] for e, r in pairs]
                weighted = (sum(e.get("count", 1) * e["median_ms"] for e, _ in pairs)
                            / sum(r.get("count", 1) * r["median_ms"] for _, r in pairs))
                geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
                srows.append((mode, str(dtype), p, str(len(pairs)), _f(geo, ".2f", "×"), _f(min(ratios), ".2f", "×"),
                              _f(max(ratios), ".2f", "×"), _f(weighted, ".2f", "×")))
    return [("kernels: geometric mean over shapes of fused ms / cudnn ms (below 1: faster than cuDNN)", shead, srows),
            ("kernels: median ms per shape and the ratio fused / cudnn", head, rows)]
