"""Turn a run's ``results.json`` into ``report.md``, ``report.html`` and PNG plots.

``write_report(results, run_dir)`` renders a ``Results`` (see ``eval.results``);
``rebuild_report(run_dir)`` reads ``RUN_DIR/results.json`` back and renders it again, which is
what ``asymcache report RUN_DIR`` calls.

This module only reads results: it must not import torch, ``asymcache_core`` or
``agent_runtime``, so that rebuilding a report takes a second, not the time to load an engine.
The plots are :mod:`eval.report_plots`'s, which imports matplotlib inside its plotting function
for the same reason (importing this module for ``--help`` stays cheap).

The HTML page is self-contained: plots are embedded as base64 ``data:`` URIs, CSS is inline, and
a Content-Security-Policy forbids loading anything else. Its one tiny inline script records on
``<body>`` how many images decoded (``data-images-loaded``), which the browser test reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eval.report_plots import Plot, write_plots
from eval.report_summary import RunMetric, format_metric, run_warnings, what_this_shows
from eval.results import PolicyResult, Results
from eval.results_io import atomic_write_text, load_results

#: The policy used as the ratio baseline when present; otherwise the first policy is.
BASELINE_POLICY = "vllm-apc"

REPORT_MD = "report.md"
REPORT_HTML = "report.html"

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
class _Table:
    """A rendered-to-strings table; the first cell of each row is its row header."""

    id: str
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""
    numeric: bool = True  # right-align the value columns in Markdown


@dataclass(frozen=True)
class _Headline:
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


def _run_table(results: Results, baseline: str | None) -> _Table:
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
    return _Table("table-run", "Run", ("Field", "Value"), rows, numeric=False)


def _metric_table(
    table_id: str, title: str, metrics: Sequence[_Metric], results: Results, note: str = ""
) -> _Table:
    """Rows are metrics, columns are policies (in display order)."""
    names = list(results.policies)
    rows = tuple((m.label, *(_cell(m, results.policies[n]) for n in names)) for m in metrics)
    return _Table(table_id, title, ("Metric", *names), rows, note)


def _cell(metric: _Metric, policy: PolicyResult) -> str:
    """One policy's cell: the mean over its runs with their ``[min, max]`` when the metric has
    a per-run mean and the policy ran more than once, else the value."""
    value = metric.get(policy)
    if metric.run_metric is not None and len(policy.runs) > 1:
        return format_metric(policy, metric.run_metric, None if value is None else float(value))
    return _fmt(value, metric.kind)


def _ratio_table(results: Results, baseline: str) -> _Table:
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
    return _Table(
        "table-ratios", f"Ratios vs {baseline}", ("Metric", "Better", *others), tuple(rows), note
    )


def _headlines(results: Results, baseline: str | None) -> tuple[_Headline, ...]:
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
        out.append(_Headline(name, items))
    return tuple(out)


def _runs_table(results: Results) -> _Table:
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
    return _Table("table-runs", "Run to run", header, tuple(rows), note, numeric=False)


def _tables(results: Results, baseline: str | None) -> tuple[_Table, ...]:
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


# --------------------------------------------------------------------------------------------
# Markdown and HTML


def _md_cell(text: str) -> str:
    """Make a string safe inside a Markdown table cell (pipes, newlines, raw HTML)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _md_table(table: _Table) -> list[str]:
    value_align = "---:" if table.numeric else ":---"
    lines = [
        "| " + " | ".join(_md_cell(h) for h in table.header) + " |",
        "|" + "|".join([":---", *[value_align] * (len(table.header) - 1)]) + "|",
    ]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return lines


def _render_markdown(
    results: Results,
    tables: Sequence[_Table],
    headlines: Sequence[_Headline],
    plots: Sequence[Plot],
) -> str:
    out = [f"# AsymCache eval report: {_md_cell(results.run.workload)}", ""]
    out += ["## What this shows", "", _md_cell(what_this_shows(results)), ""]
    warnings = run_warnings(results)
    for warning in warnings:  # NOTE: one blockquote each; adjacent quote lines join into one paragraph
        out += [f"> **Warning:** {_md_cell(warning)}", ""]
    for table in tables:
        out += [f"## {table.title}", ""]
        if table.note:
            out += [_md_cell(table.note), ""]
        out += [*_md_table(table), ""]
        if table.id == "table-run" and results.run.notes:
            out += ["Notes:", ""] + [f"- {_md_cell(n)}" for n in results.run.notes] + [""]
        if table.id == "table-summary":
            if headlines:
                out += ["Headline ratios:", ""]
                out += [f"- **{_md_cell(h.policy)}**: " + "; ".join(h.items) for h in headlines]
                out += [""]
            # Plots right after the summary: they are what a reader looks at next.
            out += ["## Plots", ""]
            for plot in plots:
                if plot.path is None:
                    out += [f"_{_md_cell(plot.placeholder)}_", ""]
                else:
                    out += [f"![{_md_cell(plot.alt)}]({plot.filename})", ""]
    return "\n".join(out)


