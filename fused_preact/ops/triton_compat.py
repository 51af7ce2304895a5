"""Everything that differs between the Triton releases fused_preact supports, in one place.

Supported: Triton 3.6 to 3.9, the releases PyTorch's CUDA wheels pin (torch 2.10.0/2.11.0 →
``triton==3.6.0``, 2.12.1 → ``3.7.1``, 2.14.x → ``~=3.8.0``, 2.15 → 3.9; read from the wheels' metadata),
statically checked under 3.6, 3.7, 3.8 and 3.9 (every launch of PreActResNet-50 and -164 compiles
without spills) and run through the interpreter tests under 3.6 and 3.9.
:data:`TORCH_TRITON_PINS` holds that table; ``tests/test_packaging.py`` checks pyproject's range
against it. Nothing else in the package compares Triton versions: it reads the facts below.

What differs, and what this module does about it:

* **Interpreter, 3.6.** ``tensor.__index__`` is ``int(handle.data)``, and a program id is a one-element
  array there, which NumPy ≥ 2.4 refuses to convert (``TypeError: only 0-dimensional arrays can be
  converted to Python scalars``): every ``range(pid * B, n, step)`` in a kernel failed. 3.7 squeezes the
  array first; :func:`_patch_interpreter` installs that same definition on 3.6.
* **Compilation knobs** that enter a launch's cache key (``instrumentation_mode`` since 3.6,
  ``fpsan_homomorphic_casts`` since 3.9): :func:`launch_knob_kwargs` returns those the running Triton has,
  for the offline static report (``tools/static_report/compile.py``), which binds arguments like
  ``JITFunction.run``.
* **Tiles a release's compiler spills** where the newest does not (its static report, ``--check``):
  :data:`TILE_OVERRIDES`, read by the tile rules (``ops/triton/configs.py``) through
  :func:`tile_override`: such a default takes the listed replacement, such a candidate is dropped.
* **Kernels a release cannot compile**: :data:`KERNEL_REQUIREMENTS` (kernel name → first release that
  compiles it, with why); :func:`kernel_unsupported_reason` answers for a kernel. Empty today: every
  kernel compiles under 3.6 to 3.9 (checked offline for sm_90 and sm_80 by the static report).
"""

from __future__ import annotations

import re
from typing import Optional

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package requires triton; kept so the report can say why
    triton = tl = None

__all__ = [
    "triton", "tl", "TRITON_VERSION", "MIN_TRITON", "TORCH_TRITON_PINS", "version_tuple", "version_label",
    "supported_reason", "KERNEL_REQUIREMENTS", "kernel_unsupported_reason", "launch_knob_kwargs",
    "TILE_OVERRIDES", "tile_override",
]

#: Oldest Triton the kernels, the static gate and the interpreter tests are checked against.
MIN_TRITON: tuple[int, int] = (3, 6)

#: Triton that each PyTorch CUDA release pins (``Requires-Dist`` of the manylinux x86_64 wheels, read
#: with ``pip install --dry-run --no-deps --report``): torch version → pip specifier.
TORCH_TRITON_PINS: dict[str, str] = {
    "2.10.0": "==3.6.0",
    "2.11.0": "==3.6.0",
    "2.12.1": "==3.7.1",
    "2.14.0": "~=3.8.0",
    "2.14.1": "~=3.8.0",
    "2.15.0": ">=3.9",  # the newest release; brings 3.9
}


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"3.6.0"`` → ``(3, 6, 0)``; a pre-release or local suffix is ignored (``"3.9.0+git1"`` → ``(3, 9, 0)``)."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


#: The running Triton's (major, minor, patch); (0, 0, 0) when it cannot be imported.
TRITON_VERSION: tuple[int, int, int] = version_tuple(triton.__version__) if triton is not None else (0, 0, 0)


def version_label() -> str:
    """The running Triton's version string (``"3.6.0"``), or ``"missing"``."""
    return triton.__version__ if triton is not None else "missing"


def supported_reason() -> Optional[str]:
    """Why the installed Triton cannot run fused_preact's kernels, or None when it can."""
    if triton is None:
        return "triton is not installed"
    if TRITON_VERSION[:2] < MIN_TRITON:
        return (f"triton {triton.__version__} is older than {MIN_TRITON[0]}.{MIN_TRITON[1]}, the oldest release "
                f"fused_preact's kernels are checked against")
    return None


