"""The KV cache manager's block hash chains and typed results (:mod:`asymcache_core.kv_cache_manager`).

A block's hash chains over every earlier token (:func:`chain_hash` from its parent's hash, the
first block's from :func:`salted_root`), so equal hashes mean equal K/V at equal positions. A
lookup returns a :class:`CacheHit`, an admission or allocation an :class:`Allocation`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import NamedTuple

_ROOT_HASH = 0x5A17C0DE
#: :attr:`KVCacheManager.on_commit`: ``(block hash, parent hash or None, tokens, extra keys)``
CommitHook = Callable[[int, int | None, list[int], tuple[str, ...] | None], None]

RELOAD = -2
"""Block-table entry, during admission only, of a logical block to be reloaded from the host."""


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash (deterministic across processes)."""
    return hash((parent, tokens))


@functools.lru_cache(maxsize=1024)
def salted_root(salt: str | None) -> int:
    """The parent hash of a request's first block: the shared root, or one of its
    ``cache_salt`` (a digest: Python's ``hash`` of a string differs between processes, and the
    hashes must not, for the host tier's and the KV events' readers)."""
    if salt is None:
        return _ROOT_HASH
    return int.from_bytes(hashlib.sha256(salt.encode("utf-8")).digest()[:8], "little", signed=True)


class CacheHit(NamedTuple):
    """Result of a lookup.

    Attributes:
        block_table: one entry per looked-up logical block: a cached block id or ``HOLE``.
        leading_tokens: tokens covered by the leading run of hits (a plain prefix hit).
        hit_tokens: tokens covered by all hits (holes excluded).
        hole_tokens: tokens in holes before the last hit (recomputed although later blocks hit).
        skipped_hit_tokens: tokens in blocks that were cached but unusable (prefix-only mode:
            past the first miss).
        reloads: logical block index -> host slot of the blocks to reload from the host tier
            (``RELOAD`` in ``block_table``); their tokens count in ``hit_tokens``.
        host_recomputed_tokens: tokens found on the host but recomputed (cheaper than a reload).
    """

    block_table: list[int]
    leading_tokens: int
    hit_tokens: int
    hole_tokens: int
    skipped_hit_tokens: int
    reloads: dict[int, int] = {}
    host_recomputed_tokens: int = 0


class Allocation(NamedTuple):
    """Blocks a request was given for one step's segments.

    Attributes:
        segments: ``(start, end)`` positions the step computes, ascending.
        new_block_ids: fresh blocks taken for them, in logical order (possibly none).
        hit: the cache lookup an admission installed (``None`` for a running request).
        deferred: the request's blocks are being loaded from the host tier (or read blocks
            that are): it holds them, and computes once the copies are complete.
    """

    segments: list[tuple[int, int]]
    new_block_ids: list[int]
    hit: CacheHit | None = None
    deferred: bool = False
