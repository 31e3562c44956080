"""A per-user cache of converted checkpoints: GGUF files (HF config, tokenizer, dequantized
weights) and the tokenizers built for dummy models (:mod:`asymcache_core.loaders.dummy_tokenizer`).

Converting a GGUF costs seconds (parsing its metadata, building the tokenizer, dequantizing
every tensor); reading the converted form back costs a fraction of a second. Entries live in
:func:`cache_dir`, one folder per source::

    <cache>/gguf/<path-hash>-<stat-hash>/meta/            config.json, tokenizer files
    <cache>/gguf/<path-hash>-<stat-hash>/weights-<dtype>/ the model's state dict (safetensors)
    <cache>/dummy-tokenizer/<spec-hash>-<source-hash>/tokenizer/   tokenizer files

A GGUF entry is keyed by the source's resolved path, size and modification time, so a replaced or
edited file gets a new entry (and the stale one is removed when the new one is written). Each
part is written into a temporary folder and renamed into place, with a manifest of its files'
sizes and CRC-32s written last: a part that fails that check (a crash mid-write, a truncated or
edited file) is removed and rebuilt. Failing to write the cache (a read-only home) is logged and
never stops a model from loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# NOTE: the cache folder is found in kernels (the bottom of the stack), re-exported here.
from kernels.cache_paths import CACHE_ENV as CACHE_ENV
from kernels.cache_paths import cache_dir as cache_dir

logger = logging.getLogger("asymcache_core.loaders")

#: Bumped whenever the layout or the conversion changes: older entries are then ignored.
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_WEIGHTS = "weights.safetensors"
_ALIASES = "aliases.json"
_CHUNK = 1 << 24


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def file_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies one version of a source file: its resolved path, size and modification
    time (with the cache's format version)."""
    resolved = path.resolve()
    st = resolved.stat()
    return {"format": FORMAT_VERSION, "source": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def load_tokenizer(folder: Path) -> Any:
    """A tokenizer written by ``save_pretrained`` (the fast tokenizer reads only its files)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class CacheEntry:
    """One cache entry: a folder of parts, each checked against a manifest when read.

    Args:
        root: the folder of this kind of entry (``<cache>/gguf``).
        key: what names the source whatever its version (its entries share a prefix: writing
            a new version removes the others).
        fingerprint: what the entry was built from (a part written for another is invalid).
    """

    def __init__(self, root: Path, key: Any, fingerprint: dict[str, Any]) -> None:
        self.root = root
        self._prefix = _digest(key)
        self.fingerprint = fingerprint
        self.entry = self.root / f"{self._prefix}-{_digest(self.fingerprint)}"

    def _valid_part(self, name: str) -> Path | None:
        part = self.entry / name
        manifest_path = part / _MANIFEST
        if not part.is_dir():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
            if manifest.get("fingerprint") != self.fingerprint:
                return self._drop(part, "written for another source")
            for rel, expected in files.items():
                path = part / rel
                if path.stat().st_size != expected["size"] or _crc32(path) != expected["crc32"]:
                    return self._drop(part, f"{rel} does not match its manifest")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._drop(part, f"incomplete ({exc})")
        return part

    def _drop(self, part: Path, why: str) -> None:
        logger.warning("model cache: %s is %s; rebuilding it", part, why)
        shutil.rmtree(part, ignore_errors=True)
        return None

    def _store(self, name: str, write: Callable[[Path], None]) -> None:
        tmp: Path | None = None
        try:
            self._remove_stale()
            self.entry.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.entry))
            write(tmp)
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "crc32": _crc32(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            # NOTE: the manifest goes last: a part without one (a crash mid-write) is invalid.
            (tmp / _MANIFEST).write_text(json.dumps({"fingerprint": self.fingerprint, "files": files}))
            tmp.chmod(0o755)
            final = self.entry / name
            shutil.rmtree(final, ignore_errors=True)
            try:
                tmp.rename(final)
            except OSError:
                # NOTE: another process renamed its copy first; it is as good as ours.
                return
            tmp = None
        except OSError as exc:
            logger.warning("model cache: cannot write %s (%s); the next start converts again", self.entry, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Removes entries of the same source written for an older version of the file."""
        if not self.root.is_dir():
            return
        for other in self.root.glob(f"{self._prefix}-*"):
            if other != self.entry:
                shutil.rmtree(other, ignore_errors=True)


class GGUFCache(CacheEntry):
    """The cache entry of one GGUF file.

    Args:
        source: the GGUF file (it must exist).
        root: the cache folder (default: :func:`cache_dir`).
    """

    def __init__(self, source: Path, root: Path | None = None) -> None:
        resolved = source.resolve()
        super().__init__((root or cache_dir()) / "gguf", [FORMAT_VERSION, str(resolved)], file_fingerprint(resolved))
        self.source = resolved

    # -- reading --------------------------------------------------------------------------

    def meta(self) -> tuple[dict[str, Any], Any] | None:
        """The cached HF config dict and tokenizer, or ``None`` (absent or invalid: removed)."""
        part = self._valid_part("meta")
        if part is None:
            return None
        try:
            config = json.loads((part / "config.json").read_text())
            tokenizer = load_tokenizer(part / "tokenizer")
        except Exception as exc:  # any parse failure means the part is unusable
            return self._drop(part, f"unreadable ({exc})")
        return config, tokenizer

    def config(self) -> dict[str, Any] | None:
        """The cached HF config dict alone, or ``None`` (absent or invalid: removed).

        NOTE: for callers that need the model's shape only (a simulated engine, a memory plan):
        loading the tokenizer too costs ~0.6 s on a 2-core machine, each time.
        """
        part = self._valid_part("meta")
        if part is None:
            return None
        try:
            return json.loads((part / "config.json").read_text())
        except Exception as exc:  # any parse failure means the part is unusable
            return self._drop(part, f"unreadable ({exc})")

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The cached state dict in ``dtype`` (memory-mapped), or ``None`` (absent or invalid:
        removed)."""
        part = self._valid_part(_weights_part(dtype))
        if part is None:
            return None
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(part / _WEIGHTS))
            aliases = json.loads((part / _ALIASES).read_text())
            for name, target in aliases.items():
                tensors[name] = tensors[target]
        except Exception as exc:
            return self._drop(part, f"unreadable ({exc})")
        return tensors

    def invalidate_weights(self, dtype: torch.dtype, why: str) -> None:
        """Removes the weights part (it did not fit the model it was loaded into)."""
        self._drop(self.entry / _weights_part(dtype), why)

    # -- writing --------------------------------------------------------------------------

    def store_meta(self, config: dict[str, Any], tokenizer: Any) -> None:
        """Writes the HF config dict and the tokenizer (``save_pretrained``) into the entry."""

        def write(folder: Path) -> None:
            (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
            tokenizer.save_pretrained(str(folder / "tokenizer"))

        self._store("meta", write)

    def store_weights(self, dtype: torch.dtype, state_dict: dict[str, torch.Tensor]) -> None:
        """Writes a model's state dict (cast to ``dtype``) into the entry.

        Tensors that share storage (tied embeddings) are written once, the other names as
        aliases.
        """
        from safetensors.torch import save_file

        def write(folder: Path) -> None:
            first: dict[tuple[int, tuple[int, ...]], str] = {}
            tensors: dict[str, torch.Tensor] = {}
            aliases: dict[str, str] = {}
            for name, tensor in state_dict.items():
                key = (tensor.data_ptr(), tuple(tensor.shape))
                if key in first:
                    aliases[name] = first[key]
                    continue
                first[key] = name
                tensors[name] = tensor.detach().to("cpu", dtype).contiguous()
            save_file(tensors, str(folder / _WEIGHTS))
            (folder / _ALIASES).write_text(json.dumps(aliases))

        self._store(_weights_part(dtype), write)


def _weights_part(dtype: torch.dtype) -> str:
    return "weights-" + str(dtype).removeprefix("torch.")


class TokenizerCache(CacheEntry):
    """The cache entry of a tokenizer built from other files (a dummy model's).

    Args:
        key: what the tokenizer is for (its entries share a prefix: writing one built from a
            new version of its sources removes the others).
        fingerprint: what it was built from (the sources' fingerprints, the builder's version).
        root: the cache folder (default: :func:`cache_dir`).
    """

    def __init__(self, key: Any, fingerprint: dict[str, Any], root: Path | None = None) -> None:
        super().__init__((root or cache_dir()) / "dummy-tokenizer", key, fingerprint)

    def tokenizer(self) -> Any:
        """The cached tokenizer, or ``None`` (absent or invalid: removed)."""
        part = self._valid_part("tokenizer")
        if part is None:
            return None
        try:
            return load_tokenizer(part)
        except Exception as exc:  # any parse failure means the part is unusable
            return self._drop(part, f"unreadable ({exc})")

    def store_tokenizer(self, tokenizer: Any) -> None:
        """Writes the tokenizer (``save_pretrained``) into the entry."""
        self._store("tokenizer", lambda folder: tokenizer.save_pretrained(str(folder)))
