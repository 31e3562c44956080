"""Per-step token budgets: fixed, or adaptive from the latency model (AsymCache's chunking)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from asymcache_core.latency_model import LatencyFeedback, LatencyModel
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
    the count at which the predicted step still meets the step's latency target when decodes
    are running; when nothing decodes, the step takes at least the utilization knee (and up to
    ``max_tokens``) since no token is waiting on its latency. The prefill share is a multiple of
    ``block_size`` so chunks end on block boundaries. Predictions include the measured
    ``feedback`` residuals when given.

    The step's latency target is ``tpot_slo_s`` (every step meets the TPOT target). With
    ``slack``, it may be longer for requests whose tokens came faster than the target: a
    request's TPOT is its mean time per output token since its first (as the metrics report
    it), so after ``n`` tokens in ``t`` seconds it can take a step of ``tpot_slo_s * n - t`` and
    still be on target. The target is then ``tpot_slo_s`` plus half of the smallest such excess
    among the decoding requests (half: one mispredicted step must not push a request over).

    Attributes:
        latency: the latency model.
        tpot_slo_s: time-per-output-token target.
        block_size: chunk alignment.
        max_tokens: hard cap (``max_num_batched_tokens``).
        feedback: measured residuals of the model (``None``: the model as is).
        clock: the engine's clock; required with ``slack``.
        slack: per-request TPOT slack (see above) instead of a per-step target.
        history: budgets chosen, one per call (per-step metrics).
    """

    latency: LatencyModel
    tpot_slo_s: float
    block_size: int
    max_tokens: int
    feedback: LatencyFeedback | None = None
    clock: Callable[[], float] | None = None
    slack: bool = False

    def __post_init__(self) -> None:
        if self.slack and self.clock is None:
            raise ValueError("clock: the slack target needs the engine's clock")
        self.history: list[int] = []

    def step_target(self, decodes: list[Request]) -> float:
        """Longest step (seconds) the decoding requests ``decodes`` can take now."""
        if not self.slack or self.clock is None:
            return self.tpot_slo_s
        now = self.clock()
        excess = min(
            (
                self.tpot_slo_s * len(r.output_token_ids) - (now - r.metrics.first_token_time) - self.tpot_slo_s
                for r in decodes
                if r.metrics.first_token_time is not None and r.output_token_ids
            ),
            default=0.0,
        )
        # NOTE: a request behind its target still gets a target-sized step: decode-only steps
        # catch it up, and the minimum prefill share below keeps prefills moving.
        return self.tpot_slo_s + 0.5 * max(0.0, excess)

    def __call__(self, running: list[Request], waiting: list[Request]) -> int:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1] + waiting
        bs = self.block_size
        if decodes:
            target = self.step_target(decodes)
            decode_fix = self.feedback.residual(True) if self.feedback else 0.0
            mixed_fix = self.feedback.residual(False) if self.feedback else 0.0
            ctx = sum(r.num_tokens for r in decodes)
            mean_prefill_ctx = (
                sum(r.num_computed_tokens for r in prefilling) / len(prefilling) if prefilling else 0.0
            )
            decode_cost = self.latency.step_latency(len(decodes), ctx, True, ctx) + decode_fix
            extra = 0
            if target - decode_cost > 0:
                within = target - mixed_fix - (self.latency.per_attn_s + self.latency.per_decode_kv_s) * ctx
                total = self.latency.max_tokens_within(within, mean_prefill_ctx)
                extra = max(0, total - len(decodes))
            extra = max(bs, extra)  # NOTE: always some progress for prefills: no starvation.
            budget = len(decodes) + (extra // bs) * bs
        else:
            knee = max(bs, (self.latency.knee_tokens // bs) * bs)
            budget = max(knee, (self.max_tokens // bs) * bs)
        budget = max(1, min(budget, self.max_tokens + len(decodes)))
        self.history.append(budget)
        return budget
