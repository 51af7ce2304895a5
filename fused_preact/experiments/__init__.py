"""The main job and the paper's experiments, built on the library (the library never imports them).

Modules:
    main_job       ``python -m fused_preact``: train a PreActResNet eagerly and fused from the same
                   weights and compare the trajectories against a float64 noise floor
    data           the data sets the main job reads (bundled scikit-learn digits, CIFAR-10 batches)
    variants       the residual-unit (Fig. 4) and shortcut (Fig. 2) variants of He et al. 2016, eager
    gradient_flow  ``python -m fused_preact.experiments.gradient_flow``: per-block gradient norms
"""
