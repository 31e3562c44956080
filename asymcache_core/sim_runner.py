"""Simulated model runner: the latency model on a virtual clock instead of a forward pass.

The scheduler, cache manager, eviction policies and pins are the real ones; only the forward
pass is replaced. Thousands of jobs run in seconds; the harness measures the error of this
simulation against a real run of the same small workload. :meth:`Engine.simulated
<asymcache_core.engine.Engine.simulated>` builds an engine on these two.
"""

from __future__ import annotations

from dataclasses import dataclass

from asymcache_core.latency_model import LatencyModel
from asymcache_core.scheduler import SchedulerOutput


@dataclass
class VirtualClock:
    """A clock that only moves when told to."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds: cannot go back in time ({seconds})")
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class SimulatedRunner:
    """Advances the clock by the predicted step latency and returns synthetic tokens.

    Tokens are a deterministic function of the request's context length, so every policy sees
    the same token stream (the harness runs with ``ignore_eos``; losslessness is checked on the
    real backend).

    Args:
        latency: the latency model.
        clock: the engine's virtual clock.
        vocab_size: token ids are drawn below it.
    """

    def __init__(self, latency: LatencyModel, clock: VirtualClock, vocab_size: int) -> None:
        self.latency = latency
        self.clock = clock
        self.vocab_size = vocab_size

    def step_cost(self, plan: SchedulerOutput) -> float:
        return self.latency.step_latency(
            plan.num_tokens, plan.attn_pairs, plan.is_decode_only, plan.decode_kv_tokens
        )

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self.clock.advance(self.step_cost(plan))
        span = max(1, self.vocab_size - 200)
        return {
            item.request.request_id: 100 + (item.request.num_tokens * 7919) % span
            for item in plan.scheduled
            if item.sample
        }
