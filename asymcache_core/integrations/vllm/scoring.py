"""AsymCache's score of a vLLM block (the embedded policy's ``expected_latency_cost``), by group.

Blocks whose content was used by the same jobs (and last freed by the same job) share every
per-job term of the score: only their position differs, and the score is affine in it. The free
queue uses that to order a whole group of candidates at once (:meth:`BlockScorer.group_terms`)
instead of scoring every block at every eviction, and bounds a group's score ahead in time
(:meth:`BlockScorer.group_bound`) so that an eviction prices only the groups near the bottom.

How a group's score depends on time: ``score(t) = P(reuse, t) x (fixed + slope x position)``,
and only ``P(reuse, t)`` reads the clock. A job's P(reuse) is constant (the prior, 0 once
finished, 1 while it runs or before its first finish) or, while it is idle with an expected gap
``g``, ``base x exp(-max(0, idle - 1.5 s) / s)`` with ``s = max(g, 1e-3)``: constant until
``last_finish + 1.5 s``, then decaying at rate ``1/s``. A shared block's ``1 - prod(1 - p_j)``
is non-increasing in each ``p_j``. So between two events of the jobs (arrival, finish, hint,
drop, or a new gap of any job for jobs that read the global mean), every group's score is
non-increasing in time, and groups whose jobs decay at different rates change order as time
passes (no time-invariant key orders them all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

#: Group key: the jobs that used a block (in the order its set iterates them, so the product
#: over them is the per-block score's to the bit) and the job that last freed it.
GroupKey = tuple[tuple[str, ...], "str | None"]

#: Positions up to which a ``strict`` group's order by position is checked to be its score order.
_MAX_POSITION = 1 << 31
#: Relative slack under a decaying group's bound: libm's ``exp`` is within an ulp of exact but
#: not proven monotone, and ``1 - prod(1 - p)`` can magnify a 1-ulp step (cancellation).
_BOUND_SLACK = 2.0**-20
#: Horizons of a bound, in decay scales: at least this many ...
_MIN_HORIZON = 0.5
#: ... and at most this many (a bound far below today's score is explored for nothing).
_MAX_HORIZON = 32.0


class FreeBlock(Protocol):
    """What the queue reads of a block (vLLM's ``KVCacheBlock`` has all of it)."""

    block_id: int
    ref_cnt: int

    @property
    def block_hash(self) -> Hashable | None: ...


class GroupBound(NamedTuple):
    """A lower bound of a group's scores ahead in time (:meth:`BlockScorer.group_bound`).

    Attributes:
        score: no block of the group at ``position >= min_position`` scores below it at any
            time ``t <= until`` (until an event of the group's jobs).
        until: the last time it holds (``inf``: until an event).
        exact: P(reuse) stays what it is now until ``until``: the score at ``min_position`` is
            exactly ``score``, and the group orders its blocks as now.
        reads_global: a job of the group reads the gaps of all jobs (no gaps or hint of its
            own): a new gap of any job re-prices it.
        terms: the group's terms at the pricing time (a walk at that time reuses them).
    """

    score: float
    until: float
    exact: bool
    reads_global: bool
    terms: GroupTerms


class GroupTerms(NamedTuple):
    """A group's score terms at one time: ``score(position) = expected_latency_cost(p_reuse,
    position, block_size, base_tokens)``.

    Attributes:
        p_reuse: P(reuse) of the group's blocks.
        base_tokens: the job's expected next new tokens.
        order: ``flat`` (every position scores the same: order by recency), ``strict`` (the
            score strictly grows with position, in floating point too: order by position, then
            recency) or ``exact`` (neither is certain: score every block).
        fixed: the rebuild latency at position 0 (the model's ``block_rebuild_line``).
        slope: the rebuild latency per position.
    """

    p_reuse: float
    base_tokens: int
    order: str
    fixed: float
    slope: float


@dataclass
class BlockInfo:
    """What the scorer knows of a cached block's content.

    Attributes:
        position: logical block index in its sequence (depth in the hash chain).
        job_id: the job that last freed it (``None``: no job id).
        jobs: every job that used it (a shared prefix is reused if any comes back).
    """

    position: int = 0
    job_id: str | None = None
    jobs: set[str] = field(default_factory=set)


class BlockScorer:
    """AsymCache's score of a vLLM block: the embedded policy's ``expected_latency_cost``.

    Args:
        job_stats: per-job reuse statistics (P(reuse), next turn size).
        latency: step-latency model of the served model.
        block_size: tokens per block.
    """

    def __init__(self, job_stats: JobStats, latency: LatencyModel, block_size: int) -> None:
        self.job_stats = job_stats
        self.latency = latency
        self.block_size = block_size
        self.info: dict[int, BlockInfo] = {}
        #: Called with a block id whose group or position may have changed (the free queue
        #: re-files a free block with it).
        self.listener: Callable[[int], None] | None = None
        #: Called with a job id whose statistics changed (``None``: the gaps of all jobs), from
        #: the job statistics' watcher, which this scorer takes (the free queue re-prices the
        #: groups of that job with it).
        self.job_listener: Callable[[str | None], None] | None = None
        self._lines: dict[int, tuple[float, float, bool]] = {}
        job_stats.watcher = self._on_job_change

    def _on_job_change(self, job_id: str | None) -> None:
        if self.job_listener is not None:
            self.job_listener(job_id)

    def watching(self) -> bool:
        """Whether the job statistics still report their changes to this scorer (a second
        scorer of the same statistics takes their watcher over)."""
        return getattr(self.job_stats, "watcher", None) == self._on_job_change

    @staticmethod
    def jobs_of(group: GroupKey) -> tuple[str, ...]:
        """The jobs whose statistics a group's score reads (P(reuse) and next turn size)."""
        jobs, job_id = group
        return jobs if job_id is None or job_id in jobs else (*jobs, job_id)

    def annotate(self, block_ids: Sequence[int], job_id: str | None) -> None:
        """Records a request's blocks (in sequence order) as used by ``job_id``.

        Args:
            block_ids: the request's block ids, block ``i`` at logical index ``i``.
            job_id: its job id, or ``None``.
        """
        listener = self.listener
        for position, block_id in enumerate(block_ids):
            info = self.info.get(block_id)
            if info is None or info.position != position:
                info = self.info[block_id] = BlockInfo(position=position)
            elif info.job_id == job_id and (job_id is None or job_id in info.jobs):
                continue  # NOTE: nothing changed: no re-filing
            info.job_id = job_id
            if job_id is not None:
                info.jobs.add(job_id)
            if listener is not None:
                listener(block_id)

    def forget(self, block_id: int) -> None:
        """The block's content is gone."""
        if self.info.pop(block_id, None) is not None and self.listener is not None:
            self.listener(block_id)

    def clear(self) -> None:
        """Every block's content is gone (a prefix-cache reset)."""
        self.info.clear()

    def position(self, block_id: int) -> int:
        """Logical index of the block's content (0 when unknown)."""
        info = self.info.get(block_id)
        return 0 if info is None else info.position

    def group_of(self, block_id: int) -> GroupKey:
        """The group whose terms price ``block_id`` (an unknown block: no jobs, no job)."""
        info = self.info.get(block_id)
        if info is None:
            return ((), None)
        return (tuple(info.jobs), info.job_id)

    def group_terms(self, group: GroupKey, now: float) -> GroupTerms:
        """The terms of a group's score at ``now``, and how its blocks order among themselves.

        Args:
            group: a :meth:`group_of` key.
            now: the clock of the job statistics.

        Returns:
            The terms; :meth:`score_at` prices a position with them.
        """
        # NOTE: runs once per group at every eviction: a NamedTuple, not a dataclass, is cheap.
        jobs, job_id = group
        p_reuse = self.job_stats.block_reuse_probability(jobs, job_id, now)
        base = self.job_stats.expected_next_tokens(job_id)
        fixed, slope, steady = self._line(base)
        if p_reuse <= 0.0 or slope == 0.0:
            # NOTE: expected_latency_cost is 0.0, or fixed + 0.0 * position == fixed: no
            # position changes the score.
            order = "flat"
        else:
            order = "strict" if steady and p_reuse >= 1e-100 else "exact"
        return GroupTerms(p_reuse, base, order, fixed, slope)

    def _line(self, base_tokens: int) -> tuple[float, float, bool]:
        """The rebuild line ``(fixed, slope)`` for ``base_tokens`` and whether its rounded values
        strictly grow with position (memoised: it depends on ``base_tokens`` alone)."""
        got = self._lines.get(base_tokens)
        if got is None:
            fixed, slope = self.latency.block_rebuild_line(self.block_size, base_tokens)
            # NOTE: order by position is the score order only if the rounded scores of adjacent
            # positions never tie: ``fixed + slope * q`` and ``p * (.)`` each round by half an
            # ulp of the largest value, so a step of more than 8 ulps keeps them apart.
            top = fixed + slope * _MAX_POSITION
            steady = (
                slope > 0.0 and fixed >= 0.0 and math.isfinite(top) and slope > 8.0 * math.ulp(top)
            )
            if len(self._lines) >= 4096:
                self._lines.clear()  # NOTE: bounded; turn sizes repeat in practice
            got = self._lines[base_tokens] = (fixed, slope, steady)
        return got

    def group_bound(
        self,
        group: GroupKey,
        min_position: int,
        now: float,
        level: float,
        terms: GroupTerms | None = None,
    ) -> GroupBound:
        """A lower bound of the group's scores from ``now`` to a horizon, with that horizon.

        Why it holds: ``P(reuse, t)`` is non-increasing in ``t`` between events of the jobs (see
        the module's docstring; in floating point every step is a monotone rounding but libm's
        ``exp``, hence the slack), and with ``fixed >= 0`` and ``slope >= 0`` the rounded
        ``p x (fixed + slope x q)`` is non-decreasing in ``p`` and in ``q``. So the score at the
        horizon ``u`` of the group's lowest position bounds every block's score at every
        ``t <= u``. When P(reuse) at ``u`` equals P(reuse) at ``now`` to the bit, nothing moved
        in between: the bound is exact (no slack) and ties between groups keep their recency
        order.

        The horizon only decides how soon the group is re-priced: the end of a constant phase
        (the first job's ``last_finish + 1.5 s``) for a group whose score is near ``level``
        (the latest victim's score); half a decay scale for a decaying one; and for a group far
        above ``level``, about the time its fastest decay takes to bring it there (it cannot be
        a victim sooner, so its loose bound costs nothing).

        Args:
            group: a :meth:`group_of` key.
            min_position: the lowest position among the group's blocks.
            now: the clock of the job statistics.
            level: the score of the latest victim (``-inf``: none yet).
            terms: the group's :meth:`group_terms` at ``now``, when the caller has them.

        Returns:
            The bound; ``score`` is ``-inf`` for a latency line with a negative term (no
            monotonicity to rely on: the group is always priced).
        """
        if terms is None:
            terms = self.group_terms(group, now)
        start, scale, reads_global = self._decay(group, now)
        head = self.score_at(terms, min_position)
        if scale is None or terms.p_reuse <= 0.0:
            until = math.inf  # NOTE: no estimate reads the clock (or P(reuse) is already 0)
        else:
            if level == -math.inf or head <= 0.0:
                ahead = 0.0  # NOTE: no victim yet (no level to stay above): a short horizon
            else:
                ahead = math.log(head / level) - 0.25 if level > 0.0 else _MAX_HORIZON
            if ahead >= _MIN_HORIZON:
                until = max(now, start) + scale * min(ahead, _MAX_HORIZON)
            elif start > now:
                # NOTE: just before the first decay starts: the score there is the score now.
                until = max(now, start - (abs(start) + 1.0) * 2.0**-40)
            else:
                until = now + scale * _MIN_HORIZON
        if terms.fixed < 0.0 or terms.slope < 0.0:
            return GroupBound(-math.inf, until, False, reads_global, terms)
        # NOTE: no job reads the clock (the mirror says so; the randomized tests hold it to
        # JobStats), or P(reuse) is 0 and cannot fall: the terms at the horizon are today's.
        fixed = until == now or scale is None or terms.p_reuse <= 0.0
        ahead_terms = terms if fixed else self.group_terms(group, until)
        late = self.score_at(ahead_terms, min_position)
        if ahead_terms.p_reuse == terms.p_reuse:
            # NOTE: P(reuse) did not move (it cannot go down and back up): every block scores
            # and orders as now until the horizon. Equal head scores alone would not do: a
            # P(reuse) that reaches 0 turns a group flat, ordered by recency, not position.
            return GroupBound(late, until, True, reads_global, terms)
        return GroupBound(late - late * _BOUND_SLACK, until, False, reads_global, terms)

    def _decay(self, group: GroupKey, now: float) -> tuple[float, float | None, bool]:
        """When the group's score may start to fall and how fast (a mirror of
        :meth:`~asymcache_core.job_stats.JobStats.reuse_probability`'s branches; it only picks
        horizons: a bound is always the score at its horizon).

        Returns:
            ``(start, scale, reads_global)``: the earliest decay start (``-inf``: some job
            decays already), the smallest decay scale among the jobs with an estimate
            (``None``: none has one, the score is constant until an event), and whether some
            job may read the gaps of all jobs.
        """
        jobs, job_id = group
        stats = self.job_stats
        start, scale, reads_global = math.inf, None, False
        readers: Iterable[str] = jobs if jobs else ((job_id,) if job_id is not None else ())
        for job in readers:
            state = stats.jobs.get(job)
            if state is None:
                continue
            if state.expected_gap is None and not state.gaps:
                reads_global = True  # NOTE: a superset of the jobs that read it (safe)
            if state.finished or state.running > 0 or state.last_finish is None:
                continue
            if state.expected_gap is not None:
                expected = state.expected_gap
            elif state.gaps:
                expected = sum(state.gaps) / len(state.gaps)
            elif stats.global_gaps:
                expected = sum(stats.global_gaps) / len(stats.global_gaps)
            else:
                continue
            job_scale = max(expected, 1e-3)
            begins = state.last_finish + 1.5 * job_scale
            start = min(start, -math.inf if now - state.last_finish > 1.5 * job_scale else begins)
            scale = job_scale if scale is None else min(scale, job_scale)
        return start, scale, reads_global

    def score_at(self, terms: GroupTerms, position: int) -> float:
        """The score of the block at ``position`` of a group with ``terms``.

        Args:
            terms: :meth:`group_terms`.
            position: the block's logical index.

        Returns:
            Expected latency (seconds) that evicting it adds to the future.
        """
        # NOTE: expected_latency_cost(p, position, ...) to the bit: p x the model's
        # block_rebuild_latency, which is fixed + slope x position on block_rebuild_line.
        if terms.p_reuse <= 0.0:
            return 0.0
        return terms.p_reuse * (terms.fixed + terms.slope * position)

    def score(self, block: FreeBlock, now: float) -> float:
        """Expected latency (seconds) that evicting ``block`` now adds to the future.

        Args:
            block: a free cached block.
            now: the clock of the job statistics.

        Returns:
            ``P(reuse) x marginal rebuild latency``; a block never annotated counts as a
            no-job block at position 0 (the job prior).
        """
        terms = self.group_terms(self.group_of(block.block_id), now)
        return self.score_at(terms, self.position(block.block_id))
