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

from collections.abc import Sequence
from pathlib import Path

from eval.report_plots import Plot, write_plots
from eval.report_summary import run_warnings, what_this_shows
from eval.report_tables import (
    BASELINE_POLICY,
    Headline,
    Table,
    build_headlines,
    build_tables,
    pick_baseline,
)
from eval.results import Results
from eval.results_io import atomic_write_text, load_results

# NOTE: BASELINE_POLICY and pick_baseline are eval.report_tables's, importable from here too
__all__ = [
    "BASELINE_POLICY", "REPORT_HTML", "REPORT_MD", "pick_baseline", "rebuild_report", "write_report",
]

REPORT_MD = "report.md"
REPORT_HTML = "report.html"


# --------------------------------------------------------------------------------------------
# Markdown and HTML


def _md_cell(text: str) -> str:
    """Make a string safe inside a Markdown table cell (pipes, newlines, raw HTML)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _md_table(table: Table) -> list[str]:
    value_align = "---:" if table.numeric else ":---"
    lines = [
        "| " + " | ".join(_md_cell(h) for h in table.header) + " |",
        "|" + "|".join([":---", *[value_align] * (len(table.header) - 1)]) + "|",
    ]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
    return lines


def _render_markdown(
    results: Results,
    tables: Sequence[Table],
    headlines: Sequence[Headline],
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
    tables: Sequence[Table],
    headlines: Sequence[Headline],
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
    tables = build_tables(results, baseline)
    headlines = build_headlines(results, baseline)
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
