"""Benchmarks of the fused kernels against eager PyTorch, ``torch.compile`` and cuDNN (needs CUDA to time),
and the static kernel report (no GPU).

Modules:
    run      ``python -m fused_preact.bench``: the runner, results files, tables and charts
    timing   timing harnesses (CUDA events, CUDA graphs, peak memory, measured roofline peaks, enqueue time)
    kernels  the kernel level: each fused conv kernel alone against cuDNN doing the same convolution
    shapes   the unit/block/model shapes of PreActResNet-50/-164 and the FLOP/byte cost model
    static   ``python -m fused_preact.bench --static``: the kernels compiled offline for sm_90/sm_80,
             registers, spills, tensor-core and vector instructions from their SASS (no GPU)
    static_chain   the static report's jobs: every launch the fused chains record (meta device)

Nothing here is imported by the library itself.
"""
