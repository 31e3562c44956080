"""AsymCache: evict the block whose loss costs least in expected future latency."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asymcache_core.eviction.base import EvictionPolicy, PolicyContext
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

if TYPE_CHECKING:
    from asymcache_core.block_pool import KVBlock


def expected_latency_cost(
    p_reuse: float, position: int, block_size: int, base_tokens: int, latency: LatencyModel
) -> float:
    """AsymCache's eviction score of one block, shared with the vLLM integration.

    Args:
        p_reuse: probability that the block is needed again.
        position: logical block index in its sequence.
        block_size: tokens per block.
        base_tokens: tokens the step that would rebuild it already carries (the job's next
            new tokens): under the latency model's knee extra tokens ride almost free.
        latency: the step-latency model.

    Returns:
        Expected latency (seconds) that evicting the block adds to the future.
    """
    if p_reuse <= 0.0:
        return 0.0
    return p_reuse * latency.block_rebuild_latency(position, block_size, base_tokens)


class AsymCachePolicy(EvictionPolicy):
    """``cost(block) = P(reuse) x marginal rebuild latency``; lowest cost goes first.

    - P(reuse) comes from :class:`~asymcache_core.job_stats.JobStats`: the job's
      own inter-turn gaps learned online, the runtime's tool-pause hint, finished jobs (0), and
      shared-prefix blocks (any of their jobs coming back).
    - The rebuild latency is position-aware (the block's tokens attend over everything before
      it) and marginal: the block is rebuilt in the same step as the job's next new tokens,
      so tokens that fit under the latency model's knee only pay their attention.
    - Ties (e.g. equal zero cost) go to the least recently used.
    - Blocks *in demand* come last: their job has a request in flight that does not hold
      them, i.e. one waiting for admission (or preempted). Their reuse is certain and comes
      before any idle job's, so evicting one only trades it for another miss moments later
      (and a preempted request would recompute what it had just prefilled). When nothing else
      is left, the request that arrived last (admitted last under FCFS) loses its blocks first,
      cheapest rebuild first: the misses fall on one request instead of on every waiting one.

    Scores change as time passes (jobs idle past their usual gap lose probability), so they
    are computed when victims are chosen. A block's key only depends on its jobs' state and
    its own position and last access, so candidates are kept in groups that share their jobs:
    each group's terms are computed once per call, and within a group the order is fixed (by
    position when the rebuild cost grows with it, else by recency), so a call merges the groups'
    heads instead of scoring every candidate (O(groups + victims x log groups), not
    O(candidates): vLLM-sized pools hold tens of thousands of candidates).
    """

    name = "asymcache"
    hole_reuse = True
    job_admission = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.job_stats: JobStats = ctx.job_stats if ctx.job_stats is not None else JobStats()
        self.latency: LatencyModel = ctx.latency_model or LatencyModel(1e-3, 1e-5, 1e-9, 64)
        # NOTE: a candidate's tick, block and group sit in three dicts, not in one tuple per
        # candidate: a whole context is released (and becomes candidates) at every turn's end,
        # and a tuple holding the block lives on, so every one counted towards the garbage
        # collector's full passes over the heap.
        self._live: dict[int, int] = {}  # block id -> tick of its live heap rows
        self._blocks: dict[int, KVBlock] = {}
        self._group_of: dict[int, _Group] = {}
        self._groups: dict[_GroupKey, _Group] = {}
        self._tick = itertools.count()

    def add(self, block: KVBlock, now: float) -> None:
        tick = next(self._tick)
        block_id = block.block_id
        key = _group_key(block)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key)
        self._live[block_id] = tick
        self._blocks[block_id] = block
        self._group_of[block_id] = group
        heapq.heappush(group.by_position, (block.position, block.last_access, tick, block_id))
        heapq.heappush(group.by_recency, (block.last_access, -block.position, tick, block_id))
        group.live += 1

    def _forget(self, block_id: int) -> _Group:
        """Drops a candidate from the live maps; returns its group (the caller counts it out)."""
        del self._live[block_id]
        del self._blocks[block_id]
        return self._group_of.pop(block_id)

    def remove(self, block: KVBlock) -> None:
        group = self._forget(block.block_id)
        group.live -= 1
        if group.live == 0:
            del self._groups[group.key]
        elif len(group.by_position) > 4 * group.live + 64:
            # NOTE: removed blocks stay in the heaps until they surface; bound the garbage.
            group.by_position = [e for e in group.by_position if self._is_live(e)]
            group.by_recency = [e for e in group.by_recency if self._is_live(e)]
            heapq.heapify(group.by_position)
            heapq.heapify(group.by_recency)

    def _is_live(self, entry: tuple) -> bool:
        return self._live.get(entry[-1]) == entry[-2]

    def worth_keeping(self, block: KVBlock, now: float) -> bool:
        """Blocks no job can come back for (every job that used it is done) are not kept."""
        return self.job_stats.block_reuse_probability(block.jobs, block.job_id, now) > 0.0

    def score(self, block: KVBlock, now: float) -> float:
        """Expected latency lost by evicting ``block`` now (seconds)."""
        p_reuse = self.job_stats.block_reuse_probability(block.jobs, block.job_id, now)
        base = self.job_stats.expected_next_tokens(block.job_id)
        return expected_latency_cost(p_reuse, block.position, self.ctx.block_size, base, self.latency)

    def _terms(self, key: _GroupKey, now: float) -> tuple[int, float, float, float]:
        """A group's key terms at ``now``: ``(in demand, -arrival if in demand, cost at position
        0, cost per position)``; the cost is P(reuse) x the model's rebuild line."""
        jobs, job_id = key
        arrivals = (self.job_stats.demand_since(jid) for jid in (jobs or (job_id,)))
        demand = min((t for t in arrivals if t is not None), default=None)
        p_reuse = self.job_stats.block_reuse_probability(jobs, job_id, now)
        base = self.job_stats.expected_next_tokens(job_id)
        fixed, slope = self.latency.block_rebuild_line(self.ctx.block_size, base)
        tier, since = (0, 0.0) if demand is None else (1, -demand)
        return tier, since, p_reuse * fixed, p_reuse * slope

    def key_function(self, now: float) -> Callable[[KVBlock], tuple]:
        """The eviction order at ``now`` as a sort key per block, smallest goes first:
        ``(in demand, -arrival if in demand, expected cost, last access, -position)``.
        ``pop_victims`` yields this order (ties by when blocks became candidates)."""
        terms: dict[_GroupKey, tuple[int, float, float, float]] = {}

        def key(block: KVBlock) -> tuple:
            group = _group_key(block)
            if group not in terms:
                terms[group] = self._terms(group, now)
            return _full_key(terms[group], block)

        return key

    def pop_victims(self, count: int, now: float) -> list[KVBlock]:
        # NOTE: runs on every allocation that must evict, on the engine's critical path.
        frontier: list[tuple[tuple, int, _GroupKey]] = []
        ordered: dict[_GroupKey, tuple[list[tuple], tuple[int, float, float, float]]] = {}
        for key, group in self._groups.items():
            terms = self._terms(key, now)
            # NOTE: with a cost that grows with position, a group's order is by position (then
            # recency); with a flat cost (P(reuse) = 0, or no attention term) it is by recency.
            heap = group.by_position if terms[3] > 0 else group.by_recency
            ordered[key] = (heap, terms)
            self._push_head(frontier, key, heap, terms)
        victims: list[KVBlock] = []
        while len(victims) < count and frontier:
            _, _, key = heapq.heappop(frontier)
            heap, terms = ordered[key]
            entry = heapq.heappop(heap)
            victims.append(self._blocks[entry[-1]])
            group = self._forget(entry[-1])
            group.live -= 1
            if group.live == 0:
                del self._groups[key]
                continue
            self._push_head(frontier, key, heap, terms)
        return victims

    def _push_head(
        self, frontier: list, key: _GroupKey, heap: list[tuple], terms: tuple[int, float, float, float]
    ) -> None:
        """Pushes the group's next live candidate (dropping stale heap rows) onto ``frontier``."""
        # NOTE: :meth:`_is_live` inlined: this loop runs for every victim of every eviction
        live = self._live
        while heap:
            _, _, tick, block_id = heap[0]
            if live.get(block_id) == tick:
                heapq.heappush(frontier, (_full_key(terms, self._blocks[block_id]), tick, key))
                return
            heapq.heappop(heap)

    def candidates(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))

    def __len__(self) -> int:
        return len(self._live)


_GroupKey = tuple[frozenset[str], "str | None"]


def _full_key(terms: tuple[int, float, float, float], block: KVBlock) -> tuple:
    """A block's eviction key from its group's terms (see ``AsymCachePolicy.key_function``)."""
    tier, since, fixed, slope = terms
    return (tier, since, fixed + slope * block.position, block.last_access, -block.position)


def _group_key(block: KVBlock) -> _GroupKey:
    """Candidates with the same jobs (and last job) share every per-job term."""
    return (block.jobs, block.job_id)


@dataclass
class _Group:
    """One group's candidates in its two possible orders (heaps with lazy deletion: rows of
    removed blocks are skipped when they surface). Rows end with ``(tick, block_id)``."""

    key: _GroupKey
    by_position: list[tuple[int, float, int, int]] = field(default_factory=list)
    by_recency: list[tuple[float, int, int, int]] = field(default_factory=list)
    live: int = 0
