"""The CUDA C++ backend, mirroring ``csrc/``: ``ext`` (loading ``fused_preact._C``, its ops and their
refusal reasons) → ``plan`` (:class:`~.plan.CudaPlan`, a chain composed of the per-unit ops)."""
