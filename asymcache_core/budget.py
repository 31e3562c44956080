"""Per-step token budgets: fixed, or adaptive from the latency model (AsymCache's chunking)."""

from __future__ import annotations

from collections.abc import Callable
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
    the count at which the predicted step still meets the TPOT target of every decoding
    request; when nothing decodes, the step takes at least the utilization knee (and up to
    ``max_tokens``) since no token is waiting on its latency. The prefill share is a multiple of
    ``block_size`` so chunks end on block boundaries.

    A request's TPOT is its mean time per output token since its first (as the metrics report
    it), so a request whose tokens came faster than the target has slack: the step may last
    ``tpot_slo_s * n - (now - first_token_time)`` for a request with ``n`` tokens and still
    leave it on target. The step's latency target is the smallest slack of the decoding
    requests, and never below ``tpot_slo_s`` (a fresh request's slack). Without a clock,
    every step targets ``tpot_slo_s``.

    Attributes:
        latency: the latency model.
        tpot_slo_s: time-per-output-token target.
        block_size: chunk alignment.
        max_tokens: hard cap (``max_num_batched_tokens``).
        clock: the engine's clock (slack accounting); ``None``: a per-step target.
        history: budgets chosen, one per call (per-step metrics).
    """

    latency: LatencyModel
    tpot_slo_s: float
    block_size: int
    max_tokens: int
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        self.history: list[int] = []

    def step_target(self, decodes: list[Request]) -> float:
        """Longest step (seconds) after which every request in ``decodes`` is still on target."""
        if self.clock is None:
            return self.tpot_slo_s
        now = self.clock()
        slack = min(
            (
                self.tpot_slo_s * len(r.output_token_ids) - (now - r.metrics.first_token_time)
                for r in decodes
                if r.metrics.first_token_time is not None and r.output_token_ids
            ),
            default=self.tpot_slo_s,
        )
        # NOTE: a request behind its target still gets one target-sized step: decode-only steps
        # are what catches it up, and the minimum prefill share below keeps prefills moving.
        return max(self.tpot_slo_s, slack)

    def __call__(self, running: list[Request], waiting: list[Request]) -> int:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1] + waiting
        bs = self.block_size
        if decodes:
            target = self.step_target(decodes)
            ctx = sum(r.num_tokens for r in decodes)
            mean_prefill_ctx = (
                sum(r.num_computed_tokens for r in prefilling) / len(prefilling) if prefilling else 0.0
            )
            decode_cost = self.latency.step_latency(len(decodes), ctx, decode_only=True)
            room = target - decode_cost
            extra = 0
            if room > 0:
                total = self.latency.max_tokens_within(target - self.latency.per_attn_s * ctx, mean_prefill_ctx)
                extra = max(0, total - len(decodes))
            extra = max(bs, extra)  # NOTE: always some progress for prefills: no starvation.
            budget = len(decodes) + (extra // bs) * bs
        else:
            knee = max(bs, (self.latency.knee_tokens // bs) * bs)
            budget = max(knee, (self.max_tokens // bs) * bs)
        budget = max(1, min(budget, self.max_tokens + len(decodes)))
        self.history.append(budget)
        return budget
