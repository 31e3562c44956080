"""Continuum-style pins for vLLM: job hints, the pin registry, and the TTL decisions.

A job's request carries ``job_id`` and ``is_last_step`` (and optionally ``tool_name``, the tool
the agent is about to run, and ``pin_ttl_s``, an explicit TTL) in ``SamplingParams.extra_args``;
over the OpenAI API they travel in the body's ``vllm_xargs`` object, whose values vLLM 0.32
limits to strings and numbers (so ``is_last_step`` is ``1``/``0`` or ``"true"``/``"false"``).
The chat API's ``session_id`` field serves as the job id when ``job_id`` is absent.

When a job's request finishes and it is not the job's last step, :class:`ContinuumPinPolicy`
chooses a TTL with the same estimator as the agent runtime (#6,
:meth:`~agent_runtime.tool_estimator.ToolDurationEstimator.choose_ttl`) and :class:`PinSet`
records the pin. Pinned blocks stay in vLLM's free queue (they count as free, so admissions
are never refused because of a pin) but are not eviction candidates until the pin expires, the
job's next request is scheduled, or memory pressure releases it (latest-expiring first). The
pinned share of the pool is capped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent_runtime.tool_estimator import (
    MemoryfulnessEstimator,
    QueueDelayTracker,
    ToolDurationEstimator,
    TTLPolicy,
)
from asymcache_core.latency_model import LatencyModel

#: Tool key used when a request names no tool.
DEFAULT_TOOL = "tool"

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class JobHints:
    """A request's Continuum hints.

    Attributes:
        job_id: the agent job (``None``: a plain request, never pinned).
        is_last_step: the job ends with this request (no pin, its blocks lose value).
        tool_name: the tool the job runs after this request (per-tool durations).
        pin_ttl_s: explicit TTL overriding the estimator.
    """

    job_id: str | None = None
    is_last_step: bool = False
    tool_name: str | None = None
    pin_ttl_s: float | None = None


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    return str(value).strip().lower() in _TRUE


def parse_job_hints(extra_args: Mapping[str, Any] | None, session_id: str | None = None) -> JobHints:
    """Reads the hints from ``SamplingParams.extra_args`` (the OpenAI body's ``vllm_xargs``).

    Args:
        extra_args: the request's extra args, or ``None``.
        session_id: vLLM's request ``session_id``, the fallback job id.

    Returns:
        The hints; malformed values are ignored rather than failing a request.
    """
    args = extra_args or {}
    job = args.get("job_id", session_id)
    job_id = None if job is None or str(job) == "" else str(job)
    tool = args.get("tool_name")
    ttl: float | None = None
    if "pin_ttl_s" in args:
        try:
            ttl = float(args["pin_ttl_s"])
        except (TypeError, ValueError):
            ttl = None
        if ttl is not None and not math.isfinite(ttl):
            ttl = None
    return JobHints(
        job_id=job_id,
        is_last_step=_as_bool(args.get("is_last_step", False)),
        tool_name=None if tool is None else str(tool),
        pin_ttl_s=ttl,
    )


@dataclass
class Pin:
    """One job's pin.

    Attributes:
        job_id: the job.
        block_ids: the pinned blocks.
        pinned_at: clock time of the pin.
        expires_at: clock time of its expiry.
    """

    job_id: str
    block_ids: tuple[int, ...]
    pinned_at: float
    expires_at: float


@dataclass
class PinStats:
    """Pin counters.

    Attributes:
        pins: pins made.
        expired: pins released at expiry.
        released_next_request: pins released because the job's next request was scheduled.
        released_pressure: pins released by memory pressure or the cap.
        released_other: pins dropped otherwise (last step, replaced).
    """

    pins: int = 0
    expired: int = 0
    released_next_request: int = 0
    released_pressure: int = 0
    released_other: int = 0


class PinSet:
    """The pins of one block pool.

    Args:
        capacity_blocks: the most blocks pins may hold together (the cap); past it the
            latest-expiring pins are released.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks: must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.pins: dict[str, Pin] = {}
        self._count: dict[int, int] = {}
        self.stats = PinStats()

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct pinned blocks."""
        return len(self._count)

    def is_pinned(self, block_id: int) -> bool:
        """Whether any pin holds ``block_id``."""
        return block_id in self._count

    def pin(self, job_id: str, block_ids: Iterable[int], ttl_s: float, now: float) -> int:
        """Pins ``block_ids`` for ``job_id`` until ``now + ttl_s`` (replacing its old pin).

        Args:
            job_id: the job.
            block_ids: its blocks.
            ttl_s: time to live (``<= 0``: no pin).
            now: clock time.

        Returns:
            Blocks pinned (0 when refused by ``ttl_s`` or by the cap).
        """
        if job_id in self.pins:
            self._drop(job_id)
            self.stats.released_other += 1
        ids = tuple(dict.fromkeys(block_ids))
        if ttl_s <= 0 or not ids:
            return 0
        self.pins[job_id] = Pin(job_id, ids, now, now + ttl_s)
        for block_id in ids:
            self._count[block_id] = self._count.get(block_id, 0) + 1
        self.stats.pins += 1
        while self.pins and self.num_pinned_blocks > self.capacity_blocks:
            latest, _ = self.pressure_order()[0]
            self._drop(latest)
            self.stats.released_pressure += 1
        return len(ids) if job_id in self.pins else 0

    def unpin(self, job_id: str, reason: str = "next_request") -> bool:
        """Releases ``job_id``'s pin.

        Args:
            job_id: the job.
            reason: ``next_request`` or ``other`` (for the counters).

        Returns:
            Whether it had one.
        """
        if job_id not in self.pins:
            return False
        self._drop(job_id)
        if reason == "next_request":
            self.stats.released_next_request += 1
        else:
            self.stats.released_other += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Releases every pin whose TTL has passed.

        Args:
            now: clock time.

        Returns:
            Their jobs.
        """
        gone = [job for job, pin in self.pins.items() if pin.expires_at <= now]
        for job in gone:
            self._drop(job)
        self.stats.expired += len(gone)
        return gone

    def pressure_order(self) -> list[tuple[str, tuple[int, ...]]]:
        """Pins in the order memory pressure releases them: latest-expiring first."""
        ranked = sorted(self.pins.values(), key=lambda p: (-p.expires_at, p.job_id))
        return [(pin.job_id, pin.block_ids) for pin in ranked]

    def release(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin under memory pressure.

        Returns:
            Whether it had one.
        """
        if job_id not in self.pins:
            return False
        self._drop(job_id)
        self.stats.released_pressure += 1
        return True

    def _drop(self, job_id: str) -> None:
        pin = self.pins.pop(job_id)
        for block_id in pin.block_ids:
            left = self._count[block_id] - 1
            if left:
                self._count[block_id] = left
            else:
                del self._count[block_id]


@dataclass
class _JobState:
    turns: int = 0
    paused_at: float | None = None
    tool: str = DEFAULT_TOOL
    context_tokens: int = 0


@dataclass
class ContinuumPinPolicy:
    """Continuum's TTL decisions, with the estimators of the agent runtime (#6).

    tau* = argmax_tau P(duration <= tau) * (T_queue * eta + C_reload(L)) - tau, where the tool's
    durations are measured from the end of a job's request to the arrival of its next one.

    Attributes:
        latency: step-latency model; C_reload(L) is one prefill of L tokens.
        durations: per-tool duration estimator (cold start 2 s).
        memoryfulness: eta from finished jobs.
        queue: recent queueing delays (T_queue).
        ttl_rule: ``continuum`` (the argmax) or ``preview`` (2 s when the mean is <= 2 s).
    """

    latency: LatencyModel
    durations: ToolDurationEstimator = field(default_factory=ToolDurationEstimator)
    memoryfulness: MemoryfulnessEstimator = field(default_factory=MemoryfulnessEstimator)
    queue: QueueDelayTracker = field(default_factory=QueueDelayTracker)
    ttl_rule: TTLPolicy = "continuum"
    jobs: dict[str, _JobState] = field(default_factory=dict)

    def reload_cost(self, context_tokens: int) -> float:
        """C_reload(L): one prefill of the whole context, from the latency model."""
        n = max(0, context_tokens)
        return self.latency.step_latency(n, n * n / 2)

    def on_arrival(self, job_id: str, now: float) -> float | None:
        """The job's next request arrived: record the pause for the tool it ran.

        Returns:
            The observed pause (seconds), or ``None`` for the job's first request.
        """
        state = self.jobs.setdefault(job_id, _JobState())
        if state.paused_at is None:
            return None
        pause = max(0.0, now - state.paused_at)
        self.durations.record(state.tool, pause)
        state.paused_at = None
        return pause

    def on_scheduled(self, arrival: float, now: float) -> None:
        """A request was scheduled for the first time (queueing delay sample)."""
        self.queue.record(max(0.0, now - arrival), now)

    def on_finish(self, hints: JobHints, context_tokens: int, now: float) -> float:
        """A job's request finished: the TTL to pin its blocks for.

        Args:
            hints: the request's hints (with a job id).
            context_tokens: tokens of the job's context now (prompt + output).
            now: clock time.

        Returns:
            TTL in seconds (0: do not pin).
        """
        if hints.job_id is None:
            return 0.0
        state = self.jobs.setdefault(hints.job_id, _JobState())
        state.turns += 1
        state.context_tokens = context_tokens
        if hints.is_last_step:
            self.memoryfulness.record_job(state.turns)
            del self.jobs[hints.job_id]
            return 0.0
        state.paused_at = now
        state.tool = hints.tool_name or DEFAULT_TOOL
        if hints.pin_ttl_s is not None:
            return max(0.0, hints.pin_ttl_s)
        return self.durations.choose_ttl(
            state.tool,
            context_tokens,
            self.reload_cost,
            self.queue.mean(now),
            self.memoryfulness.eta(),
            policy=self.ttl_rule,
        )

    def expected_pause(self, tool: str | None) -> float:
        """The tool's mean duration (the reuse hint for the eviction score)."""
        return self.durations.mean(tool or DEFAULT_TOOL)
