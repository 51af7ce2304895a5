"""Placeholder classes for the torchvision stand-in: importable, subclassable, not constructible."""

from __future__ import annotations

from typing import Callable


def placeholder(qualname: str, base: type = object) -> type:
    """A class named after ``qualname`` whose construction raises ``RuntimeError``.

    Args:
        qualname: the dotted torchvision name it stands for (used in the error message).
        base: base class (``torch.nn.Module`` for module stand-ins, so ``isinstance`` checks work).
    """

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{qualname} is not available: torchvision is a test-only stand-in here (tests/stubs)")

    return type(qualname.rsplit(".", 1)[-1], (base,), {"__init__": __init__, "__module__": qualname.rsplit(".", 1)[0]})


def placeholder_getattr(module_name: str) -> Callable[[str], type]:
    """A module-level ``__getattr__`` (PEP 562) returning a cached placeholder for public names.

    Dunder and private names raise ``AttributeError`` as usual, so ``hasattr`` probes stay honest.
    """
    cache: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name.startswith("_"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if name not in cache:
            cache[name] = placeholder(f"{module_name}.{name}")
        return cache[name]

    return __getattr__
