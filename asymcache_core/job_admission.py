"""Job-level admission: whole agent jobs wait instead of every job thrashing the KV pool.

An agent job is a sequence of requests that share a ``job_id``: each turn's prompt is the whole
history so far, so a job's KV footprint grows turn by turn and is reused by its next turn. When
more jobs are in flight than the pool holds, every eviction policy thrashes: each returning turn
finds its history evicted and recomputes it, and the device spends its time rebuilding contexts
that are evicted again before their next use.

:class:`JobAdmission` keeps the jobs that run within what the pool holds, in program order
(Continuum's first-come-first-served by job): jobs are ranked by their first admission, and a
request of a job is admitted only while the contexts of that job and of every older job fit the
pool together. New jobs rank last, so they start only when everything older fits; when older
jobs grow, the youngest ones stop between two turns (their next request waits, their idle blocks
become ordinary eviction candidates) and resume, oldest first, when older jobs finish. No
forecast is needed: the set that runs is whatever fits now, and the oldest job always runs, so
the gate cannot deadlock. Where the pool is not the bottleneck, nothing is ever held back.

Holding a job back is worth it only when the contexts it would push out are dear to rebuild. A
job between turns whose context is at most :attr:`JobAdmission.min_held_tokens` (the engine
passes its step budget: one step rebuilds such a context) keeps its rank but reserves nothing,
provided that jobs stay that short: the median final context of the last jobs that finished is
within it too. Letting a younger job evict such a job costs the older one at most a step when
it returns, while holding the younger one back costs it a whole wait (chat and tool loops,
whose contexts stay short, lose more to the wait than they gain in hits). Jobs whose histories
grow long (coding agents) start short too: there a short context is only a job's first turns,
and the gate reserves it, or the young jobs it let in would have to stop later, once grown.
Until a job has finished, every idle job reserves its context.

A prefix several jobs share (a system prompt, a tool set's documentation) is one set of blocks
in the pool, but the gate charges it to every job that holds it: that overcount is the room the
running jobs take as they grow, and where the pool binds it pays (counted once, SWE at 128
agents on 19,934 blocks took 147.9-162.5 s a job against 142.4, and a tool loop on 4,000 blocks
32.7 against 24.5 s). Where the pool does not bind, it only holds turns back: 256 tool-loop
agents sharing eight tool-set prompts were held on a pool never more than 42% full. So a
request whose job does not fit by that count is still admitted when, with each shared prefix
counted once (for the oldest reserving job that keys it), its job and the older ones need at
most half the pool: then even every job's own tokens doubling would fit. Not before
:attr:`JobAdmission.final_history` jobs have finished: early in a run every job is young and
short, whatever it will grow to (256 SWE agents starting at once on 19,934 blocks lost 1.6-3.4%
of mean job time with the rule on from the start).

With a host KV tier the gate counts more than the device pool, as far as the jobs it admits pause
(:attr:`JobAdmission.capacity_tokens`). A job in a tool pause needs no device blocks: its context
waits on the host and comes back by copy, so the device must hold only the share of the ranked
contexts that is in flight, and the gate admits ``device / (1 - pause share)``, the pause share
learned from the jobs themselves (:meth:`JobAdmission.pause_share`: each tool pause and each
turn's time holding the device, weighted by the context held). It is never more than the device
pool plus half of what the tier holds beyond it (:func:`gate_capacity_blocks`): the tier is
inclusive and admitted jobs grow past what they reserve, so a gate that fills the whole tier
makes the tier evict the contexts of running jobs, which then come back as holes. Until pauses
are seen, the tier counts for nothing. Where the user states a time-to-first-token target
(:attr:`JobAdmission.tier_for_ttft`), the gate counts that bound at once: holding jobs back is
the time-to-first-token tail, and with a tier the jobs let through come back by copy rather
than thrash (SWE with 256 GB at 128 agents: TTFT p99 12 s against 98 s learned, while JCT p90
is 209 s against 177 s).

Clients that never say ``is_last_step`` would hold their rank forever: a job with nothing in
flight for longer than :attr:`JobAdmission.idle_timeout_s` (learned from the gaps between
turns seen so far) leaves the ranking; if it comes back it ranks as a new job.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from asymcache_core.job_ranking import JobRanking, JobState
from asymcache_core.request import Request


def gate_capacity_blocks(device_blocks: int, host_blocks: int = 0) -> int:
    """The most blocks the job gate admits jobs against: the device pool, plus half of what a
    host tier holds beyond it (how much of that it uses: :attr:`JobAdmission.capacity_tokens`).

    NOTE: the tier is inclusive (it copies what the device evicts), so at most
    ``max(device, host)`` blocks of contexts can live on the two together. Filling all of it
    over-commits the host: admitted jobs grow past what they reserve, the host then evicts the
    contexts of running jobs and they come back as recomputed holes. Simulated H200, SWE at
    19,934 device blocks with a 64 GB tier (32,768 blocks), seed 1, mean JCT: counting all of
    the tier 117.5 / 225.7 s at 128 / 256 agents (2.45M hole tokens at 256), none of it
    121.6 / 173.1, half of it 114.4 / 167.3 (no tier: 126.8 / 183.1).

    Args:
        device_blocks: blocks of the device pool.
        host_blocks: slots of the host tier (0: no tier).

    Returns:
        The bound in blocks, at least ``device_blocks``.
    """
    if device_blocks <= 0:
        raise ValueError(f"device_blocks: must be positive, got {device_blocks!r}")
    if host_blocks < 0:
        raise ValueError(f"host_blocks: must be >= 0, got {host_blocks!r}")
    return device_blocks + max(0, host_blocks - device_blocks) // 2


class JobAdmission(JobRanking):
    """Admission of whole jobs against the pool's capacity, oldest job first.

    Invariants (:meth:`check_integrity`):
      - ``jobs`` is ordered by first admission and holds each job once;
      - a job's ``in_flight`` count is its admitted, unfinished requests (never negative);
      - the oldest job, requests without a ``job_id``, jobs that fit, and any request while
        nothing runs (holding back only pays while other jobs use the pool) are never held back;
      - ``final_tokens`` holds at most ``final_history`` final contexts, of jobs that finished;
      - a job's shared prefix is at most its context, and is keyed exactly when it is not empty;
      - a request that does not fit by the per-job count passes only if the count with each
        shared prefix once is within half the pool, and ``final_history`` jobs have finished.

    Args:
        capacity_tokens: the device pool's size in tokens (blocks x block size).
        tier_tokens: the most a host tier adds to it (:func:`gate_capacity_blocks` less the
            device pool, in tokens; 0: no tier); how much it adds is learned
            (:attr:`capacity_tokens`).
        min_idle_timeout_s: the floor of :attr:`idle_timeout_s`.
        min_held_tokens: a job with nothing in flight reserves its context only when it is
            longer than this or jobs do not stay that short (:meth:`jobs_stay_short`; 0: every
            ranked job reserves its context).
        final_history: finished jobs whose final contexts :meth:`jobs_stay_short` looks at.
        block_size: tokens per KV block (``request.block_hashes`` hash whole blocks).
        min_pauses: tool pauses seen before the tier counts (:meth:`pause_share`).
        pause_window: the latest pauses and turns :meth:`pause_share` weighs.
        tier_for_ttft: a time-to-first-token target is stated: the gate counts all of
            ``tier_tokens`` from the start (fewer turns held, more job time).
    """

    def __init__(
        self,
        capacity_tokens: int,
        *,
        tier_tokens: int = 0,
        min_idle_timeout_s: float = 30.0,
        min_held_tokens: int = 0,
        final_history: int = 64,
        block_size: int = 16,
        min_pauses: int = 64,
        pause_window: int = 512,
        tier_for_ttft: bool = False,
    ) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens: must be positive, got {capacity_tokens!r}")
        if tier_tokens < 0:
            raise ValueError(f"tier_tokens: must be >= 0, got {tier_tokens!r}")
        if min_pauses < 1:
            raise ValueError(f"min_pauses: must be >= 1, got {min_pauses!r}")
        if pause_window < min_pauses:
            raise ValueError(f"pause_window: must be >= min_pauses ({min_pauses}), got {pause_window!r}")
        if not min_idle_timeout_s > 0:
            raise ValueError(f"min_idle_timeout_s: must be positive, got {min_idle_timeout_s!r}")
        if min_held_tokens < 0:
            raise ValueError(f"min_held_tokens: must be >= 0, got {min_held_tokens!r}")
        if final_history < 1:
            raise ValueError(f"final_history: must be >= 1, got {final_history!r}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size!r}")
        super().__init__(block_size)
        self.device_tokens = capacity_tokens
        self.tier_tokens = tier_tokens
        self.min_pauses = min_pauses
        self.tier_for_ttft = tier_for_ttft
        #: context-weighted seconds of the latest tool pauses (a job's release to its next
        #: request's arrival) and turns (first scheduled to release), x tokens held
        self._pauses: deque[float] = deque(maxlen=pause_window)
        self._turns: deque[float] = deque(maxlen=pause_window)
        self._capacity = capacity_tokens + (tier_tokens if tier_for_ttft else 0)
        self.min_idle_timeout_s = min_idle_timeout_s
        self.min_held_tokens = min_held_tokens
        self.final_history = final_history
        #: final contexts of the last jobs that finished (their last step released), oldest first
        self.final_tokens: deque[int] = deque(maxlen=final_history)
        self._stay_short: bool | None = None
        self._gaps: deque[float] = deque(maxlen=256)
        # NOTE: jobs that idled out, with their last release: a gap longer than the timeout
        # is learned when such a job returns, so the timeout can grow past a too-short start.
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._max_expired = 4096
        self.num_held_back = 0  # admission attempts the gate refused
        self.num_expired = 0  # jobs that left the ranking by idling
        self._expired_scan: tuple[float, int] | None = None

    @property
    def idle_timeout_s(self) -> float:
        """Idle time after which a job with nothing in flight leaves the ranking:
        three times the longest of the last 256 gaps between a job's turns, at least
        ``min_idle_timeout_s``."""
        return max(self.min_idle_timeout_s, 3.0 * max(self._gaps, default=0.0))

    @property
    def capacity_tokens(self) -> int:
        """The tokens the gate admits jobs against: the device pool, plus as much of
        :attr:`tier_tokens` as the jobs' pauses leave on the host:
        ``device x share / (1 - share)`` with the :meth:`pause_share` (the device then holds
        the contexts in flight), that scaled by the ranked jobs' :meth:`overcount` where jobs
        stay short (:meth:`jobs_stay_short`), and at most ``device + tier_tokens``; the device
        pool alone until ``min_pauses`` pauses are seen; all of it with :attr:`tier_for_ttft`.

        NOTE: a fixed half of a large tier is too much: simulated H200, SWE, 19,934 device
        blocks and a 256 GB tier, seeds 1-3, 4.3x the device pool served 88 agents within the
        JCT p90 target (101 without a tier); learned, 1.5-1.7x it, 104.
        """
        # NOTE: _capacity is the device pool without a tier or before min_pauses: nothing to scale
        if self.tier_for_ttft or self._capacity == self.device_tokens or not self.jobs_stay_short():
            return self._capacity
        # NOTE: the gate counts a shared prefix once for every job that holds it, the device
        # holds it once. Where jobs grow long that overcount is the room they grow into (module
        # docstring; SWE with a 256 GB tier lost 9 of 106 agents within its JCT p90 target
        # with the capacity scaled by it); where they stay short it only holds back turns the
        # device has room for, so the learned capacity is scaled by it. Simulated H200, a tool
        # loop on 1,200 device blocks and a 4,800-block tier, 48 agents sharing eight tool-set
        # prompts: mean JCT 5.89 s unscaled, 4.88 s scaled (vllm-apc with an LRU tier 4.68).
        ratio = self.overcount()
        return min(self.device_tokens + self.tier_tokens, int(self._capacity * ratio))

    def pause_share(self) -> float | None:
        """The share of the latest jobs' time spent in tool pauses, each pause and each turn
        (from its first step to its release) weighted by the context the job held; None before
        ``min_pauses`` pauses were seen."""
        if len(self._pauses) < self.min_pauses:
            return None
        paused = sum(self._pauses)
        total = paused + sum(self._turns)
        return paused / total if total > 0 else None

    def _update_capacity(self) -> None:
        share = self.pause_share()
        if self.tier_for_ttft or share is None:
            return  # the whole bound, or the device pool, fixed from the start
        extra = self.tier_tokens if share >= 1.0 else int(self.device_tokens * share / (1.0 - share))
        self._capacity = self.device_tokens + min(self.tier_tokens, extra)

    def jobs_stay_short(self) -> bool:
        """Whether the median final context of the last :attr:`final_history` finished jobs
        is at most :attr:`min_held_tokens` (False before any job finished)."""
        if self._stay_short is None:
            finals = sorted(self.final_tokens)
            self._stay_short = bool(finals) and finals[(len(finals) - 1) // 2] <= self.min_held_tokens
        return self._stay_short

    def reserves(self, job: JobState) -> bool:
        """Whether ``job`` holds its context in the gate's sum: while it has a request in
        flight, its context is longer than :attr:`min_held_tokens`, or jobs do not stay that
        short (:meth:`jobs_stay_short`)."""
        return bool(job.in_flight) or job.tokens > self.min_held_tokens or not self.jobs_stay_short()

    def admits(self, request: Request, now: float, *, engine_idle: bool = False) -> bool:
        """Whether ``request`` may be admitted now (it fits with every older job).

        Args:
            request: a waiting request.
            now: engine time (for the idle expiry).
            engine_idle: nothing runs: the request passes (work conservation: a client that
                drives its jobs one after another must not wait for the idle expiry).

        Returns:
            True for requests without a job, for the oldest job, while the contexts of
            ``request``'s job and of every job ranked before it (those they reserve:
            :meth:`reserved_tokens`) fit ``capacity_tokens``, or while they fit half of it with
            each shared prefix counted once (once ``final_history`` jobs have finished).
        """
        job_id = request.job_id
        if job_id is None or engine_idle:
            return True
        self.expire(now)
        older = self._tokens_before(job_id)
        if older == 0:
            return True
        job = self.jobs.get(job_id)
        own = max(request.num_tokens, job.tokens if job is not None else 0)
        if older + own <= self.capacity_tokens or self._fits_half_pool_unique(request, job_id, job, own):
            return True
        self.num_held_back += 1
        return False

    def _fits_half_pool_unique(self, request: Request, job_id: str, job: JobState | None, own: int) -> bool:
        """Whether, with each shared prefix counted once, ``request``'s job (``own`` tokens)
        and the jobs ranked before it need at most half the pool, once ``final_history`` jobs
        have finished.

        NOTE: the per-job count (every shared prefix once a job) did not fit; this one fitting
        half the pool says the pool does not bind (module docstring). Before final_history jobs
        finished, every job is young and short, whatever it will grow to.
        """
        if len(self.final_tokens) < self.final_history:
            return False
        older = self._unique_before(job_id)
        if job is None:
            own -= self._shared_with_ranked(request)
        elif job_id in self._prefix_from_older:
            own -= job.shared_tokens  # counted with the older job that brings it in
        return 2 * (older + own) <= self.capacity_tokens

    def on_admitted(self, request: Request, now: float, *, cached_prefix_tokens: int = 0) -> None:
        """``request`` holds its blocks now (its first admission or one after a preemption).

        Args:
            request: the admitted request.
            now: engine time.
            cached_prefix_tokens: the leading tokens it found cached (whole blocks, hashed in
                ``request.block_hashes``); for the first request of a job, a prefix other
                jobs hold too.
        """
        job_id = request.job_id
        if job_id is None:
            return
        self._version += 1
        job = self.jobs.get(job_id)
        if job is None:
            left_at = self._expired.pop(job_id, None)
            if left_at is not None:
                self._gaps.append(max(0.0, now - left_at))
            job = self.jobs[job_id] = JobState(request.num_tokens)
            num_blocks = min(len(request.block_hashes), cached_prefix_tokens // self.block_size)
            if num_blocks > 0:
                job.shared_tokens = num_blocks * self.block_size
                job.shared_key = request.block_hashes[num_blocks - 1]
        elif job.in_flight == 0 and job.last_release is not None:
            self._gaps.append(max(0.0, now - job.last_release))
            if not request.admitted_once and self.tier_tokens:
                # NOTE: the client's pause (release to the next arrival), not the wait after it
                pause = max(0.0, request.metrics.arrival_time - job.last_release)
                self._pauses.append(pause * job.tokens)
                self._update_capacity()
        job.in_flight += 1
        job.tokens = max(job.tokens, request.num_tokens)

    def on_released(self, request: Request, now: float, *, preempted: bool = False) -> None:
        """``request`` gave its blocks back: finished, aborted, or ``preempted`` (it will be
        admitted again). A finished last step ends its job."""
        job = self.jobs.get(request.job_id) if request.job_id is not None else None
        if job is None:
            return
        self._version += 1
        job.in_flight = max(0, job.in_flight - 1)
        if preempted:
            return
        job.tokens = max(job.tokens, request.num_tokens)
        job.last_release = now
        started = request.metrics.first_scheduled_time
        if self.tier_tokens and started is not None:
            self._turns.append(max(0.0, now - started) * job.tokens)
            self._update_capacity()
        if request.is_last_step and job.in_flight == 0:
            del self.jobs[request.job_id]  # type: ignore[arg-type]
            self.final_tokens.append(job.tokens)
            self._stay_short = None

    def end_job(self, job_id: str) -> None:
        """A job is over without a last step saying so: it leaves the ranking now, as a
        finished job, if nothing of it is in flight (else its next release or expiry does).

        Args:
            job_id: the job.
        """
        job = self.jobs.get(job_id)
        if job is None or job.in_flight:
            return
        del self.jobs[job_id]
        self._version += 1
        self.final_tokens.append(job.tokens)
        self._stay_short = None

    def expire(self, now: float) -> list[str]:
        """Drops the jobs idle past :attr:`idle_timeout_s`; returns their ids."""
        if self._expired_scan == (now, self._version):
            return []  # nothing changed since the scan at this instant
        timeout = self.idle_timeout_s
        idle = [
            job_id
            for job_id, job in self.jobs.items()
            if job.in_flight == 0 and job.last_release is not None and now - job.last_release > timeout
        ]
        for job_id in idle:
            self._expired[job_id] = self.jobs.pop(job_id).last_release  # type: ignore[assignment]
        while len(self._expired) > self._max_expired:
            self._expired.popitem(last=False)
        self.num_expired += len(idle)
        if idle:
            self._version += 1
        self._expired_scan = (now, self._version)
        return idle

    def check_integrity(self) -> None:
        """Asserts the invariants of the class docstring."""
        assert all(job.in_flight >= 0 for job in self.jobs.values()), "negative in-flight count"
        assert all(job.tokens > 0 for job in self.jobs.values()), "a ranked job with no context"
        self._check_prefix_sums()
        assert not set(self.jobs) & set(self._expired), "a job both ranked and expired"
        assert len(self._expired) <= self._max_expired, "expired jobs past their bound"
        assert len(self.final_tokens) <= self.final_history, "final contexts past their bound"
        assert all(tokens > 0 for tokens in self.final_tokens), "a finished job with no context"
        assert self.device_tokens <= self.capacity_tokens <= self.device_tokens + self.tier_tokens, (
            "the gate's capacity outside the device pool plus the tier's part"
        )
