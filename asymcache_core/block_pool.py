"""The pool of KV blocks: ref counts, the hash map of cached blocks, pins and eviction.

Invariants (checked by :meth:`BlockPool.check_integrity`):

- every block is in exactly one of: referenced (``ref_cnt > 0``), pinned and unreferenced,
  an eviction candidate (unreferenced, unpinned, cached), or the uncached free list;
- ``cached`` maps a hash to a block whose ``block_hash`` is that hash, and every hashed block is
  in the map;
- only candidates are ever evicted, so a referenced or pinned block keeps its content.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from asymcache_core.eviction.base import EvictionPolicy


@dataclass(eq=False)
class KVBlock:
    """Bookkeeping of one physical KV block.

    Attributes:
        block_id: index into the per-layer cache tensors.
        ref_cnt: running requests that hold it.
        pin_cnt: pins that hold it (Continuum TTL pins); a pinned block is never evicted.
        block_hash: chained hash of every token up to the end of this block, once it is full
            and computed; ``None`` while it holds no reusable content.
        position: logical block index in its sequence (``position * block_size`` tokens
            precede it): the rebuild cost grows with it.
        job_id: the last job that used it.
        jobs: jobs that have used it (shared-prefix blocks have several). Immutable: a new
            job replaces the set, so the eviction policy keys its groups by it without a copy
            (a shared prefix's set holds every job of a run; copying it on each release was
            ~5% of a simulated SWE run).
        last_access: engine time of the last use.
    """

    block_id: int
    ref_cnt: int = 0
    pin_cnt: int = 0
    block_hash: int | None = None
    position: int = 0
    job_id: str | None = None
    jobs: frozenset[str] = frozenset()
    last_access: float = 0.0

    def reset(self) -> None:
        self.block_hash = None
        self.position = 0
        self.job_id = None
        self.jobs = frozenset()


class BlockListener(Protocol):
    """Told when a block's content changes hands (the host tier copies blocks out on these)."""

    def on_cached(self, block: KVBlock) -> None:
        """``block`` now caches its ``block_hash`` (its content is computed and reusable)."""

    def on_candidate(self, block: KVBlock) -> None:
        """``block`` became an eviction candidate."""

    def on_evict(self, block: KVBlock) -> None:
        """``block`` is about to lose its cached content (called before it is reset)."""

    def on_uncache(self, block_id: int) -> None:
        """``block_id``'s content is no longer trustworthy."""


def _with_job(
    job_sets: dict[frozenset[str], frozenset[str]], jobs: frozenset[str], job_id: str
) -> frozenset[str]:
    """``jobs | {job_id}``, one object per distinct ``jobs`` of a call (``job_sets`` remembers them).

    NOTE: the eviction policy keys its groups by ``(jobs, job_id)``: a dict lookup of an equal
    set that is another object compares the sets element by element, and a shared prefix's set
    holds every job of a run (14 us a lookup at 150 jobs, against 0.3 us for the same object).
    The blocks one call extends now share their new set: 11% less host CPU a step in a
    simulated SWE run at 128 agents (BENCHMARKS.md, "The engine's host work per step at scale").
    """
    extended = job_sets.get(jobs)
    if extended is None:
        extended = job_sets[jobs] = jobs | {job_id}
    return extended


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


