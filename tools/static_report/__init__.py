"""Static kernel report: every Triton launch of the fused chains compiled offline for sm_90/sm_80, and
CUDA C++ cubins, read from their SASS (no GPU). ``python -m tools.static_report --help``; the fields,
the main-loop model and the limits are described in ``docs/static-report.md``.

Modules (imports go one way: report → anchors, compile, limits, loop_limits → sass, jobs):
    report       the command line, the results file and the table
    compile      specializing and compiling the jobs (Triton), reading CUDA C++ cubins; the metrics cache
    sass         cubin resources, SASS instruction counts, the main-loop analysis and its model
    limits       the per-compilation rules of ``--check``
    loop_limits  the main-loop limits of ``--check`` and their ratchet baseline (``loop_baseline.json``)
    anchors      reference GEMM loops (``--anchors``; ``anchor_cutlass.cu``)
    jobs         :class:`StaticJob` (one launch) and the fused chains' job provider
"""
