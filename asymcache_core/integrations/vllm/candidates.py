"""The eviction candidates of the vLLM plugin's free queue, filed by score group, and the groups
ordered by a lower bound of their scores.

A group's blocks share every term of their score but their position
(:meth:`~asymcache_core.integrations.vllm.scoring.BlockScorer.group_of`). Each group keeps its
candidates in two heaps (by position and by recency) with lazy deletion, and one *bound*: a key
``(score, tick)`` no candidate of the group goes below at any time up to the bound's ``until``
(:meth:`~asymcache_core.integrations.vllm.scoring.BlockScorer.group_bound` says why it holds).
The groups sit in a heap by bound, so an eviction walk reads groups in bound order and prices
only those whose bound is not above the next victim: O(log groups) a victim while bounds are
tight, instead of pricing every group.

A bound is re-priced (lazily, at the next walk) when it may no longer hold or has become loose:
its group gained a block or lost one, a job of the group changed (arrival, finish, hint, drop:
:attr:`~asymcache_core.job_stats.JobStats.watcher`), the gaps of all jobs changed and the group
reads them, or time passed its ``until``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple


class Bound(NamedTuple):
    """A group's bound, what :class:`CandidateIndex` files.

    Attributes:
        score: no candidate of the group scores below it at any time up to ``until``.
        tick: with ``exact``, the filing tick of the candidate scoring ``score`` (ties between
            groups go by recency, so an exact bound orders tied groups too); ``-inf`` otherwise.
        until: the last time the bound holds (``inf``: until an event re-prices it).
        exact: the group's first candidate scores exactly ``score`` until ``until``.
        reads_global: a job of the group reads the gaps of all jobs (no gaps of its own).
    """

    score: float
    tick: float
    until: float
    exact: bool
    reads_global: bool


@dataclass
class GroupRows:
    """One score group's candidates, in two heaps with lazy deletion (a row is live while the
    block's filing stamp matches). Rows end with ``(block_id, stamp)``.

    Attributes:
        by_position: ``(position, tick, block_id, stamp)`` rows.
        by_tick: ``(tick, block_id, stamp)`` rows.
        live: live candidates.
        bound: the group's current bound (``None`` until first priced).
        bound_stamp: the stamp of its current rows in the bound and expiry heaps.
        priced: ``(time, terms)`` of its latest pricing (a walk at that time reuses the terms).
    """

    by_position: list[tuple[int, int, int, int]] = field(default_factory=list)
    by_tick: list[tuple[int, int, int]] = field(default_factory=list)
    live: int = 0
    bound: Bound | None = None
    bound_stamp: int = -1
    priced: tuple[float, object] | None = None


#: Prices a group at ``now`` given the index's eviction level: ``price(group, rows, now, level)``.
Pricer = Callable[[Hashable, GroupRows, float, float], Bound]


class CandidateIndex:
    """The candidates of a free queue by group, and the groups by bound.

    Args:
        jobs_of: the job ids a group's score reads (its pricing changes when one of them does).
    """

    def __init__(self, jobs_of: Callable[[Hashable], Iterable[str]]) -> None:
        self.jobs_of = jobs_of
        #: block -> (group, filing stamp) of every candidate.
        self.cand: dict[int, tuple[Hashable, int]] = {}
        self.groups: dict[Hashable, GroupRows] = {}
        #: Groups to re-price at the next walk.
        self.dirty: set[Hashable] = set()
        #: Score of the latest victim a walk handed out (pricing picks bound horizons with it;
        #: ``-inf`` before the first).
        self.level = -math.inf
        self._stamp = itertools.count()
        self._bounds: list[tuple[float, float, int, Hashable]] = []
        self._expiry: list[tuple[float, int, Hashable]] = []
        self._job_groups: dict[str, set[Hashable]] = {}
        self._global_groups: set[Hashable] = set()
        # NOTE: bumped whenever the bound heap changes; a reader refuses to go on after one.
        self._revision = 0

    # ---- candidates ---------------------------------------------------------------------------

    def file(self, block_id: int, group: Hashable, position: int, tick: int) -> None:
        """Files ``block_id`` (not filed) as a candidate of ``group``."""
        stamp = next(self._stamp)
        self.cand[block_id] = (group, stamp)
        rows = self.groups.get(group)
        if rows is None:
            rows = self.groups[group] = GroupRows()
            for job in self.jobs_of(group):
                self._job_groups.setdefault(job, set()).add(group)
        heapq.heappush(rows.by_position, (position, tick, block_id, stamp))
        heapq.heappush(rows.by_tick, (tick, block_id, stamp))
        rows.live += 1
        self.dirty.add(group)  # NOTE: its first candidate may be this one: the bound may not hold

    def unfile(self, block_id: int) -> None:
        """Takes a filed candidate out."""
        group, _ = self.cand.pop(block_id)
        rows = self.groups[group]
        rows.live -= 1
        if rows.live == 0:
            del self.groups[group]
            self.dirty.discard(group)
            self._global_groups.discard(group)
            for job in self.jobs_of(group):
                held = self._job_groups.get(job)
                if held is not None:
                    held.discard(group)
                    if not held:
                        del self._job_groups[job]
            return
        # NOTE: the bound still holds (a minimum over fewer blocks is not lower) but may be loose.
        self.dirty.add(group)
        # NOTE: victims leave from the heads: drop those rows now, so walks start on live ones.
        for heap in (rows.by_position, rows.by_tick):
            while heap and not self.live_row(heap[0]):
                heapq.heappop(heap)
        if len(rows.by_position) > 4 * rows.live + 64:
            # NOTE: rows of blocks that left elsewhere stay until they surface; bound them.
            rows.by_position = [r for r in rows.by_position if self.live_row(r)]
            rows.by_tick = [r for r in rows.by_tick if self.live_row(r)]
            heapq.heapify(rows.by_position)
            heapq.heapify(rows.by_tick)

    def live_row(self, row: tuple[int, ...]) -> bool:
        """Whether a group heap's row is its block's current filing."""
        filed = self.cand.get(row[-2])
        return filed is not None and filed[1] == row[-1]

    def clear(self) -> None:
        """Forgets every candidate and group."""
        self.cand.clear()
        self.groups.clear()
        self.dirty.clear()
        self._bounds.clear()
        self._expiry.clear()
        self._job_groups.clear()
        self._global_groups.clear()
        self._revision += 1

    # ---- bounds -------------------------------------------------------------------------------

    def note_job(self, job_id: str | None) -> None:
        """A job's statistics changed (``None``: the gaps of all jobs): its groups re-price."""
        if job_id is None:
            self.dirty |= self._global_groups
            return
        self.dirty |= self._job_groups.get(job_id, set())

    def refresh(self, now: float, price: Pricer) -> None:
        """Re-prices the dirty groups and those whose bound ended before ``now``."""
        for group in self.dirty:
            rows = self.groups.get(group)
            if rows is not None:
                self._file_bound(group, rows, price(group, rows, now, self.level))
        self.dirty.clear()
        expiry = self._expiry
        while expiry and expiry[0][0] < now:
            _, stamp, group = heapq.heappop(expiry)
            rows = self.groups.get(group)
            if rows is not None and rows.bound_stamp == stamp:
                self._file_bound(group, rows, price(group, rows, now, self.level))
        if len(self._bounds) > 2 * len(self.groups) + 64:
            # NOTE: rows of re-priced or gone groups stay until they surface; bound them.
            self._bounds = [r for r in self._bounds if self._live_bound(r[2], r[3])]
            heapq.heapify(self._bounds)
            self._expiry = [r for r in self._expiry if self._live_bound(r[1], r[2])]
            heapq.heapify(self._expiry)
            self._revision += 1

    def _file_bound(self, group: Hashable, rows: GroupRows, bound: Bound) -> None:
        self._revision += 1
        stamp = next(self._stamp)
        rows.bound = bound
        rows.bound_stamp = stamp
        heapq.heappush(self._bounds, (bound.score, bound.tick, stamp, group))
        if bound.until < math.inf:
            heapq.heappush(self._expiry, (bound.until, stamp, group))
        if bound.reads_global:
            self._global_groups.add(group)
        else:
            self._global_groups.discard(group)

    def _live_bound(self, stamp: int, group: Hashable) -> bool:
        rows = self.groups.get(group)
        return rows is not None and rows.bound_stamp == stamp

    def by_bound(self) -> Iterator[tuple[float, float, Hashable, GroupRows]]:
        """Every priced group as ``(score, tick, group, rows)``, lowest bound first, lazily and
        without changing anything (call :meth:`refresh` first: every group is priced then).

        Raises:
            RuntimeError: the bounds changed meanwhile (another walk re-priced groups).
        """
        heap = self._bounds
        revision = self._revision
        # NOTE: a heap read in order without popping: a second heap of (row, index) grows from
        # the root by children.
        front = [(heap[0], 0)] if heap else []
        while front:
            if self._revision != revision:
                raise RuntimeError("the free queue's bounds changed during a walk of its order")
            row, i = heapq.heappop(front)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(front, (heap[child], child))
            score, tick, stamp, group = row
            rows = self.groups.get(group)
            if rows is not None and rows.bound_stamp == stamp:
                yield score, tick, group, rows
