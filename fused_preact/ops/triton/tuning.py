"""Tile autotuning for the fused conv kernels, with a persistent on-disk cache.

When a plan is built on a GPU (the first call with a new input signature), each conv kernel's tile
configuration is looked up in the cache by a key of the kernel, the filter structure, the channel
counts, the row count rounded up to a power of two, the dtypes and the layout. A miss times every
candidate of the kernel's pruned config space on random tensors of the layer's shape (Triton's
``do_bench``), keeps the fastest and writes it to the cache, so a second process reuses the winners.

Environment:
    ``FUSED_PREACT_AUTOTUNE``        ``0`` disables tuning (the heuristic default tiles are used);
                                     tuning never runs under Triton's interpreter.
    ``FUSED_PREACT_AUTOTUNE_CACHE``  the cache folder; ``none`` keeps winners in memory only.
                                     Default: ``$XDG_CACHE_HOME/fused_preact/autotune-<device>-triton<version>``
                                     (``~/.cache`` without XDG_CACHE_HOME).

The folder holds one JSON file per key (:class:`TuneCache`: bounded in memory, process-safe, never
fatal). Source of the approach: Triton's own ``triton.autotune`` (``cache_results``), with the key
chosen here so that one entry serves every batch size of a power-of-two row bucket; the storage as
``torch._inductor``'s caches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

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
    """``<XDG cache>/fused_preact/<prefix>-<device>-triton<version>`` (a folder; names made file-safe)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{prefix}-{device_name}-triton{triton_version}")
    return os.path.join(root, "fused_preact", safe)


#: Entries a :class:`TuneCache` holds in memory (one per tuned problem or decided signature; the least
#: recently used is dropped first and read again from disk when needed).
MAX_ENTRIES = 1024


def _entry_file(folder: str, key: str) -> str:
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:40] + ".json")


class TuneCache:
    """Values (JSON objects) by key string: in memory, at most :data:`MAX_ENTRIES` (least recently used
    dropped first), and on disk in a folder with one small JSON file per key (``path=None``: memory only).

    As ``torch._inductor``'s caches: a write is one new file, written to a temporary name and renamed,
    so it costs the same whatever the cache holds, and processes sharing the folder never lose each
    other's entries (the last writer of a key wins). A key's file is read on its first lookup. A
    location that cannot be used (read-only, a file where the folder should be, …) is never fatal: the
    first failure warns once and the cache goes on in memory.

    Args:
        path: the folder (created on the first write).
    """

    _warned: set = set()

    def __init__(self, path: Optional[str]):
        self.path = path
        #: False after a write failed: entries then stay in memory (the folder is still read)
        self.writable = path is not None
        self.entries: OrderedDict[str, dict] = OrderedDict()
        self._preload()

    def _preload(self) -> None:
        """The newest :data:`MAX_ENTRIES` entries of the folder, so that a traced call (``torch.compile``,
        which reads memory only) finds what earlier processes stored; and, read-only, the single JSON file
        of releases before 2026-12 (``<path>.json``, or ``path`` itself where it is such a file)."""
        if not self.path:
            return
        for legacy in (self.path + ".json", self.path):
            if os.path.isfile(legacy):
                try:
                    with open(legacy) as f:
                        old = json.load(f)
                except (OSError, ValueError):
                    old = None
                if isinstance(old, dict):
                    for k, v in list(old.items())[-MAX_ENTRIES:]:
                        if isinstance(k, str) and isinstance(v, dict):
                            self.entries[k] = v
        if not os.path.isdir(self.path):
            return
        try:
            names = [e for e in os.scandir(self.path) if e.name.endswith(".json") and e.is_file()]
            names.sort(key=lambda e: e.stat().st_mtime)
        except OSError:
            return
        for e in names[-MAX_ENTRIES:]:
            record = self._read(e.path, None)
            if record is not None:
                self.entries[record[0]] = record[1]
        while len(self.entries) > MAX_ENTRIES:  # the legacy file's entries are the oldest
            self.entries.popitem(last=False)

    def _read(self, file: str, key: Optional[str]) -> Optional[tuple[str, dict]]:
        """(key, value) of an entry file (its key must be ``key`` when given); None if it is missing,
        unreadable or malformed (as if absent: tuned or decided again, and rewritten)."""
        try:
            with open(file) as f:
                record = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("fused_preact: ignoring unreadable cache entry %s (%s)", file, e)
            return None
        if not (isinstance(record, dict) and isinstance(record.get("key"), str) and isinstance(record.get("value"), dict)
                and (key is None or record["key"] == key)):
            logger.warning("fused_preact: ignoring malformed cache entry %s", file)
            return None
        return record["key"], record["value"]

    def _remember(self, key: str, value: dict) -> None:
        with _lock:
            self.entries[key] = value
            self.entries.move_to_end(key)
            while len(self.entries) > MAX_ENTRIES:
                self.entries.popitem(last=False)

    def get(self, key: str) -> Optional[dict]:
        """The value of ``key`` (from memory, else its file), or None. Traced by ``torch.compile``:
        memory only."""
        if torch.compiler.is_compiling():
            return self.entries.get(key)
        with _lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        path = self.path
        if not path or not os.path.isdir(path):
            return None
        record = self._read(_entry_file(path, key), key)
        if record is None:
            return None
        self._remember(key, record[1])
        return record[1]

    def put(self, key: str, value: dict) -> None:
        """Store ``value`` for ``key`` in memory and, where the folder can be written, on disk."""
        self._remember(key, value)
        path = self.path
        if not path or not self.writable:
            return
        tmp = None
        try:
            os.makedirs(path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path, prefix=".entry-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "value": value}, f, sort_keys=True)
            os.replace(tmp, _entry_file(path, key))
            tmp = None
        except OSError as e:
            self._give_up(path, e)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _give_up(self, path: str, error: OSError) -> None:
        """No more writes (entries stay in memory; the folder is still read), one warning per folder and
        process."""
        self.writable = False
        with _lock:
            first = path not in TuneCache._warned
            TuneCache._warned.add(path)
        if first:
            warnings.warn(f"fused_preact: cannot write the cache folder {path} ({type(error).__name__}: {error}); "
                          "keeping its entries in memory for this process", RuntimeWarning, stacklevel=3)

    @staticmethod
    def read_folder(path: str) -> dict[str, dict]:
        """Every entry stored in the folder ``path`` (key → value), for tools and tests."""
        out = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".json"):
                with open(os.path.join(path, name)) as f:
                    record = json.load(f)
                out[record["key"]] = record["value"]
        return out


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
           to_dict: Callable[[object], dict]):
    """The cached winner for ``key``, else the fastest candidate by ``bench`` (ms; candidates that
    raise — e.g. out of shared memory — are skipped), stored in ``cache`` as ``to_dict(winner)``.
    ``default`` when every candidate fails. A cached entry is served only if it is exactly ``to_dict``
    of one of ``candidates`` or ``default`` (same keys, same values, same JSON types): a file from
    another version, or edited, may name tiles this problem cannot take, or a tile's sizes as floats
    (which compare equal and then break every launch); otherwise the key is tuned again and its entry
    overwritten."""
    hit = cache.get(key)
    if hit is not None:
        forms = {json.dumps(to_dict(c), sort_keys=True): c for c in (*candidates, default) if c is not None}
        try:
            cfg = forms.get(json.dumps(hit, sort_keys=True))
        except (TypeError, ValueError):  # not JSON at all
            cfg = None
        if cfg is not None:
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
