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

An eviction does not scan the free blocks: the queue indexes them by forest key and keeps the
set of keys that are evictable now (the forest reports every count change), so a plan scores
only the current leaves and wakes a parent's blocks when its last child goes. A dry run
(:meth:`ExpectedLatencyFreeQueue.get_all_free_blocks`) scans everything on a copy of the forest:
the reference the indexed plan is tested against.

Everything here is plain Python over duck-typed blocks (``block_id``, ``block_hash``,
``ref_cnt``): the vLLM scheduler (``scheduler.py``) wires it to real ``KVCacheBlock`` objects
and tests drive it with fakes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asymcache_core.eviction.asymcache import expected_latency_cost
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel


class FreeBlock(Protocol):
    """What the queue reads of a block (vLLM's ``KVCacheBlock`` has all of it)."""

    block_id: int
    ref_cnt: int

    @property
    def block_hash(self) -> Hashable | None: ...


class CachedForest:
    """The forest of cached hash chains: which hashes are cached, and by how many blocks.

    Keys are vLLM's hash keys (block hash + group id). A key's parent is the key of the block
    before it in the same request's chain; the chain is a pure function of the tokens, so a key
    always has the same parent and the relation, once learned, never changes.

    Attributes:
        watcher: called with every key whose :meth:`evictable` answer may have changed (and
            with ``None`` when every key's may have: :meth:`clear`); the free queue keeps its
            index of evictable keys current with it.
    """

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._copies: dict[Hashable, int] = {}
        self._children: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self.watcher: Callable[[Hashable | None], None] | None = None

    def _changed(self, key: Hashable | None) -> None:
        if self.watcher is not None:
            self.watcher(key)

    def learn_chain(self, keys: Sequence[Hashable], start: int = 0) -> None:
        """Records parent links of a request's chain of keys.

        Args:
            keys: the request's keys in order (key ``i``'s parent is key ``i - 1``).
            start: first index whose parent link to record.
        """
        for i in range(max(0, start), len(keys)):
            key = keys[i]
            if key in self._parent:
                continue
            parent = keys[i - 1] if i > 0 else None
            self._parent[key] = parent
            # NOTE: a key cached before its link was learned already has copies; count them.
            copies = self._copies.get(key, 0)
            if parent is not None and copies:
                self._children[parent] = self._children.get(parent, 0) + copies
                self._changed(parent)

    def add(self, block_id: int, key: Hashable) -> None:
        """Block ``block_id`` now caches ``key`` (its primary hash)."""
        if self._key_of.get(block_id) == key:
            return
        self.remove(block_id)
        self._key_of[block_id] = key
        self._copies[key] = self._copies.get(key, 0) + 1
        self._changed(key)
        parent = self._parent.get(key)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._changed(parent)

    def remove(self, block_id: int) -> Hashable | None:
        """Block ``block_id`` lost its cached content (idempotent).

        Returns:
            The parent key whose child count fell, or ``None``.
        """
        key = self._key_of.pop(block_id, None)
        if key is None:
            return None
        left = self._copies.get(key, 0) - 1
        if left > 0:
            self._copies[key] = left
        else:
            self._copies.pop(key, None)
        self._changed(key)
        parent = self._parent.get(key)
        if parent is None:
            return None
        kids = self._children.get(parent, 0) - 1
        if kids > 0:
            self._children[parent] = kids
        else:
            self._children.pop(parent, None)
        self._changed(parent)
        return parent

    def clear(self) -> None:
        """Every cached block lost its content (prefix-cache reset); links stay valid."""
        self._copies.clear()
        self._children.clear()
        self._key_of.clear()
        self._changed(None)

    def key_of(self, block_id: int) -> Hashable | None:
        """The key ``block_id`` is counted under, or ``None``."""
        return self._key_of.get(block_id)

    def parent(self, key: Hashable) -> Hashable | None:
        """The parent key of ``key`` (``None``: a root or unknown)."""
        return self._parent.get(key)

    def copies(self, key: Hashable) -> int:
        """Blocks caching ``key``."""
        return self._copies.get(key, 0)

    def children(self, key: Hashable) -> int:
        """Cached blocks whose parent key is ``key``."""
        return self._children.get(key, 0)

    def evictable(self, key: Hashable) -> bool:
        """Whether losing one block of ``key`` leaves every cached block reachable."""
        return self._copies.get(key, 0) > 1 or self._children.get(key, 0) == 0

    def copy(self) -> CachedForest:
        """A copy whose counts can be changed without touching this one (and unwatched)."""
        twin = CachedForest()
        twin._parent = self._parent  # NOTE: links are immutable facts; sharing them is safe.
        twin._copies = dict(self._copies)
        twin._children = dict(self._children)
        twin._key_of = dict(self._key_of)
        return twin

    def __len__(self) -> int:
        return len(self._key_of)