class BlockPool:
    """Owns every KV block; eviction goes through one :class:`EvictionPolicy`.

    Args:
        num_blocks: pool size.
        policy: chooses victims among candidates.
        clock: engine time source (virtual in the simulator).
        listeners: told about cached blocks, candidates and evictions (the host tier, a KV
            event publisher), in order; more can be appended to :attr:`listeners`.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        clock: Callable[[], float],
        listeners: Iterable[BlockListener] = (),
    ) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.policy = policy
        self.clock = clock
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.num_evictions = 0
        self.peak_in_use = 0
        #: blocks pinned and held by no request (:attr:`num_pinned_idle`), kept by the four
        #: places that change a count: Continuum's pin cap reads it on every pin
        self._pinned_idle = 0
        self.listeners: list[BlockListener] = list(listeners)

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: uncached free ones plus evictable candidates."""
        return len(self.free_uncached) + len(self.policy)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lookup(self, block_hash: int) -> int | None:
        """Returns the block caching ``block_hash``, or ``None``."""
        return self.cached.get(block_hash)

    def is_candidate(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.ref_cnt == 0 and block.pin_cnt == 0 and block.block_hash is not None

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, count: int, job_id: str | None = None) -> list[int]:
        """Takes ``count`` blocks: uncached free blocks first, then evicted candidates.

        Raises:
            OutOfBlocksError: fewer than ``count`` blocks are free or evictable.
        """
        if count > self.num_free_blocks:
            raise OutOfBlocksError(f"need {count} blocks, {self.num_free_blocks} free")
        now = self.clock()
        taken: list[int] = []
        while self.free_uncached and len(taken) < count:
            taken.append(self.free_uncached.popleft())
        if len(taken) < count:
            for block in self.policy.pop_victims(count - len(taken), now):
                assert block.ref_cnt == 0 and block.pin_cnt == 0, "policy returned a held block"
                self._drop_content(block)
                self.num_evictions += 1
                taken.append(block.block_id)
        job_sets: dict[frozenset[str], frozenset[str]] = {}
        for block_id in taken:
            block = self.blocks[block_id]
            block.ref_cnt = 1
            block.last_access = now
            block.job_id = job_id
            if job_id is not None and job_id not in block.jobs:
                block.jobs = _with_job(job_sets, block.jobs, job_id)
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return taken

    def touch(self, block_ids: Iterable[int], job_id: str | None = None) -> None:
        """Takes a reference on cache hits (removing them from the candidates)."""
        now = self.clock()
        job_sets: dict[frozenset[str], frozenset[str]] = {}
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0 and block.pin_cnt > 0:
                self._pinned_idle -= 1
            elif self.is_candidate(block_id):
                self.policy.remove(block)
            block.ref_cnt += 1
            block.last_access = now
            if job_id is not None:
                block.job_id = job_id
                if job_id not in block.jobs:
                    block.jobs = _with_job(job_sets, block.jobs, job_id)
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block, in the order given (the policy sees that order)."""
        now = self.clock()
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            block.last_access = now
            if block.ref_cnt == 0:
                if block.pin_cnt > 0:
                    self._pinned_idle += 1
                self._release(block, now)

    def _release(self, block: KVBlock, now: float) -> None:
        """Files an unreferenced block as a candidate, a pinned block, or uncached free."""
        if block.pin_cnt > 0:
            return
        if block.block_hash is None:
            block.reset()
            self.free_uncached.append(block.block_id)
        else:
            self.policy.add(block, now)
            for listener in self.listeners:
                listener.on_candidate(block)

    def _drop_content(self, block: KVBlock) -> None:
        """Forgets an evicted block's cached content (the listener sees it first)."""
        for listener in self.listeners:
            listener.on_evict(block)
        del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.reset()

    def cache_block(self, block_id: int, block_hash: int, position: int) -> bool:
        """Registers a full, computed block under its chained hash.

        Returns:
            False when another block already caches this hash (the new one stays uncached and
            is recycled when freed), True otherwise.
        """
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.position = position
        self.cached[block_hash] = block_id
        for listener in self.listeners:
            listener.on_cached(block)
        return True

    def uncache(self, block_id: int) -> None:
        """Forgets what a block caches (a failed step left its content partly written).

        It is no longer a cache hit. A block that a request or a pin holds goes back to the
        uncached free list once released; an idle one (an eviction candidate) goes there now.
        Listeners see ``on_uncache``, never ``on_evict``: the content is not copied anywhere.

        NOTE: held and pinned blocks alike: with async scheduling a request can stop (and its
        blocks be freed, or pinned for its job) while the step that was to write them is in
        flight, and that step may still fail (:func:`~asymcache_core.step_faults.drop_stopped`).
        """
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        idle = block.ref_cnt == 0 and block.pin_cnt == 0
        for listener in self.listeners:
            listener.on_uncache(block_id)
        if idle:
            self.policy.remove(block)
        del self.cached[block.block_hash]
        if idle:
            block.reset()
            self.free_uncached.append(block_id)
        else:
            block.block_hash = None

    # -- pins ------------------------------------------------------------------------------
    def pin(self, block_ids: Iterable[int]) -> None:
        """Protects blocks from eviction until :meth:`unpin` (counts nest)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pin_cnt == 0 and block.ref_cnt == 0:
                self._pinned_idle += 1
            if self.is_candidate(block_id):
                self.policy.remove(block)
            block.pin_cnt += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        now = self.clock()
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.pin_cnt <= 0:
                raise RuntimeError(f"unpin of unpinned block {block_id}")
            block.pin_cnt -= 1
            if block.pin_cnt == 0 and block.ref_cnt == 0:
                self._pinned_idle -= 1
                self._release(block, now)

    @property
    def num_pinned_idle(self) -> int:
        """Pinned blocks that no running request holds (what pins cost the pool)."""
        return self._pinned_idle

    def evict_all(self) -> int:
        """Evicts every candidate (tests and resets); returns how many."""
        victims = self.policy.pop_victims(len(self.policy), self.clock())
        for block in victims:
            self._drop_content(block)
            self.free_uncached.append(block.block_id)
            self.num_evictions += 1
        return len(victims)

    def evict_block(self, block_id: int) -> None:
        """Evicts one specific candidate (tests and tools that punch holes by hand)."""
        if not self.is_candidate(block_id):
            raise ValueError(f"block_id: block {block_id} is not an eviction candidate")
        block = self.blocks[block_id]
        self.policy.remove(block)
        self._drop_content(block)
        self.free_uncached.append(block_id)
        self.num_evictions += 1

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises ``AssertionError`` when a pool invariant is broken."""
        free_set = set(self.free_uncached)
        assert len(free_set) == len(self.free_uncached), "block twice in the free list"
        candidates = {b.block_id for b in self.policy.candidates()}
        assert len(candidates) == len(self.policy), "policy size disagrees with its candidates"
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_cnt >= 0 and block.pin_cnt >= 0, f"negative count on {bid}"
            in_free = bid in free_set
            in_cand = bid in candidates
            if block.ref_cnt > 0 or block.pin_cnt > 0:
                assert not in_free and not in_cand, f"held block {bid} is free or a candidate"
            elif block.block_hash is None:
                assert in_free and not in_cand, f"unheld uncached block {bid} not in free list"
            else:
                assert in_cand and not in_free, f"unheld cached block {bid} not a candidate"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == bid, f"hash map misses block {bid}"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        pinned_idle = sum(1 for b in self.blocks if b.pin_cnt > 0 and b.ref_cnt == 0)
        assert self._pinned_idle == pinned_idle, f"pinned idle count {self._pinned_idle}, blocks say {pinned_idle}"
