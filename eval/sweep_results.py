"""The ``sweep.json`` schema of a load sweep (``asymcache bench`` with several load points,
seeds or workloads), and the analysis the sweep report draws from it.

Like :mod:`eval.results`, this module depends only on pydantic (no torch, no engine code), so
that rebuilding a sweep report is fast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from eval.results import SLO, Results, _Model
from eval.results_io import atomic_write_text, document_path, load_document

SWEEP_FILE = "sweep.json"
SWEEP_SCHEMA_VERSION = 1


class PointFigures(_Model):
    """The figures of one variant at one point (seconds; rates per hour of one GPU)."""

    jct_mean: float | None
    jct_p90: float | None
    jct_p99: float | None
    ttft_mean: float | None
    ttft_p99: float | None
    tpot_mean: float | None
    itl_p99: float | None = None
    jobs_per_hour: float = Field(ge=0)
    goodput_jobs_per_hour: float | None = None
    hit_rate: float = Field(ge=0, le=1)
    computed_tokens: int = Field(ge=0)
    recomputed_tokens: int = Field(ge=0)
    preempted_tokens: int = Field(ge=0)
    queue_s: float | None = Field(default=None, description="Mean job's time queued (eval.results.JobTime).")
    prefill_s: float | None = Field(default=None, description="Mean job's time from scheduling to first tokens.")
    decode_s: float | None = Field(default=None, description="Mean job's time decoding.")
    pause_s: float | None = Field(default=None, description="Mean job's time between turns.")


class SweepPoint(_Model):
    """One point's results: where it ran and each variant's figures."""

    workload: str
    seed: int
    concurrency: int | None = None
    rate: float | None = None
    kv_blocks: int | None = None
    run_dir: str = Field(description="The point's bench folder, relative to the sweep folder.")
    policies: dict[str, PointFigures]


class SweepResults(_Model):
    """The whole ``sweep.json`` document."""

    schema_version: int = SWEEP_SCHEMA_VERSION
    command: str
    started: str
    duration_s: float = Field(ge=0)
    machine: str
    backend: str
    model: str
    slo: SLO | None = None
    points: list[SweepPoint]


def point_figures(results: Results) -> dict[str, PointFigures]:
    """The sweep's figures of every variant of one bench run."""
    figures = {}
    for name, p in results.policies.items():
        figures[name] = PointFigures(
            jct_mean=p.jct.mean, jct_p90=p.jct.p90, jct_p99=p.jct.p99, ttft_mean=p.ttft.mean,
            ttft_p99=p.ttft.p99, tpot_mean=p.tpot.mean, itl_p99=p.itl.p99 if p.itl is not None else None,
            jobs_per_hour=p.jobs_per_hour, goodput_jobs_per_hour=p.goodput_jobs_per_hour, hit_rate=p.hit_rate,
            computed_tokens=p.computed_tokens, recomputed_tokens=p.recomputed_tokens.total,
            preempted_tokens=p.recomputed_tokens.preempted,
            **(p.job_time.model_dump() if p.job_time is not None else {}),
        )
    return figures


def save_sweep(sweep: SweepResults, run_dir: Path) -> Path:
    """Writes ``sweep.json``; returns its path."""
    path = Path(run_dir) / SWEEP_FILE
    atomic_write_text(path, sweep.model_dump_json(indent=2) + "\n")
    return path


def load_sweep(path_or_dir: str | Path) -> SweepResults:
    """Reads a ``sweep.json`` (or the folder that holds it), as :func:`~eval.results_io.load_results`
    reads a ``results.json`` (:func:`~eval.results_io.load_document`).

    Raises:
        ValueError: missing, unreadable, not JSON or not a sweep document (names the file and
            each bad field); a ``schema_version`` this code does not read.
    """
    sweep = load_document(path_or_dir, SWEEP_FILE, SweepResults, "sweep", "not a sweep document")
    if sweep.schema_version != SWEEP_SCHEMA_VERSION:
        raise ValueError(f"{document_path(path_or_dir, SWEEP_FILE)}: sweep schema_version {sweep.schema_version} is not supported")
    return sweep


# ------------------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class Curve:
    """One variant's figure against load on one workload, over seeds.

    Attributes:
        loads: the x values, ascending.
        mean: the figure's mean over seeds at each load (``nan`` where no seed has it).
        low: its minimum over seeds.
        high: its maximum over seeds.
    """

    loads: tuple[float, ...]
    mean: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]


