"""Per-step token budgets: fixed, or adaptive from the latency model (AsymCache's chunking)."""

from __future__ import annotations

from dataclasses import dataclass

from asymcache_core.latency_model import LatencyModel
from asymcache_core.request import Request


@dataclass
class FixedBudget:
    """The same budget every step (vLLM's ``max_num_batched_tokens``)."""

    tokens: int

    def __call__(self, running: list[Request], waiting: list[Request]) -> int:
        return self.tokens


@dataclass
class AdaptiveBudget:
    """Chooses each step's budget from the latency model.

    Decodes always run (one token each, stall-free). Prefill and hole tokens are added up to
    the count at which the predicted step latency still meets ``tpot_slo_s`` when decodes are
    running; when nothing decodes, the step takes at least the utilization knee (and up to
    ``max_tokens``) since no token is waiting on its latency. The prefill share is a multiple of
    ``block_size`` so chunks end on block boundaries.

    Attributes:
        latency: the latency model.
        tpot_slo_s: time-per-output-token target.
        block_size: chunk alignment.
        max_tokens: hard cap (``max_num_batched_tokens``).
        history: budgets chosen, one per call (per-step metrics).
    """

    latency: LatencyModel
    tpot_slo_s: float
    block_size: int
    max_tokens: int

    def __post_init__(self) -> None:
        self.history: list[int] = []

    def __call__(self, running: list[Request], waiting: list[Request]) -> int:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1] + waiting
        bs = self.block_size
        if decodes:
            ctx = sum(r.num_tokens for r in decodes)
            mean_prefill_ctx = (
                sum(r.num_computed_tokens for r in prefilling) / len(prefilling) if prefilling else 0.0
            )
            decode_cost = self.latency.step_latency(len(decodes), ctx, decode_only=True)
            room = self.tpot_slo_s - decode_cost
            extra = 0
            if room > 0:
                total = self.latency.max_tokens_within(self.tpot_slo_s - self.latency.per_attn_s * ctx, mean_prefill_ctx)
                extra = max(0, total - len(decodes))
            extra = max(bs, extra)  # NOTE: always some progress for prefills: no starvation.
            budget = len(decodes) + (extra // bs) * bs
        else:
            knee = max(bs, (self.latency.knee_tokens // bs) * bs)
            budget = max(knee, (self.max_tokens // bs) * bs)
        budget = max(1, min(budget, self.max_tokens + len(decodes)))
        self.history.append(budget)
        return budget