_HTML_TEMPLATE = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; \
style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>AsymCache eval report: {{ run.workload }}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 1200px; padding: 0 1rem; color: #222; background: #fff; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; }
thead th { background: #f0f0f0; }
td { text-align: right; font-variant-numeric: tabular-nums; }
tbody th { text-align: left; font-weight: normal; }
#table-run td { text-align: left; word-break: break-all; }
.note { color: #555; font-size: 0.9rem; }
.warning { background: #fff4e0; border-left: 4px solid #e08a00; padding: 0.4rem 0.8rem; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(540px, 1fr)); gap: 1rem; }
figure { margin: 0; } img { max-width: 100%; height: auto; border: 1px solid #ddd; }
.placeholder { border: 1px dashed #aaa; padding: 2rem; color: #555; text-align: center; }
</style>
</head>
<body data-images-loaded="0">
<h1>AsymCache eval report: {{ run.workload }}</h1>
<section id="section-what-this-shows">
<h2>What this shows</h2>
<p id="what-this-shows">{{ summary }}</p>
{% for w in warnings %}<p class="warning"><strong>Warning:</strong> {{ w }}</p>
{% endfor %}</section>
{% for table in tables %}
<section id="section-{{ table.id }}">
<h2>{{ table.title }}</h2>
{% if table.note %}<p class="note">{{ table.note }}</p>{% endif %}
<table id="{{ table.id }}">
<thead><tr>{% for h in table.header %}<th scope="col">{{ h }}</th>{% endfor %}</tr></thead>
<tbody>
{% for row in table.rows %}<tr><th scope="row">{{ row[0] }}</th>\
{% for cell in row[1:] %}<td>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</tbody>
</table>
{% if table.id == "table-run" and run.notes %}
<ul id="run-notes">{% for note in run.notes %}<li>{{ note }}</li>{% endfor %}</ul>
{% endif %}
{% if table.id == "table-summary" and headlines %}
<ul id="headline-ratios">
{% for h in headlines %}<li><strong>{{ h.policy }}</strong>: {{ h.items | join("; ") }}</li>
{% endfor %}</ul>
{% endif %}
</section>
{% if table.id == "table-summary" %}
<section id="section-plots">
<h2>Plots</h2>
<div class="plots">
{% for plot in plots %}<figure>
{% if plot.path %}<img id="{{ plot.id }}" src="{{ plot.data_uri }}" alt="{{ plot.alt }}">
{% else %}<p class="placeholder" id="{{ plot.id }}-placeholder">{{ plot.placeholder }}</p>
{% endif %}<figcaption>{{ plot.title }}</figcaption>
</figure>
{% endfor %}</div>
</section>
{% endif %}
{% endfor %}
<script>
// Records how many images decoded, so a headless browser's --dump-dom shows whether the
// embedded plots actually render.
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (im) { return im.complete && im.naturalWidth > 0; });
  document.body.dataset.imagesTotal = String(imgs.length);
  document.body.dataset.imagesLoaded = String(ok.length);
});
</script>
</body>
</html>
"""


def _render_html(
    results: Results,
    tables: Sequence[_Table],
    headlines: Sequence[_Headline],
    plots: Sequence[Plot],
) -> str:
    import jinja2

    # A fresh environment per call (no module-level state); autoescape escapes every string.
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(_HTML_TEMPLATE)
    return template.render(
        run=results.run, tables=tables, headlines=headlines, plots=plots,
        summary=what_this_shows(results), warnings=run_warnings(results),
    )




def write_report(results: Results, run_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``report.md``, ``report.html`` and the PNG plots of a run.

    Args:
        results: The run's results.
        run_dir: The folder to write into (created if missing); usually the run folder that
            holds ``results.json``.
        plots: ``False`` draws no plot (the report says so where each would be).

    Returns:
        The written files: ``report.md``, ``report.html``, then the PNGs that had data
        (a plot without data is skipped and the HTML shows a placeholder instead).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    baseline = pick_baseline(list(results.policies))
    tables = _tables(results, baseline)
    headlines = _headlines(results, baseline)
    drawn = write_plots(results, run_dir, draw=plots)

    md_path = run_dir / REPORT_MD
    html_path = run_dir / REPORT_HTML
    atomic_write_text(md_path, _render_markdown(results, tables, headlines, drawn))
    atomic_write_text(html_path, _render_html(results, tables, headlines, drawn))
    return [md_path, html_path, *(p.path for p in drawn if p.path is not None)]


def rebuild_report(run_dir: str | Path) -> list[Path]:
    """Re-render the report of a finished run from its ``results.json``.

    Args:
        run_dir: The run folder holding ``results.json``.

    Returns:
        The written files, as ``write_report`` returns them.

    Raises:
        ValueError: If ``results.json`` is missing or invalid (see ``eval.results_io.load_results``).
    """
    run_dir = Path(run_dir)
    return write_report(load_results(run_dir), run_dir)
