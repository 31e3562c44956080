"""Simulated model runner: the latency model on a virtual clock instead of a forward pass.

The scheduler, cache manager, eviction policies and pins are the real ones; only the forward
pass is replaced. Thousands of jobs run in seconds; the harness measures the error of this
simulation against a real run of the same small workload. :meth:`Engine.simulated
<asymcache_core.engine.Engine.simulated>` builds an engine on these two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asymcache_core.host_tier import HostTier, KVTransfers
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


@dataclass
class _CopyEngines:
    """The simulated copy streams, one per direction: each runs its copies one after another,
    beside the compute.

    Attributes:
        offload_busy_until: when the last issued offload lands.
        reload_busy_until: when the last issued reload lands.
        offloads_done: ticket -> when its offloads land.
        reloads_done: ticket -> when its reloads land.
        stall_s: time the compute waited for copies in all.
    """

    offload_busy_until: float = 0.0
    reload_busy_until: float = 0.0
    offloads_done: dict[int, float] = field(default_factory=dict)
    reloads_done: dict[int, float] = field(default_factory=dict)
    stall_s: float = 0.0


class SimulatedRunner:
    """Advances the clock by the predicted step latency and returns synthetic tokens.

    Tokens are a deterministic function of the request's context length, so every policy sees
    the same token stream (the harness runs with ``ignore_eos``; losslessness is checked on the
    real backend). Host-tier copies run on a simulated copy stream at the tier's bandwidth, in
    the order the real runner issues them (:mod:`asymcache_core.kv_transfer`): a forward waits
    only for the offloads its plan names, a reloading request for its own ticket. While copies
    are in flight a step runs ``latency.copy_slowdown`` times slower (:meth:`contended`).

    Args:
        latency: the latency model.
        clock: the engine's virtual clock.
        vocab_size: token ids are drawn below it.
        tier: the engine's host tier (copy costs), or ``None``.
    """

    def __init__(
        self, latency: LatencyModel, clock: VirtualClock, vocab_size: int, tier: HostTier | None = None
    ) -> None:
        self.latency = latency
        self.clock = clock
        self.vocab_size = vocab_size
        self.tier = tier
        self.copies = _CopyEngines()

    def transfer_kv(self, transfers: KVTransfers) -> None:
        assert self.tier is not None, "a plan with block copies needs the host tier"
        copies = self.copies
        now = self.clock.now
        done = copies.offloads_done
        if transfers.offloads:
            start = max(now, copies.offload_busy_until)
            copies.offload_busy_until = done[transfers.ticket] = start + self.tier.offload_seconds(
                len(transfers.offloads)
            )
        reuse = transfers.wait_offloads_of
        reuse_ready = max((t for k, t in done.items() if reuse is not None and k <= reuse), default=now)
        if transfers.reloads:
            after = transfers.reloads_after
            slots_ready = max((t for k, t in done.items() if after is not None and k <= after), default=now)
            start = max(now, copies.reload_busy_until, reuse_ready, slots_ready)
            copies.reload_busy_until = copies.reloads_done[transfers.ticket] = start + self.tier.reload_seconds(
                len(transfers.reloads)
            )
        for ticket in [k for k, t in done.items() if t <= now and k != transfers.ticket]:
            del done[ticket]
        stall = reuse_ready - now
        if stall > 0:
            copies.stall_s += stall
            self.clock.advance(stall)

    def transfer_complete(self, ticket: int) -> bool:
        done = self.copies.reloads_done.get(ticket)
        if done is None or done <= self.clock.now:
            self.copies.reloads_done.pop(ticket, None)
            return True
        return False

    def wait_transfers(self, ticket: int | None = None) -> None:
        """Moves the clock to when the reloads of ``ticket`` (``None``: the earliest pending
        ones) land."""
        pending = self.copies.reloads_done
        if not pending:
            return
        if ticket is None:
            ticket = min(pending, key=pending.__getitem__)
        done = pending.pop(ticket, None)
        if done is not None and done > self.clock.now:
            self.copies.stall_s += done - self.clock.now
            self.clock.advance_to(done)

    def contended(self, seconds: float) -> float:
        """The duration of ``seconds`` of compute that starts now, run at
        ``1 / latency.copy_slowdown`` of its speed while the copy streams are busy."""
        slowdown = self.latency.copy_slowdown
        busy = max(self.copies.offload_busy_until, self.copies.reload_busy_until) - self.clock.now
        if slowdown <= 1.0 or busy <= 0.0:
            return seconds
        if seconds * slowdown <= busy:
            return seconds * slowdown
        return busy + (seconds - busy / slowdown)

    def step_cost(self, plan: SchedulerOutput) -> float:
        return self.latency.step_latency(
            plan.num_tokens, plan.attn_pairs, plan.is_decode_only, plan.decode_kv_tokens
        )

    def between_steps(self) -> None:
        """Moves the clock past the host time a live serving loop spends between two steps
        (``latency.host_gap_s``): the engine calls it once a step's outputs are out."""
        self.clock.advance(self.latency.host_gap_s)

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self.clock.advance(self.contended(self.step_cost(plan)))
        span = max(1, self.vocab_size - 200)
        return {
            item.request.request_id: 100 + (item.request.num_tokens * 7919) % span
            for item in plan.scheduled
            if item.sample
        }
