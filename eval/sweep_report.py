"""A load sweep's report: ``sweep.md``, ``sweep.html`` and one PNG per workload (JCT p90 and
goodput against load, every variant, the spread over seeds shaded).

The capacity table answers "how many agents can one GPU serve within the SLO": per workload and
variant, the largest load whose JCT p90 (mean over seeds) meets the target
(:func:`eval.sweep_results.capacity_at_slo`), and its ratio to ``vllm-apc``'s and
``continuum``'s. Like :mod:`eval.report`, this module reads results only (no torch).
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

from eval.results_io import atomic_write_text
from eval.sweep_results import (
    SweepResults,
    capacity_at_slo,
    ceiling_variant,
    curve,
    default_jct_slo,
    load_sweep,
    workload_slugs,
    workloads_of,
)

SWEEP_MD = "sweep.md"
SWEEP_HTML = "sweep.html"
PEERS = ("vllm-apc", "continuum")


def _slug(sweep: SweepResults, workload: str) -> str:
    """The workload's name in the sweep's tables and plot files (distinct among its workloads,
    :func:`~eval.sweep_results.workload_slugs`)."""
    return workload_slugs(workloads_of(sweep))[workload]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def format_capacity(capacity: float | None, at_end: bool) -> str:
    """A capacity cell: ``none`` (even the lowest load misses), ``>= N`` (met at every point:
    a lower bound) or ``N``."""
    return "none" if capacity is None else (">= " if at_end else "") + f"{capacity:.0f}"


def _has_rates(sweep: SweepResults, workload: str) -> list[bool]:
    kinds = {p.rate is not None for p in sweep.points if p.workload == workload}
    return sorted(kinds)


def capacity_rows(sweep: SweepResults) -> list[tuple[str, str, float, str, float | None, bool]]:
    """``(workload, variant, jct_slo_s, slo_source, capacity, reached_end)`` per workload and
    variant: the load at the JCT p90 target (``reached_end``: every point met it, so the
    capacity is a lower bound)."""
    rows = []
    names = list(sweep.points[0].policies) if sweep.points else []
    for workload in workloads_of(sweep):
        for rates in _has_rates(sweep, workload):
            if sweep.slo is not None and sweep.slo.jct_s is not None:
                target, source = sweep.slo.jct_s, "--slo"
            else:
                default = default_jct_slo(sweep, workload, rates)
                if default is None:
                    continue
                target, source = default, "2x ceiling p90 at the lowest load"
            for name in names:
                c = curve(sweep, workload, name, "jct_p90", rates)
                cap = capacity_at_slo(c, target)
                rows.append((workload, name, target, source, cap, cap is not None and c.loads and cap == c.loads[-1]))
    return rows


def peer_variant(names: list[str], preset: str) -> str | None:
    """The variant of ``names`` that stands for ``preset`` in the ratios: ``preset`` itself, else
    ``preset`` with suffixes (``vllm-apc/reserve-prompt``), never its ``/unbounded`` ceiling."""
    if preset in names:
        return preset
    return next((n for n in names if n.startswith(preset + "/") and "unbounded" not in n.split("/")), None)


def _markdown(sweep: SweepResults, plots: list[tuple[str, Path]]) -> str:
    names = list(sweep.points[0].policies) if sweep.points else []
    lines = [
        "# AsymCache load sweep",
        "",
        f"- command: `{sweep.command}`",
        f"- started {sweep.started}, {sweep.duration_s:.0f} s, {sweep.backend} backend, model {sweep.model}",
        f"- machine: {sweep.machine}",
        f"- SLO: {sweep.slo.model_dump(exclude_none=True) if sweep.slo else 'none given (JCT target: 2x the ceiling)'}",
        "",
        "## Capacity: load within the JCT p90 target",
        "",
        "Largest load (agents in flight, or jobs/s for rate points) whose JCT p90, averaged over seeds, meets the "
        "target; `>=` marks a variant that met it at every point (the sweep did not reach its knee).",
        "",
        "| workload | variant | JCT p90 target (s) | capacity | vs vllm-apc | vs continuum |",
        "|:---|:---|---:|---:|---:|---:|",
    ]
    rows = capacity_rows(sweep)
    caps = {(w, n): c for w, n, _, _, c, _ in rows}
    peers = [peer_variant(names, peer) for peer in PEERS]
    for workload, name, target, _, cap, at_end in rows:
        ratios = []
        for peer in peers:
            base = caps.get((workload, peer)) if peer is not None else None
            ratios.append("-" if cap is None or not base else f"{cap / base:.2f}x")
        lines.append(
            f"| {_slug(sweep, workload)} | {name} | {target:.1f} | {format_capacity(cap, at_end)} | {ratios[0]} | {ratios[1]} |"
        )
    for figure, title, digits in (
        ("jct_mean", "Mean JCT (s)", 1), ("jct_p90", "JCT p90 (s)", 1), ("ttft_p99", "TTFT p99 (s)", 2),
        ("goodput_jobs_per_hour", "Goodput (jobs/hour meeting the SLO)", 0), ("jobs_per_hour", "Jobs/hour", 0),
    ):
        lines += ["", f"## {title}, mean over seeds [min-max]", ""]
        for workload in workloads_of(sweep):
            for rates in _has_rates(sweep, workload):
                loads = curve(sweep, workload, names[0], figure, rates).loads
                unit = "jobs/s" if rates else "agents"
                lines += [
                    f"**{_slug(sweep, workload)}** ({unit})",
                    "",
                    "| variant | " + " | ".join(f"{x:g}" for x in loads) + " |",
                    "|:---|" + "---:|" * len(loads),
                ]
                for name in names:
                    c = curve(sweep, workload, name, figure, rates)
                    cells = [
                        f"{_fmt(m, digits)} [{_fmt(lo, digits)}-{_fmt(hi, digits)}]"
                        for m, lo, hi in zip(c.mean, c.low, c.high, strict=True)
                    ]
                    lines.append(f"| {name} | " + " | ".join(cells) + " |")
                lines.append("")
    lines += _job_time_section(sweep, names)
    lines += ["## Plots", ""] + [f"![{title}]({path.name})" for title, path in plots]
    if not plots:
        lines.append("_Not drawn (--no-plots); `asymcache report SWEEP_DIR` draws them._")
    return "\n".join(lines) + "\n"


JOB_TIME_PARTS = (("queue_s", "queued"), ("prefill_s", "to first tokens"), ("decode_s", "decoding"), ("pause_s", "between turns"))


def _job_time_section(sweep: SweepResults, names: list[str]) -> list[str]:
    """"Where the job time goes": the mean job's seconds queued, to first tokens, decoding and
    between turns per variant and load, mean over seeds, each with its difference to the
    ceiling's (the ``/unbounded`` variant) at the same load, so that every second a variant
    spends above the ceiling is placed."""
    ceiling = ceiling_variant(names)
    lines = [
        "",
        "## Where the job time goes (s per job, mean over seeds)",
        "",
        "Each of a job's requests is queued (before its first scheduling), then computes its prompt up to "
        "its first token, then decodes; the rest of the job's time is between turns (tool calls). "
        + (f"In brackets: the difference to `{ceiling}` at the same load." if ceiling else ""),
        "",
    ]
    found = False
    for workload in workloads_of(sweep):
        for rates in _has_rates(sweep, workload):
            parts = {
                name: [curve(sweep, workload, name, field, rates) for field, _ in JOB_TIME_PARTS] for name in names
            }
            loads = parts[names[0]][0].loads
            if all(math.isnan(y) for c in parts[names[0]] for y in c.mean):
                continue
            found = True
            unit = "jobs/s" if rates else "agents"
            lines += [
                f"**{_slug(sweep, workload)}**",
                "",
                f"| variant | {unit} | " + " | ".join(title for _, title in JOB_TIME_PARTS) + " | JCT |",
                "|:---|---:|" + "---:|" * (len(JOB_TIME_PARTS) + 1),
            ]
            for name in names:
                for i, load in enumerate(loads):
                    cells, total, base_total = [], 0.0, 0.0
                    for j, c in enumerate(parts[name]):
                        y = c.mean[i]
                        total += y
                        cell = _fmt(y, 1)
                        if ceiling is not None and name != ceiling:
                            b = parts[ceiling][j].mean[i]
                            base_total += b
                            cell += f" ({y - b:+.1f})" if not math.isnan(y - b) else ""
                        cells.append(cell)
                    jct = _fmt(total, 1)
                    if ceiling is not None and name != ceiling and not math.isnan(total - base_total):
                        jct += f" ({total - base_total:+.1f})"
                    lines.append(f"| {name} | {load:g} | " + " | ".join(cells) + f" | {jct} |")
            lines.append("")
    return lines if found else []


def _plots(sweep: SweepResults, run_dir: Path) -> list[tuple[str, Path]]:
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(sweep.points[0].policies) if sweep.points else []
    cmap = colormaps["tab10"]
    out = []
    for workload in workloads_of(sweep):
        for rates in _has_rates(sweep, workload):
            fig = Figure(figsize=(11, 4.2), layout="constrained")
            axes = fig.subplots(1, 2)
            for i, name in enumerate(names):
                for ax, figure in zip(axes, ("jct_p90", "goodput_jobs_per_hour"), strict=True):
                    c = curve(sweep, workload, name, figure, rates)
                    if all(math.isnan(y) for y in c.mean):
                        continue
                    ax.plot(c.loads, c.mean, marker="o", color=cmap(i % 10), label=name, lw=2)
                    ax.fill_between(c.loads, c.low, c.high, color=cmap(i % 10), alpha=0.15)
            unit = "Poisson rate (jobs/s)" if rates else "agents in flight"
            axes[0].set(xlabel=unit, ylabel="JCT p90 (s)", title=f"{_slug(sweep, workload)}: JCT p90")
            axes[1].set(xlabel=unit, ylabel="jobs/hour within SLO", title=f"{_slug(sweep, workload)}: goodput")
            for ax in axes:
                ax.grid(alpha=0.3)
                if not rates:
                    ax.set_xscale("log", base=2)
            axes[0].legend(fontsize=8)
            path = run_dir / f"sweep_{_slug(sweep, workload)}{'_rate' if rates else ''}.png"
            FigureCanvasAgg(fig)
            fig.savefig(path, format="png", dpi=90)
            out.append((f"{_slug(sweep, workload)}: JCT p90 and goodput against load", path))
    return out


def _html(markdown: str, plots: list[tuple[str, Path]]) -> str:
    import html

    images = "".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}" '
        f'alt="{html.escape(t)}"><figcaption>{html.escape(t)}</figcaption></figure>'
        for t, p in plots
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\"><title>AsymCache load sweep</title>"
        "<style>body{font-family:system-ui,sans-serif;max-width:1200px;margin:2rem auto;padding:0 1rem}"
        "pre{white-space:pre-wrap;font-size:.85rem}img{max-width:100%}</style></head><body>"
        f"<h1>AsymCache load sweep</h1>{images}<pre>{html.escape(markdown)}</pre></body></html>\n"
    )


def write_sweep_report(sweep: SweepResults, run_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Writes ``sweep.md``, ``sweep.html`` and the plots.

    Args:
        sweep: the sweep's results.
        run_dir: the sweep folder.
        plots: ``False`` draws no plot (``sweep.md`` says so).

    Returns:
        The written files.
    """
    run_dir = Path(run_dir)
    plots = _plots(sweep, run_dir) if plots else []
    markdown = _markdown(sweep, plots)
    atomic_write_text(run_dir / SWEEP_MD, markdown)
    atomic_write_text(run_dir / SWEEP_HTML, _html(markdown, plots))
    return [run_dir / SWEEP_MD, run_dir / SWEEP_HTML, *(p for _, p in plots)]


def rebuild_sweep_report(run_dir: str | Path) -> list[Path]:
    """Re-renders a sweep folder's report from its ``sweep.json``."""
    return write_sweep_report(load_sweep(run_dir), run_dir)
