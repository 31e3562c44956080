"""AsymCache: evict the block whose loss costs least in expected future latency."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from asymcache_core.eviction.base import EvictionPolicy, PolicyContext
from asymcache_core.latency_model import LatencyModel
from asymcache_core.session_stats import SessionStats

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
        base_tokens: tokens the step that would rebuild it already carries (the session's next
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

    - P(reuse) comes from :class:`~asymcache_core.session_stats.SessionStats`: the session's
      own inter-turn gaps learned online, the runtime's tool-pause hint, finished jobs (0), and
      shared-prefix blocks (any of their sessions coming back).
    - The rebuild latency is position-aware (the block's tokens attend over everything before
      it) and marginal: the block is rebuilt in the same step as the session's next new tokens,
      so tokens that fit under the latency model's knee only pay their attention.
    - Ties (e.g. equal zero cost) go to the least recently used.
    - Blocks *in demand* come last: their session has a request in flight that does not hold
      them, i.e. one waiting for admission (or preempted). Their reuse is certain and comes
      before any idle session's, so evicting one only trades it for another miss moments later
      (and a preempted request would recompute what it had just prefilled). When nothing else
      is left, the request that arrived last (admitted last under FCFS) loses its blocks first,
      cheapest rebuild first: the misses fall on one request instead of on every waiting one.

    Scores change as time passes (sessions idle past their usual gap lose probability), so they
    are computed when victims are chosen, once per allocation, over all candidates (each
    session's state once per call).
    """

    name = "asymcache"
    hole_reuse = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._blocks: dict[int, KVBlock] = {}
        self.sessions: SessionStats = ctx.sessions if ctx.sessions is not None else SessionStats()
        self.latency: LatencyModel = ctx.latency_model or LatencyModel(1e-3, 1e-5, 1e-9, 64)

    def add(self, block: KVBlock, now: float) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._blocks[block.block_id]

    def score(self, block: KVBlock, now: float) -> float:
        """Expected latency lost by evicting ``block`` now (seconds)."""
        p_reuse = self.sessions.block_reuse_probability(block.sessions, block.session_id, now)
        base = self.sessions.expected_next_tokens(block.session_id)
        return expected_latency_cost(p_reuse, block.position, self.ctx.block_size, base, self.latency)

    def _demand(self, block: KVBlock) -> float | None:
        """Earliest arrival among the block's sessions with a request waiting for it, or None."""
        arrivals = (self.sessions.demand_since(sid) for sid in (block.sessions or (block.session_id,)))
        return min((t for t in arrivals if t is not None), default=None)

    def key_function(self, now: float) -> Callable[[KVBlock], tuple]:
        """The eviction order at ``now``: a sort key per block, smallest goes first.

        ``(in demand, -arrival if in demand, expected cost, last access, -position)``. A
        block's key only depends on its sessions' state and its own position, so the
        per-session terms (demand, P(reuse), the rebuild cost as a line in the position) are
        computed once per session, not per block.
        """
        bs = self.ctx.block_size
        per_session: dict[object, tuple[int, float, float, float]] = {}

        def key(block: KVBlock) -> tuple:
            # the shared-prefix probability depends on all its sessions, the turn size on the last
            group: object = (frozenset(block.sessions), block.session_id) if block.sessions else block.session_id
            terms = per_session.get(group)
            if terms is None:
                demand = self._demand(block)
                p_reuse = self.sessions.block_reuse_probability(block.sessions, block.session_id, now)
                base = self.sessions.expected_next_tokens(block.session_id)
                fixed, slope = self.latency.block_rebuild_line(bs, base)
                tier, since = (0, 0.0) if demand is None else (1, -demand)
                terms = per_session[group] = (tier, since, p_reuse * fixed, p_reuse * slope)
            tier, since, fixed, slope = terms
            return (tier, since, fixed + slope * block.position, block.last_access, -block.position)

        return key

    def pop_victims(self, count: int, now: float) -> list[KVBlock]:
        # NOTE: runs on every allocation that must evict, over every candidate, on the engine's
        # critical path: hence the per-session terms of key_function.
        victims = heapq.nsmallest(count, self._blocks.values(), key=self.key_function(now))
        for block in victims:
            del self._blocks[block.block_id]
        return victims

    def candidates(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))

    def __len__(self) -> int:
        return len(self._blocks)
