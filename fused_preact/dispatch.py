"""Which backend runs, and why the others do not: the public report over :mod:`fused_preact.ops.backends`.

``fused_preact.backends()`` answers, per backend and per device/dtype, "ok" or the reasons it refuses
(including what to do about it: set ``TRITON_INTERPRET=1`` to run the kernels on CPU, build the CUDA
extension). The backend classes themselves (``TritonBackend``, ``CudaBackend``, ``ReferenceBackend``)
and ``select_backend`` live in the op layer and are re-exported here.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from fused_preact.ops._common import triton_mode
from fused_preact.ops.backends import (BACKENDS, PRIORITY, Backend, BackendChoice, CudaBackend, ReferenceBackend,
                                       TritonBackend, select_backend)

__all__ = ["Backend", "BackendChoice", "BACKENDS", "PRIORITY", "TritonBackend", "CudaBackend", "ReferenceBackend",
           "backends", "select_backend", "triton_mode"]

_ALL_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def backends(devices: Optional[Sequence[str]] = None) -> dict[str, dict[str, object]]:
    """Report every backend's availability per device and dtype.

    Args:
        devices: device strings to probe (default: ``"cpu"`` and, if available, ``"cuda"``).

    Returns:
        ``{backend: {"priority": int or None, "dtypes": [...], "min_compute_capability": ...,
        "triton_mode": ..., "TRITON_INTERPRET": ..., "<device>/<dtype>": "ok" or the refusal reasons}}``.
        Probes are stride-0 (N=1, C=8, H=W=1) stand-ins; nothing is launched or allocated beyond one
        element.
    """
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report: dict[str, dict[str, object]] = {}
    for name, backend in BACKENDS.items():
        entry: dict[str, object] = {
            "priority": PRIORITY.index(name) if name in PRIORITY else None,
            "dtypes": [str(d) for d in backend.dtypes],
            "min_compute_capability": backend.min_compute_capability,
            "triton_mode": backend.runtime_mode(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        }
        for dev in devices:
            for dtype in _ALL_FLOATS:
                probe = torch.empty(1, device=dev, dtype=dtype).expand(1, 8, 1, 1)
                reasons = backend.not_supported_reasons(probe)
                entry[f"{dev}/{str(dtype).replace('torch.', '')}"] = "; ".join(reasons) if reasons else "ok"
        report[name] = entry
    return report
