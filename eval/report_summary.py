"""What a run shows, in words: run-to-run intervals, warnings and the report's opening paragraph.

Everything here is computed from a ``Results`` document alone (no engine, no matplotlib), so the
CLI table, ``report.md`` and ``report.html`` say the same thing:

- :func:`run_interval` / :func:`format_interval`: a policy's mean over its runs with the
  ``[min, max]`` of the runs' means (``--repeats``).
- :func:`run_warnings`: the lines a reader must see before trusting a comparison (a pool that
  never filled, a single run, intervals that overlap).
- :func:`what_this_shows`: one paragraph that states the setup, the pressure on the pool and the
  headline comparison with its spread, from the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from eval.results import PolicyResult, Results

#: A pool counts as filled when the busiest policy's peak blocks in use reached this share of it.
#: NOTE: blocks in use are sampled after each engine step, when the step's finished requests
#: have already returned their blocks, so a pool that ran out during a step peaks a little
#: below its size (a run that evicted all step long can show 95% of the pool).
FILLED_SHARE = 0.9

#: Mean JCTs closer than this share of the baseline's read as the same in the paragraph (the
#: ratios are printed with two decimals).
SAME_SHARE = 0.005

#: The per-run means the intervals are taken over (``RunMeans`` field names) and their labels.
RunMetric = Literal["jct_mean", "ttft_mean", "tpot_mean"]
COMPARED_METRICS: tuple[tuple[RunMetric, str], ...] = (("jct_mean", "JCT mean"), ("ttft_mean", "TTFT mean"))


@dataclass(frozen=True)
class Interval:
    """The spread of one metric over a policy's runs.

    Attributes:
        mean: the mean of the runs' values.
        low: the smallest run's value.
        high: the largest run's value.
        runs: how many runs.
    """

    mean: float
    low: float
    high: float
    runs: int

    def overlaps(self, other: Interval) -> bool:
        """Whether the two ``[low, high]`` ranges share a point (touching counts)."""
        return self.low <= other.high and other.low <= self.high


def run_interval(policy: PolicyResult, metric: RunMetric) -> Interval | None:
    """The interval of ``metric`` over ``policy``'s runs.

    Args:
        policy: a policy's results.
        metric: the per-run mean to take.

    Returns:
        The interval, or ``None`` with fewer than two runs that measured it.
    """
    values = [v for v in (getattr(r, metric) for r in policy.runs) if v is not None]
    if len(values) < 2:
        return None
    return Interval(sum(values) / len(values), min(values), max(values), len(values))


def _seconds_scale(largest_s: float) -> tuple[str, float, str]:
    """Unit, factor and number format for durations up to ``largest_s``."""
    if largest_s >= 1.0:
        return "s", 1.0, ".2f" if largest_s < 100 else ".1f"
    if largest_s >= 1e-3:
        return "ms", 1e3, ".1f"
    return "µs", 1e6, ".1f"


def format_seconds(value: float | None) -> str:
    """A duration with a unit that fits it (``54.34 s``, ``12.3 ms``); ``n/a`` for ``None``."""
    if value is None:
        return "n/a"
    unit, scale, fmt = _seconds_scale(abs(value))
    return f"{format(value * scale, fmt)} {unit}"


def format_interval(interval: Interval) -> str:
    """``mean unit [low, high]``, the three in one unit (the mean's), e.g. ``54.34 s [53.10, 55.02]``."""
    unit, scale, fmt = _seconds_scale(max(abs(interval.mean), abs(interval.high)))
    return (
        f"{format(interval.mean * scale, fmt)} {unit} "
        f"[{format(interval.low * scale, fmt)}, {format(interval.high * scale, fmt)}]"
    )


def format_metric(policy: PolicyResult, metric: RunMetric, pooled: float | None) -> str:
    """A policy's figure for the tables: the interval over its runs when it ran more than
    once, else the single run's value (``pooled``)."""
    interval = run_interval(policy, metric)
    return format_seconds(pooled) if interval is None else format_interval(interval)


def peak_share(results: Results) -> tuple[int, float] | None:
    """The busiest policy's peak blocks in use and its share of the pool; ``None`` without a
    bounded pool or without policies."""
    pool = results.run.kv_blocks
    if not pool or not results.policies:
        return None
    peak = max(p.peak_blocks_in_use for p in results.policies.values())
    return peak, peak / pool


def pool_filled(results: Results) -> bool | None:
    """Whether the pool came under pressure (:data:`FILLED_SHARE`); ``None`` when unbounded."""
    share = peak_share(results)
    return None if share is None else share[1] >= FILLED_SHARE


def _baseline(results: Results) -> str | None:
    from eval.report_tables import pick_baseline

    return pick_baseline(list(results.policies))


def overlapping(results: Results, baseline: str | None = None) -> list[tuple[str, str, Interval, Interval]]:
    """The compared metrics whose intervals overlap the baseline's.

    Args:
        results: the run.
        baseline: the policy compared against (default: the report's baseline).

    Returns:
        ``(policy, metric label, policy's interval, baseline's interval)`` per overlap, in
        display order.
    """
    baseline = baseline or _baseline(results)
    if baseline is None:
        return []
    base = results.policies[baseline]
    out = []
    for name, pol in results.policies.items():
        if name == baseline:
            continue
        for metric, label in COMPARED_METRICS:
            mine, theirs = run_interval(pol, metric), run_interval(base, metric)
            if mine is not None and theirs is not None and mine.overlaps(theirs):
                out.append((name, label, mine, theirs))
    return out


#: How a run note about jobs cut to ``--max-model-len`` starts (such a note is also a warning).
CUT_JOBS_NOTE = "jobs cut to --max-model-len"


def run_warnings(results: Results) -> list[str]:
    """What a reader must know before trusting the comparison, one sentence each.

    Returns:
        Warnings (empty when no job was cut to ``--max-model-len``, the pool filled, every
        policy ran at least twice and no compared interval overlaps the baseline's).
    """
    out = [note for note in results.run.notes if note.startswith(CUT_JOBS_NOTE)]
    share = peak_share(results)
    if share is not None and share[1] < FILLED_SHARE:
        peak, fraction = share
        out.append(
            f"the pool never filled: at most {peak:,} of {results.run.kv_blocks:,} blocks were in use "
            f"({fraction:.0%}), so the policies were not under pressure and their eviction choices "
            f"could not matter; size the pool below the peak (e.g. --num-kv-blocks {max(1, peak * 3 // 5)})."
        )
    if len(results.policies) > 1 and all(len(p.runs) < 2 for p in results.policies.values()):
        out.append(
            "one run per policy: no spread was measured, so no difference here is shown to exceed "
            "run-to-run noise (--repeats 3 runs each policy three times)."
        )
    baseline = _baseline(results)
    for name, label, mine, theirs in overlapping(results, baseline):
        out.append(
            f"{name} vs {baseline}: the {label} intervals overlap ({format_interval(mine)} vs "
            f"{format_interval(theirs)}), so the difference is within the run-to-run spread."
        )
    return out


def _join(items: Sequence[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def what_this_shows(results: Results) -> str:
    """One paragraph, from the figures: the setup, how hard the pool was pressed, and how the
    policy with the lowest mean JCT compares with the baseline, with its spread.

    Returns:
        The paragraph (plain text; the caller escapes it for its format).
    """
    run = results.run
    pols = results.policies
    if not pols:
        return "This run has no policy results, so it shows nothing."
    if run.concurrency is not None:
        load = f", {run.concurrency} in flight at a time,"
    elif run.rate is not None:
        load = f", arriving as a Poisson process at {run.rate:g} jobs/s,"
    else:
        load = ""  # an older run that did not record its load
    where = {
        "sim": "the simulated engine (the scheduler and pool of the real one, priced by a latency model on a virtual clock)",
        "real": f"the real engine ({run.model} on {run.device})",
        "http": "an HTTP server",
    }[run.backend]
    pool = "an unbounded KV pool" if run.kv_blocks is None else (
        f"a KV pool of {run.kv_blocks:,} blocks ({run.kv_blocks * run.block_size:,} tokens)"
    )
    parts = [f"{run.num_jobs:,} {run.workload} jobs{load} ran on {where} with {pool}."]
    if run.time_scale is not None and run.time_scale != 1.0:
        parts.append(f"Tool pauses and think times ran at {run.time_scale:g}x their workload length.")
    share = peak_share(results)
    filled = pool_filled(results)
    if share is not None:
        peak, fraction = share
        if filled:
            parts.append(f"The pool was under pressure: the busiest policy held {peak:,} blocks ({fraction:.0%} of it).")
        else:
            parts.append(
                f"The pool never filled (at most {peak:,} blocks in use, {fraction:.0%}), so this run does not "
                "test eviction: any difference below comes from elsewhere."
            )
    runs = max(len(p.runs) for p in pols.values())
    if runs >= 2:
        how = "a fresh workload seed each" if run.backend == "sim" else "the same seed"
        parts.append(f"Each policy ran {runs} times ({how}); figures are the mean of the runs with their [min, max].")
    baseline = _baseline(results)
    assert baseline is not None
    base = pols[baseline]
    ranked = sorted((p.jct.mean, n) for n, p in pols.items() if p.jct.mean is not None)
    if len(pols) < 2 or not ranked or not base.jct.mean:
        parts.append(f"{baseline} ran alone, so there is no comparison.")
        return " ".join(parts)
    best = ranked[0][1]
    top = pols[best]
    ratio = ranked[0][0] / base.jct.mean
    same: list[str] = []
    if best == baseline or ratio >= 1.0 - SAME_SHARE:
        # NOTE: a tie (within the printed precision) is said as such: a 1.00x "win" is none.
        same = [n for n, p in pols.items() if n != baseline and p.jct.mean is not None
                and abs(p.jct.mean / base.jct.mean - 1.0) < SAME_SHARE]
        tie = f"; {_join(same)} matched it within {SAME_SHARE:.1%}" if same else ""
        parts.append(
            f"No policy finished jobs faster than {baseline} ({format_metric(base, 'jct_mean', base.jct.mean)} "
            f"mean JCT{tie})."
        )
        best = baseline
    else:
        parts.append(
            f"{best} had the lowest mean job completion time, {format_metric(top, 'jct_mean', top.jct.mean)} against "
            f"{baseline}'s {format_metric(base, 'jct_mean', base.jct.mean)} ({ratio:.2f}x), with a prefix-cache hit "
            f"rate of {top.hit_rate:.0%} against {base.hit_rate:.0%} and {top.evictions:,} blocks evicted against "
            f"{base.evictions:,}."
        )
        mine, theirs = run_interval(top, "jct_mean"), run_interval(base, "jct_mean")
        if mine is None or theirs is None:
            parts.append("With one run each, the spread is unknown and the difference may be noise.")
        elif mine.overlaps(theirs):
            parts.append("The two intervals overlap, so this run does not separate them.")
        else:
            parts.append("The two intervals do not overlap: the difference is larger than the run-to-run spread.")
    others = [
        f"{n} {p.jct.mean / base.jct.mean:.2f}x"
        for n, p in pols.items() if n not in (baseline, best, *same) and p.jct.mean is not None
    ]
    if others:
        parts.append(f"Mean JCT of the others against {baseline}: {_join(others)}.")
    return " ".join(parts)