def curve(sweep: SweepResults, workload: str, policy: str, figure: str, rates: bool = False) -> Curve:
    """A variant's ``figure`` (a :class:`PointFigures` field) against load on ``workload``.

    Args:
        sweep: the sweep.
        workload: the workload spec.
        policy: the variant.
        figure: e.g. ``jct_p90``, ``goodput_jobs_per_hour``.
        rates: the Poisson points instead of the closed-loop ones.

    Returns:
        The curve (seeds pooled per load).
    """
    by_load: dict[float, list[float]] = {}
    for p in sweep.points:
        if p.workload != workload or (p.rate is not None) != rates or policy not in p.policies:
            continue
        value = getattr(p.policies[policy], figure)
        load = float(p.rate if rates else p.concurrency or 0)
        by_load.setdefault(load, [])
        if value is not None:
            by_load[load].append(float(value))
    loads = tuple(sorted(by_load))

    def stat(fn: Callable[[list[float]], float]) -> tuple[float, ...]:
        return tuple(fn(by_load[x]) if by_load[x] else math.nan for x in loads)

    return Curve(loads, stat(lambda v: sum(v) / len(v)), stat(min), stat(max))


def capacity_at_slo(c: Curve, slo: float) -> float | None:
    """The largest load whose figure (mean over seeds) is within ``slo``, interpolated
    linearly between the last point within and the first above it.

    Args:
        c: a latency curve (lower is better), e.g. JCT p90.
        slo: the target, in the curve's units.

    Returns:
        The load; ``None`` when even the lowest load misses the target. When every point meets
        it, the highest load (a lower bound: the sweep did not reach the knee).
    """
    within: tuple[float, float] | None = None  # the last (load, figure) within the target
    for x, y in zip(c.loads, c.mean, strict=True):
        if math.isnan(y):
            continue
        if y <= slo:
            within = (x, y)
            continue
        if within is None:
            return None
        # NOTE: the first crossing is the knee; a curve that dips back under later is noise.
        x0, y0 = within
        return x0 + (x - x0) * (slo - y0) / (y - y0)
    return within[0] if within is not None else None


def default_jct_slo(sweep: SweepResults, workload: str, rates: bool = False) -> float | None:
    """The JCT p90 target the report uses when ``--slo`` gives none: twice the ceiling's JCT
    p90 at the lowest load (the ``/unbounded`` variant's; without one, the first variant's).

    NOTE: a job may take twice as long as it would alone on an unbounded pool at light load:
    a target stated against the hardware's own best, not against any policy under test.
    """
    names = list(sweep.points[0].policies) if sweep.points else []
    if not names:
        return None
    ceiling = ceiling_variant(names) or names[0]
    c = curve(sweep, workload, ceiling, "jct_p90", rates)
    firsts = [y for y in c.mean if not math.isnan(y)]
    return 2.0 * firsts[0] if firsts else None


def ceiling_variant(names: list[str]) -> str | None:
    """The sweep's unbounded-pool ceiling: the first ``.../unbounded`` variant, if any."""
    return next((n for n in names if "unbounded" in n.split("/")), None)


def _slug_parts(spec: str) -> tuple[str, list[str]]:
    """A workload spec's kind (``trace``, ``bfcl``, ``""`` for a generator) and the path's
    parts, the file's stem last."""
    kind, sep, rest = spec.partition(":")
    if not sep:
        kind, rest = "", spec
    parts = [p for p in rest.split("/") if p not in ("", ".")] or [rest]
    parts[-1] = parts[-1].split(".", 1)[0] or parts[-1]
    return kind, parts


def workload_slugs(workloads: Sequence[str]) -> dict[str, str]:
    """Short names of a sweep's workloads, distinct and safe in file names: the file's stem
    (``swe``, ``x`` for ``bfcl:traces/x.jsonl``); where stems collide, as many parent folders
    as tell them apart (``A-w``, ``B-w``), then the format (``bfcl-x``), then a number.

    Args:
        workloads: the workload specs (repeats are one workload).

    Returns:
        Spec -> name.
    """
    specs = list(dict.fromkeys(workloads))
    split = {s: _slug_parts(s) for s in specs}
    depth = dict.fromkeys(specs, 1)

    def name(spec: str) -> str:
        kind, parts = split[spec]
        d = depth[spec]
        if d <= len(parts):
            return "-".join(parts[-d:])
        return "-".join([kind or "gen", *parts])

    while True:
        groups: dict[str, list[str]] = {}
        for spec in specs:
            groups.setdefault(name(spec), []).append(spec)
        grow = [s for group in groups.values() if len(group) > 1 for s in group if depth[s] <= len(split[s][1])]
        if not grow:
            break
        for spec in grow:
            depth[spec] += 1
    out: dict[str, str] = {}
    used: set[str] = set()
    for spec in specs:
        # NOTE: only characters safe in a folder or file name on every OS
        base = re.sub(r"[^A-Za-z0-9._+-]", "_", name(spec)) or "workload"
        slug, k = base, 1
        while slug in used:
            k += 1
            slug = f"{base}-{k}"
        used.add(slug)
        out[spec] = slug
    return out


def workloads_of(sweep: SweepResults) -> list[str]:
    """The sweep's workloads, in run order."""
    return list(dict.fromkeys(p.workload for p in sweep.points))
