"""Tests of the eval report layer: report files, what the plots show, and a real browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eval.report import rebuild_report, write_report
from eval.results import (
    PolicyResult,
    Recompute,
    Results,
    summarize,
)
from eval.results_io import save_results
from tests.eval.sample_results import sample_results, sample_run_info

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BROWSER_TIMEOUT_S = 60
PLOT_IDS = ("plot-jct-cdf", "plot-ttft-tpot", "plot-hit-rate", "plot-blocks-in-use")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with results.json and a full report, written once for the module."""
    run_dir = tmp_path_factory.mktemp("run")
    save_results(sample_results(), run_dir)
    write_report(sample_results(), run_dir)
    return run_dir


# ---------------------------------------------------------------------------------------------
# Report files


def test_report_files(report_dir: Path) -> None:
    for name in (
        "report.md",
        "report.html",
        "jct_cdf.png",
        "ttft_tpot.png",
        "hit_rate.png",
        "blocks_in_use.png",
    ):
        assert (report_dir / name).is_file(), name
    for png in report_dir.glob("*.png"):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC), png
        assert len(data) > 10_000, f"{png} is suspiciously small ({len(data)} bytes)"


def test_report_markdown(report_dir: Path) -> None:
    md = (report_dir / "report.md").read_text()
    # The baseline is vllm-apc even though it is not the first policy: 8.2 / 10.0 and 12 / 10.
    assert "JCT mean vs vllm-apc: 0.82x" in md
    assert "JCT mean vs vllm-apc: 1.20x" in md
    assert "Throughput vs vllm-apc: 1.25x" in md
    assert "Hit rate vs vllm-apc: 1.50x" in md
    assert "| Metric | lru | vllm-apc | asymcache |" in md
    for label in (
        "JCT p95",
        "TTFT p99",
        "TPOT p50",
        "Queueing mean",
        "Recomputed tokens (hole)",
        "Recomputed tokens (suffix)",
        "Recomputed tokens (preempted)",
        "Evictions",
        "Throughput",
        "Lossless agreement",
    ):
        assert f"| {label}" in md, label
    assert "\\| pipe" in md and "<script>" not in md  # table cells and notes are escaped
    assert "![" in md and "(jct_cdf.png)" in md


def test_report_html(report_dir: Path) -> None:
    html = (report_dir / "report.html").read_text()
    for table_id in ("table-run", "table-summary", "table-ratios", "table-volume"):
        assert f'<table id="{table_id}">' in html
    for plot_id in PLOT_IDS:
        assert re.search(
            rf'<img id="{plot_id}" src="data:image/png;base64,[A-Za-z0-9+/=]{{1000,}}" '
            r'alt="[^"]+">',
            html,
        ), plot_id
    assert "&lt;script&gt;alert(" in html and "<script>alert(" not in html
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "0.82x" in html


def test_report_with_empty_data(tmp_path: Path) -> None:
    """A policy without samples: plots with no data are skipped with a placeholder, no crash."""
    empty = PolicyResult(
        jct=summarize([]),
        ttft=summarize([]),
        tpot=summarize([]),
        queue=summarize([]),
        hit_rate=0.0,
        recomputed_tokens=Recompute(hole=0, suffix=0, preempted=0, total=0),
        evictions=0,
        throughput_tok_s=0.0,
        num_jobs=0,
        num_requests=0,
        prompt_tokens=0,
        hit_tokens=0,
        computed_tokens=0,
        generated_tokens=0,
        peak_blocks_in_use=0,
        duration_s=0.0,
    )
    (tmp_path / "jct_cdf.png").write_bytes(PNG_MAGIC)  # stale plot from an earlier rendering
    results = Results(run=sample_run_info(kv_blocks=None), policies={"lru": empty, "other": empty})
    written = write_report(results, tmp_path)
    assert {p.name for p in written} == {"report.md", "report.html", "hit_rate.png"}
    assert not (tmp_path / "jct_cdf.png").exists()
    html = (tmp_path / "report.html").read_text()
    assert 'id="plot-jct-cdf-placeholder"' in html and "no per-job JCT data" in html
    assert 'id="plot-blocks-in-use-placeholder"' in html
    md = (tmp_path / "report.md").read_text()
    assert "n/a" in md and "unbounded" in md and "JCT mean vs lru: n/a" in md


