"""Plain block LRU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymcache_core.eviction.base import KeyedPolicy

if TYPE_CHECKING:
    from asymcache_core.block_pool import KVBlock


class LRUPolicy(KeyedPolicy):
    """Least recently used block first; among blocks used at the same time, the shallowest.

    Blind to structure: it happily evicts the head of a sequence whose tail it keeps, which
    under prefix-only reuse makes the tail unreachable.
    """

    name = "lru"
    hole_reuse = False

    def key(self, block: KVBlock, now: float) -> tuple[float, int]:
        return (block.last_access, block.position)
