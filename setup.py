"""Build script. Pure Python today; builds the ``fused_preact._C`` CUDA extension from ``csrc/``
once it has sources and a CUDA-enabled torch and nvcc are present (issue: CUDA C++ backend).

Set ``FUSED_PREACT_SKIP_CUDA=1`` to never build the extension. In pip's isolated build
environment torch is not importable, so the extension is only built with ``--no-build-isolation``.
"""

import glob
import os

from setuptools import setup


def _ext_modules():
    if os.environ.get("FUSED_PREACT_SKIP_CUDA") == "1":
        return [], {}
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu"))
    if not sources:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        return [], {}
    ext = CUDAExtension("fused_preact._C", sources, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
