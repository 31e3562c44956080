"""The tables of a run's report: its numbers read from ``Results`` and formatted as strings.

:func:`build_tables` gives every table of the report (the run, the summary, the ratios to the
baseline, volumes, where the job time goes, the host tier, run to run) and
:func:`build_headlines` the key ratios of each policy against :func:`pick_baseline`'s. They are
rendered to Markdown and HTML by :mod:`eval.report`. Like it, this module reads results only (no
torch, ``asymcache_core`` or ``agent_runtime``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from eval.report_summary import RunMetric, format_metric
from eval.results import PolicyResult, Results

#: The policy used as the ratio baseline when present; otherwise the first policy is.
BASELINE_POLICY = "vllm-apc"

_Kind = Literal["seconds", "percent", "int", "tok_s"]


@dataclass(frozen=True)
class _Metric:
    """One row of the summary table: how to read it from a policy and how to show it."""

    label: str
    get: Callable[[PolicyResult], float | int | None]
    kind: _Kind
    # True: a ratio below 1 is better; False: above 1 is better; None: no ratio row.
    lower_is_better: bool | None
    headline: bool = False
    # The per-run mean behind the row: with several runs the cell shows their interval.
    run_metric: RunMetric | None = None


# Tuples of frozen dataclasses: constant, not mutable module state.
_SUMMARY_METRICS: tuple[_Metric, ...] = (
    _Metric("JCT mean", lambda p: p.jct.mean, "seconds", True, headline=True, run_metric="jct_mean"),
    _Metric("JCT p50", lambda p: p.jct.p50, "seconds", True),
    _Metric("JCT p95", lambda p: p.jct.p95, "seconds", True),
    _Metric("JCT p99", lambda p: p.jct.p99, "seconds", True, headline=True),
    _Metric("TTFT mean", lambda p: p.ttft.mean, "seconds", True, headline=True, run_metric="ttft_mean"),
    _Metric("TTFT p50", lambda p: p.ttft.p50, "seconds", True),
    _Metric("TTFT p99", lambda p: p.ttft.p99, "seconds", True, headline=True),
    _Metric("TPOT mean", lambda p: p.tpot.mean, "seconds", True, headline=True, run_metric="tpot_mean"),
    _Metric("TPOT p50", lambda p: p.tpot.p50, "seconds", True),
    _Metric("TPOT p99", lambda p: p.tpot.p99, "seconds", True),
    _Metric("Queueing mean", lambda p: p.queue.mean, "seconds", True),
    _Metric("Hit rate", lambda p: p.hit_rate, "percent", False, headline=True),
    _Metric("Recomputed tokens (hole)", lambda p: p.recomputed_tokens.hole, "int", None),
    _Metric("Recomputed tokens (suffix)", lambda p: p.recomputed_tokens.suffix, "int", None),
    _Metric("Recomputed tokens (preempted)", lambda p: p.recomputed_tokens.preempted, "int", None),
    _Metric("Recomputed tokens (total)", lambda p: p.recomputed_tokens.total, "int", True),
    _Metric("Evictions (blocks)", lambda p: p.evictions, "int", True),
    _Metric("Throughput", lambda p: p.throughput_tok_s, "tok_s", False, headline=True),
    # Agreement is a correctness check, not a quantity to compare as a ratio.
    _Metric("Lossless agreement", lambda p: p.lossless_agreement, "percent", None),
)

_VOLUME_METRICS: tuple[_Metric, ...] = (
    _Metric("Jobs", lambda p: p.num_jobs, "int", None),
    _Metric("Requests", lambda p: p.num_requests, "int", None),
    _Metric("Prompt tokens", lambda p: p.prompt_tokens, "int", None),
    _Metric("Hit tokens", lambda p: p.hit_tokens, "int", None),
    _Metric("Computed tokens", lambda p: p.computed_tokens, "int", None),
    _Metric("Generated tokens", lambda p: p.generated_tokens, "int", None),
    _Metric("Peak blocks in use", lambda p: p.peak_blocks_in_use, "int", None),
    _Metric("Peak pinned blocks", lambda p: p.pinned_blocks_peak, "int", None),
    _Metric("Duration", lambda p: p.duration_s, "seconds", None),
)


_HOST_TIER_METRICS: tuple[_Metric, ...] = (
    _Metric("Host tier blocks", lambda p: p.host_tier and p.host_tier.blocks, "int", None),
    _Metric("Offloaded blocks (device -> host)", lambda p: p.host_tier and p.host_tier.offloaded_blocks, "int", None),
    _Metric("Reloaded blocks (host -> device)", lambda p: p.host_tier and p.host_tier.reloaded_blocks, "int", None),
    _Metric("  of which prefetched", lambda p: p.host_tier and p.host_tier.prefetched_blocks, "int", None),
    _Metric("Host hits recomputed (cheaper)", lambda p: p.host_tier and p.host_tier.recompute_chosen_blocks, "int", None),
    _Metric("Host evictions (blocks)", lambda p: p.host_tier and p.host_tier.evictions, "int", None),
    _Metric("Tokens reloaded instead of computed", lambda p: p.host_tier and p.host_tier.reload_tokens, "int", None),
    _Metric("GiB to host", lambda p: p.host_tier and round(p.host_tier.bytes_to_host / 2**30), "int", None),
    _Metric("GiB to device", lambda p: p.host_tier and round(p.host_tier.bytes_to_device / 2**30), "int", None),
    _Metric("Job gate at the end (blocks)", lambda p: p.host_tier and p.host_tier.gate_blocks, "int", None),
)


_JOB_TIME_METRICS: tuple[_Metric, ...] = (
    _Metric("Queued", lambda p: p.job_time and p.job_time.queue_s, "seconds", None),
    _Metric("To first tokens", lambda p: p.job_time and p.job_time.prefill_s, "seconds", None),
    _Metric("Decoding", lambda p: p.job_time and p.job_time.decode_s, "seconds", None),
    _Metric("Between turns", lambda p: p.job_time and p.job_time.pause_s, "seconds", None),
)


@dataclass(frozen=True)
class Table:
    """A rendered-to-strings table; the first cell of each row is its row header."""

    id: str
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""
    numeric: bool = True  # right-align the value columns in Markdown


@dataclass(frozen=True)
class Headline:
    """The key ratios of one non-baseline policy against the baseline."""

    policy: str
    items: tuple[str, ...]  # e.g. "JCT mean vs vllm-apc: 0.82x"


# --------------------------------------------------------------------------------------------
# Numbers to strings


def _fmt_seconds(value: float | None) -> str:
    """Seconds with a unit chosen so that 3-4 significant digits show."""
    if value is None:
        return "n/a"
    mag = abs(value)
    if mag == 0:
        return "0 s"
    if mag < 1e-3:
        return f"{value * 1e6:.1f} µs"
    if mag < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.3f} s"


def _fmt(value: float | int | None, kind: _Kind) -> str:
    """Format one table cell."""
    if value is None:
        return "n/a"
    if kind == "seconds":
        return _fmt_seconds(float(value))
    if kind == "percent":
        return f"{100.0 * value:.1f}%"
    if kind == "int":
        return f"{int(value):,}"
    return f"{value:,.1f} tok/s"


def _ratio(value: float | int | None, base: float | int | None) -> float | None:
    """value / base, or None when either is missing or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return float(value) / float(base)


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


