"""argparse argument types shared by the package's command-line tools (``python -m fused_preact``,
``python -m fused_preact.bench``, the experiments): a bad value is argparse's usage error (exit 2)."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["int_at_least", "positive_float"]


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: the int in the text, which must be ≥ ``low``.

    Raises (from the returned function): argparse.ArgumentTypeError for text that is not an int or an
    int below ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0.

    Raises: argparse.ArgumentTypeError otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value
