"""Continuum-style pins for vLLM: job hints and the pin registry (a Continuum pin backend).

A job's request carries ``job_id`` and ``is_last_step`` (and optionally ``tool_name``, the tool
the agent is about to run, and ``pin_ttl_s``, an explicit TTL) in ``SamplingParams.extra_args``;
over the OpenAI API they travel in the body's ``vllm_xargs`` object, whose values vLLM 0.32
limits to strings and numbers (so ``is_last_step`` is ``1``/``0`` or ``"true"``/``"false"``).
vLLM's own request ``session_id`` (the chat API's field of that name) serves as the job id when
``job_id`` is absent: that name is vLLM's, and is read only at this boundary.

When a job's request finishes and it is not the job's last step, the scheduler's
:class:`~asymcache_core.continuum.controller.ContinuumController` (the same one the embedded
engine uses) chooses a TTL and pins through :class:`PinSet`, which implements
:class:`~asymcache_core.continuum.backends.PinBackend`. Pinned blocks stay in vLLM's free queue
(they count as free, so admissions are never refused because of a pin) but are not eviction
candidates until the pin expires, the job's next request is scheduled, or memory pressure
releases it (latest-expiring first). The pinned share of the pool is capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asymcache_core.continuum.backends import Pin

#: Tool key used when a request names no tool.
DEFAULT_TOOL = "tool"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class JobHints:
    """A request's Continuum hints.

    Attributes:
        job_id: the agent job (``None``: a plain request, never pinned).
        is_last_step: the job ends with this request (no pin, its blocks lose value).
        tool_name: the tool the job runs after this request (per-tool durations).
        pin_ttl_s: explicit TTL overriding the estimator.
        implicit: the scheduler gave the job (the request named none: the conversation its
            prompt continues, :class:`~asymcache_core.implicit_jobs.ImplicitJobs`).
    """

    job_id: str | None = None
    is_last_step: bool = False
    tool_name: str | None = None
    pin_ttl_s: float | None = None
    implicit: bool = False


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    return str(value).strip().lower() in _TRUE


def parse_job_hints(extra_args: Mapping[str, Any] | None, fallback_job_id: str | None = None) -> JobHints:
    """Reads the hints from ``SamplingParams.extra_args`` (the OpenAI body's ``vllm_xargs``).

    Args:
        extra_args: the request's extra args, or ``None``.
        fallback_job_id: the job id when the args name none (vLLM's request ``session_id``).

    Returns:
        The hints; malformed values are ignored rather than failing a request.
    """
    args = extra_args or {}
    job = args.get("job_id", fallback_job_id)
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


def job_hint_problems(extra_args: Mapping[str, Any] | None) -> list[str]:
    """The hints :func:`parse_job_hints` cannot read as sent (it ignores them, or reads
    ``is_last_step`` as false), for a warning naming each.

    Args:
        extra_args: the request's extra args (the OpenAI body's ``vllm_xargs``), or ``None``.

    Returns:
        One message per bad hint (empty when every hint reads as sent).
    """
    args = extra_args or {}
    problems = []
    for name in ("job_id", "tool_name"):
        value = args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
            problems.append(f"vllm_xargs.{name} must be a string, got {value!r}")
    last = args.get("is_last_step")
    if last is not None and not isinstance(last, bool | int | float):
        if str(last).strip().lower() not in _TRUE | _FALSE:
            problems.append(
                f"vllm_xargs.is_last_step must be 1/0 or true/false, got {last!r} (read as false)"
            )
    if "pin_ttl_s" in args:
        value = args["pin_ttl_s"]
        try:
            ok = math.isfinite(float(value))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            problems.append(
                f"vllm_xargs.pin_ttl_s must be a number of seconds, got {value!r} (ignored)"
            )
    return problems


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
    """The pins of one vLLM block pool: a :class:`~asymcache_core.continuum.backends.PinBackend`.

    The scheduler calls :meth:`remember` with the cached blocks of a job's request as it is
    freed (they still hold their content then); :meth:`pin` pins those blocks. The free queue
    asks :meth:`holds_block` and releases pins under pressure in :meth:`pressure_order`.

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
        self._last: dict[str, tuple[int, ...]] = {}
        self.stats = PinStats()
        #: Called with a block id that gained its first pin or lost its last one (the free queue
        #: keeps pinned blocks out of its candidates with it).
        self.listener: Callable[[int], None] | None = None

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct pinned blocks."""
        return len(self._count)

    def holds_block(self, block_id: int) -> bool:
        """Whether any pin holds ``block_id``."""
        return block_id in self._count

    def is_pinned(self, job_id: str | None) -> bool:
        """Whether ``job_id`` holds a pin."""
        return job_id is not None and job_id in self.pins

    def remember(self, job_id: str, block_ids: Iterable[int]) -> None:
        """Records the cached blocks a job's finished request leaves behind, for :meth:`pin`.

        Args:
            job_id: the job.
            block_ids: its blocks that hold content.
        """
        self._last[job_id] = tuple(dict.fromkeys(block_ids))

    def pin(self, job_id: str, ttl_s: float, now: float) -> int:
        """Pins the blocks :meth:`remember` recorded for ``job_id`` until ``now + ttl_s``
        (replacing its old pin).

        Args:
            job_id: the job.
            ttl_s: time to live (``<= 0``: no pin).
            now: clock time.

        Returns:
            Blocks pinned (0 when refused by ``ttl_s`` or by the cap, or nothing recorded).
        """
        # NOTE: the recorded blocks are used once: vLLM may reuse them after this call.
        ids = self._last.pop(job_id, ())
        if job_id in self.pins:
            self._drop(job_id)
            self.stats.released_other += 1
        if ttl_s <= 0 or not ids:
            return 0
        self.pins[job_id] = Pin(job_id, ids, now, now + ttl_s)
        for block_id in ids:
            count = self._count.get(block_id, 0)
            self._count[block_id] = count + 1
            if count == 0 and self.listener is not None:
                self.listener(block_id)
        self.stats.pins += 1
        while self.pins and self.num_pinned_blocks > self.capacity_blocks:
            latest, _ = self.pressure_order()[0]
            self._drop(latest)
            self.stats.released_pressure += 1
        return len(ids) if job_id in self.pins else 0

    def unpin(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin: its next request was scheduled.

        Args:
            job_id: the job.

        Returns:
            Whether it had one.
        """
        if job_id not in self.pins:
            return False
        self._drop(job_id)
        self.stats.released_next_request += 1
        return True

    def forget(self, job_id: str) -> None:
        """The job ended (its last step): drops its pin and its recorded blocks.

        Args:
            job_id: the job.
        """
        self._last.pop(job_id, None)
        if job_id in self.pins:
            self._drop(job_id)
            self.stats.released_other += 1

    def discard_recorded(self, job_id: str) -> None:
        """Drops the blocks :meth:`remember` recorded for ``job_id`` that no pin used (vLLM may
        give those block ids other content later).

        Args:
            job_id: the job.
        """
        self._last.pop(job_id, None)

    def drop_block(self, block_id: int) -> None:
        """``block_id`` lost its content (vLLM's ``evict_blocks``, a connector): no pin holds it
        any longer, so its id, once reused for other content, is not protected.

        Args:
            block_id: the block.
        """
        if block_id not in self._count:
            return
        for job_id, pin in list(self.pins.items()):
            if block_id in pin.block_ids:
                rest = tuple(b for b in pin.block_ids if b != block_id)
                self.pins[job_id] = Pin(job_id, rest, pin.pinned_at, pin.expires_at)
        del self._count[block_id]
        if self.listener is not None:
            self.listener(block_id)

    def clear(self) -> None:
        """Drops every pin and every recorded block (vLLM's ``reset_prefix_cache``: no block
        holds its content any longer)."""
        self._last.clear()
        for job_id in list(self.pins):
            self._drop(job_id)
            self.stats.released_other += 1

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
                if self.listener is not None:
                    self.listener(block_id)
