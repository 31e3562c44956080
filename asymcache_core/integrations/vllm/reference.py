"""The reference eviction plan of the vLLM plugin's free queue: a full scan, every block scored.

:class:`~asymcache_core.integrations.vllm.free_queue.ExpectedLatencyFreeQueue` orders its
candidates by score group and walks a copy-on-write view of the forest; this plan scores every
free cached block on a copy of the forest instead. It defines the order the queue must give
(tests compare the two) and is the baseline of ``scripts/bench_free_queue.py``: O(free blocks)
per call, far too slow for a vLLM-sized pool's every allocation.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import TYPE_CHECKING

from asymcache_core.integrations.vllm.forest import CachedForest

if TYPE_CHECKING:
    from asymcache_core.integrations.vllm.free_queue import ExpectedLatencyFreeQueue


def reference_plan(
    queue: ExpectedLatencyFreeQueue, k: int, now: float, forest: CachedForest
) -> tuple[list[int], int, int]:
    """Chooses ``k`` cached free blocks of ``queue`` to evict, without changing the queue.

    Args:
        queue: the free queue (its blocks, score and pins are read).
        k: victims wanted (at most the cached free blocks).
        now: scoring time.
        forest: a copy of the queue's forest (changed as victims go).

    Returns:
        (victim block ids in order, pins released under pressure, forced orphans).
    """
    cached = queue._cached
    pins = queue.pins
    pressure = list(pins.pressure_order()) if pins is not None else []
    pinned: set[int] = set()
    for _, block_ids in pressure:
        pinned.update(b for b in block_ids if b in cached)
    if pins is not None:
        pinned.update(b for b in cached if pins.holds_block(b))

    scores: dict[int, float] = {}

    def entry(block_id: int) -> tuple[float, int, int]:
        tick, block = cached[block_id]
        if block_id not in scores:
            # NOTE: a block whose hash vanished while free holds nothing: it costs 0.
            scores[block_id] = -1.0 if block.block_hash is None else queue.score(block, now)
        return (scores[block_id], tick, block_id)

    chosen: list[int] = []
    taken: set[int] = set()
    released = forced = 0
    waiting: dict[Hashable, list[int]] = {}
    heap: list[tuple[float, int, int]] = []

    def consider(block_id: int) -> None:
        if block_id in taken or block_id in pinned:
            return
        key = cached[block_id][1].block_hash
        if key is None or forest.evictable(forest.key_of(block_id) or key):
            heapq.heappush(heap, entry(block_id))
        else:
            waiting.setdefault(forest.key_of(block_id) or key, []).append(block_id)

    for block_id in cached:
        consider(block_id)

    def take(block_id: int) -> None:
        chosen.append(block_id)
        taken.add(block_id)
        parent = forest.remove(block_id)
        if parent is not None and forest.evictable(parent):
            for other in waiting.pop(parent, []):
                consider(other)

    while len(chosen) < k:
        if heap:
            _, _, block_id = heapq.heappop(heap)
            if block_id in taken:
                continue
            key = forest.key_of(block_id)
            if key is not None and not forest.evictable(key):
                waiting.setdefault(key, []).append(block_id)
                continue
            take(block_id)
            continue
        if pressure:
            _, block_ids = pressure.pop(0)
            released += 1
            still = {b for _, ids in pressure for b in ids}
            for block_id in block_ids:
                if block_id in pinned and block_id not in still:
                    pinned.discard(block_id)
                    consider(block_id)
            continue
        rest = [b for b in cached if b not in taken]
        victim = min(rest, key=lambda b: (-queue._depth(forest, b), entry(b)))
        for ids in waiting.values():
            if victim in ids:
                ids.remove(victim)
        forced += 1
        take(victim)
    return chosen, released, forced
