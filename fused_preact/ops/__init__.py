"""The op layer: fused BN→ReLU→Conv chains, their backends, statistics, and the functional API.

    bn_relu_conv2d, bn_relu_conv2d_reference    one unit, ``F.batch_norm`` + ``F.conv2d`` arguments
    batch_stats, batch_stats_reference          per-channel (mean, biased var) in fp32
    ChainSpec, ConvGeom, BNMode                 what a chain computes (:mod:`.spec`)
    ChainTensors, UnitTensors                   a call's tensors, per unit (:mod:`.spec`)
    run_chain                                   running a chain (:mod:`.run`)
    select_backend, BACKENDS                    the backends and why they refuse (:mod:`.backends`)

Layout: backend-neutral ``spec`` (structure, typed hand-offs, validation) → ``chain`` (autograd,
reference) → ``backends`` (protocol, registry, static choice) → ``auto`` (measured choice) → ``run``
(the entry point), with ``library`` (torch.compile custom ops);
one folder per backend: ``triton/`` (kernels, tile configs, launchers, plan), ``cuda/`` (the
``csrc/`` extension's glue and plan) and ``recompute/`` (cuDNN convolutions with BN+ReLU recomputed);
``auto`` + ``trial`` + ``validate`` decide ``backend="auto"`` by measurement and validation. Nothing here
imports the modules, models or reports.
"""

from fused_preact.ops.backends import BACKENDS, PRIORITY, BackendChoice, PlanCache, select_backend
from fused_preact.ops.bn_relu_conv import bn_relu_conv2d, bn_relu_conv2d_reference
from fused_preact.ops.chain import ChainResult
from fused_preact.ops.run import run_chain
from fused_preact.ops.spec import (
    BATCH,
    EXTERNAL,
    RUNNING,
    BNMode,
    ChainSpec,
    ChainTensors,
    ConvGeom,
    StatsHandoff,
    UnitTensors,
)
from fused_preact.ops.stats import batch_stats, batch_stats_reference

__all__ = [
    "BACKENDS", "PRIORITY", "BackendChoice", "PlanCache", "run_chain", "select_backend",
    "bn_relu_conv2d", "bn_relu_conv2d_reference", "batch_stats", "batch_stats_reference",
    "ChainResult", "ChainSpec", "ConvGeom", "BNMode", "ChainTensors", "UnitTensors", "StatsHandoff",
    "BATCH", "RUNNING", "EXTERNAL",
]
