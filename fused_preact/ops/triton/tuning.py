"""Tile autotuning for the fused conv kernels, with a persistent on-disk cache.

When a plan is built on a GPU (the first call with a new input signature), each conv kernel's tile
configuration is looked up in the cache by a key of the kernel, the filter structure, the channel
counts, the row count rounded up to a power of two, the dtypes and the layout. A miss times every
candidate of the kernel's pruned config space on random tensors of the layer's shape (Triton's
``do_bench``), keeps the fastest and writes it to the cache, so a second process reuses the winners.

Environment:
    ``FUSED_PREACT_AUTOTUNE``        ``0`` disables tuning (the heuristic default tiles are used);
                                     tuning never runs under Triton's interpreter.
    ``FUSED_PREACT_AUTOTUNE_CACHE``  path of the JSON cache file; ``none`` keeps winners in memory only.
                                     Default: ``$XDG_CACHE_HOME/fused_preact/autotune-<device>-triton<version>.json``
                                     (``~/.cache`` without XDG_CACHE_HOME).

The file maps key strings to configs and is rewritten atomically (merged with what another process
wrote meanwhile). Source of the approach: Triton's own ``triton.autotune`` (``cache_results``), with
the key chosen here so that one entry serves every batch size of a power-of-two row bucket.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from fused_preact.ops._common import interpreting

logger = logging.getLogger("fused_preact")

__all__ = ["TuneCache", "tuning_enabled", "default_cache_path", "choose", "tuning_seconds", "cache_for"]

_lock = threading.Lock()
_caches: dict[str, "TuneCache"] = {}
_spent = [0.0]


def tuning_enabled() -> bool:
    """Whether plans tune their tiles (``FUSED_PREACT_AUTOTUNE`` is not ``0``; never in the interpreter)."""
    return os.environ.get("FUSED_PREACT_AUTOTUNE", "1") != "0" and not interpreting()


def default_cache_path(device_name: str, triton_version: str, prefix: str = "autotune") -> str:
    """``<XDG cache>/fused_preact/<prefix>-<device>-triton<version>.json`` (names made file-safe)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{prefix}-{device_name}-triton{triton_version}")
    return os.path.join(root, "fused_preact", safe + ".json")


class TuneCache:
    """Winning configs by key, backed by a JSON file (``path=None``: memory only).

    Args:
        path: the JSON file; read at construction, rewritten (merged, atomically) on :meth:`put`.
    """

    def __init__(self, path: Optional[str]):
        self.path = path
        self.entries: dict[str, dict] = {}
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    entries = json.load(f)
                if not isinstance(entries, dict):
                    raise ValueError(f"a JSON {type(entries).__name__}, not an object")
                self.entries = entries
            except (OSError, ValueError) as e:  # a corrupt cache is ignored, not fatal
                logger.warning("fused_preact: ignoring unreadable autotune cache %s (%s)", path, e)

    def get(self, key: str) -> Optional[dict]:
        return self.entries.get(key)

    def put(self, key: str, config: dict) -> None:
        self.entries[key] = config
        if not self.path:
            return
        with _lock:
            merged = {}
            if os.path.isfile(self.path):
                try:
                    with open(self.path) as f:
                        merged = json.load(f)
                except (OSError, ValueError):
                    merged = {}
                if not isinstance(merged, dict):
                    merged = {}
            merged.update(self.entries)
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


def cache_for(device_name: str) -> TuneCache:
    """The process-wide cache for ``device_name`` (path from ``FUSED_PREACT_AUTOTUNE_CACHE`` or default)."""
    import triton

    env = os.environ.get("FUSED_PREACT_AUTOTUNE_CACHE")
    path = None if env == "none" else (env or default_cache_path(device_name, triton.__version__))
    key = f"{device_name}|{path}"
    with _lock:
        if key not in _caches:
            _caches[key] = TuneCache(path)
        return _caches[key]


def choose(cache: TuneCache, key: str, candidates: Sequence, default, bench: Callable[[object], float],
           to_dict: Callable[[object], dict], from_dict: Callable[[dict], object]):
    """The cached winner for ``key``, else the fastest candidate by ``bench`` (ms; candidates that
    raise — e.g. out of shared memory — are skipped), stored in ``cache``. ``default`` when every
    candidate fails. A cached entry is used only if it is one of ``candidates`` or ``default`` (a file
    from another version, or edited, may name tiles this problem cannot take); otherwise it is tuned
    again and overwritten."""
    hit = cache.get(key)
    if hit is not None:
        try:
            cfg = from_dict(hit)
        except (TypeError, ValueError, KeyError):  # not even a config: tuned again below
            cfg = None
        if cfg is not None and cfg in (*candidates, default):
            return cfg
        logger.warning("fused_preact: autotune cache entry %s = %r is not a candidate; tuning again", key, hit)
    start = time.perf_counter()
    best, best_ms = default, float("inf")
    for cfg in candidates:
        try:
            ms = bench(cfg)
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is simply not a candidate
            logger.debug("fused_preact: autotune %s: %s failed (%s)", key, cfg, e)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    spent = time.perf_counter() - start
    _spent[0] += spent
    logger.info("fused_preact: autotuned %s in %.1f s: %s (%.3f ms)", key, spent, best, best_ms)
    cache.put(key, to_dict(best))
    return best


def tuning_seconds() -> float:
    """Seconds this process has spent tuning (compiles and timed runs of the candidates)."""
    return _spent[0]
