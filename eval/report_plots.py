"""The PNG plots of a run's report: the JCT CDF, TTFT and TPOT, hit rate and recomputed tokens, blocks in use.

:func:`write_plots` renders them for :mod:`eval.report`, which embeds them in the HTML page.
Like that module it only reads results; matplotlib is imported inside the plotting function, so
importing this module (for ``--help``, for a Markdown-only rebuild) stays cheap.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.results import Results

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Plot:
    """One plot: where it was written, or why it was skipped."""

    id: str
    filename: str
    title: str
    alt: str
    path: Path | None
    placeholder: str

    @property
    def data_uri(self) -> str:
        """The PNG as a ``data:`` URI, or "" when the plot was skipped."""
        if self.path is None:
            return ""
        return "data:image/png;base64," + base64.b64encode(self.path.read_bytes()).decode("ascii")



#: Parts of the recomputed tokens: name, hatch, opacity (the bar's colour is its policy's).
RECOMPUTE_PARTS: tuple[tuple[str, str, float], ...] = (
    ("hole", "", 1.0), ("suffix", "//", 0.6), ("preempted", "xx", 0.35),
)


def seconds_unit(largest_s: float) -> tuple[str, float]:
    """The unit a panel of durations reads best in: ms below a second, else s.

    Args:
        largest_s: the largest value shown, in seconds.

    Returns:
        ``(label, factor)``: multiply seconds by ``factor`` to get the label's unit.
    """
    return ("s", 1.0) if largest_s >= 1.0 else ("ms", 1e3)


def _legend_outside(ax: Axes) -> None:
    """The legend to the right of the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _save_figure(fig: Figure, path: Path) -> None:
    """Render ``fig`` with the Agg canvas and write it as PNG.

    Attaching ``FigureCanvasAgg`` to this one figure selects the Agg backend for it without
    touching pyplot's global backend or figure registry (safe in a headless process, and it
    leaves the caller's matplotlib state alone).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=100)


#: The placeholder of a plot a run did not draw (``asymcache bench --no-plots``).
NOT_DRAWN = "not drawn (--no-plots); `asymcache report RUN_DIR` draws it."


def write_plots(results: Results, run_dir: Path, *, draw: bool = True) -> tuple[Plot, ...]:
    """Write the four PNG plots; a plot without data is skipped (and a stale file removed).

    Args:
        results: the run's results.
        run_dir: the folder the PNGs go to.
        draw: ``False`` draws none (each gets the :data:`NOT_DRAWN` placeholder): a run's
            plots take about a second, longer than a small simulated run.
    """
    names = list(results.policies)
    colors: dict[str, Any] = {}
    if draw:
        # NOTE: matplotlib is imported only where something is drawn
        from matplotlib import colormaps
        from matplotlib.figure import Figure

        cmap = colormaps["tab10"]
        colors = {n: cmap(i % 10) for i, n in enumerate(names)}
    pols = results.policies
    plots: list[Plot] = []

    def finish(
        plot_id: str, filename: str, title: str, alt: str, fig: Figure | None, why_not: str
    ) -> None:
        path = run_dir / filename
        if fig is None:
            # Don't leave a plot from an earlier rendering next to a report that says "skipped".
            path.unlink(missing_ok=True)
            plots.append(Plot(plot_id, filename, title, alt, None, f"{title}: {why_not if draw else NOT_DRAWN}"))
            return
        _save_figure(fig, path)
        plots.append(Plot(plot_id, filename, title, alt, path, ""))

    # 1. JCT CDF: one empirical CDF per policy.
    fig = None
    if draw and any(pols[n].series.jct for n in names):
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for n in names:
            jct = sorted(pols[n].series.jct)
            if not jct:
                continue
            frac = [(i + 1) / len(jct) for i in range(len(jct))]
            # Start at (min JCT, 0) so the curve rises from the axis.
            ax.step([jct[0], *jct], [0.0, *frac], where="post", label=n, color=colors[n], lw=2)
        ax.set_xlabel("job completion time (s)")
        ax.set_ylabel("fraction of jobs")
        ax.set_ylim(0, 1.02)
        ax.set_title("JCT CDF")
        ax.grid(alpha=0.3)
        _legend_outside(ax)
    finish(
        "plot-jct-cdf",
        "jct_cdf.png",
        "JCT CDF",
        "Cumulative distribution of job completion time, one line per policy",
        fig,
        "skipped, no per-job JCT data.",
    )

    # 2. TTFT and TPOT bars: mean and p99 per policy, each panel in the unit its values fit.
    fig = None
    if draw and any(pols[n].ttft.count or pols[n].tpot.count for n in names):
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        axes = fig.subplots(1, 2)
        width = 0.38
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            xs = range(len(names))
            raw = [getattr(getattr(pols[n], metric), stat) for stat in ("mean", "p99") for n in names]
            unit, scale = seconds_unit(max((v for v in raw if v is not None), default=0.0))
            for k, stat in enumerate(("mean", "p99")):
                vals = []
                for n in names:
                    v = getattr(getattr(pols[n], metric), stat)
                    vals.append(0.0 if v is None else v * scale)
                ax.bar(
                    [x + (k - 0.5) * width for x in xs],
                    vals,
                    width,
                    color=[colors[n] for n in names],
                    alpha=1.0 if stat == "mean" else 0.55,
                    hatch="" if stat == "mean" else "//",
                    edgecolor="black",
                    linewidth=0.5,
                    label=stat,
                )
            ax.set_xticks(list(xs), names, rotation=20, ha="right")
            ax.set_ylabel(unit)
            ax.set_title(f"{metric.upper()} (solid: mean, hatched: p99)")
            ax.grid(axis="y", alpha=0.3)
    finish(
        "plot-ttft-tpot",
        "ttft_tpot.png",
        "TTFT and TPOT",
        "Bar charts of TTFT and TPOT mean and p99 per policy (milliseconds, or seconds when larger)",
        fig,
        "skipped, no TTFT or TPOT samples.",
    )

    # 3. Hit rate and recomputed tokens per policy.
    fig = None
    if draw and names:
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        ax_hit, ax_rec = fig.subplots(1, 2)
        xs = list(range(len(names)))
        ax_hit.bar(xs, [100 * pols[n].hit_rate for n in names], color=[colors[n] for n in names])
        ax_hit.set_xticks(xs, names, rotation=20, ha="right")
        ax_hit.set_ylabel("% of prompt tokens")
        ax_hit.set_ylim(0, 100)
        ax_hit.set_title("Prefix-cache hit rate")
        ax_hit.grid(axis="y", alpha=0.3)
        # NOTE: bars keep their policy's colour (as in every panel); the parts differ by hatch
        # and shade, so no part reads as another policy.
        bottom = [0] * len(names)
        other = [pols[n].recomputed_tokens.total - sum(getattr(pols[n].recomputed_tokens, part)
                 for part, _, _ in RECOMPUTE_PARTS) for n in names]
        for part, hatch, alpha in RECOMPUTE_PARTS + (("other", "..", 0.25),):
            vals = other if part == "other" else [getattr(pols[n].recomputed_tokens, part) for n in names]
            if part == "other" and not any(vals):
                continue
            ax_rec.bar(xs, vals, bottom=bottom, color=[colors[n] for n in names], alpha=alpha, hatch=hatch,
                       edgecolor="black", linewidth=0.5)
            ax_rec.bar([0], [0], color="#bbbbbb", alpha=alpha, hatch=hatch, edgecolor="black", linewidth=0.5,
                       label=part)  # a grey legend swatch: the part, not a policy
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax_rec.set_xticks(xs, names, rotation=20, ha="right")
        ax_rec.set_ylabel("tokens")
        ax_rec.set_title("Recomputed tokens")
        ax_rec.grid(axis="y", alpha=0.3)
        _legend_outside(ax_rec)
    finish(
        "plot-hit-rate",
        "hit_rate.png",
        "Hit rate and recomputed tokens",
        "Bar charts of prefix-cache hit rate and recomputed tokens (hole, suffix, preempted) "
        "per policy",
        fig,
        "skipped, no policies.",
    )

    # 4. KV blocks in use over time.
    fig = None
    if draw and any(pols[n].series.blocks_in_use for n in names):
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for n in names:
            samples = pols[n].series.blocks_in_use
            if samples:
                ts, blocks = zip(*samples, strict=True)
                ax.step(ts, blocks, where="post", label=n, color=colors[n], lw=1.5)
        if results.run.kv_blocks is not None:
            ax.axhline(results.run.kv_blocks, color="black", ls="--", lw=1, label="pool size")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV blocks in use")
        ax.set_title("KV blocks in use over time")
        ax.grid(alpha=0.3)
        _legend_outside(ax)
    finish(
        "plot-blocks-in-use",
        "blocks_in_use.png",
        "KV blocks in use",
        "Line chart of KV blocks in use over time, one line per policy",
        fig,
        "skipped, no blocks-in-use samples.",
    )
    return tuple(plots)