# --------------------------------------------------------------------------------------------
# Tables


def pick_baseline(policies: Sequence[str]) -> str | None:
    """The policy the others are compared with.

    Args:
        policies: Policy names in display order.

    Returns:
        ``BASELINE_POLICY`` ("vllm-apc") if present, else the first policy, else None.
    """
    if BASELINE_POLICY in policies:
        return BASELINE_POLICY
    return policies[0] if policies else None


def _run_table(results: Results, baseline: str | None) -> Table:
    run = results.run
    rows = (
        ("Workload", run.workload),
        ("Backend", run.backend),
        ("Model", run.model),
        ("Device", run.device),
        ("Seed", str(run.seed)),
        ("Jobs", f"{run.num_jobs:,}"),
        ("KV blocks", "unbounded" if run.kv_blocks is None else f"{run.kv_blocks:,}"),
        ("Block size", f"{run.block_size} tokens"),
        ("Latency profile", run.latency_profile),
        ("Started", run.started),
        ("Duration", _fmt_seconds(run.duration_s)),
        ("Command", run.command),
        ("Machine", run.machine),
        ("Policies", ", ".join(results.policies) or "(none)"),
        ("Baseline", baseline or "(none)"),
        ("Schema version", str(results.schema_version)),
    )
    return Table("table-run", "Run", ("Field", "Value"), rows, numeric=False)


def _metric_table(
    table_id: str, title: str, metrics: Sequence[_Metric], results: Results, note: str = ""
) -> Table:
    """Rows are metrics, columns are policies (in display order)."""
    names = list(results.policies)
    rows = tuple((m.label, *(_cell(m, results.policies[n]) for n in names)) for m in metrics)
    return Table(table_id, title, ("Metric", *names), rows, note)


def _cell(metric: _Metric, policy: PolicyResult) -> str:
    """One policy's cell: the mean over its runs with their ``[min, max]`` when the metric has
    a per-run mean and the policy ran more than once, else the value."""
    value = metric.get(policy)
    if metric.run_metric is not None and len(policy.runs) > 1:
        return format_metric(policy, metric.run_metric, None if value is None else float(value))
    return _fmt(value, metric.kind)


