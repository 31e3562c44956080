"""An expected-latency free-block order for vLLM V1's ``BlockPool`` that never orphans.

vLLM V1 keeps every block with ref count 0 in ``BlockPool.free_block_queue`` (an LRU linked
list); allocation pops from its head and drops the popped block's hash, which is the eviction.
:class:`ExpectedLatencyFreeQueue` offers the same methods (``popleft``, ``popleft_n``,
``remove``, ``append``, ``append_n``, ``prepend_n``, ``get_all_free_blocks``,
``iter_blocks_after`` and the ``num_free_blocks`` count) with AsymCache's order:

1. free blocks without a hash (no cached content) first: losing them costs nothing;
2. then cached blocks that are *eviction candidates*, cheapest first, by the embedded policy's
   score :func:`~asymcache_core.eviction.asymcache.expected_latency_cost`
   (P(reuse) x marginal rebuild latency); ties go to the least recently freed block, and a
   request's blocks are freed tail first, so its tail goes first;
3. when no candidate is left, Continuum pins are released, latest-expiring first (memory
   pressure), and their blocks join the candidates;
4. only when nothing else is left (e.g. a sliding-window request still holds a descendant), a
   non-candidate goes; :attr:`QueueStats.forced_orphans` counts it.

A cached block is a candidate when it is not pinned and evicting it leaves no cached block
unreachable: vLLM reuses prefixes only (``find_longest_cache_hit`` stops at the first miss), so
a block whose hash has a cached child must stay while that child does. :class:`CachedForest`
tracks the cached hash chains (copies per hash, cached children per hash); the leaves of that
forest, and hashes held by more than one block, are the candidates. Evicting a leaf may turn its
parent into a leaf within the same allocation.

An eviction neither scans nor scores every free block, nor prices every score group. The queue
keeps the *candidates* (free, cached, evictable key, not pinned) filed by score group
(:meth:`BlockScorer.group_of`: blocks used by the same jobs share every term of the score but
their position), each group in two heaps, by position and by recency, and the groups in a heap
by a lower bound of their scores that holds until a horizon
(:mod:`~asymcache_core.integrations.vllm.candidates`, :meth:`BlockScorer.group_bound`); the
forest, the pins, the scorer and the job statistics report every change that moves a block in or
out or re-prices a group. A walk (:func:`~asymcache_core.integrations.vllm.walk.walk`) re-prices
the groups that changed or whose horizon passed, reads the groups by bound, prices one only when
its bound is not above the best candidate found so far, merges the priced groups' heads and walks
a copy-on-write view of the forest
(:class:`~asymcache_core.integrations.vllm.forest.ForestOverlay`) that wakes a parent's blocks
when its last child goes: O((re-priced + priced groups + victims) x log groups) per allocation.
The order is the full scan's (:func:`~asymcache_core.integrations.vllm.reference.reference_plan`,
every block scored, which tests compare against); a dry run
(:meth:`ExpectedLatencyFreeQueue.get_all_free_blocks`, :meth:`~ExpectedLatencyFreeQueue.iter_blocks_after`)
is the same walk, lazily.

Everything here is plain Python over duck-typed blocks (``block_id``, ``block_hash``,
``ref_cnt``): the vLLM scheduler (``scheduler.py``) wires it to real ``KVCacheBlock`` objects
and tests drive it with fakes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from asymcache_core.integrations.vllm.candidates import CandidateIndex
from asymcache_core.integrations.vllm.forest import CachedForest, ForestOverlay
from asymcache_core.integrations.vllm.reference import reference_plan
from asymcache_core.integrations.vllm.scoring import BlockInfo, BlockScorer, FreeBlock
from asymcache_core.integrations.vllm.walk import HASHLESS, OPAQUE, chain_depth, walk

__all__ = [
    "BlockInfo",
    "BlockScorer",
    "CachedForest",
    "ExpectedLatencyFreeQueue",
    "FreeBlock",
    "QueueStats",
]


@dataclass
class QueueStats:
    """Counters of one queue.

    Attributes:
        popped: blocks handed out.
        evicted_cached: popped blocks that held cached content (evictions).
        pressure_unpins: pins released because nothing else could go.
        forced_orphans: evictions of a block whose descendant stayed cached (last resort).
    """

    popped: int = 0
    evicted_cached: int = 0
    pressure_unpins: int = 0
    forced_orphans: int = 0


class _PinView(Protocol):
    """What the queue needs of a pin registry (:class:`~.pins.PinSet`; one with a ``listener``
    attribute also reports blocks that gain or lose their pins, so pinned blocks are never
    candidates)."""

    def holds_block(self, block_id: int) -> bool: ...

    def expire(self, now: float) -> list[str]: ...

    def pressure_order(self) -> list[tuple[str, tuple[int, ...]]]: ...

    def release(self, job_id: str) -> bool: ...


class ExpectedLatencyFreeQueue:
    """Drop-in replacement for vLLM's ``FreeKVCacheBlockQueue`` with AsymCache's order.

    Args:
        blocks: the free blocks, in vLLM's current order.
        score: ``score(block, now)``, expected latency lost by evicting a cached block. A
            :class:`BlockScorer`'s own ``score`` is priced per group (same order); any other
            callable is called for every candidate at every eviction.
        clock: the time source of ``score`` and of pin expiry.
        forest: the cached hash chains (shared with the pool hooks that keep it current).
        pins: the pin registry, or ``None`` for no pins.
    """

    def __init__(
        self,
        blocks: Iterable[FreeBlock],
        score: Callable[[FreeBlock, float], float],
        clock: Callable[[], float],
        forest: CachedForest | None = None,
        pins: _PinView | None = None,
    ) -> None:
        self.score = score
        self.clock = clock
        self.forest = forest if forest is not None else CachedForest()
        self.pins = pins
        self.stats = QueueStats()
        owner = getattr(score, "__self__", None)
        is_scorer = (
            isinstance(owner, BlockScorer) and getattr(score, "__func__", None) is BlockScorer.score
        )
        self._scorer: BlockScorer | None = owner if is_scorer else None
        self._uncached: OrderedDict[int, FreeBlock] = OrderedDict()
        self._cached: dict[int, tuple[int, FreeBlock]] = {}
        # Forest key of every cached free block, and the blocks of each key.
        self._key_blocks: dict[Hashable, set[int]] = {}
        self._index_key: dict[int, Hashable] = {}
        # The candidates (free, cached, evictable key, not pinned) by score group, and the
        # groups by a lower bound of their scores.
        self._candidates = CandidateIndex(self._jobs_of)
        # Groups the latest walk priced (those with a loose bound re-price after a pop).
        self._explored: list[Hashable] = []
        # NOTE: bumped by every change; a walk (a lazy dry run) refuses to go on after one.
        self._version = 0
        self._tick = itertools.count()
        # NOTE: blocks prepended as "evict first" get ticks below every appended block.
        self._front_tick = itertools.count(-1, -1)
        self.forest.watcher = self._on_forest_change
        if self._scorer is not None:
            self._scorer.listener = self._on_info_change
            self._scorer.job_listener = self._candidates.note_job
        self._pin_aware = pins is not None and hasattr(pins, "listener")
        if self._pin_aware:
            pins.listener = self._on_pin_change  # type: ignore[union-attr]
        for block in blocks:
            self._add(block, front=False)

    # ---- the FreeKVCacheBlockQueue API -------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (cached or not), what vLLM's admission control counts."""
        return len(self._uncached) + len(self._cached)

    def popleft(self) -> FreeBlock:
        """Pops the next victim.

        Raises:
            ValueError: no free block.
        """
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[FreeBlock]:
        """Pops ``n`` victims in eviction order (the caller then drops their hashes).

        Args:
            n: blocks wanted (at most :attr:`num_free_blocks`).

        Returns:
            The blocks, cheapest to lose first.
        """
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        out: list[FreeBlock] = []
        while self._uncached and len(out) < n:
            _, block = self._uncached.popitem(last=False)
            out.append(block)
        self._version += 1
        if len(out) < n:
            now = self.clock()
            if self.pins is not None:
                self.pins.expire(now)
            chosen: list[int] = []
            released: list[str] = []
            forced = 0
            walk = self._walk(now)
            for block_id, job, orphan in walk:
                if block_id is None:
                    released.append(job or "")
                    continue
                chosen.append(block_id)
                forced += orphan
                if len(chosen) == n - len(out):
                    break
            walk.close()
            # NOTE: the walk only pretended; now its pin releases and removals happen for real.
            for job in released:
                self.pins.release(job)  # type: ignore[union-attr]
            for block_id in chosen:
                out.append(self._pop_cached(block_id))
                self.forest.remove(block_id)
            groups = self._candidates.groups
            for group in self._explored:
                rows = groups.get(group)
                if rows is not None and rows.bound is not None and not rows.bound.exact:
                    # NOTE: priced with a loose bound: re-price it at the new level.
                    self._candidates.dirty.add(group)
            self.stats.pressure_unpins += len(released)
            self.stats.forced_orphans += forced
            self.stats.evicted_cached += len(chosen)
        self.stats.popped += len(out)
        return out

    def remove(self, block: FreeBlock) -> None:
        """Takes a free block out (a cache hit touched it).

        Raises:
            RuntimeError: the block is not free.
        """
        block_id = block.block_id
        if self._uncached.pop(block_id, None) is not None:
            self._version += 1
            return
        if block_id in self._cached:
            self._pop_cached(block_id)
            return
        raise RuntimeError(f"remove() called on a block that is not free: {block_id}")

    def append(self, block: FreeBlock) -> None:
        """Returns a freed block (vLLM's "evict last" end; we order by score anyway)."""
        self._add(block, front=False)

    def append_n(self, blocks: Iterable[FreeBlock]) -> None:
        """Returns freed blocks, in the order vLLM wants them evicted (tail first)."""
        for block in blocks:
            self._add(block, front=False)

    def prepend_n(self, blocks: Iterable[FreeBlock]) -> None:
        """Returns freed blocks that vLLM wants evicted first (uncached ones)."""
        for block in reversed(list(blocks)):
            self._add(block, front=True)

    def get_all_free_blocks(self) -> list[FreeBlock]:
        """Every free block in the order they would be popped now (a dry run)."""
        return list(self._order())

    def iter_blocks_after(self, cursor: FreeBlock | None) -> Iterator[FreeBlock]:
        """Free blocks in eviction order after ``cursor`` (all of them when ``None``), lazily:
        a caller that stops after m blocks pays for the walk up to the cursor and those m, not
        for a plan of the whole pool (vLLM's offload connector walks ``target_free`` blocks a
        step). Nothing when the cursor is not free. The queue must not change meanwhile.
        """
        if cursor is not None and cursor not in self:
            return iter(())
        order = self._order()
        if cursor is None:
            return order
        target = cursor.block_id
        for block in order:
            if block.block_id == target:
                break
        return order

    # ---- hooks the pool wrapper calls ---------------------------------------------------------

    def note_hash_change(self, block: FreeBlock) -> None:
        """A free block gained or lost its cached content: re-file it."""
        block_id = block.block_id
        if block_id in self._uncached and block.block_hash is not None:
            del self._uncached[block_id]
            self._add(block, front=False)
        elif block_id in self._cached and block.block_hash is None:
            self._pop_cached(block_id)
            self._add(block, front=True)

    def refile_all(self) -> None:
        """Re-files every free block by its current hash (after a prefix-cache reset)."""
        for block_id, (_, block) in list(self._cached.items()):
            if block.block_hash is None:
                self._pop_cached(block_id)
                self._add(block, front=True)

    def __contains__(self, block: object) -> bool:
        block_id = getattr(block, "block_id", None)
        return block_id in self._uncached or block_id in self._cached

    def __len__(self) -> int:
        return self.num_free_blocks

    # ---- filing -------------------------------------------------------------------------------

    def _add(self, block: FreeBlock, front: bool) -> None:
        block_id = block.block_id
        if block_id in self._uncached or block_id in self._cached:
            raise RuntimeError(f"block {block_id} is already free")
        self._version += 1
        if block.block_hash is None:
            self._uncached[block_id] = block
            if front:
                self._uncached.move_to_end(block_id, last=False)
        else:
            tick = next(self._front_tick) if front else next(self._tick)
            self._cached[block_id] = (tick, block)
            self._index(block)

    def _pop_cached(self, block_id: int) -> FreeBlock:
        """Takes a cached block out of the free set, the index and the candidates."""
        self._version += 1
        _, block = self._cached.pop(block_id)
        key = self._index_key.pop(block_id)
        ids = self._key_blocks[key]
        ids.discard(block_id)
        if not ids:
            del self._key_blocks[key]
        if block_id in self._candidates.cand:
            self._candidates.unfile(block_id)
        return block

    def _index(self, block: FreeBlock) -> None:
        key = self.forest.key_of(block.block_id) or block.block_hash
        self._index_key[block.block_id] = key
        self._key_blocks.setdefault(key, set()).add(block.block_id)
        self._recheck(block.block_id)

    @property
    def _cand(self) -> dict[int, tuple[Hashable, int]]:
        """The candidates: block -> (group, filing stamp)."""
        return self._candidates.cand

    def _group_key(self, block_id: int) -> Hashable:
        if self._cached[block_id][1].block_hash is None:
            return HASHLESS
        if self._scorer is None:
            return OPAQUE
        return self._scorer.group_of(block_id)

    def _jobs_of(self, group: Hashable) -> tuple[str, ...]:
        if self._scorer is None or group is HASHLESS or group is OPAQUE:
            return ()
        return self._scorer.jobs_of(group)  # type: ignore[arg-type]

    def _recheck(self, block_id: int) -> None:
        """Files ``block_id`` as a candidate or not: free, cached, evictable key, not pinned."""
        entry = self._cached.get(block_id)
        want = entry is not None and not (self._pin_aware and self.pins.holds_block(block_id))  # type: ignore[union-attr]
        if want and entry is not None and entry[1].block_hash is not None:
            want = self.forest.evictable(self._index_key[block_id])
        index = self._candidates
        filed = index.cand.get(block_id)
        if not want:
            if filed is not None:
                index.unfile(block_id)
            return
        group = self._group_key(block_id)
        if filed is not None:
            if filed[0] == group:
                return
            index.unfile(block_id)
        position = self._scorer.position(block_id) if self._scorer is not None else 0
        index.file(block_id, group, position, self._cached[block_id][0])

    def _on_forest_change(self, key: Hashable | None) -> None:
        self._version += 1
        if key is not None:
            for block_id in list(self._key_blocks.get(key, ())):
                self._recheck(block_id)
            return
        # Every count changed (a reset): re-key and re-file every cached free block.
        self._key_blocks.clear()
        self._index_key.clear()
        self._candidates.clear()
        for _, block in list(self._cached.values()):
            self._index(block)

    def _on_pin_change(self, block_id: int) -> None:
        self._version += 1
        if block_id in self._cached:
            self._recheck(block_id)

    def _on_info_change(self, block_id: int) -> None:
        self._version += 1
        if block_id in self._candidates.cand:
            self._candidates.unfile(
                block_id
            )  # NOTE: its position may have changed, not only its group
        if block_id in self._cached:
            self._recheck(block_id)

    # ---- the plan ----------------------------------------------------------------------------

    def _order(self) -> Iterator[FreeBlock]:
        """Every free block in eviction order, lazily (uncached first, then the walk)."""
        yield from list(self._uncached.values())
        if self._cached:
            for block_id, _, _ in self._walk(self.clock()):
                if block_id is not None:
                    yield self._cached[block_id][1]

    def _plan(
        self, k: int, now: float, forest: CachedForest, mutate: bool = False
    ) -> tuple[list[int], int, int]:
        """The full-scan reference plan (:func:`~.reference.reference_plan`) on ``forest``, a
        copy of this queue's (``scripts/bench_free_queue.py`` times it against the walk)."""
        if mutate:
            raise ValueError("the reference plan is a dry run")
        return reference_plan(self, k, now, forest)

    def _walk(self, now: float) -> Iterator[tuple[int | None, str | None, bool]]:
        """The eviction order at ``now``, lazily, changing nothing (:func:`~.walk.walk`)."""
        return walk(self, now)

    def _depth(self, forest: CachedForest | ForestOverlay, block_id: int) -> int:
        """Chain depth of a block's key (:func:`~.walk.chain_depth`)."""
        return chain_depth(forest, block_id)