#: Kernel (its Python name, e.g. ``"_fprop_kernel"``) → (first Triton (major, minor) that compiles it,
#: why). A kernel listed here is never launched on an older Triton: the triton backend
#: (``TritonBackend.version_reasons``) then refuses every input with :func:`kernel_unsupported_reason`,
#: so ``auto`` takes the next backend with that reason and a warning, and a forced ``backend="triton"``
#: raises it. (The recompute backend's elementwise kernels are plain loads and stores that every
#: supported release compiles.)
KERNEL_REQUIREMENTS: dict[str, tuple[tuple[int, int], str]] = {}


def kernel_unsupported_reason(kernel: str) -> Optional[str]:
    """Why the installed Triton cannot compile ``kernel`` (named as in :data:`KERNEL_REQUIREMENTS`),
    naming the kernel and both versions; None when it can."""
    base = supported_reason()
    if base is not None:
        return base
    need = KERNEL_REQUIREMENTS.get(kernel)
    if need is not None and TRITON_VERSION[:2] < need[0]:
        return (f"{kernel} needs triton >= {need[0][0]}.{need[0][1]} ({need[1]}); "
                f"triton {triton.__version__} is installed")
    return None


#: Per Triton (major, minor): the tiles its compiler spills where 3.9's does not, by (kernel, compute
#: capability, dtype, ``GemmConfig.label()``) → the fields to change (a replacement tile that compiles
#: without spills, checked by the same report), or None: not a candidate there. Found by
#: ``python -m tools.static_report --check`` under that release (every launch of PreActResNet-50/-164);
#: each replacement was compiled under that release and compiles without spills.
TILE_OVERRIDES: dict[tuple[int, int], dict[tuple[str, int, str, str], Optional[dict]]] = {
    (3, 6): {
        # default of R50 layer1.0's 1x1 dgrad beside the projection (HAS_PROJ WRITE_DX): 8 bytes in 3 stages
        ("dgrad", 80, "bf16", "64x64x64_w4_s3"): {"num_stages": 4},
        # default of R164 layer1.0's one-step 1x1 16->64 fprop beside the projection: 16 bytes at any stage count
        ("fprop", 80, "fp32", "64x64x16_w4_s4"): {"BLOCK_N": 32},
        # candidates of R164's 1x1 fprops (16->16 with STATS; 32->128 and 16->64 beside the residual)
        ("fprop", 80, "bf16", "128x16x16_w4_s2_u2"): None,
        ("fprop", 80, "bf16", "64x64x32_w4_s4"): None,
        ("fprop", 80, "fp16", "64x64x16_w4_s3"): None,
        ("fprop", 80, "fp16", "64x64x16_w4_s4"): None,
    },
    (3, 7): {
        # defaults: R164 layer2's one-step 1x1 128->32 fprop (128 rows -> 64), R164's thin 1x1 64->16 wgrad
        # (2 stages -> 3), R50's wide 3x3 wgrad on sm_90 (8 bytes at 255 registers; 256 rows -> 128)
        ("fprop", 80, "bf16", "128x32x64_w4_s2_u2"): {"BLOCK_M": 64},
        ("fprop", 80, "fp16", "128x32x64_w4_s2_u2"): {"BLOCK_M": 64},  # the same, with fp16's halved transform
        ("wgrad", 80, "fp16", "16x64x128_w2_s2_u2"): {"num_stages": 3},
        ("wgrad", 90, "fp16", "64x64x256_w4_s2"): {"BLOCK_K": 128},
    },
    (3, 8): {
        # defaults: R50's 3x3 dgrads (8 bytes in 3 or 4 stages; 64-deep steps -> 32, and in 3 stages
        # 128x32 tiles as below), R164 layer1.0's
        # projection wgrad 16->64 (48-80 bytes at 255 registers; 256 rows -> 128), R164's 1x1 wgrads
        # 32->128 (8-40 bytes at 255 registers; 128 rows -> 64)
        ("dgrad", 80, "bf16", "64x64x64_w4_s3"): {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 32},
        ("dgrad", 80, "bf16", "64x64x64_w4_s4"): {"BLOCK_K": 32},
        # γ applied last in dgrad's WRITE_DX epilogue (eval mode): R50's and R164's 64-channel 1x1 and
        # 3x3 dgrads in 64x64x32 tiles, 8 bytes at 128 registers; 128x32 tiles do not spill (their
        # training twins' issue ratio 0.672 -> 0.727 for the 1x1, 0.805 -> 0.891 for the 3x3)
        ("dgrad", 80, "bf16", "64x64x32_w4_s3"): {"BLOCK_M": 128, "BLOCK_N": 32},
        ("wgrad", 90, "bf16", "64x16x256_w1_s2"): {"BLOCK_K": 128},
        ("wgrad", 90, "fp16", "64x16x256_w1_s2"): {"BLOCK_K": 128},
        # fp16's halved transform (prologue16): R50's wide 3x3 wgrad on sm_90, 8 bytes at 255 registers
        # (256 rows -> 128: issue ratio 0.877 -> 0.984)
        ("wgrad", 90, "fp16", "64x64x256_w4_s2"): {"BLOCK_K": 128},
        ("wgrad", 80, "bf16", "128x32x128_w2_s3"): {"BLOCK_K": 64},
        ("wgrad", 90, "fp16", "128x32x128_w2_s2"): {"BLOCK_K": 64},
        ("wgrad", 80, "fp16", "128x32x128_w2_s3"): {"BLOCK_K": 64},
        # candidates of R164's narrow 1x1 and strided 3x3 wgrads (32-808 bytes)
        ("wgrad", 90, "bf16", "64x16x512_w1_s2"): None,
        ("wgrad", 80, "bf16", "64x16x512_w1_s2"): None,
        ("wgrad", 80, "bf16", "64x16x256_w1_s3"): None,
        ("wgrad", 90, "bf16", "32x32x128_w2_s2_u2"): None,
        ("wgrad", 90, "bf16", "128x32x256_w2_s2"): None,
        ("wgrad", 80, "bf16", "128x32x256_w2_s3"): None,
    },
    (3, 9): {
        # defaults that spill 8 bytes with fp16's halved transform (prologue16) on sm_90: R50's wide 3x3
        # wgrad at 255 registers (64 channels -> 32: issue ratio 0.961 -> 0.971) and R164 layer1.0's
        # projection wgrad 16->64 (1 warp -> 2, 3 stages: 0.982 -> 0.904; its autocast twin 1.295 -> 1.131)
        ("wgrad", 90, "fp16", "64x64x256_w4_s2"): {"BLOCK_N": 32},
        ("wgrad", 90, "fp16", "64x16x256_w1_s2"): {"num_warps": 2, "num_stages": 3},
    },
}


