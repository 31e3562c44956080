"""AsymCache: evict the block whose loss costs least in expected future latency."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
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

    def _demand(self, block: KVBlock, cache: dict[str | None, float | None]) -> float | None:
        """Earliest arrival among the block's sessions with a request waiting for it, or None."""
        sids = block.sessions or (block.session_id,)
        demand: float | None = None
        for sid in sids:
            if sid not in cache:
                cache[sid] = self.sessions.demand_since(sid)
            since = cache[sid]
            if since is not None and (demand is None or since < demand):
                demand = since
        return demand

    def eviction_key(self, block: KVBlock, now: float, cache: dict[str | None, float | None] | None = None) -> tuple:
        """Sort key of ``block`` (smallest goes first); ``cache`` memoises per-session state."""
        demand = self._demand(block, {} if cache is None else cache)
        if demand is None:
            return (0, 0.0, self.score(block, now), block.last_access, -block.position)
        return (1, -demand, self.score(block, now), block.last_access, -block.position)

    def pop_victims(self, count: int, now: float) -> list[KVBlock]:
        # NOTE: this runs on every allocation that must evict, over every candidate, on the
        # engine's critical path (2-3 ms a prefill step on the H200's host before memoising).
        # A block's key only depends on its sessions' state and its own position, so the
        # per-session terms are computed once per call: same order as ``eviction_key``.
        sessions = self.sessions
        bs = self.ctx.block_size
        lat = self.latency
        per_session: dict[object, tuple[int, float, float, float]] = {}

        def key(block: KVBlock) -> tuple:
            # the shared-prefix probability depends on all its sessions, the turn size on the last
            group: object = (frozenset(block.sessions), block.session_id) if block.sessions else block.session_id
            terms = per_session.get(group)
            if terms is None:
                demand = self._demand(block, {})
                p_reuse = sessions.block_reuse_probability(block.sessions, block.session_id, now)
                base = sessions.expected_next_tokens(block.session_id)
                # p * block_rebuild_latency(position) = fixed + slope * position (see the model)
                over = max(0, base + bs - lat.knee_tokens) - max(0, base - lat.knee_tokens)
                fixed = p_reuse * (lat.per_token_s * over + lat.per_attn_s * bs * (bs + 1) / 2)
                slope = p_reuse * lat.per_attn_s * bs * bs
                tier, since = (0, 0.0) if demand is None else (1, -demand)
                terms = per_session[group] = (tier, since, fixed, slope)
            tier, since, fixed, slope = terms
            return (tier, since, fixed + slope * block.position, block.last_access, -block.position)

        victims = heapq.nsmallest(count, self._blocks.values(), key=key)
        for block in victims:
            del self._blocks[block.block_id]
        return victims

    def candidates(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))

    def __len__(self) -> int:
        return len(self._blocks)
