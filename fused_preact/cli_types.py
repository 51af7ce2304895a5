"""argparse argument types shared by the package's command-line tools (``python -m fused_preact``,
``python -m fused_preact.bench``, the experiments): a bad value is argparse's usage error (exit 2)."""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

__all__ = ["int_at_least", "positive_float", "unwritable_file", "unwritable_folder"]


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


def unwritable_file(path: str) -> Optional[str]:
    """Why results cannot be written to the file ``path`` (None if they can): checked before a run, so
    that a long run's results are not lost at its end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    if not os.path.isdir(folder):
        up = folder
        while up and not os.path.exists(up) and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        if os.path.exists(up) and not os.path.isdir(up):
            return f"{up!r} is a file, not a folder"
        return f"no such folder: {folder!r}"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path!r} is not writable"
    return None


def unwritable_folder(path: str) -> Optional[str]:
    """Why files cannot be written into the folder ``path``, created with its parents if missing (None
    if they can)."""
    up = os.path.abspath(path)
    while not os.path.exists(up) and os.path.dirname(up) != up:
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        return f"{up!r} is a file, not a folder"
    if not os.access(up, os.W_OK | os.X_OK):
        return f"{up!r} is not writable"
    return None
