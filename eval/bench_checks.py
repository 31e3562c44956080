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


def check_kv_fraction(kv_fraction: float | None) -> None:
    """Refuses a ``kv_fraction`` that is no share of the working set.

    NOTE: a share above 1 sizes a pool larger than everything the workload ever holds, which
    is the unbounded pool the ``/unbounded`` suffix and the lossless reference already run;
    ``--num-kv-blocks`` sets a pool of any size.

    Args:
        kv_fraction: the pool's share of the workload's working set (``None``: the default).

    Raises:
        BenchError: naming ``kv_fraction``: not in ``(0, 1]`` or not finite.
    """
    if kv_fraction is not None and not (math.isfinite(kv_fraction) and 0 < kv_fraction <= 1):
        raise BenchError(
            f"kv_fraction: must be a share of the working set in (0, 1], got {kv_fraction!r} "
            "(--num-kv-blocks sets a pool of any size)"
        )


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
    for name, number in (("time_scale", cfg.time_scale), ("token_scale", cfg.token_scale)):
        if number is not None and not (math.isfinite(number) and 0 <= number <= MAX_SCALE):
            raise BenchError(f"{name}: must be a number in [0, {MAX_SCALE:g}], got {number!r}")
    check_kv_fraction(cfg.kv_fraction)
    # NOTE: checked here, not by the workload's generator, whose message names the workload
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise BenchError(f"seed: must be an integer >= 0, got {cfg.seed!r}")
    if cfg.rate is not None and not (math.isfinite(cfg.rate) and cfg.rate > 0):
        raise BenchError(f"rate: must be a finite number of jobs/s > 0, got {cfg.rate!r}")


__all__ = [
    "MAX_JOBS",
    "MAX_REPEATS",
    "MAX_SCALE",
    "BenchError",
    "check_bench_sizes",
    "check_kv_fraction",
]
