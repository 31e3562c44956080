"""Continuum's decisions: when a turn ends in a tool call, pin the job's KV for tau*.

One :class:`ContinuumController` serves both the embedded engine (over its
:class:`~asymcache_core.continuum.backends.PinManager`; the engine builds it as
``engine.continuum``) and the vLLM plugin (over its
:class:`~asymcache_core.integrations.vllm.pins.PinSet`). The backend is the mechanism (pins,
expiry, the cap, pressure release); the controller decides:

* end of a turn that called tool(s): tau* = argmax_tau P(duration <= tau) * (T_queue * eta +
  C_reload(L)) - tau (:mod:`~asymcache_core.continuum.ttl`), with C_reload(L) one prefill of
  the whole context on the latency model, T_queue the recent mean queueing delay and eta the
  memoryfulness of finished jobs; then a pin for tau* and a tool-pause hint to the job
  statistics the eviction policies read;
* arrival of the job's next request: the pause just observed (end of the LLM call -> this
  arrival) is recorded for the tool; the pin is released once the request holds its blocks;
* the job's last step: its pin goes and its blocks are marked as not to be reused;
* program-level admission order (the engine's ``priority="program"``): pinned jobs first,
  then by the job's first arrival; the eta-weighted variant (``priority="adaptive"``), bounded
  under a time-to-first-token target by :class:`~asymcache_core.continuum.ttft_target.TTFTTarget`.

Every method runs on the thread that owns the engine or scheduler. Times come from the injected
clock, so a virtual clock drives it in tests and simulations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asymcache_core.continuum.backends import PinBackend
from asymcache_core.continuum.estimator import ToolDurationEstimator
from asymcache_core.continuum.ttft_target import TTFTTarget
from asymcache_core.continuum.ttl import (
    MemoryfulnessEstimator,
    QueueDelayTracker,
    TTLDecision,
    TTLRule,
    apply_ttl_rule,
    pin_benefit_s,
)
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel, segment_attn_pairs
from asymcache_core.request import Request

#: Tool name of a pause whose tool is not known.
UNKNOWN_TOOL = "unknown"
#: The longest TTL a client may ask for (``pin_ttl_s``): a pin past it would keep a share of the
#: pool from every other job for as long as the client likes (the rule's TTLs are seconds).
MAX_CLIENT_TTL_S = 600.0


@dataclass(frozen=True)
class PinDecision:
    """What the controller decided at the end of a tool-calling turn.

    Attributes:
        job_id: the job.
        tool: the tool whose duration drove the decision.
        ttl_s: chosen TTL (0: not pinned).
        blocks_pinned: blocks the backend pinned (0 when refused, capped, or nothing cached).
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
    """Pinning, hint and admission-order decisions for Continuum-style serving.

    Attributes:
        pins: the pin mechanism.
        latency: step-latency model; C_reload(L) is one prefill of L tokens on it.
        job_stats: per-job reuse statistics that get the tool-pause and job-done hints.
        clock: time source (the engine's or the scheduler's).
        durations: per-tool duration estimator (cold start 2 s).
        memoryfulness: eta from finished jobs.
        queue: recent queueing delays (T_queue).
        ttl_rule: ``continuum`` (the argmax) or ``preview`` (2 s when the mean is <= 2 s).
        pinning: pin at all (False: only record durations and give hints, as the non-Continuum
            presets want for AsymCache's reuse estimates).
        ttft_target: the user's time-to-first-token target (``EngineConfig.ttft_slo_ms``;
            ``None``: none): its slack bounds how far :meth:`adaptive_program_key` moves a
            request ahead of its own arrival, and it learns from the waits :meth:`on_admit` sees.
        decisions: the latest decisions (bounded).
    """

    pins: PinBackend
    latency: LatencyModel
    job_stats: JobStats
    clock: Callable[[], float]
    durations: ToolDurationEstimator = field(default_factory=ToolDurationEstimator)
    memoryfulness: MemoryfulnessEstimator = field(default_factory=MemoryfulnessEstimator)
    queue: QueueDelayTracker = field(default_factory=QueueDelayTracker)
    ttl_rule: TTLRule = "continuum"
    pinning: bool = True
    ttft_target: TTFTTarget | None = None
    decisions: list[PinDecision] = field(default_factory=list, repr=False)
    _pauses: dict[str, _Pause] = field(default_factory=dict, repr=False)
    _turns: dict[str, int] = field(default_factory=dict, repr=False)
    _first_arrival: dict[str, float] = field(default_factory=dict, repr=False)

    def now(self) -> float:
        """Current time on the controller's clock.

        Returns:
            Seconds.
        """
        return self.clock()

    def configure(self, *, ttl_rule: TTLRule | None = None, pinning: bool | None = None) -> ContinuumController:
        """Sets the defaults a serving preset asks for (``None`` keeps the current one).

        Args:
            ttl_rule: the TTL rule.
            pinning: whether tool-calling turns pin at all.

        Returns:
            This controller.
        """
        if ttl_rule is not None:
            self.ttl_rule = ttl_rule
        if pinning is not None:
            self.pinning = pinning
        return self

    def reload_cost(self, context_tokens: int) -> float:
        """C_reload(L): one prefill of the whole context, from the latency model.

        Args:
            context_tokens: L.

        Returns:
            Seconds.
        """
        n = max(0, int(context_tokens))
        return float(self.latency.step_latency(n, segment_attn_pairs(n, 0)))

    # -- job events ----------------------------------------------------------------------------
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
        ttl_rule: TTLRule | None = None,
        ttl_s: float | None = None,
    ) -> PinDecision:
        """A turn of ``job_id`` ended in tool call(s): pin for tau* and hint the pause.

        Args:
            job_id: the job.
            tools: names of the called tools, in order; the pause is attributed to the first
                (a turn's calls run back to back and are measured as one pause).
            context_tokens: L, the job's context (prompt + output tokens of the turn).
            ended_at: end of the LLM call (default: now); the pause and the TTL run from it.
            pinning: override of :attr:`pinning` for this turn.
            ttl_rule: override of :attr:`ttl_rule` for this turn.
            ttl_s: an explicit TTL (the client's) instead of the rule's; negatives mean 0, and
                it is capped at :data:`MAX_CLIENT_TTL_S`.

        Returns:
            The decision (also appended to :attr:`decisions`).
        """
        now = self.now()
        tool = tools[0] if tools else UNKNOWN_TOOL
        started = now if ended_at is None else ended_at
        self._pauses[job_id] = _Pause(tool, started)
        expected = self.durations.mean(tool)
        benefit = pin_benefit_s(context_tokens, self.reload_cost, self.queue.mean(now), self.memoryfulness.eta())
        if ttl_s is not None:
            ttl = min(max(0.0, ttl_s), MAX_CLIENT_TTL_S)
            p = self.durations.cdf(tool, ttl) if ttl > 0 else 0.0
            decision = TTLDecision(ttl, p, benefit, p * benefit - ttl)
        else:
            decision = apply_ttl_rule(ttl_rule or self.ttl_rule, self.durations, tool, benefit)
        do_pin = self.pinning if pinning is None else pinning
        blocks = 0
        ttl = decision.ttl_s if do_pin else 0.0
        if ttl > 0:
            # NOTE: the TTL runs from the end of the LLM call, not from this (slightly later) moment.
            remaining = ttl - max(0.0, now - started)
            blocks = self.pins.pin(job_id, remaining, now) if remaining > 0 else 0
        self.hint(job_id, expected_gap_s=expected)
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
        self.hint(job_id, finished=True)

    def forget_job(self, job_id: str) -> None:
        """Drop a job's bookkeeping without learning from it (abandoned or failed jobs).

        Args:
            job_id: the job.
        """
        self._turns.pop(job_id, None)
        self._pauses.pop(job_id, None)
        self._first_arrival.pop(job_id, None)

    def tracked_jobs(self) -> dict[str, int]:
        """Sizes of the per-job tables (they must stay bounded).

        Returns:
            Table name -> entries.
        """
        return {"pauses": len(self._pauses), "turns": len(self._turns), "first_arrival": len(self._first_arrival)}

    def hint(self, job_id: str, expected_gap_s: float | None = None, finished: bool | None = None) -> None:
        """Passes reuse hints to the job statistics; a finished job also loses its pin.

        Args:
            job_id: the job.
            expected_gap_s: the expected pause before its next request.
            finished: the job is done (its blocks will not be reused).
        """
        self.job_stats.hint(job_id, expected_gap_s, finished)
        if finished:
            self.pins.forget(job_id)

    def paused_jobs(self) -> list[str]:
        """Jobs currently in a tool pause (a tool call seen, no next request yet).

        Returns:
            Their ids.
        """
        return list(self._pauses)

    # -- program-level admission order (the embedded engine's scheduler) -----------------------
    def on_request_added(self, request: Request) -> None:
        """A request entered the engine: note whether its job held a pin, and the job's first
        arrival.

        Args:
            request: the new request.
        """
        request.had_pin = self.pins.is_pinned(request.job_id)
        if request.job_id is not None:
            self._first_arrival.setdefault(request.job_id, request.metrics.arrival_time)

    def program_key(self, request: Request) -> tuple:
        """Continuum's program-level FCFS: pinned jobs first, then by the job's first arrival.

        Args:
            request: a waiting request.

        Returns:
            Its sort key (smaller first).
        """
        pinned = 0 if request.had_pin else 1
        first = self._first_arrival.get(request.job_id or "", request.metrics.arrival_time)
        return (pinned, first, request.metrics.arrival_time)

    def adaptive_program_key(self, request: Request) -> tuple:
        """Program order as far as jobs are memoryful: pinned jobs first, then by
        ``first + (1 - eta) * (arrival - first)``, the job's first arrival moved towards the
        request's own by the memoryfulness ``eta`` the jobs finished so far show (the lower
        bound of its 95% confidence interval: 0, arrival order, until memory is shown).

        With eta = 1 (a job's turns done predict its turns left: an old job is near its end)
        this is :meth:`program_key`; with eta = 0 (memoryless lengths: an old job is no closer
        to its end than a young one) it is arrival order, which then serves jobs better than
        favouring old ones.

        With :attr:`ttft_target` set, a request ranks no earlier than its arrival less the
        target's slack, and a pinned job's request ranks at that bound rather than before every
        other: a later request can pass a request only if it arrived within the slack after it,
        so program order delays no request by more than the slack beyond what arrival order would.

        NOTE: program order buys job time by making the youngest jobs' turns wait, and its
        time-to-first-token tail is the price: simulated H200, BFCL on 300 blocks, 48 agents,
        mean JCT 29.3 s against 33.2 with ``vllm-apc``, TTFT p99 17.3 s against 3.9; SWE with a
        256 GB host tier at 128 agents, JCT p99 244 s against 301, TTFT p99 48.7 s against 8.9.
        A bound that keeps most of the first costs the second (BFCL: a 5 s slack gives 32.6 s /
        7.7 s, 20 s gives 29.3 s / 17.1 s), so it is the user's stated target that sets it.

        Args:
            request: a waiting request.

        Returns:
            Its sort key (smaller first).
        """
        pinned = 0 if request.had_pin else 1
        arrival = request.metrics.arrival_time
        first = self._first_arrival.get(request.job_id or "", arrival)
        # NOTE: the eta the jobs show with confidence, running ones counted as censored lengths,
        # not the point estimate (MemoryfulnessEstimator.eta_shown): arrival order until shown
        eta = self.memoryfulness.eta_shown(self._turns.values())
        rank = first + (1.0 - eta) * (arrival - first)
        if self.ttft_target is not None:
            # NOTE: a pinned job's turn goes ahead as far as the slack allows, not before every
            # other: with short tools most turns come back pinned, and the rest waited behind
            # them (simulated tool loop, 1,200 blocks, 2 s target: TTFT p99 5.7 s against 6.6
            # with pinned turns first, mean JCT 6.45 against 6.65; SWE with a 256 GB tier at
            # 256 agents unchanged).
            slack = self.ttft_target.slack_s
            return (0, arrival - slack if pinned == 0 else max(rank, arrival - slack), arrival)
        return (pinned, rank, arrival)

    def on_admit(self, request: Request) -> None:
        """A waiting request was admitted: its job's pin is released; a first admission ends
        its queueing delay (T_queue, and the waits :attr:`ttft_target` learns from).

        Args:
            request: the admitted request.
        """
        # NOTE: the pin is released only now, once the request holds its blocks: releasing it
        # at arrival would leave them evictable while the request waits in the queue.
        if not request.admitted_once:
            # NOTE: a first admission ends the request's queueing (a re-admission after a
            # preemption does not): T_queue for the pin benefit, and the waits the target
            # control keeps within the target. Recorded here, once, for every caller of the
            # embedded engine; before 2026-12-04 the agent runtime and the bench harness each
            # recorded it when the request finished, a whole turn late.
            now = self.now()
            self.on_request_scheduled(request.metrics.arrival_time, now)
            if self.ttft_target is not None:
                self.ttft_target.record(now - request.metrics.arrival_time)
        if request.job_id is not None:
            self.pins.unpin(request.job_id)

    def on_request_finished(self, request: Request) -> None:
        """A request finished: the job's last step ends its place in the program order.

        Args:
            request: the finished request.
        """
        if request.job_id is not None and request.is_last_step:
            self._first_arrival.pop(request.job_id, None)
