"""Real data for the main job: scikit-learn's bundled handwritten digits, or CIFAR-10 python pickles."""

from __future__ import annotations

import os
import pickle
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["CIFAR10_FILES", "CIFAR10_SOURCE", "Dataset", "cifar10_missing", "load_digits", "load_cifar10"]

#: the files of the CIFAR-10 python-version folder (``cifar-10-batches-py``)
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
#: where that folder comes from
CIFAR10_SOURCE = ("the python version of CIFAR-10, https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz "
                  "(extract it: tar xzf cifar-10-python.tar.gz gives cifar-10-batches-py/)")


class Dataset(NamedTuple):
    """Image classification data as tensors.

    Attributes:
        train_x, test_x: (n, 3, S, S) float32, per-channel normalized (zero mean, unit std on train).
        train_y, test_y: (n,) int64 class indices.
        num_classes: number of classes. name: a human-readable description.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str


def _normalize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = train.mean(dim=(0, 2, 3), keepdim=True)
    std = train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (train - mean) / std, (test - mean) / std


def load_digits(image_size: int = 32, test_size: int = 297) -> Dataset:
    """scikit-learn's bundled 1797 handwritten digits (8×8, 17 gray levels), no download needed.

    Images are scaled to [0, 1], bilinearly upsampled to ``image_size``², repeated to 3 channels
    and normalized. The last ``test_size`` images are the test split.

    Raises:
        ImportError: scikit-learn is not installed (``pip install fused_preact[train]``).
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as e:
        raise ImportError("the digits data needs scikit-learn: pip install 'fused_preact[train]'") from e
    d = _sk_load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.from_numpy(d.target.astype(np.int64))
    train_x, test_x = _normalize(x[:-test_size], x[-test_size:])
    return Dataset(train_x, y[:-test_size], test_x, y[-test_size:], 10,
                   f"sklearn digits ({len(y) - test_size} train / {test_size} test, 8×8 → {image_size}×{image_size})")


def cifar10_missing(data_dir: str) -> list[str]:
    """The files of :data:`CIFAR10_FILES` that ``data_dir`` lacks (all of them when it is no folder)."""
    return [name for name in CIFAR10_FILES if not os.path.isfile(os.path.join(data_dir, name))]


def load_cifar10(data_dir: str) -> Dataset:
    """CIFAR-10 from its python-pickle folder (``data_batch_1`` … ``data_batch_5``, ``test_batch``), as
    extracted from :data:`CIFAR10_SOURCE`: 50000 train / 10000 test images, 3×32×32, 10 classes.

    Raises:
        FileNotFoundError: a batch file is missing from ``data_dir``.
    """
    missing = cifar10_missing(data_dir)
    if missing:
        raise FileNotFoundError(f"CIFAR-10 batch {os.path.join(data_dir, missing[0])!r} not found (expected the "
                                f"python-pickle folder: {CIFAR10_SOURCE})")

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        path = os.path.join(data_dir, name)
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        x = torch.from_numpy(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
        return x, torch.tensor(batch[b"labels"], dtype=torch.int64)

    parts = [read(f"data_batch_{i}") for i in range(1, 6)]
    train_x = torch.cat([p[0] for p in parts])
    train_y = torch.cat([p[1] for p in parts])
    test_x, test_y = read("test_batch")
    train_x, test_x = _normalize(train_x, test_x)
    return Dataset(train_x, train_y, test_x, test_y, 10, f"CIFAR-10 from {data_dir}")
