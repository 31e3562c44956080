"""Arrival processes: when each job of a trace starts.

Every function returns a *new* trace (the input is never modified) whose ``arrival`` field
records the process, so a saved trace says how it was driven:

* ``poisson(trace, rate, seed)``: open loop, exponential inter-arrival gaps with mean
  ``1 / rate``; job ``0`` arrives at ``start_s``.
* ``burst(trace, burst_size, interval_s)``: open loop, ``burst_size`` jobs at once every
  ``interval_s`` seconds (the last burst may be smaller).
* ``closed_loop(trace, concurrency)``: closed loop. Every ``arrival_s`` is 0 and
  ``trace.arrival == ArrivalInfo(kind="closed_loop", concurrency=N)``. A harness must keep ``N``
  jobs in flight: start jobs ``0..N-1`` at time 0 and, each time a job *completes* (its last
  turn finished), start the next job in trace order at that moment. ``ClosedLoopDispatcher``
  implements exactly this bookkeeping and can be driven by real or virtual clocks; harnesses
  should check ``trace.closed_loop_concurrency`` (None for open-loop traces).

``apply_arrivals(trace, spec, seed)`` parses a compact spec string for CLIs:
``"poisson:RATE"``, ``"burst:SIZExINTERVAL"``, ``"closed:N"``, ``"zero"`` (all at 0, no
process), or ``"trace"`` (keep the arrival times already in the trace).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from workloads.schema import ArrivalInfo, Job, Trace


def _with_arrivals(trace: Trace, times: list[float], info: ArrivalInfo) -> Trace:
    jobs = [
        job.model_copy(update={"arrival_s": float(t)}, deep=True)
        for job, t in zip(trace.jobs, times, strict=True)
    ]
    return trace.model_copy(update={"jobs": jobs, "arrival": info})


def poisson(trace: Trace, rate: float, seed: int = 0, start_s: float = 0.0) -> Trace:
    """Poisson arrivals at ``rate`` jobs per second, in trace order.

    Args:
        trace: Source trace (unchanged).
        rate: Mean jobs per second (> 0).
        seed: Seed of the gaps; same seed, same times.
        start_s: Arrival time of the first job.

    Returns:
        A new trace with increasing ``arrival_s``.

    Raises:
        ValueError: ``rate`` is not positive or ``start_s`` negative.
    """
    if not rate > 0:
        raise ValueError(f"poisson rate must be > 0, got {rate}")
    if start_s < 0:
        raise ValueError(f"start_s must be >= 0, got {start_s}")
    n = len(trace.jobs)
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0xA771,)))
    gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    times = [start_s, *(start_s + np.cumsum(gaps)).tolist()][:n]
    return _with_arrivals(trace, times, ArrivalInfo(kind="poisson", rate=rate, seed=seed))


def burst(trace: Trace, burst_size: int, interval_s: float, start_s: float = 0.0) -> Trace:
    """``burst_size`` jobs arrive together every ``interval_s`` seconds, in trace order.

    Args:
        trace: Source trace (unchanged).
        burst_size: Jobs per burst (>= 1).
        interval_s: Seconds between bursts (>= 0).
        start_s: Time of the first burst.

    Returns:
        A new trace; job ``i`` arrives at ``start_s + (i // burst_size) * interval_s``.

    Raises:
        ValueError: Invalid size or interval.
    """
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1, got {burst_size}")
    if interval_s < 0 or start_s < 0:
        raise ValueError("interval_s and start_s must be >= 0")
    times = [start_s + (i // burst_size) * interval_s for i in range(len(trace.jobs))]
    info = ArrivalInfo(kind="burst", burst_size=burst_size, burst_interval_s=interval_s)
    return _with_arrivals(trace, times, info)


def closed_loop(trace: Trace, concurrency: int) -> Trace:
    """Mark a trace for closed-loop driving with ``concurrency`` jobs in flight.

    Args:
        trace: Source trace (unchanged).
        concurrency: Jobs kept in flight (>= 1).

    Returns:
        A new trace with every ``arrival_s`` 0 and ``arrival.kind == "closed_loop"``; drive it
        with ``ClosedLoopDispatcher``.

    Raises:
        ValueError: ``concurrency`` < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    info = ArrivalInfo(kind="closed_loop", concurrency=concurrency)
    return _with_arrivals(trace, [0.0] * len(trace.jobs), info)


def zero(trace: Trace) -> Trace:
    """All jobs at time 0, no process recorded (an offline batch).

    Args:
        trace: Source trace (unchanged).

    Returns:
        A new trace with every ``arrival_s`` 0 and ``arrival.kind == "none"``.
    """
    return _with_arrivals(trace, [0.0] * len(trace.jobs), ArrivalInfo(kind="none"))


def apply_arrivals(trace: Trace, spec: str, seed: int = 0) -> Trace:
    """Apply an arrival process given as a compact string.

    Args:
        trace: Source trace (unchanged).
        spec: ``"poisson:RATE"``, ``"burst:SIZExINTERVAL"`` (e.g. ``"burst:8x30"``),
            ``"closed:N"``, ``"zero"``, or ``"trace"`` (keep the trace's own times).
        seed: Seed for random processes.

    Returns:
        The new trace (or the same trace for ``"trace"``).

    Raises:
        ValueError: Unparseable spec.
    """
    kind, _, arg = spec.strip().partition(":")
    kind = kind.lower()
    try:
        if kind == "poisson":
            return poisson(trace, float(arg), seed=seed)
        if kind == "burst":
            size, _, interval = arg.lower().partition("x")
            return burst(trace, int(size), float(interval))
        if kind in ("closed", "closed_loop"):
            return closed_loop(trace, int(arg))
        if kind == "zero" and not arg:
            return zero(trace)
        if kind == "trace" and not arg:
            return trace
    except ValueError as e:
        raise ValueError(f"bad arrival spec {spec!r}: {e}") from e
    raise ValueError(
        f"bad arrival spec {spec!r}; expected poisson:RATE, burst:SIZExINTERVAL, closed:N, "
        "zero or trace"
    )


@dataclass
class ClosedLoopDispatcher:
    """Bookkeeping for closed-loop driving: keep ``concurrency`` jobs in flight.

    Use::

        d = ClosedLoopDispatcher.from_trace(trace)
        for job in d.start(now=0.0):       # the first `concurrency` jobs
            launch(job, at=0.0)
        ...                                # when a job's last turn finishes at time t:
        nxt = d.on_job_done(job.job_id, now=t)
        if nxt is not None:
            launch(nxt, at=t)
        ...                                # d.finished is True when every job completed

    Started jobs are returned as copies whose ``arrival_s`` is the time they were started, so
    JCT = completion - ``arrival_s`` works unchanged for closed-loop runs.

    Attributes:
        jobs: Jobs in dispatch order.
        concurrency: Jobs kept in flight.
    """

    jobs: list[Job]
    concurrency: int
    _pending: deque[Job] = field(init=False, repr=False)
    _in_flight: set[str] = field(init=False, repr=False)
    _done: int = field(init=False, default=0, repr=False)
    _started: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        self._pending = deque(self.jobs)
        self._in_flight = set()

    @classmethod
    def from_trace(cls, trace: Trace, concurrency: int | None = None) -> ClosedLoopDispatcher:
        """Dispatcher for a trace.

        Args:
            trace: A trace; closed-loop traces carry their own concurrency.
            concurrency: Overrides the trace's; required for open-loop traces.

        Returns:
            The dispatcher.

        Raises:
            ValueError: No concurrency given and the trace is not closed-loop.
        """
        n = concurrency if concurrency is not None else trace.closed_loop_concurrency
        if n is None:
            raise ValueError(
                f"trace {trace.name!r} is not closed-loop ({trace.arrival.kind}); pass concurrency"
            )
        return cls(jobs=list(trace.jobs), concurrency=n)

    def _launch(self, now: float) -> Job:
        job = self._pending.popleft()
        self._in_flight.add(job.job_id)
        return job.model_copy(update={"arrival_s": float(now)})

    def start(self, now: float = 0.0) -> list[Job]:
        """Start the first ``concurrency`` jobs.

        Args:
            now: Start time.

        Returns:
            The jobs to launch now (fewer when the trace is smaller).

        Raises:
            RuntimeError: Called twice.
        """
        if self._started:
            raise RuntimeError("ClosedLoopDispatcher.start() called twice")
        self._started = True
        return [self._launch(now) for _ in range(min(self.concurrency, len(self._pending)))]

    def on_job_done(self, job_id: str, now: float) -> Job | None:
        """Record a completion and return the job to start in its place, if any.

        Args:
            job_id: The completed job.
            now: Completion time (the next job's arrival).

        Returns:
            The next job (with ``arrival_s = now``) or None when the trace is exhausted.

        Raises:
            KeyError: ``job_id`` is not in flight.
        """
        if job_id not in self._in_flight:
            raise KeyError(f"job {job_id!r} is not in flight")
        self._in_flight.remove(job_id)
        self._done += 1
        return self._launch(now) if self._pending else None

    @property
    def in_flight(self) -> int:
        """Jobs started and not yet completed."""
        return len(self._in_flight)

    @property
    def remaining(self) -> int:
        """Jobs not yet started."""
        return len(self._pending)

    @property
    def finished(self) -> bool:
        """True when every job has completed."""
        return self._started and not self._pending and not self._in_flight