def _ratio_table(results: Results, baseline: str) -> Table:
    """Rows are metrics, columns are the non-baseline policies, cells are value / baseline."""
    base = results.policies[baseline]
    others = [n for n in results.policies if n != baseline]
    rows = []
    for m in _SUMMARY_METRICS:
        if m.lower_is_better is None:
            continue
        direction = "lower is better" if m.lower_is_better else "higher is better"
        cells = (_fmt_ratio(_ratio(m.get(results.policies[n]), m.get(base))) for n in others)
        rows.append((f"{m.label} vs {baseline}", direction, *cells))
    note = f"Each cell is the policy's value divided by {baseline}'s."
    return Table(
        "table-ratios", f"Ratios vs {baseline}", ("Metric", "Better", *others), tuple(rows), note
    )


def build_headlines(results: Results, baseline: str | None) -> tuple[Headline, ...]:
    """The headline ratios per policy, phrased "JCT mean vs vllm-apc: 0.82x"."""
    if baseline is None:
        return ()
    base = results.policies[baseline]
    out = []
    for name, pol in results.policies.items():
        if name == baseline:
            continue
        items = tuple(
            f"{m.label} vs {baseline}: {_fmt_ratio(_ratio(m.get(pol), m.get(base)))}"
            for m in _SUMMARY_METRICS
            if m.headline
        )
        out.append(Headline(name, items))
    return tuple(out)


def _runs_table(results: Results) -> Table:
    """Each run's means, for policies that ran more than once (``--repeats``)."""

    def per_run(values: Sequence[float | None], scale: float, fmt: str) -> str:
        return ", ".join("-" if v is None else format(v * scale, fmt) for v in values)

    def spread(values: Sequence[float | None]) -> str:
        vals = [v for v in values if v is not None]
        if len(vals) < 2 or sum(vals) <= 0:
            return "-"
        return f"{(max(vals) - min(vals)) / (sum(vals) / len(vals)):.0%}"

    rows = []
    for name, pol in results.policies.items():
        if len(pol.runs) < 2:
            continue
        ttft = [r.ttft_mean for r in pol.runs]
        rows.append((
            name, per_run(ttft, 1e3, ".0f"), spread(ttft), per_run([r.tpot_mean for r in pol.runs], 1e3, ".1f"),
            per_run([r.jct_mean for r in pol.runs], 1.0, ".2f"), ", ".join(f"{r.computed_tokens:,}" for r in pol.runs),
        ))
    note = (
        "Spread = (max - min) / mean of the runs' mean TTFT. A difference between policies smaller "
        "than their spread is not a result."
    )
    header = ("Policy", "TTFT mean per run (ms)", "TTFT spread", "TPOT mean per run (ms)", "JCT mean per run (s)", "Tokens computed per run")
    return Table("table-runs", "Run to run", header, tuple(rows), note, numeric=False)


def build_tables(results: Results, baseline: str | None) -> tuple[Table, ...]:
    """Every table of the report, in display order."""
    tables = [
        _run_table(results, baseline),
        _metric_table(
            "table-summary",
            "Summary",
            _SUMMARY_METRICS,
            results,
            "Latencies per job (JCT) or per request (TTFT, TPOT, queueing). With several runs per "
            "policy, the mean rows show the mean of the runs' means and [min, max] over the runs; "
            "the other rows pool the runs. Hit rate = hit tokens / prompt tokens. Lossless "
            "agreement = fraction of requests whose tokens equal the unbounded-pool run's.",
        ),
    ]
    if baseline is not None and len(results.policies) > 1:
        tables.append(_ratio_table(results, baseline))
    tables.append(_metric_table("table-volume", "Volumes", _VOLUME_METRICS, results))
    if any(p.job_time is not None for p in results.policies.values()):
        tables.append(
            _metric_table(
                "table-job-time", "Where the job time goes", _JOB_TIME_METRICS, results,
                "Seconds per job, mean over jobs; the four add up to the mean JCT. Each of a job's "
                "requests is queued (before its first scheduling), then computes its prompt up to its "
                "first token (recomputed history included), then decodes; the rest of the job's time "
                "is between its turns (tool calls, the client). Against the unbounded-pool run, the "
                "rows show which part a policy's extra time is in.",
            )
        )
    if any(p.host_tier is not None for p in results.policies.values()):
        tables.append(
            _metric_table(
                "table-host-tier", "Host KV tier", _HOST_TIER_METRICS, results,
                "Device pool and host tier together: what was copied each way, what came back by copy "
                "instead of being computed, and the host hits the cost model chose to recompute.",
            )
        )
    if any(len(p.runs) > 1 for p in results.policies.values()):
        tables.append(_runs_table(results))
    return tuple(tables)

