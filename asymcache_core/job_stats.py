"""Per-job reuse statistics, learned online, that eviction policies consult.

A job is whatever shares a ``job_id``: an agent's turns or a chat's messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field


@dataclass
class JobState:
    """What the engine knows about one job (a chat or an agent job).

    Attributes:
        last_active: engine time of its last request arrival or finish.
        last_finish: when its last request finished (``None`` while one runs).
        running: requests of the job in flight.
        gaps: recent inter-turn gaps (finish -> next arrival), seconds.
        expected_gap: a hint from the runtime (e.g. the tool-duration estimate), seconds.
        finished: the job said its last step is done: its blocks will not be reused.
        new_tokens: recent per-turn new-token counts (the size of its next step).
        last_arrival: arrival time of its latest request.
        context_tokens: tokens its last finished request ended with (prompt + output).
    """

    last_active: float = 0.0
    last_finish: float | None = None
    running: int = 0
    gaps: list[float] = field(default_factory=list)
    expected_gap: float | None = None
    finished: bool = False
    new_tokens: list[int] = field(default_factory=list)
    last_arrival: float = 0.0
    context_tokens: int = 0


class JobStats:
    """Tracks jobs and estimates the probability that a job's blocks are reused.

    Args:
        prior_reuse: probability used for a job with no history.
        history: gaps and turn sizes kept per job.

    Attributes:
        watcher: called after every change of what :meth:`reuse_probability` and
            :meth:`expected_next_tokens` read: with the job's id, or with ``None`` when the
            gaps of all jobs changed (jobs without gaps of their own read them). The vLLM
            plugin's free queue re-prices only the score groups of the jobs it names.
    """

    def __init__(self, prior_reuse: float = 0.5, history: int = 16) -> None:
        self.prior_reuse = prior_reuse
        self.history = history
        self.jobs: dict[str, JobState] = {}
        self.global_gaps: list[float] = []
        self.watcher: Callable[[str | None], None] | None = None

    def _changed(self, job_id: str | None) -> None:
        if self.watcher is not None:
            self.watcher(job_id)

    def state(self, job_id: str) -> JobState:
        state = self.jobs.get(job_id)
        if state is None:
            state = self.jobs[job_id] = JobState()
            self._changed(job_id)  # NOTE: a known job's P(reuse) is no longer the prior
        return state

    def last_active(self, job_id: str, default: float) -> float:
        state = self.jobs.get(job_id)
        return default if state is None else state.last_active

    def drop_idle(
        self, now: float, idle_s: float, max_jobs: int, is_pinned: Callable[[str], bool]
    ) -> list[str]:
        """Forgets idle jobs (nothing in flight, not pinned): those idle past ``idle_s``, and
        while more than ``max_jobs`` are tracked, the longest idle down to 90% of it.

        Returns:
            The jobs dropped (the caller forgets them in its own tables).
        """
        idle = sorted(
            (st.last_active, job)
            for job, st in self.jobs.items()
            if st.running == 0 and not is_pinned(job)
        )
        drop = [job for last, job in idle if now - last > idle_s]
        if len(self.jobs) > max_jobs:
            extra = len(self.jobs) - len(drop) - int(0.9 * max_jobs)
            if extra > 0:
                dropped = set(drop)
                drop += [job for _, job in idle if job not in dropped][:extra]
        for job in drop:
            self.jobs.pop(job, None)
            self._changed(job)
        return drop

    def on_arrival(self, job_id: str, now: float, new_tokens: int) -> None:
        """A request of ``job_id`` arrived at ``now`` with ``new_tokens`` new tokens.

        A job that had ended (its last step, :attr:`JobState.finished`) is live again: the id
        came back (vLLM's ``session_id`` is a conversation's stable id, and a client may start
        a new task under an old job id).

        Args:
            job_id: the job.
            now: arrival time.
            new_tokens: the turn's new tokens (the size of the step that rebuilds its blocks).
        """
        state = self.state(job_id)
        if state.finished:
            # NOTE: without this the job's blocks score P(reuse) = 0 for as long as the id lives,
            # even while its new request runs. The pause since its last step is not a pause of
            # the job (it said it was done): not a gap sample, which would inflate its gaps.
            state.finished = False
            state.last_finish = None
        if state.last_finish is not None and state.running == 0:
            gap = max(0.0, now - state.last_finish)
            state.gaps = (state.gaps + [gap])[-self.history :]
            self.global_gaps = (self.global_gaps + [gap])[-256:]
            self._changed(None)
        state.new_tokens = (state.new_tokens + [new_tokens])[-self.history :]
        state.running += 1
        state.last_active = now
        state.last_arrival = now
        state.expected_gap = None
        self._changed(job_id)

    def turn_tokens(self, job_id: str, prompt_tokens: int) -> int:
        """New tokens of a prompt of ``prompt_tokens`` (its length beyond the context the
        job's last request ended with): the size of the step that will rebuild its blocks."""
        state = self.jobs.get(job_id)
        before = 0 if state is None else state.context_tokens
        return prompt_tokens - before if prompt_tokens >= before else prompt_tokens

    def on_finish(
        self, job_id: str, now: float, last_step: bool, context_tokens: int | None = None
    ) -> None:
        """The job's request ended at ``now`` with ``context_tokens`` tokens (when known)."""
        state = self.state(job_id)
        if context_tokens is not None:
            state.context_tokens = context_tokens
        state.running = max(0, state.running - 1)
        state.last_finish = now
        state.last_active = now
        if last_step:
            state.finished = True
        self._changed(job_id)

    def hint(
        self, job_id: str, expected_gap_s: float | None = None, finished: bool | None = None
    ) -> None:
        """Runtime hints: the next request is expected in ``expected_gap_s``; or the job is done."""
        state = self.state(job_id)
        if expected_gap_s is not None:
            state.expected_gap = max(0.0, expected_gap_s)
        if finished is not None:
            state.finished = finished
        self._changed(job_id)

    def expected_return(self, job_id: str) -> float | None:
        """When the job's next request is expected: its last finish plus the runtime's hint,
        else plus the mean of its own gaps; ``None`` while it runs, once it is done, or with
        no estimate yet."""
        state = self.jobs.get(job_id)
        if state is None or state.finished or state.running > 0 or state.last_finish is None:
            return None
        if state.expected_gap is not None:
            return state.last_finish + state.expected_gap
        if state.gaps:
            return state.last_finish + sum(state.gaps) / len(state.gaps)
        return None

    def expected_next_tokens(self, job_id: str | None) -> int:
        if job_id is None or job_id not in self.jobs:
            return 0
        sizes = self.jobs[job_id].new_tokens
        return int(sum(sizes) / len(sizes)) if sizes else 0

    def demand_since(self, job_id: str | None) -> float | None:
        """Arrival time of the job's request in flight, ``None`` when it has none (or is done).

        An unreferenced block of such a job is wanted by a request that is waiting for
        admission (or was preempted): its reuse is certain and imminent.
        """
        if job_id is None:
            return None
        state = self.jobs.get(job_id)
        if state is None or state.finished or state.running == 0:
            return None
        return state.last_arrival

    def reuse_probability(self, job_id: str | None, now: float) -> float:
        """P(the job comes back for its blocks), from its state at ``now``.

        - a finished job: 0;
        - a running job: 1 (its blocks are in use or about to be);
        - otherwise the idle time is compared with the expected gap (the runtime's hint, else
          the mean of its own gaps, else the mean over all jobs): the probability stays high
          until about the expected gap and then decays exponentially with that scale, so a
          job that overstays its usual pause is treated as gone.
        """
        if job_id is None:
            return self.prior_reuse
        state = self.jobs.get(job_id)
        if state is None:
            return self.prior_reuse
        if state.finished:
            return 0.0
        if state.running > 0 or state.last_finish is None:
            return 1.0
        idle = max(0.0, now - state.last_finish)
        if state.expected_gap is not None:
            expected, base = state.expected_gap, 0.95
        elif state.gaps:
            expected, base = sum(state.gaps) / len(state.gaps), 0.9
        elif self.global_gaps:
            expected, base = sum(self.global_gaps) / len(self.global_gaps), self.prior_reuse
        else:
            return self.prior_reuse
        scale = max(expected, 1e-3)
        overstay = max(0.0, idle - 1.5 * scale)
        return base * math.exp(-overstay / scale)

    def block_reuse_probability(
        self, jobs: Collection[str], job_id: str | None, now: float
    ) -> float:
        """A block shared by several jobs is reused if any of them comes back."""
        if not jobs:
            return self.reuse_probability(job_id, now)
        miss = 1.0
        for jid in jobs:
            miss *= 1.0 - self.reuse_probability(jid, now)
        return 1.0 - miss
