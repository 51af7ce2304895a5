"""The numeric probe: a block and its converted copy run in float64 on random inputs and parameters,
train and eval mode, with the RNG state of the model restored afterwards."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from fused_preact.ops.spec import ConvGeom

_PROBE_TOL = 1e-6

def _randomize_(module: nn.Module) -> None:
    """Re-draw every floating parameter and buffer of ``module`` (a probe copy) from the global RNG:
    a forward that reads one (a residual scale held as a buffer on the block) shows it in the probe."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:  # each on its own: a BatchNorm may have only one of them
                    m.bias.normal_(0.0, 0.5)
                if m.running_mean is not None:
                    m.running_mean.normal_(0.0, 0.5)
                    m.running_var.uniform_(0.5, 1.5)
                continue
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    fan_in = p[0].numel() if p.dim() > 1 else 1
                    p.normal_(0.0, 1.0 / math.sqrt(fan_in))
            for b in m.buffers(recurse=False):
                if b.is_floating_point():
                    b.uniform_(0.5, 1.5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _probe_size(convs: list[nn.Conv2d]) -> int:
    """Smallest S ≥ 4 (a power of two) such that a chain of ``convs`` maps an S×S input to at least 1×1."""
    size = 4
    while size < 4096:
        s = size
        for c in convs:
            s = min(ConvGeom.of(c).out_hw(s, s))
        if s >= 1:
            return size
        size *= 2
    return size


def _generator(device: torch.device) -> torch.Generator:
    """The global generator that ops on ``device`` draw from: the CPU one, or that CUDA device's
    (``torch.cuda.default_generators``). Nothing else is looked at, so a CPU block never touches CUDA."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise RuntimeError(f"the probe runs on CPU and CUDA devices only, not {device}")


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[Callable[[int], None]]:
    """Save the CPU generator and ``device``'s, yield a ``seed(n)`` that seeds both, restore both on exit.

    Exactly the generators a probe on ``device`` draws from are saved and restored (``fork_rng``
    and ``torch.manual_seed`` would touch every device of the process).
    """
    gens = [torch.default_generator] + ([_generator(device)] if device.type != "cpu" else [])
    states = [g.get_state() for g in gens]

    def seed(n: int) -> None:
        for g in gens:
            g.manual_seed(n)

    seed.states = lambda: [g.get_state() for g in gens]  # what the draws since the last seed left
    try:
        yield seed
    finally:
        for g, state in zip(gens, states):
            g.set_state(state)


def _devices(module: nn.Module) -> set[torch.device]:
    """The devices of ``module``'s parameters and buffers."""
    return {t.device for t in module.parameters()} | {t.device for t in module.buffers()}


def _probe_device(module: nn.Module) -> torch.device:
    """The one device of ``module``'s parameters and buffers (CPU for a module holding none).

    Raises:
        RuntimeError: they lie on more than one device.
    """
    devices = _devices(module)
    if len(devices) > 1:
        raise RuntimeError(f"parameters and buffers on several devices ({sorted(map(str, devices))})")
    return devices.pop() if devices else torch.device("cpu")


def _probe(original: nn.Module, build: Callable[[nn.Module], nn.Module], channels: int, size: int) -> Optional[str]:
    """Run a randomized float64 copy of ``original`` against ``build(copy)`` (backend "reference").

    Everything runs on ``original``'s own device (its parameters' and buffers'), on deep copies in
    float64 (1e-6 is meaningful there; a wrong shortcut reading differs by O(1)); the CPU generator
    and that device's generator are seeded for the probe and restored afterwards, and no other
    device is touched. Returns ``None`` when outputs, gradients, buffers and the random numbers drawn
    agree in eval and training mode (and in training on a batch of 5 scaled by 8), else a short
    reason. Nothing of ``original`` is modified. A probe sees only these inputs: a forward whose
    behaviour changes elsewhere (a branch on other values) can still pass.
    """
    try:
        device = _probe_device(original)
        with _rng_preserved(device) as _seed:
            _seed(0)
            ref = copy.deepcopy(original)
            _randomize_(ref)
            ref = ref.double()
            cand = build(copy.deepcopy(ref))
            # eval, training, and training on a batch of another size and scale (a forward that depends
            # on them — ghost batches, a clamp — differs there)
            for train, batch, scale in ((False, 2, 1.0), (True, 2, 1.0), (True, 5, 8.0)):
                ref.train(train)
                cand.train(train)
                x = torch.randn(batch, channels, size, size, dtype=torch.float64, device=device) * scale + 0.3
                outs, grads, draws = [], [], []
                for m in (ref, cand):
                    xi = x.clone().requires_grad_()
                    _seed(1)
                    y = m(xi)
                    draws.append(_seed.states())
                    _seed(2)
                    y.backward(torch.randn_like(y))
                    outs.append(y.detach())
                    grads.append(xi.grad)
                mode = ("training" if train else "eval") + (f" (batch {batch}, scale {scale:g})" if batch != 2 else "")
                if not all(torch.equal(a, b) for a, b in zip(*draws)):
                    return f"{mode}-mode forward draws other random numbers (randomness in its forward)"
                if _rel(outs[1], outs[0]) > _PROBE_TOL:
                    return f"{mode}-mode output differs (rel. error {_rel(outs[1], outs[0]):.1e})"
                if _rel(grads[1], grads[0]) > _PROBE_TOL:
                    return f"{mode}-mode input gradient differs"
            params, buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
            if list(dict(cand.named_parameters())) != list(params) or list(dict(cand.named_buffers())) != list(buffers):
                return "the converted block's parameters or buffers are not the original's"
            for name, a in cand.named_parameters():
                b = params[name]
                if (a.grad is None) != (b.grad is None) or (a.grad is not None and _rel(a.grad, b.grad) > _PROBE_TOL):
                    return f"gradient of {name} differs"
            for name, a in cand.named_buffers():
                if _rel(a.double(), buffers[name].double()) > _PROBE_TOL:
                    return f"buffer {name} differs after a training step"
    except Exception as e:  # any failure of the probe means: do not convert
        return f"probe raised {type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------------------------
# block recognition


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(e) for e in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _tensor_digest(t: torch.Tensor) -> str:
    """Shape, dtype, device type and a SHA-256 of the values of ``t`` (a ``repr`` elides large tensors)."""
    head = f"tensor{tuple(t.shape)}:{t.dtype}:{t.device.type}"
    if t.device.type == "meta":
        return head
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return head + ":" + hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _signature(module: nn.Module) -> str:
    """What a probe of ``module`` depends on besides parameter values: its class, its tree (``repr``
    lists every child with its hyperparameters), the public attributes of every submodule and its
    private ones of plain types (numbers, strings, None and tuples/lists of them: a ``self._scale``
    that the forward reads) or tensors (by value: a ``self._skip_scale = torch.tensor(0.5)``; parameters
    and buffers live in the module's own dicts and are probed)."""
    attrs = [
        (name, type(m).__qualname__, k, _tensor_digest(v) if isinstance(v, torch.Tensor) else repr(v))
        for name, m in module.named_modules()
        for k, v in sorted(vars(m).items())
        if k != "training" and (not k.startswith("_") or _plain(v) or isinstance(v, torch.Tensor))
    ]
    return f"{type(module).__module__}.{type(module).__qualname__}|{module!r}|{attrs}"