def tile_override(kernel: str, arch: int, dtype: str, label: str) -> tuple[bool, Optional[dict]]:
    """Whether the running Triton lists tile ``label`` of ``kernel`` on sm_``arch`` in ``dtype``
    (``"bf16"``, ``"fp16"``, ``"fp32"``) in :data:`TILE_OVERRIDES`, and its field changes (None: drop it)."""
    table = TILE_OVERRIDES.get(TRITON_VERSION[:2], {})
    key = (kernel, arch, dtype, label)
    return (key in table), table.get(key)


def launch_knob_kwargs() -> dict:
    """The compilation knobs a launch passes to Triton's argument binder (``JITFunction.run``) and so to
    its cache key, as the running release names them: ``instrumentation_mode`` (3.6+) and
    ``fpsan_homomorphic_casts`` (3.9+)."""
    from triton import knobs

    out = {}
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            out[name] = getattr(knobs.compilation, name)
    return out


def _patch_interpreter() -> None:
    """Triton 3.6's interpreter converts a scalar to an index with ``int(handle.data)``, which NumPy
    ≥ 2.4 refuses for its one-element arrays; later releases use ``int(handle.data.squeeze())``. Install
    the later definition (the interpreter applies its patches per kernel call, so wrap the function
    that installs them)."""
    if triton is None or TRITON_VERSION[:2] != (3, 6):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fused_preact_patched", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fused_preact_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = _patch_lang_tensor


_patch_interpreter()
