"""AsymCache's score of a vLLM block (the embedded policy's ``expected_latency_cost``), by group.

Blocks whose content was used by the same jobs (and last freed by the same job) share every
per-job term of the score: only their position differs, and the score is affine in it. The free
queue uses that to order a whole group of candidates at once (:meth:`BlockScorer.group_terms`)
instead of scoring every block at every eviction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

#: Group key: the jobs that used a block (in the order its set iterates them, so the product
#: over them is the per-block score's to the bit) and the job that last freed it.
GroupKey = tuple[tuple[str, ...], "str | None"]

#: Positions up to which a ``strict`` group's order by position is checked to be its score order.
_MAX_POSITION = 1 << 31


class FreeBlock(Protocol):
    """What the queue reads of a block (vLLM's ``KVCacheBlock`` has all of it)."""

    block_id: int
    ref_cnt: int

    @property
    def block_hash(self) -> Hashable | None: ...


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
        self._lines: dict[int, tuple[float, float, bool]] = {}

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
            steady = slope > 0.0 and fixed >= 0.0 and math.isfinite(top) and slope > 8.0 * math.ulp(top)
            if len(self._lines) >= 4096:
                self._lines.clear()  # NOTE: bounded; turn sizes repeat in practice
            got = self._lines[base_tokens] = (fixed, slope, steady)
        return got

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
