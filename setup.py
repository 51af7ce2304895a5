"""Build script: pure Python everywhere, plus the ``fused_preact._C`` CUDA extension (CUTLASS-based
fused kernels from ``csrc/``) where a CUDA-enabled torch and nvcc are present.

Environment:
    FUSED_PREACT_SKIP_CUDA=1    never build the extension (pure-Python install).
    FUSED_PREACT_CUDA_ARCHS     compute capabilities to build, default "8.0;9.0a" (else TORCH_CUDA_ARCH_LIST);
                                csrc/sm90_*.cu are built for sm_90a alone when a 9.x entry is present.
    MAX_JOBS                    parallel compile jobs; default from cores and free memory.
    FUSED_PREACT_CUTLASS_INCLUDE  CUTLASS include/ directory instead of the nvidia-cutlass package's.

The extension needs the CUTLASS headers from ``pip install --no-deps 'nvidia-cutlass>=4.2,<5'`` (a
build dependency of the CUDA build only). In pip's isolated build environment torch is not
importable, so the extension is only built with ``--no-build-isolation``, e.g.
``pip install --no-build-isolation -e .``. See ``csrc/build_config.py`` for the flags.
"""

import importlib.util
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _build_config():
    path = os.path.join(HERE, "csrc", "build_config.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("fused_preact_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _skip(reason):
    print(f"fused_preact: not building the CUDA extension: {reason}", file=sys.stderr)
    return [], {}


def _ext_modules():
    if os.environ.get("FUSED_PREACT_SKIP_CUDA") == "1":
        return _skip("FUSED_PREACT_SKIP_CUDA=1")
    config = _build_config()
    if config is None or not config.sources():
        return _skip("no sources in csrc/")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _skip("torch is not importable (build with --no-build-isolation to build it)")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is not CUDA-enabled")
    if CUDA_HOME is None:
        return _skip("nvcc / CUDA_HOME not found")
    include_dirs = config.include_dirs()  # raises with install instructions if CUTLASS is missing
    os.environ.setdefault("MAX_JOBS", str(config.max_jobs()))
    ext = CUDAExtension(
        "fused_preact._C",
        [os.path.relpath(s, HERE) for s in config.common_sources()],
        include_dirs=include_dirs,
        extra_compile_args={"cxx": config.cxx_flags(), "nvcc": config.nvcc_flags()},
    )

    class BuildExtensionWithSm90(BuildExtension):
        """torch's builder gives every source the same flags; the sm90 sources (sm_90a only) are
        compiled to objects first by build_config.compile_sm90_objects and linked in."""

        def build_extensions(self):
            objects = config.compile_sm90_objects(os.path.join(self.build_temp, "sm90"), verbose=self.verbose)
            for extension in self.extensions:
                extension.extra_objects = list(extension.extra_objects or []) + objects
            super().build_extensions()

    return [ext], {"build_ext": BuildExtensionWithSm90}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
