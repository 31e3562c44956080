"""Where the project keeps what it computes once per machine or model: converted checkpoints
(:mod:`asymcache_core.loaders.cache`), the GPU's GEMM checks (:mod:`kernels.gemm_calibration`)
and the CPU linear op's probe and checks (:mod:`kernels.cpu_linear`), with the JSON stores they
keep their answers in (:func:`kept_in_store`, under a lock). Here, at the bottom of the stack, so
that every package can find it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: Environment variable naming the cache folder (it wins over ``XDG_CACHE_HOME``).
CACHE_ENV = "ASYMCACHE_CACHE_DIR"


def cache_dir() -> Path:
    """The cache folder: ``$ASYMCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/asymcache``, else
    ``~/.cache/asymcache``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "asymcache"


def read_json_store(store: Path | None) -> dict:
    """The JSON object in ``store``; ``{}`` where there is none, or it cannot be read or parsed
    (the caller then computes again what it would have read)."""
    if store is None:
        return {}
    try:
        data = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_store(store: Path, data: dict) -> None:
    """Writes ``data`` to ``store`` atomically (a temporary file renamed into place).

    NOTE: a failure (a read-only home) is ignored: it costs the caller its computation again in
    the next process, nothing else.
    """
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(store)
    except OSError:
        pass


@contextlib.contextmanager
def locked_store(store: Path | None) -> Iterator[None]:
    """Holds ``store``'s lock file (beside it) while the caller reads, computes and writes it;
    where no lock can be taken (no store, a file system without locks), goes on unlocked."""
    lock_file = None
    if store is not None:
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            lock_file = open(store.with_suffix(".lock"), "w")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        except OSError:
            if lock_file is not None:
                lock_file.close()
            lock_file = None
    try:
        yield
    finally:
        if lock_file is not None:
            lock_file.close()


def kept_in_store(store: Path | None, key: str, valid: Callable[[Any], bool], compute: Callable[[], Any]) -> Any:
    """``store``'s value under ``key`` where ``valid`` accepts it, else ``compute()``, then kept
    there (JSON). Under the store's lock: processes starting together compute it once, the
    others read it.

    Args:
        store: the JSON file (``None``: compute every call, keep nothing).
        key: the value's key.
        valid: whether a stored value can be used (a store of another version may hold others).
        compute: makes the value (JSON-serializable).

    Returns:
        The stored or computed value.
    """
    with locked_store(store):
        data = read_json_store(store)
        if valid(data.get(key)):
            return data[key]
        value = compute()
        if store is not None:
            data[key] = value
            write_json_store(store, data)
        return value


__all__ = ["CACHE_ENV", "cache_dir", "kept_in_store", "locked_store", "read_json_store", "write_json_store"]