def test_rebuild_report(tmp_path: Path) -> None:
    save_results(sample_results(), tmp_path)
    written = rebuild_report(tmp_path)
    assert (tmp_path / "report.html") in written and (tmp_path / "report.md") in written
    with pytest.raises(ValueError, match="not found"):
        rebuild_report(tmp_path / "nowhere")


def test_report_module_stays_light() -> None:
    """`asymcache report` must not pay for torch or the engine: check in a fresh interpreter."""
    code = (
        "import sys, eval.report, eval.report_plots\n"
        "heavy = [m for m in ('torch', 'asymcache_core', 'agent_runtime', 'matplotlib') "
        "if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# A real headless browser


#: Chromium-family browsers that run ``--headless --screenshot``, in the order they are tried.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "microsoft-edge")


def find_browser() -> str | None:
    """A headless-capable Chromium-family browser: ``$ASYMCACHE_CHROMIUM``, else the first of
    :data:`BROWSERS` on the PATH (``None``: none found)."""
    override = os.environ.get("ASYMCACHE_CHROMIUM")
    if override:
        return override
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _chromium() -> str:
    """The browser; fails under CI (``.ci/run`` installs one there), else skips saying why."""
    path = find_browser()
    if path is None:
        msg = (f"no browser found (tried {', '.join(BROWSERS)}; ASYMCACHE_CHROMIUM names another): "
               "install one, e.g. `sudo apt-get install chromium` (`make browser` as root)")
        if os.environ.get("CI"):
            pytest.fail(msg + " (required when CI is set)")
        pytest.skip(msg)
    return path


def _run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # Containers often have a tiny /dev/shm; without this the renderer can crash there.
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, timeout=BROWSER_TIMEOUT_S)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]!r}"
    return proc


def test_report_renders_in_chromium(report_dir: Path, tmp_path: Path) -> None:
    chromium = _chromium()
    url = (report_dir / "report.html").resolve().as_uri()

    # 1. The DOM after load: the tables are there, and the inline script counted every plot
    #    image as decoded (naturalWidth > 0), which only happens if the data URIs are valid PNGs.
    dom = _run_chromium(
        chromium, tmp_path / "profile-dom", "--virtual-time-budget=5000", "--dump-dom", url
    ).stdout.decode("utf-8", "replace")
    for table_id in ("table-run", "table-summary", "table-ratios", "table-volume"):
        assert f'<table id="{table_id}">' in dom, table_id
    for plot_id in PLOT_IDS:
        assert f'id="{plot_id}"' in dom, plot_id
    m = re.search(r'<body[^>]*data-images-loaded="(\d+)"', dom)
    assert m, "the page's load script did not run: " + dom[:500]
    assert int(m.group(1)) == len(PLOT_IDS), f"only {m.group(1)} of {len(PLOT_IDS)} plots decoded"
    assert f'data-images-total="{len(PLOT_IDS)}"' in dom

    # 2. A screenshot: the page is not blank, and the plots' colored lines/bars are on screen.
    #    Tables and text are black/gray on white, so strongly saturated pixels come from plots.
    shot = tmp_path / "shot.png"
    _run_chromium(
        chromium,
        tmp_path / "profile-shot",
        f"--screenshot={shot}",
        "--window-size=1280,2400",
        "--hide-scrollbars",
        url,
    )
    assert shot.is_file() and shot.read_bytes().startswith(PNG_MAGIC)
    from PIL import Image

    with Image.open(shot) as im:
        rgb = np.asarray(im.convert("RGB"), dtype=np.int16)
    assert rgb.shape[:2] == (2400, 1280)
    assert rgb.std() > 20, "screenshot is (nearly) uniform"
    non_white = (rgb < 235).any(axis=2).mean()
    assert non_white > 0.02, f"only {non_white:.2%} of the screenshot is not white"
    saturation = rgb.max(axis=2) - rgb.min(axis=2)
    colored = int((saturation > 80).sum())
    assert colored > 40_000, f"only {colored} colored pixels: plots did not render on screen"