@dataclass
class BlockInfo:
    """What the scorer knows of a cached block's content.

    Attributes:
        position: logical block index in its sequence (depth in the hash chain).
        job_id: the job that last freed it (``None``: no job id).
        jobs: every job that used it (a shared prefix is reused if any comes back).
    """

    position: int = 0
    job_id: str | None = None
    jobs: set[str] = field(default_factory=set)


class BlockScorer:
    """AsymCache's score of a vLLM block: the embedded policy's ``expected_latency_cost``.

    Args:
        job_stats: per-job reuse statistics (P(reuse), next turn size).
        latency: step-latency model of the served model.
        block_size: tokens per block.
    """

    def __init__(self, job_stats: JobStats, latency: LatencyModel, block_size: int) -> None:
        self.job_stats = job_stats
        self.latency = latency
        self.block_size = block_size
        self.info: dict[int, BlockInfo] = {}

    def annotate(self, block_ids: Sequence[int], job_id: str | None) -> None:
        """Records a request's blocks (in sequence order) as used by ``job_id``.

        Args:
            block_ids: the request's block ids, block ``i`` at logical index ``i``.
            job_id: its job id, or ``None``.
        """
        for position, block_id in enumerate(block_ids):
            info = self.info.get(block_id)
            if info is None or info.position != position:
                info = self.info[block_id] = BlockInfo(position=position)
            info.job_id = job_id
            if job_id is not None:
                info.jobs.add(job_id)

    def forget(self, block_id: int) -> None:
        """The block's content is gone."""
        self.info.pop(block_id, None)

    def position(self, block_id: int) -> int:
        """Logical index of the block's content (0 when unknown)."""
        info = self.info.get(block_id)
        return 0 if info is None else info.position

    def score(self, block: FreeBlock, now: float) -> float:
        """Expected latency (seconds) that evicting ``block`` now adds to the future.

        Args:
            block: a free cached block.
            now: the clock of the job statistics.

        Returns:
            ``P(reuse) x marginal rebuild latency``; a block never annotated counts as a
            no-job block at position 0 (the job prior).
        """
        info = self.info.get(block.block_id)
        if info is None:
            p_reuse = self.job_stats.reuse_probability(None, now)
            return expected_latency_cost(p_reuse, 0, self.block_size, 0, self.latency)
        p_reuse = self.job_stats.block_reuse_probability(info.jobs, info.job_id, now)
        base = self.job_stats.expected_next_tokens(info.job_id)
        return expected_latency_cost(p_reuse, info.position, self.block_size, base, self.latency)


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
    """What the queue needs of a pin registry (:class:`~.pins.PinSet`)."""

    def holds_block(self, block_id: int) -> bool: ...

    def expire(self, now: float) -> list[str]: ...

    def pressure_order(self) -> list[tuple[str, tuple[int, ...]]]: ...

    def release(self, job_id: str) -> bool: ...


