"""vLLM V1's automatic prefix caching order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymcache_core.eviction.base import KeyedPolicy

if TYPE_CHECKING:
    from asymcache_core.block_pool import KVBlock


class VllmApcPolicy(KeyedPolicy):
    """vLLM V1's ``FreeKVCacheBlockQueue``: evict in the order blocks were freed.

    The cache manager frees a request's blocks tail first, so within a request the deepest
    block goes first, as in vLLM. Reuse is prefix-only (lookup stops at the first miss).
    """

    name = "vllm-apc"
    hole_reuse = False

    def key(self, block: KVBlock, now: float) -> int:
        # NOTE: the heap's tie-break tick is the insertion order, which is all this policy needs.
        return 0