def test_find_browser_tries_each_name_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYMCACHE_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_browser() is None
    chrome = tmp_path / "google-chrome"
    chrome.write_text("#!/bin/sh\n")
    chrome.chmod(0o755)
    assert find_browser() == str(chrome)
    monkeypatch.setenv("ASYMCACHE_CHROMIUM", "/opt/other/chrome")
    assert find_browser() == "/opt/other/chrome"


# ---------------------------------------------------------------------------------------------
# What the plots show


def _figures(monkeypatch: pytest.MonkeyPatch, results: Results, run_dir: Path) -> dict[str, Any]:
    """The figures ``write_report`` saves, by file name (rendered, so extents are known)."""
    import eval.report_plots as report_plots

    saved: dict[str, Any] = {}
    real = report_plots._save_figure

    def keep(fig: Any, path: Path) -> None:
        real(fig, path)
        saved[path.name] = fig

    monkeypatch.setattr(report_plots, "_save_figure", keep)
    write_report(results, run_dir)
    return saved


def _with_ttft(results: Results, seconds: list[float]) -> Results:
    policies = {n: p.model_copy(update={"ttft": summarize(seconds)}) for n, p in results.policies.items()}
    return results.model_copy(update={"policies": policies})


def test_seconds_unit_fits_the_values() -> None:
    from eval.report_plots import seconds_unit

    assert seconds_unit(0.045) == ("ms", 1e3)
    assert seconds_unit(0.999) == ("ms", 1e3)
    assert seconds_unit(45.0) == ("s", 1.0)


def test_ttft_panel_switches_to_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figs = _figures(monkeypatch, _with_ttft(sample_results(), [5.0, 20.0, 45.0]), tmp_path)
    ttft, tpot = figs["ttft_tpot.png"].axes
    assert (ttft.get_ylabel(), tpot.get_ylabel()) == ("s", "ms")
    assert max(bar.get_height() for bar in ttft.patches) == pytest.approx(45.0, rel=0.05)
    figs = _figures(monkeypatch, _with_ttft(sample_results(), [0.05, 0.2]), tmp_path)
    assert figs["ttft_tpot.png"].axes[0].get_ylabel() == "ms"


def test_colours_mean_policies_in_every_panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.colors import to_rgb

    results = sample_results()
    figs = _figures(monkeypatch, results, tmp_path)
    hit, rec = figs["hit_rate.png"].axes
    names = list(results.policies)
    policy_colours = [to_rgb(bar.get_facecolor()) for bar in hit.patches[: len(names)]]
    assert len(set(policy_colours)) == len(names)
    # every stacked part of a policy's bar is drawn in that policy's colour
    for bar in rec.patches:
        if bar.get_height() > 0:
            x = round(bar.get_x() + bar.get_width() / 2)
            assert to_rgb(bar.get_facecolor()) == policy_colours[x]
    # the parts' legend swatches are no policy's colour (a part never reads as a policy)
    swatches = [to_rgb(h.get_facecolor()) for h in rec.get_legend().legend_handles]
    assert not set(swatches) & set(policy_colours)
    # and the lines of the other plots use the same colour per policy
    for name in ("jct_cdf.png", "blocks_in_use.png"):
        ax = figs[name].axes[0]
        lines = {line.get_label(): to_rgb(line.get_color()) for line in ax.get_lines()}
        assert [lines[n] for n in names] == policy_colours


@pytest.mark.parametrize("name", ["jct_cdf.png", "hit_rate.png", "blocks_in_use.png"])
def test_legends_sit_off_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    figs = _figures(monkeypatch, sample_results(), tmp_path)
    fig = figs[name]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= area.x1, (name, box, area)  # right of the plotting area
        assert box.x1 <= fig.bbox.x1 + 1  # and inside the image


def test_report_files_are_world_readable(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        save_results(sample_results(), tmp_path)
        written = write_report(sample_results(), tmp_path)
    finally:
        os.umask(old)
    for path in [tmp_path / "results.json", tmp_path / "results.schema.json", *written]:
        assert path.stat().st_mode & 0o777 == 0o644, path
