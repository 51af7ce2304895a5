"""The ``recompute`` backend: cuDNN's convolutions with BatchNorm+ReLU recomputed around them, saving
what the fused kernels save (:mod:`.plan`; elementwise kernels in :mod:`.kernels`, launchers in
:mod:`.launch`)."""
