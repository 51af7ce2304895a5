"""The documentation points at things that exist: every relative link, every repository path in
backticks and every ``python -m`` module named in README.md, CHANGELOG.md, docs/*.md and the
folders' READMEs; README stays short."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted({os.path.relpath(p, ROOT) for pattern in ("README.md", "CHANGELOG.md", "docs/*.md", "*/README.md",
                                                         "benchmarks/results/README.md")
               for p in glob.glob(os.path.join(ROOT, pattern))})
_TOP = ("fused_preact/", "tests/", "docs/", "csrc/", "benchmarks/", "tools/", ".ci/")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_CODE = re.compile(r"`([^`\s]+)`")
_MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")


def _paths(text: str) -> set[str]:
    found = set()
    for token in _CODE.findall(text):
        token = token.split("::")[0].rstrip(".,:;")
        if token.startswith(_TOP) and not any(c in token for c in "<>*{}$") and "…" not in token:
            found.add(token)
    return found


def test_docs_were_found():
    assert {"README.md", "docs/design.md", "docs/semantics.md"} <= set(DOCS)


@pytest.mark.parametrize("doc", DOCS)
def test_links_and_paths_exist(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    here = os.path.dirname(os.path.join(ROOT, doc))
    missing = [link for link in _LINK.findall(text)
               if "://" not in link and not link.startswith("mailto:") and not os.path.exists(os.path.join(here, link))]
    missing += [p for p in _paths(text) if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"{doc} points at paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS)
def test_python_m_modules_exist(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    missing = []
    for name in set(_MODULE.findall(text)):
        if name in ("pytest", "pip", "venv"):
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    assert not missing, f"{doc} names modules that do not exist: {missing}"


def test_readme_is_short_and_user_first():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text) <= 8000, len(text)
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[:2] == ["Install", "Quick start"], headings


@pytest.mark.parametrize("path", ["benchmarks/test_unit.py", "benchmarks/test_block.py", "benchmarks/bench_support.py",
                                  "benchmarks/results/README.md"])
def test_benchmark_docs_list_every_provider(path):
    """The benchmark suite's docstrings and the results format name every provider that is run."""
    from fused_preact.bench.timing import LAYER_PROVIDERS, MODEL_PROVIDERS

    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    if path.endswith(".py"):
        text = text.split('"""')[1]  # the module docstring
    names = MODEL_PROVIDERS if path.endswith(("README.md", "bench_support.py")) else LAYER_PROVIDERS
    missing = [p for p in names if not re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", text)]
    assert not missing, f"{path} does not name the providers {missing}"
