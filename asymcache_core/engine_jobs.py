"""The engine's job-level calls: pins and reuse hints from the runtime, and the sweep that
keeps per-job state bounded (a mixin of :class:`~asymcache_core.engine.Engine`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asymcache_core.sim_runner import VirtualClock

if TYPE_CHECKING:
    from asymcache_core.continuum.backends import PinManager
    from asymcache_core.continuum.controller import ContinuumController
    from asymcache_core.job_stats import JobStats

#: Seconds a job may stay idle (nothing in flight, no pin) before its per-job state is dropped.
JOB_IDLE_S = 1800.0
#: Jobs whose per-job state is kept at most.
MAX_TRACKED_JOBS = 10_000
#: Engine seconds between idle-job sweeps.
JOB_SWEEP_INTERVAL_S = 10.0


class JobControl:
    """Pins, hints and idle-job sweeps of the engine (a mixin).

    Invariant: a job's per-job state (statistics, remembered blocks, the controller's tables)
    is dropped only while nothing of the job is in flight and it holds no pin.
    """

    clock: Callable[[], float]
    pins: PinManager
    job_stats: JobStats
    continuum: ContinuumController
    #: a job idle this long (nothing in flight, no pin) loses its per-job state
    job_idle_s: float = JOB_IDLE_S
    #: jobs whose state is kept at most (the longest idle dropped first)
    max_tracked_jobs: int = MAX_TRACKED_JOBS
    _next_job_sweep: float = 0.0

    def idle_until(self, when: float) -> None:
        """Nothing is left to run until engine time ``when`` (e.g. every job is in a tool pause).

        On the virtual clock of :meth:`simulated` time jumps to ``when`` (never back). A real
        clock is not the engine's to move: the caller waits, and this call only does what an
        idle engine owes. Either way, pins whose TTL has passed by now expire (inside
        :meth:`step` they expire at the start of every step).
        """
        if isinstance(self.clock, VirtualClock):
            self.clock.advance_to(when)
        self.pins.expire(self.clock())
        self._sweep_jobs(self.clock())

    def _sweep_jobs(self, now: float) -> None:
        """Drops the per-job state of idle jobs (:meth:`JobStats.drop_idle`: past
        :attr:`job_idle_s`, or the longest idle past :attr:`max_tracked_jobs`), so abandoned jobs
        cannot grow memory without bound: their statistics, remembered blocks and the
        controller's tables. A job is idle when nothing of it is in flight and it holds no pin.
        """
        if now < self._next_job_sweep and len(self.job_stats.jobs) <= self.max_tracked_jobs:
            return
        self._next_job_sweep = now + JOB_SWEEP_INTERVAL_S
        for job in self.job_stats.drop_idle(now, self.job_idle_s, self.max_tracked_jobs, self.pins.is_pinned):
            self.pins.forget(job)
            self.continuum.forget_job(job)

    def tracked_jobs(self) -> dict[str, int]:
        """Sizes of every per-job table of the engine (they stay bounded; see :meth:`_sweep_jobs`).

        Returns:
            Table name -> entries.
        """
        return {
            "job_stats": len(self.job_stats.jobs),
            "pins_last_blocks": len(self.pins.last_blocks),
            "pins": len(self.pins.pins),
            **{f"controller_{k}": v for k, v in self.continuum.tracked_jobs().items()},
        }

    def pin_job(self, job_id: str, ttl_s: float) -> int:
        """Pins the blocks of ``job_id``'s last finished request for ``ttl_s`` seconds.

        Returns:
            Blocks pinned (0 when the pin was refused or nothing was cached).
        """
        return self.pins.pin(job_id, ttl_s, self.clock())

    def unpin_job(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin; whether it had one."""
        return self.pins.unpin(job_id)

    def hint_job(self, job_id: str, expected_gap_s: float | None = None, finished: bool | None = None) -> None:
        """Passes the runtime's reuse hints (tool-pause estimate, job done) to the policies."""
        self.continuum.hint(job_id, expected_gap_s, finished)


__all__ = ["JOB_IDLE_S", "JOB_SWEEP_INTERVAL_S", "MAX_TRACKED_JOBS", "JobControl"]
