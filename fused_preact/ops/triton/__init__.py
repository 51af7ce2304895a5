"""The Triton backend: ``kernels_fprop`` (fprop), ``kernels_halo`` (fprop of narrow 3×3s through a
staged halo), ``kernels_dgrad`` and ``kernels_wgrad`` (the gradients, with ``kernels_grad``'s helpers),
``kernels_bn`` (statistics, finalize, dx) and ``pack`` (the per-channel rows they read, and the fp32
transform) → ``launch`` (one launcher per kernel) → ``layout`` (:class:`~.layout.ChainLayout`: shapes,
tiles, buffers) → ``plan`` (:class:`~.plan.TritonPlan`: the order of launches), with ``configs`` (tile
rules, autotune spaces) and ``tuning`` (the on-disk autotune cache)."""
