"""Where the project keeps what it computes once per machine or model: converted checkpoints
(:mod:`asymcache_core.loaders.cache`), the GPU's GEMM checks (:mod:`kernels.gemm_calibration`)
and the CPU linear op's probe (:mod:`kernels.cpu_linear`). Here, at the bottom of the stack, so
that every package can find it."""

from __future__ import annotations

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


__all__ = ["CACHE_ENV", "cache_dir"]
