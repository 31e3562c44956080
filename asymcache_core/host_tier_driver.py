"""The engine's side of the host KV tier: each step's copies, failed copies, and prefetch.

:mod:`asymcache_core.host_tier` decides what is copied (offload candidates, reload-or-recompute,
which paused jobs are due back); this module carries those decisions out between the engine's
scheduler, the device pool and the runner, once per step.
"""

from __future__ import annotations

import logging
from typing import Any

from asymcache_core.continuum.backends import PinManager
from asymcache_core.host_tier import HostTier, KVTransfers
from asymcache_core.job_stats import JobStats
from asymcache_core.kv_cache_manager import KVCacheManager
from asymcache_core.scheduler import Scheduler

logger = logging.getLogger("asymcache_core.engine")

#: engine seconds between two scans for paused jobs due back (the scan walks every job)
PREFETCH_SCAN_S = 0.01


class HostTierDriver:
    """Issues the host tier's copies and prefetches for one engine.

    Args:
        tier: the host tier.
        kv: the device pool's cache manager.
        scheduler: the engine's scheduler (requests that lose their reloads are preempted).
        pins: the engine's pins (each paused job's last blocks).
        job_stats: per-job gaps (when a paused job is due back).
        runner: the model runner (``transfer_kv``).
    """

    def __init__(
        self,
        tier: HostTier,
        kv: KVCacheManager,
        scheduler: Scheduler,
        pins: PinManager,
        job_stats: JobStats,
        runner: Any,
    ) -> None:
        self.tier = tier
        self.kv = kv
        self.pool = kv.pool
        self.scheduler = scheduler
        self.pins = pins
        self.job_stats = job_stats
        self.runner = runner
        self._next_prefetch_scan = 0.0

    def transfer(self, transfers: KVTransfers) -> None:
        """Issues the step's host-tier copies; if they fail, what they were to fill is dropped
        (:meth:`abandon`: the requests waiting for it recompute it), and the step goes on."""
        if transfers.is_empty and transfers.wait_offloads_of is None:
            return
        try:
            self.runner.transfer_kv(transfers)
        except Exception as exc:  # noqa: BLE001 - the copies' targets are recomputed instead
            logger.error("host KV tier copies failed (%s: %s); recomputing their blocks", type(exc).__name__, exc)
            self.abandon(transfers)

    def abandon(self, transfers: KVTransfers) -> None:
        """The copies of ``transfers`` may not have landed: the host slots they were to fill
        and the device blocks they were to reload stop being cache hits, and the requests that
        hold such blocks start over."""
        tier = self.tier
        for _, slot in transfers.offloads:
            if tier.pool.is_candidate(slot):
                tier.pool.evict_block(slot)
        targets = {block_id for _, block_id in transfers.reloads}
        for request in [r for r in self.scheduler.running if targets.intersection(self.kv.held_blocks(r))]:
            request.kv_ticket = None
            self.scheduler.preempt(request)
        for block_id in targets:
            block = self.pool.blocks[block_id]
            if block.block_hash is None or block.pin_cnt > 0:
                continue
            tier.on_uncache(block_id)  # never copy its content back out
            if block.ref_cnt > 0:
                self.pool.uncache(block_id)  # a prefetch holds it
            else:
                self.pool.evict_block(block_id)
        self.kv.loading = {b: t for b, t in self.kv.loading.items() if b not in targets}

    def prefetch(self, now: float, step_s: float) -> None:
        """Copies paused jobs' blocks back from the host before their next turn arrives
        (:meth:`HostTier.due_for_prefetch`), soonest job first, into free blocks only, so
        nothing cached is evicted for a guess.

        Args:
            now: engine time.
            step_s: the last step's duration (a job due within two steps is due now).

        NOTE: the scan walks every remembered job; it runs at most every
        :data:`PREFETCH_SCAN_S` of engine time, and not at all while no block is free.
        """
        free = len(self.pool.free_uncached)
        if free == 0 or now < self._next_prefetch_scan:
            return
        self._next_prefetch_scan = now + PREFETCH_SCAN_S
        for job_id in self.tier.due_for_prefetch(self.pins.last_blocks, self.job_stats, now, 2 * step_s):
            free -= self.kv.prefetch([h for _, h in self.pins.last_blocks[job_id]], job_id, free)
            if free <= 0:
                break

    def stats(self) -> dict[str, int]:
        """The tier's gauges and counters, as :class:`~asymcache_core.engine_stats.EngineStats` fields."""
        tier = self.tier
        n = tier.counters
        return {
            "host_kv_blocks_total": tier.pool.num_blocks,
            "host_kv_blocks_cached": len(tier.pool.cached),
            "host_offloaded_blocks_total": n.offloaded,
            "host_reloaded_blocks_total": n.reloaded,
            "host_prefetched_blocks_total": n.prefetched,
            "host_recompute_chosen_blocks_total": n.recompute_chosen,
            "host_evictions_total": tier.pool.num_evictions,
            "host_bytes_to_host_total": n.bytes_to_host,
            "host_bytes_to_device_total": n.bytes_to_device,
        }
