"""What a bench run refuses before anything is built: its error type and the bounds on its sizes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eval.bench import BenchConfig


class BenchError(ValueError):
    """A bad option or an impossible setup (the CLI prints it on one line, exit code 2)."""


#: Bounds on a run's sizes: past them a bench would run for days or exhaust memory (a trace of
#: 10**23 jobs was once generated until killed) rather than measure anything.
MAX_JOBS = 1_000_000
MAX_REPEATS = 1_000
MAX_SCALE = 1_000.0


def check_bench_sizes(cfg: BenchConfig) -> None:
    """Rejects sizes no run could finish, before anything is built.

    Raises:
        BenchError: naming the field: ``jobs``, ``repeats``, ``concurrency``, ``time_scale``,
            ``token_scale``, ``kv_fraction`` or ``rate`` out of range or not finite.
    """
    # NOTE: concurrency 0 or less admitted no job (a run of nothing), or sliced the job list
    sizes = (("jobs", cfg.jobs, MAX_JOBS), ("repeats", cfg.repeats, MAX_REPEATS), ("concurrency", cfg.concurrency, MAX_JOBS))
    for name, value, bound in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise BenchError(f"{name}: must be an integer in [1, {bound:,}], got {value!r}")
    for name, number in (("time_scale", cfg.time_scale), ("token_scale", cfg.token_scale),
                         ("kv_fraction", cfg.kv_fraction)):
        if number is not None and not (math.isfinite(number) and 0 <= number <= MAX_SCALE):
            raise BenchError(f"{name}: must be a number in [0, {MAX_SCALE:g}], got {number!r}")
    if cfg.rate is not None and not (math.isfinite(cfg.rate) and cfg.rate > 0):
        raise BenchError(f"rate: must be a finite number of jobs/s > 0, got {cfg.rate!r}")


__all__ = ["MAX_JOBS", "MAX_REPEATS", "MAX_SCALE", "BenchError", "check_bench_sizes"]
