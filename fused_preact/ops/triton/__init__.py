"""The Triton backend: ``kernels_fprop`` (fprop), ``kernels_halo`` (fprop of narrow 3×3s through a
staged halo), ``kernels_conv`` (dgrad, wgrad, the shared transform helpers) and ``kernels_bn``
(statistics, finalize, dx) → ``launch`` (one launcher per kernel) → ``plan``
(:class:`~.plan.TritonPlan`: shapes, buffers and the order of launches), with ``configs`` (tile rules,
autotune spaces) and ``tuning`` (the on-disk autotune cache)."""
