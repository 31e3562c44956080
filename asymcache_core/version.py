"""The project's version, for the CLI's ``--version`` and the server's ``GET /version``."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """The installed package's version (the source tree's ``pyproject.toml`` when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("asymcache")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


__all__ = ["package_version"]
