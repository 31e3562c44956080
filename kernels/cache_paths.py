"""Where the project keeps what it computes once per machine or model: converted checkpoints
(:mod:`asymcache_core.loaders.cache`), the GPU's GEMM checks (:mod:`kernels.gemm_calibration`)
and the CPU linear op's probe (:mod:`kernels.cpu_linear`). Here, at the bottom of the stack, so
that every package can find it."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


__all__ = ["CACHE_ENV", "cache_dir", "read_json_store", "write_json_store"]
