"""A bench run's workload: the trace, its arrivals, and its jobs cut to ``--max-model-len``
(how many were dropped or shortened is said, not hidden)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eval.bench_checks import BenchError
from eval.report_summary import CUT_JOBS_NOTE

if TYPE_CHECKING:
    from eval.bench import BenchConfig


@dataclass(frozen=True)
class JobCuts:
    """What cutting a trace's jobs to ``max_model_len`` did.

    Attributes:
        max_model_len: the longest context kept.
        jobs: jobs in the trace before the cut.
        dropped: jobs whose first turn did not fit (left out of the run).
        shortened: jobs kept with fewer turns than they had.
    """

    max_model_len: int
    jobs: int
    dropped: int
    shortened: int

    def note(self, seed: int | None = None) -> str | None:
        """The run note saying what was cut (``None`` when nothing was).

        Args:
            seed: the workload seed, named when a run holds several workloads (``--repeats``).

        Returns:
            One sentence starting with :data:`~eval.report_summary.CUT_JOBS_NOTE`, or ``None``.
        """
        if not (self.dropped or self.shortened):
            return None
        where = "" if seed is None else f" (workload seed {seed})"
        return (
            f"{CUT_JOBS_NOTE} {self.max_model_len}{where}: {self.dropped} of {self.jobs} jobs dropped (their first "
            f"turn is longer) and {self.shortened} shortened to the turns that fit; a larger --max-model-len keeps them"
        )


def cut_jobs(trace: Any, max_model_len: int) -> tuple[Any, JobCuts]:
    """Cuts every job to the turns whose whole context fits ``max_model_len``.

    Args:
        trace: the workload.
        max_model_len: the longest context kept.

    Returns:
        ``(trace, cuts)``: the cut trace (a kept job's last turn calls no tool) and what was cut.

    Raises:
        BenchError: naming ``max_model_len`` when no job's first turn fits.
    """
    jobs = []
    dropped = shortened = 0
    for job in trace.jobs:
        turns = []
        for k in range(len(job.turns)):
            candidate = job.model_copy(update={"turns": job.turns[: k + 1]})
            if candidate.total_tokens > max_model_len:
                break
            turns.append(job.turns[k])
        if not turns:
            dropped += 1
            continue
        shortened += len(turns) < len(job.turns)
        last = turns[-1].model_copy(update={"tool": None, "tool_duration_s": 0.0, "think_time_s": 0.0})
        jobs.append(job.model_copy(update={"turns": [*turns[:-1], last]}))
    if not jobs:
        raise BenchError(f"max_model_len: no job's first turn fits {max_model_len} tokens")
    cuts = JobCuts(max_model_len, len(trace.jobs), dropped, shortened)
    return trace.model_copy(update={"jobs": jobs}), cuts


def load_workload_cut(cfg: BenchConfig) -> tuple[Any, JobCuts | None]:
    """The trace, with arrivals and with jobs cut to ``max_model_len``, and what was cut.

    Args:
        cfg: the run's configuration.

    Returns:
        ``(trace, cuts)``; ``cuts`` is ``None`` without ``max_model_len``.

    Raises:
        BenchError: naming ``workload`` for a trace that cannot be loaded or holds no job, or
            ``max_model_len`` when no job fits.
    """
    from workloads import apply_arrivals, load_trace

    options: dict[str, Any] = {}
    if ":" not in cfg.workload:
        options["token_scale"] = cfg.token_scale
    try:
        trace = load_trace(cfg.workload, num_jobs=cfg.jobs, seed=cfg.seed, **options)
    except ValueError as exc:
        raise BenchError(f"workload: {exc}") from None
    if not trace.jobs:
        raise BenchError(f"workload: {cfg.workload} holds no jobs")
    if cfg.rate is not None:
        trace = apply_arrivals(trace, f"poisson:{cfg.rate}", cfg.seed)
    if cfg.max_model_len is None:
        return trace, None
    return cut_jobs(trace, cfg.max_model_len)


def load_workload(cfg: BenchConfig) -> Any:
    """The trace, with arrivals and with jobs cut to ``max_model_len`` (:func:`load_workload_cut`
    without its account of the cut)."""
    return load_workload_cut(cfg)[0]
