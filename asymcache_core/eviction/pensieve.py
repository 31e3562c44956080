"""Pensieve's order: leading blocks of idle jobs (conversations) first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymcache_core.eviction.base import KeyedPolicy

if TYPE_CHECKING:
    from asymcache_core.block_pool import KVBlock


class PensievePolicy(KeyedPolicy):
    """Evicts from the longest-idle job first, and inside it the leading blocks first.

    Leading blocks are the cheapest to rebuild (they attend over few earlier tokens), and with
    hole-aware reuse the job's later blocks stay usable (Pensieve, EuroSys 2025).
    """

    name = "pensieve"
    hole_reuse = True

    def key(self, block: KVBlock, now: float) -> tuple[float, int]:
        idle_since = block.last_access
        if self.ctx.job_stats is not None and block.job_id is not None:
            idle_since = self.ctx.job_stats.last_active(block.job_id, default=idle_since)
        return (idle_since, block.position)
