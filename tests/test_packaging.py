"""The declared dependency range against the Triton that PyTorch's CUDA wheels pin.

pip must resolve ``fused_preact`` beside every supported CUDA torch without replacing it or its triton:
the torch range has to admit the torch release, and the triton range has to meet the torch release's
pin (:data:`fused_preact.ops.triton_compat.TORCH_TRITON_PINS`, read from the wheels' metadata).
"""

import os
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from fused_preact.ops import triton_compat as tc

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Triton releases on PyPI from 3.6 on (the versions a pin can be met with).
TRITON_RELEASES = ["3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0"]


def _requirements() -> dict[str, Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_every_cuda_torch_resolves_beside_the_package():
    reqs = _requirements()
    torch_req, triton_req = reqs["torch"], reqs["triton"]
    for torch_version, pin in tc.TORCH_TRITON_PINS.items():
        assert Version(torch_version) in torch_req.specifier, (torch_version, str(torch_req))
        met = [v for v in TRITON_RELEASES if Version(v) in Requirement(f"triton{pin}").specifier]
        assert met, (torch_version, pin)
        ok = [v for v in met if Version(v) in triton_req.specifier]
        assert ok, f"torch {torch_version} pins triton{pin}, which {triton_req} excludes"


def test_the_declared_floor_is_the_oldest_checked_release_and_there_is_no_upper_pin():
    spec = _requirements()["triton"].specifier
    floors = [s.version for s in spec if s.operator == ">="]
    assert floors and Version(floors[0]).release[:2] == tc.MIN_TRITON
    assert not [s for s in spec if s.operator in ("<", "<=", "==", "~=")], str(spec)
    # the oldest release any supported torch pins is exactly the floor, so the range is no wider
    oldest = min(Version(re.sub(r"[^\d.]", "", p)) for p in tc.TORCH_TRITON_PINS.values())
    assert oldest.release[:2] == tc.MIN_TRITON


def test_version_tuple_reads_releases_and_local_builds():
    assert tc.version_tuple("3.6.0") == (3, 6, 0)
    assert tc.version_tuple("3.9.0+git1a2b3c") == (3, 9, 0)
    assert tc.version_tuple("3.8") == (3, 8, 0)


def test_a_kernel_the_installed_triton_cannot_compile_is_named_with_both_versions(monkeypatch):
    need = (tc.TRITON_VERSION[0], tc.TRITON_VERSION[1] + 1)
    monkeypatch.setitem(tc.KERNEL_REQUIREMENTS, "_fake_kernel", (need, "a newer language feature"))
    reason = tc.kernel_unsupported_reason("_fake_kernel")
    assert reason is not None and "_fake_kernel" in reason and tc.version_label() in reason
    assert f"{need[0]}.{need[1]}" in reason
    assert tc.kernel_unsupported_reason("_some_other_kernel") is None
    monkeypatch.setitem(tc.KERNEL_REQUIREMENTS, "_fake_kernel", (tc.MIN_TRITON, "always there"))
    assert tc.kernel_unsupported_reason("_fake_kernel") is None


def test_auto_skips_triton_with_a_warning_and_a_forced_triton_raises_the_same_reason(monkeypatch):
    import torch

    from fused_preact.ops import backends

    need = (tc.TRITON_VERSION[0], tc.TRITON_VERSION[1] + 1)
    monkeypatch.setitem(tc.KERNEL_REQUIREMENTS, "_fprop_kernel", (need, "a newer language feature"))
    monkeypatch.setattr(backends.TritonBackend, "_warned", set())
    monkeypatch.setattr(backends, "triton_mode", lambda: "interpreter")
    x = torch.randn(2, 8, 5, 5)
    with pytest.warns(RuntimeWarning, match=r"_fprop_kernel needs triton >= .*installed"):
        choice = backends.select_backend("auto", x)
    assert choice.name != "triton" and "_fprop_kernel" in choice.reason and tc.version_label() in choice.reason
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot serve.*_fprop_kernel needs triton"):
        backends.select_backend("triton", x)


def test_a_tile_the_installed_triton_spills_is_replaced_as_default_and_dropped_as_candidate(monkeypatch):
    import torch

    from fused_preact.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's tile rules
    default = configs.dgrad_config(10**6, 256, 256, torch.bfloat16, arch=80)
    cands = configs.candidates("dgrad", 10**6, 256, 256, torch.bfloat16, arch=80)
    some = next(c for c in cands if (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K) != (default.BLOCK_M, default.BLOCK_N, default.BLOCK_K))
    table = {("dgrad", 80, "bf16", default.label()): {"num_stages": default.num_stages + 1},
             ("dgrad", 80, "bf16", some.label()): None}
    monkeypatch.setitem(tc.TILE_OVERRIDES, tc.TRITON_VERSION[:2], table)
    replaced = configs.dgrad_config(10**6, 256, 256, torch.bfloat16, arch=80)
    assert replaced.num_stages == default.num_stages + 1 and replaced.BLOCK_M == default.BLOCK_M
    now = configs.candidates("dgrad", 10**6, 256, 256, torch.bfloat16, arch=80)
    assert some not in now and default not in now and replaced in now and len(now) == len(set(now))
    assert configs.dgrad_config(10**6, 256, 256, torch.bfloat16, arch=86) == replaced  # sm_80's family
    # another arch family, dtype or release is untouched
    assert configs.dgrad_config(10**6, 64, 64, torch.float16, arch=80) == configs._dgrad_config(
        10**6, 64, 64, torch.float16, arch=80)
    assert configs.dgrad_config(10**6, 64, 64, torch.bfloat16, arch=90) == configs._dgrad_config(
        10**6, 64, 64, torch.bfloat16, arch=90)