class ExpectedLatencyFreeQueue:
    """Drop-in replacement for vLLM's ``FreeKVCacheBlockQueue`` with AsymCache's order.

    Args:
        blocks: the free blocks, in vLLM's current order.
        score: ``score(block, now)``, expected latency lost by evicting a cached block.
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
        self._uncached: OrderedDict[int, FreeBlock] = OrderedDict()
        self._cached: dict[int, tuple[int, FreeBlock]] = {}
        # Index of the cached free blocks by forest key, and the keys that are evictable now:
        # a plan starts from these instead of scanning every free block (vLLM pools hold tens of
        # thousands); the forest reports every key whose evictability may change.
        self._key_blocks: dict[Hashable, set[int]] = {}
        self._index_key: dict[int, Hashable] = {}
        self._evictable_keys: set[Hashable] = set()
        self.forest.watcher = self._on_forest_change
        self._tick = itertools.count()
        # NOTE: blocks prepended as "evict first" get ticks below every appended block.
        self._front_tick = itertools.count(-1, -1)
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
        if len(out) < n:
            now = self.clock()
            if self.pins is not None:
                self.pins.expire(now)
            chosen, released, forced = self._plan(n - len(out), now, self.forest, mutate=True)
            for block_id in chosen:
                out.append(self._pop_cached(block_id))
            self.stats.pressure_unpins += released
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
        order = list(self._uncached.values())
        if self._cached:
            chosen, _, _ = self._plan(len(self._cached), self.clock(), self.forest.copy(), mutate=False)
            order.extend(self._cached[block_id][1] for block_id in chosen)
        return order

    def iter_blocks_after(self, cursor: FreeBlock | None) -> Iterator[FreeBlock]:
        """Free blocks in eviction order after ``cursor`` (all of them when ``None``)."""
        order = self.get_all_free_blocks()
        if cursor is not None:
            ids = [b.block_id for b in order]
            start = ids.index(cursor.block_id) + 1 if cursor.block_id in ids else len(order)
            order = order[start:]
        return iter(order)

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

    # ---- internals ----------------------------------------------------------------------------

    def _add(self, block: FreeBlock, front: bool) -> None:
        block_id = block.block_id
        if block_id in self._uncached or block_id in self._cached:
            raise RuntimeError(f"block {block_id} is already free")
        if block.block_hash is None:
            self._uncached[block_id] = block
            if front:
                self._uncached.move_to_end(block_id, last=False)
        else:
            tick = next(self._front_tick) if front else next(self._tick)
            self._cached[block_id] = (tick, block)
            self._index(block)

    def _pop_cached(self, block_id: int) -> FreeBlock:
        """Takes a cached block out of the free set and the index."""
        _, block = self._cached.pop(block_id)
        key = self._index_key.pop(block_id)
        ids = self._key_blocks[key]
        ids.discard(block_id)
        if not ids:
            del self._key_blocks[key]
        self._refresh(key)
        return block

    def _index(self, block: FreeBlock) -> None:
        key = self.forest.key_of(block.block_id) or block.block_hash
        self._index_key[block.block_id] = key
        self._key_blocks.setdefault(key, set()).add(block.block_id)
        self._refresh(key)

    def _refresh(self, key: Hashable) -> None:
        """Files ``key`` as evictable or not, by the forest's current counts."""
        if key in self._key_blocks and self.forest.evictable(key):
            self._evictable_keys.add(key)
        else:
            self._evictable_keys.discard(key)

    def _on_forest_change(self, key: Hashable | None) -> None:
        if key is not None:
            self._refresh(key)
            return
        # Every count changed (a reset): re-key every cached free block.
        blocks = [block for _, block in self._cached.values()]
        self._key_blocks.clear()
        self._index_key.clear()
        self._evictable_keys.clear()
        for block in blocks:
            self._index(block)

    def _plan(
        self, k: int, now: float, forest: CachedForest, mutate: bool
    ) -> tuple[list[int], int, int]:
        """Chooses ``k`` cached free blocks to evict, keeping ``forest`` current as it goes.

        Args:
            k: victims wanted (at most the cached free blocks).
            now: scoring time.
            forest: the forest to consult and update (a copy for a dry run).
            mutate: release pins for real (False: only pretend, for a dry run).

        Returns:
            (victim block ids in order, pins released under pressure, forced orphans).
        """
        # NOTE: a live plan (the queue's own forest, pins released for real) starts from the
        # index of evictable keys and wakes parked keys from it; a dry run, on a copy of the
        # forest, scans every free block (the reference the live plan is tested against).
        live = mutate and forest is self.forest
        pressure = list(self.pins.pressure_order()) if self.pins is not None else []
        pinned: set[int] = set()
        for _, block_ids in pressure:
            pinned.update(b for b in block_ids if b in self._cached)
        if self.pins is not None and not live:
            # NOTE: pressure_order covers every pin; re-check in case a registry filters it.
            pinned.update(b for b in self._cached if self.pins.holds_block(b))

        scores: dict[int, float] = {}

        def entry(block_id: int) -> tuple[float, int, int]:
            tick, block = self._cached[block_id]
            if block_id not in scores:
                # NOTE: a block whose hash vanished while free holds nothing: it costs 0.
                scores[block_id] = -1.0 if block.block_hash is None else self.score(block, now)
            return (scores[block_id], tick, block_id)

        chosen: list[int] = []
        taken: set[int] = set()
        released = forced = 0
        # Free cached blocks waiting for their key to become evictable, by key.
        waiting: dict[Hashable, list[int]] = {}
        heap: list[tuple[float, int, int]] = []

        def consider(block_id: int) -> None:
            if block_id in taken or block_id in pinned:
                return
            if live and self.pins is not None and self.pins.holds_block(block_id):
                return
            block = self._cached[block_id][1]
            key = block.block_hash
            if key is None or forest.evictable(forest.key_of(block_id) or key):
                heapq.heappush(heap, entry(block_id))
            else:
                waiting.setdefault(forest.key_of(block_id) or key, []).append(block_id)

        if live:
            for key in list(self._evictable_keys):
                for block_id in list(self._key_blocks[key]):
                    consider(block_id)
        else:
            for block_id in self._cached:
                consider(block_id)

        def parked(key: Hashable) -> list[int]:
            """Free blocks of ``key`` not yet in the heap (it just became evictable)."""
            ids = waiting.pop(key, [])
            if live:
                ids += [b for b in self._key_blocks.get(key, ()) if b not in taken]
            return ids

        def take(block_id: int) -> None:
            chosen.append(block_id)
            taken.add(block_id)
            parent = forest.remove(block_id)
            if parent is not None and forest.evictable(parent):
                for other in parked(parent):
                    consider(other)

        while len(chosen) < k:
            if heap:
                _, _, block_id = heapq.heappop(heap)
                if block_id in taken:
                    continue
                key = forest.key_of(block_id)
                if key is not None and not forest.evictable(key):
                    # NOTE: a copy of its key went earlier in this plan; wait for the children.
                    waiting.setdefault(key, []).append(block_id)
                    continue
                take(block_id)
                continue
            if pressure:
                job_id, block_ids = pressure.pop(0)
                if mutate and self.pins is not None:
                    self.pins.release(job_id)
                released += 1
                still = {b for _, ids in pressure for b in ids}
                for block_id in block_ids:
                    if block_id in pinned and block_id not in still:
                        pinned.discard(block_id)
                        consider(block_id)
                continue
            # Last resort: nothing evictable is left; the deepest, cheapest block goes.
            rest = [b for b in self._cached if b not in taken]
            victim = min(rest, key=lambda b: (-self._depth(forest, b), entry(b)))
            for ids in waiting.values():
                if victim in ids:
                    ids.remove(victim)
            forced += 1
            take(victim)
        return chosen, released, forced

    def _depth(self, forest: CachedForest, block_id: int) -> int:
        """Chain depth of a block's key (0 for roots and unknown keys)."""
        depth = 0
        key = forest.key_of(block_id)
        while key is not None and depth < 1 << 20:
            key = forest.parent(key)
            depth += 1 if key is not None else 0
        return depth
