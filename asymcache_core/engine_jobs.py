"""The engine's job-level calls: pins and reuse hints from the runtime, the jobs it gives
requests that name none, and the sweep that keeps per-job state bounded (a mixin of
:class:`~asymcache_core.engine.Engine`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asymcache_core.engine_checks import check_id, check_seconds
from asymcache_core.implicit_jobs import ImplicitJobs
from asymcache_core.request import Request, RequestStatus
from asymcache_core.sim_runner import VirtualClock

if TYPE_CHECKING:
    from asymcache_core.config import EngineConfig
    from asymcache_core.continuum.backends import PinManager
    from asymcache_core.continuum.controller import ContinuumController
    from asymcache_core.job_admission import JobAdmission
    from asymcache_core.job_stats import JobStats
    from asymcache_core.kv_cache_manager import KVCacheManager

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
    job_admission: JobAdmission | None
    implicit_jobs: ImplicitJobs | None
    config: EngineConfig
    kv: KVCacheManager
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
        check_seconds("when", when, allow_negative=True)
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

        Raises:
            ValueError: a job id that is no non-empty string, or a TTL that is no finite
                number of seconds >= 0 (an infinite one would never expire).
        """
        check_id("job_id", job_id)
        check_seconds("ttl_s", ttl_s)
        return self.pins.pin(job_id, ttl_s, self.clock())

    def unpin_job(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin; whether it had one."""
        return self.pins.unpin(job_id)

    def use_implicit_jobs(self) -> bool:
        """Give requests that name no job their conversation's job, as
        :attr:`~asymcache_core.config.EngineConfig.implicit_jobs` says: its ``None`` is on
        wherever job admission is, once a caller that ends such jobs asks for them (the agent
        runtime, which ends a job whose reply calls no tool; a bare engine's jobless requests
        stay jobless: nothing would end their jobs but the gate's idle timeout).

        Returns:
            Whether the engine now gives them.
        """
        if self.implicit_jobs is None and self.config.implicit_jobs is None and self.job_admission is not None:
            self.implicit_jobs = ImplicitJobs(self.config.block_size)
        return self.implicit_jobs is not None

    def _join_conversation(self, request: Request, continues: str | None = None) -> str | None:
        """A new request's job: its own, or where it names none and the engine gives them, the
        job of the conversation it continues (its admission rank, pins and reuse estimates,
        for clients that name no job; a last step gets none). ``continues``: the job the
        caller found by the rendered chat (:meth:`ImplicitJobs.assign`)."""
        if request.job_id is None and self.implicit_jobs is not None and not request.is_last_step:
            request.job_id = self.implicit_jobs.assign(request.prompt_token_ids, self.kv.ensure_hashes(request),
                                                       continues)
            request.implicit_job = True
        return request.job_id

    def _remember_conversation(self, request: Request) -> None:
        """A finished request whose job the engine gave keeps its turn's keys (not an aborted
        one: nothing continues it)."""
        if request.implicit_job and self.implicit_jobs is not None and request.status is not RequestStatus.FINISHED_ABORTED:
            assert request.job_id is not None
            self.implicit_jobs.on_finished(request.job_id, request.all_token_ids, len(request.prompt_token_ids),
                                           self.kv.ensure_hashes(request))

    def end_job(self, job_id: str) -> None:
        """A job is over, though no last step said so (the runtime's ``finish_job``, or a job
        the engine gave a request whose reply called no tool): job admission lets it go and its
        pins are released. A later request of it ranks as a new job.

        Args:
            job_id: the job.

        Raises:
            ValueError: a job id that is no non-empty string.
        """
        check_id("job_id", job_id)
        if self.job_admission is not None:
            self.job_admission.end_job(job_id)
        self.pins.forget(job_id)

    def hint_job(self, job_id: str, expected_gap_s: float | None = None, finished: bool | None = None) -> None:
        """Passes the runtime's reuse hints (tool-pause estimate, job done) to the policies.

        Raises:
            ValueError: a job id that is no non-empty string, a gap that is no finite number of
                seconds >= 0, or ``finished`` that is no boolean.
        """
        check_id("job_id", job_id)
        if expected_gap_s is not None:
            check_seconds("expected_gap_s", expected_gap_s)
        if finished is not None and not isinstance(finished, bool):
            raise ValueError(f"finished: True, False or None, got {finished!r}")
        self.continuum.hint(job_id, expected_gap_s, finished)


__all__ = ["JOB_IDLE_S", "JOB_SWEEP_INTERVAL_S", "MAX_TRACKED_JOBS", "JobControl"]
