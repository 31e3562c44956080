"""Continuum's runtime side: when a turn ends in a tool call, pin the job's KV for tau*.

The engine owns the mechanism (:meth:`Engine.pin_session`, expiry, pressure release, the cap
on pinned blocks, program-level FCFS); this controller owns the *decisions*, from the
estimators of :mod:`agent_runtime.tool_estimator`:

* end of a turn that called tool(s): tau* = argmax_tau P(duration <= tau) * (T_queue * eta +
  C_reload(L)) - tau, with C_reload(L) ~ ``engine.latency.step_latency(L, L*L/2)`` (one prefill
  of the whole context), T_queue the recent mean queueing delay and eta the memoryfulness of
  finished jobs; then ``engine.pin_session(job, tau*)`` and a tool-pause hint
  (``engine.hint_session(job, expected_gap_s=...)``) for the eviction policy;
* arrival of the job's next request: the pause just observed (end of the LLM call -> this
  arrival) is recorded for the tool; the engine itself unpins once the request is admitted;
* the job's last step: ``hint_session(finished=True)``, which drops its pins and tells the
  eviction policy its blocks will not be reused.

Every method runs on the thread that owns the engine (the engine is not thread-safe). Times
come from the injected clock (the engine's by default), so a virtual clock drives it in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_runtime.tool_estimator import (
    MemoryfulnessEstimator,
    QueueDelayTracker,
    ToolDurationEstimator,
    TTLPolicy,
)


@dataclass(frozen=True)
class PinDecision:
    """What the controller decided at the end of a tool-calling turn.

    Attributes:
        job_id: the job.
        tool: the tool whose duration drove the decision.
        ttl_s: chosen TTL (0: not pinned).
        blocks_pinned: blocks the engine pinned (0 when refused, capped, or nothing cached).
        expected_duration_s: the tool's estimated duration (the hint given to the policy).
        benefit_s: T_queue * eta + C_reload(L).
        p_return: P(duration <= ttl_s).
        context_tokens: L, the job's context length.
        decided_at: clock time of the decision.
    """

    job_id: str
    tool: str
    ttl_s: float
    blocks_pinned: int
    expected_duration_s: float
    benefit_s: float
    p_return: float
    context_tokens: int
    decided_at: float


@dataclass
class _Pause:
    tool: str
    started_at: float


@dataclass
class ContinuumController:
    """Pinning and hint decisions for Continuum-style serving.

    Attributes:
        engine: the engine (its ``pin_session``, ``hint_session``, ``latency`` and ``clock``).
        durations: per-tool duration estimator (cold start 2 s).
        memoryfulness: eta from finished jobs.
        queue: recent queueing delays (T_queue).
        clock: time source; ``None`` uses the engine's clock.
        ttl_rule: ``continuum`` (the argmax) or ``preview`` (2 s when the mean is <= 2 s).
        pinning: pin at all (False: only record durations and give hints, as the non-Continuum
            policies want for AsymCache's reuse estimates).
    """

    engine: Any
    durations: ToolDurationEstimator = field(default_factory=ToolDurationEstimator)
    memoryfulness: MemoryfulnessEstimator = field(default_factory=MemoryfulnessEstimator)
    queue: QueueDelayTracker = field(default_factory=QueueDelayTracker)
    clock: Callable[[], float] | None = None
    ttl_rule: TTLPolicy = "continuum"
    pinning: bool = True
    decisions: list[PinDecision] = field(default_factory=list, repr=False)
    _pauses: dict[str, _Pause] = field(default_factory=dict, repr=False)
    _turns: dict[str, int] = field(default_factory=dict, repr=False)

    def now(self) -> float:
        """Current time on the controller's clock.

        Returns:
            Seconds.
        """
        return (self.clock or self.engine.clock)()

    def reload_cost(self, context_tokens: int) -> float:
        """C_reload(L): one prefill of the whole context, from the engine's latency model.

        Args:
            context_tokens: L.

        Returns:
            Seconds.
        """
        n = max(0, int(context_tokens))
        return float(self.engine.latency.step_latency(n, n * n / 2))

    # -- events --------------------------------------------------------------------------------
    def on_request_arrival(self, job_id: str | None, now: float | None = None) -> float | None:
        """The job's next request arrived: close its tool pause, learning the tool's duration.

        Args:
            job_id: the job (None: nothing to do).
            now: arrival time (default: the clock).

        Returns:
            The recorded pause in seconds, or None when the job was not paused.
        """
        if job_id is None:
            return None
        self._turns[job_id] = self._turns.get(job_id, 0) + 1
        pause = self._pauses.pop(job_id, None)
        if pause is None:
            return None
        duration = max(0.0, (self.now() if now is None else now) - pause.started_at)
        self.durations.record(pause.tool, duration)
        return duration

    def on_request_scheduled(self, arrival_s: float, first_scheduled_s: float | None) -> None:
        """A request left the queue: feed T_queue.

        Args:
            arrival_s: its arrival time.
            first_scheduled_s: when it was first scheduled (None: never; ignored).
        """
        if first_scheduled_s is not None:
            self.queue.record(first_scheduled_s - arrival_s, first_scheduled_s)

    def on_tool_call(
        self,
        job_id: str,
        tools: Sequence[str],
        context_tokens: int,
        ended_at: float | None = None,
        pinning: bool | None = None,
        ttl_rule: TTLPolicy | None = None,
    ) -> PinDecision:
        """A turn of ``job_id`` ended in tool call(s): pin for tau* and hint the pause.

        Args:
            job_id: the job (the engine session of its requests).
            tools: names of the called tools, in order; the pause is attributed to the first
                (a turn's calls run back to back and are measured as one pause).
            context_tokens: L, the job's context (prompt + output tokens of the turn).
            ended_at: end of the LLM call (default: now); the pause is measured from it.
            pinning: override of :attr:`pinning` for this job.
            ttl_rule: override of :attr:`ttl_rule` for this job.

        Returns:
            The decision (also appended to :attr:`decisions`).
        """
        now = self.now()
        tool = tools[0] if tools else "unknown"
        started = now if ended_at is None else ended_at
        self._pauses[job_id] = _Pause(tool, started)
        expected = self.durations.mean(tool)
        decision = self.durations.explain_ttl(
            tool,
            context_tokens,
            self.reload_cost,
            self.queue.mean(now),
            self.memoryfulness.eta(),
            policy=ttl_rule or self.ttl_rule,
        )
        do_pin = self.pinning if pinning is None else pinning
        blocks = 0
        ttl = decision.ttl_s if do_pin else 0.0
        if ttl > 0:
            # The TTL runs from the end of the LLM call, not from this (slightly later) moment.
            remaining = ttl - max(0.0, now - started)
            blocks = self.engine.pin_session(job_id, remaining) if remaining > 0 else 0
        self.engine.hint_session(job_id, expected_gap_s=expected)
        result = PinDecision(
            job_id, tool, ttl, int(blocks), expected, decision.benefit_s,
            decision.p_return if do_pin else 0.0, int(context_tokens), now,
        )
        self.decisions.append(result)
        del self.decisions[:-1024]  # bounded history
        return result

    def on_job_finished(self, job_id: str, num_turns: int | None = None) -> None:
        """The job's last step is done: release everything and learn its length.

        Args:
            job_id: the job.
            num_turns: its LLM calls (default: the requests the controller saw for it).
        """
        turns = self._turns.pop(job_id, 0) if num_turns is None else num_turns
        self._turns.pop(job_id, None)
        self._pauses.pop(job_id, None)
        if turns:
            self.memoryfulness.record_job(turns)
        self.engine.hint_session(job_id, finished=True)

    def forget_job(self, job_id: str) -> None:
        """Drop a job's bookkeeping without learning from it (abandoned or failed jobs).

        Args:
            job_id: the job.
        """
        self._turns.pop(job_id, None)
        self._pauses.pop(job_id, None)

    def paused_jobs(self) -> list[str]:
        """Jobs currently in a tool pause (a tool call seen, no next request yet).

        Returns:
            Their ids.
        """
        return list(self._pauses)
