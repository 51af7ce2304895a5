"""Benchmarks of the fused kernels against eager PyTorch, ``torch.compile`` and cuDNN (needs CUDA to time).

Modules:
    run      ``python -m fused_preact.bench``: the runner (task plan, time budget, CLI)
    results  the results schema: entries, files, derived ratios, validation
    report   tables, markdown and charts of a results file
    timing   timing harnesses (CUDA events, CUDA graphs, peak memory, measured roofline peaks, enqueue time)
    kernels  the kernel level: each fused conv kernel alone against cuDNN doing the same convolution
    shapes   the unit/block/model shapes of PreActResNet-50/-164 and the FLOP/byte cost model

Nothing here is imported by the library itself. The static kernel report (SASS compiled offline, no
GPU) is the repository tool ``python -m tools.static_report``.
"""
