"""The job gate's fit accounting: the ranked jobs' contexts, summed in rank order.

:class:`JobRanking` keeps the jobs in the order of their first admission and the prefix sums the
gate (:class:`~asymcache_core.job_admission.JobAdmission`) compares with the pool: what the jobs
ranked before each job reserve, once counting every shared prefix once a job and once counting
each shared prefix once (for the oldest reserving job that keys it). Which jobs reserve their
context, and when a request is admitted, is the gate's policy (:mod:`asymcache_core.job_admission`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from asymcache_core.request import Request


@dataclass
class JobState:
    """A ranked job: its latest context, its requests in flight, its shared prefix."""

    tokens: int
    in_flight: int = 0
    last_release: float | None = None
    #: the leading tokens its first request found cached (a prefix another job also holds,
    #: such as a shared system prompt), and the hash of their last block: the gate counts a
    #: shared prefix once, for the oldest ranked job that holds it
    shared_tokens: int = 0
    shared_key: int | None = None


class JobRanking:
    """The ranked jobs and the prefix sums of what they reserve, recomputed once per change.

    Args:
        block_size: tokens per KV block (``request.block_hashes`` hash whole blocks).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.jobs: OrderedDict[str, JobState] = OrderedDict()
        # NOTE: a scheduling pass asks about every waiting request, but the ranking changes only
        # on admissions, releases and expiries: the tokens of the jobs ranked before each job
        # (and the expiry scan at one instant) are computed once per change, not once a request.
        self._version = 0
        self._older: dict[str, int] = {}
        #: each shared prefix's key -> the oldest reserving job that keys it (it brings it in)
        self._key_owner: dict[int, str] = {}
        #: the jobs whose shared prefix a reserving job ranked before them brings in
        self._prefix_from_older: set[str] = set()
        self._older_total = 0
        #: the same prefix sums with each shared prefix counted once
        self._older_unique: dict[str, int] = {}
        self._older_unique_total = 0
        self._older_version = -1

    @property
    def num_jobs(self) -> int:
        """Jobs in the ranking (running, between turns, or held back between turns)."""
        return len(self.jobs)

    def reserves(self, job: JobState) -> bool:
        """Whether ``job`` holds its context in the sums: here every ranked job does (the gate
        decides otherwise: :meth:`~asymcache_core.job_admission.JobAdmission.reserves`)."""
        return True

    def reserved_tokens(self, job: JobState) -> int:
        """The tokens ``job`` holds in the gate's sum when it :meth:`reserves` (else none): its
        context."""
        return job.tokens if self.reserves(job) else 0

    def ranked_tokens(self) -> int:
        """Sum of the ranked jobs' latest context lengths."""
        return sum(job.tokens for job in self.jobs.values())

    def overcount(self) -> float:
        """The ranked jobs' contexts as the gate sums them (each shared prefix once a job) over
        the same sum with each shared prefix once: at least 1."""
        if self._older_version != self._version:
            self._recount()
        if self._older_unique_total <= 0:
            return 1.0
        return max(1.0, self._older_total / self._older_unique_total)

    def _tokens_before(self, job_id: str) -> int:
        """Sum of what the jobs ranked before ``job_id`` reserve (all ranked jobs for a job not
        in the ranking yet)."""
        if self._older_version != self._version:
            self._recount()
        return self._older.get(job_id, self._older_total)

    def _unique_before(self, job_id: str) -> int:
        """:meth:`_tokens_before` with each shared prefix counted once."""
        if self._older_version != self._version:
            self._recount()
        return self._older_unique.get(job_id, self._older_unique_total)

    def _shared_with_ranked(self, request: Request) -> int:
        """The leading tokens of a new job's ``request`` that are a prefix a reserving ranked
        job brought in (its hashed blocks up to the last one that is such a prefix's key).

        NOTE: block hashes are chained, so a request whose block at a key's position has the
        key's hash holds the whole prefix that key ends.
        """
        if self._older_version != self._version:
            self._recount()
        hashes = request.block_hashes
        shared = 0
        for key, owner in self._key_owner.items():
            tokens = self.jobs[owner].shared_tokens
            n = tokens // self.block_size
            if tokens > shared and len(hashes) >= n and hashes[n - 1] == key:
                shared = tokens
        return shared

    def _recount(self) -> None:
        """The prefix sums of :meth:`_tokens_before` and :meth:`_unique_before`, in rank order:
        a reserving job adds what it reserves to the first; to the second the same less its
        shared prefix, plus that prefix if no older reserving job brought it in."""
        self._older.clear()
        self._older_unique.clear()
        self._key_owner.clear()
        self._prefix_from_older.clear()
        total = unique = 0
        for other_id, other in self.jobs.items():
            self._older[other_id] = total
            self._older_unique[other_id] = unique
            if other.shared_key in self._key_owner:
                self._prefix_from_older.add(other_id)
            if not self.reserves(other):
                continue
            total += other.tokens
            unique += other.tokens - other.shared_tokens
            if other.shared_key is not None and other.shared_key not in self._key_owner:
                self._key_owner[other.shared_key] = other_id
                unique += other.shared_tokens
        self._older_total = total
        self._older_unique_total = unique
        self._older_version = self._version

    def _check_prefix_sums(self) -> None:
        """Asserts that the prefix sums, where current, are those of the ranking, and that each
        job's shared prefix is at most its context and keyed exactly when it is not empty."""
        if self._older_version == self._version:
            total = unique = 0
            owners: dict[int, str] = {}
            for job_id, job in self.jobs.items():
                assert self._older.get(job_id) == total, f"stale prefix sum for job {job_id!r}"
                assert self._older_unique.get(job_id) == unique, f"stale unique prefix sum for job {job_id!r}"
                if self.reserves(job):
                    total += self.reserved_tokens(job)
                    unique += self.reserved_tokens(job) - job.shared_tokens
                    if job.shared_key is not None and job.shared_key not in owners:
                        owners[job.shared_key] = job_id
                        unique += job.shared_tokens
            assert self._key_owner == owners, "stale owners of the shared prefixes"
            assert self._older_total == total, "stale total of the ranked contexts"
            assert self._older_unique_total == unique <= total, "stale unique total of the ranked contexts"
        for job in self.jobs.values():
            assert 0 <= job.shared_tokens <= job.tokens, "a shared prefix longer than its context"
            assert (job.shared_key is None) == (job.shared_tokens == 0), "a shared prefix without its key"
