"""Intervals, warnings and the "What this shows" paragraph, on synthetic results (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval.cli import print_results_table
from eval.report import write_report
from eval.report_summary import (
    Interval,
    format_interval,
    format_metric,
    overlapping,
    pool_filled,
    run_interval,
    run_warnings,
    what_this_shows,
)
from eval.results import Results, RunMeans
from tests.eval.sample_results import sample_policy, sample_run_info


def _runs(*jct: float, ttft: float = 0.2) -> list[RunMeans]:
    return [RunMeans(jct_mean=j, ttft_mean=ttft + 0.01 * i, tpot_mean=0.02, computed_tokens=100) for i, j in enumerate(jct)]


def _results(
    *, pool: int = 75, peak: int = 70, base_runs: tuple[float, ...] = (10.0, 10.5, 9.8),
    asym_runs: tuple[float, ...] = (8.0, 8.4, 8.1), ttft_apart: bool = True,
) -> Results:
    """vllm-apc against asymcache; a pool of ``pool`` blocks whose busiest policy held ``peak``."""
    base = sample_policy(sum(base_runs) / len(base_runs), 2, hit_rate=0.5, throughput=100.0)
    asym = sample_policy(sum(asym_runs) / len(asym_runs), 3, hit_rate=0.8, throughput=140.0)
    return Results(
        run=sample_run_info(kv_blocks=pool, concurrency=8),
        policies={
            "vllm-apc": base.model_copy(update={"runs": _runs(*base_runs, ttft=0.5), "peak_blocks_in_use": peak}),
            "asymcache": asym.model_copy(
                update={"runs": _runs(*asym_runs, ttft=0.2 if ttft_apart else 0.5), "peak_blocks_in_use": peak - 10}
            ),
        },
    )


def test_interval_over_the_runs() -> None:
    pol = _results().policies["vllm-apc"]
    interval = run_interval(pol, "jct_mean")
    assert interval == Interval(pytest.approx(10.1), 9.8, 10.5, 3)
    assert run_interval(pol.model_copy(update={"runs": pol.runs[:1]}), "jct_mean") is None
    # a run that did not measure the metric is left out, and one run left is no interval
    partial = [pol.runs[0], pol.runs[1].model_copy(update={"jct_mean": None})]
    assert run_interval(pol.model_copy(update={"runs": partial}), "jct_mean") is None


def test_interval_formatting_keeps_one_unit() -> None:
    assert format_interval(Interval(54.333, 53.11, 56.149, 3)) == "54.33 s [53.11, 56.15]"
    assert format_interval(Interval(191.93, 190.88, 192.61, 3)) == "191.9 s [190.9, 192.6]"
    assert format_interval(Interval(0.5188, 0.509, 0.5307, 3)) == "518.8 ms [509.0, 530.7]"
    # the unit follows the largest value, so the low end is not in another unit than the high end
    assert format_interval(Interval(0.95, 0.9, 1.2, 3)) == "0.95 s [0.90, 1.20]"


def test_format_metric_single_run_is_the_value() -> None:
    pol = _results().policies["vllm-apc"]
    assert format_metric(pol.model_copy(update={"runs": []}), "jct_mean", 10.1) == "10.10 s"
    assert format_metric(pol, "jct_mean", 10.1) == "10.10 s [9.80, 10.50]"
    assert format_metric(pol.model_copy(update={"runs": []}), "ttft_mean", None) == "n/a"


def test_overlap_touching_counts() -> None:
    assert Interval(1.0, 0.5, 2.0, 2).overlaps(Interval(3.0, 2.0, 4.0, 2))
    assert not Interval(1.0, 0.5, 1.9, 2).overlaps(Interval(3.0, 2.0, 4.0, 2))


def test_no_warning_when_pool_filled_and_intervals_apart() -> None:
    results = _results()
    assert pool_filled(results) is True  # 70 of 75 blocks
    assert run_warnings(results) == []


def test_warns_when_the_pool_never_filled() -> None:
    results = _results(pool=4582, peak=847)
    assert pool_filled(results) is False
    (warning,) = run_warnings(results)
    assert warning.startswith("the pool never filled: at most 847 of 4,582 blocks were in use (18%)")
    assert "--num-kv-blocks 508" in warning
    assert "never filled" in what_this_shows(results)
    # an unbounded pool is not a pool that failed to fill
    unbounded = results.model_copy(update={"run": results.run.model_copy(update={"kv_blocks": None})})
    assert pool_filled(unbounded) is None and run_warnings(unbounded) == []


def test_warns_when_intervals_overlap() -> None:
    results = _results(asym_runs=(9.9, 10.6, 9.0), ttft_apart=False)
    assert [(p, m) for p, m, _, _ in overlapping(results)] == [("asymcache", "JCT mean"), ("asymcache", "TTFT mean")]
    warnings = run_warnings(results)
    assert warnings[0] == (
        "asymcache vs vllm-apc: the JCT mean intervals overlap (9.83 s [9.00, 10.60] vs 10.10 s [9.80, 10.50]), "
        "so the difference is within the run-to-run spread."
    )
    assert len(warnings) == 2 and "TTFT mean" in warnings[1]
    assert "The two intervals overlap, so this run does not separate them." in what_this_shows(results)


def test_warns_on_a_single_run() -> None:
    results = _results()
    single = results.model_copy(
        update={"policies": {n: p.model_copy(update={"runs": []}) for n, p in results.policies.items()}}
    )
    assert run_warnings(single) == [
        "one run per policy: no spread was measured, so no difference here is shown to exceed run-to-run "
        "noise (--repeats 3 runs each policy three times)."
    ]
    assert "the spread is unknown" in what_this_shows(single)


def test_what_this_shows_is_written_from_the_figures() -> None:
    text = what_this_shows(_results())
    assert text.startswith("20 swe-agent-mini jobs, 8 in flight at a time, ran on the simulated engine")
    assert "a KV pool of 75 blocks (1,200 tokens)" in text
    assert "the busiest policy held 70 blocks (93% of it)" in text
    assert "Each policy ran 3 times (a fresh workload seed each)" in text
    assert "asymcache had the lowest mean job completion time, 8.17 s [8.00, 8.40] against vllm-apc's 10.10 s [9.80, 10.50] (0.81x)" in text
    assert "hit rate of 80% against 50%" in text
    assert "The two intervals do not overlap" in text
    # the baseline winning is said as such, not as a ratio of the baseline with itself
    slower = _results(asym_runs=(12.0, 12.5, 12.2))
    assert "No policy finished jobs faster than vllm-apc (10.10 s [9.80, 10.50] mean JCT)." in what_this_shows(slower)


def test_report_opens_with_what_this_shows_and_warnings(tmp_path: Path) -> None:
    results = _results(pool=4582, peak=847)
    write_report(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings[0] == "## What this shows"
    head = md.split("## Run\n")[0]
    assert "> **Warning:** the pool never filled: at most 847 of 4,582 blocks" in head
    assert "| JCT mean | 10.10 s [9.80, 10.50] | 8.17 s [8.00, 8.40] |" in md
    html = (tmp_path / "report.html").read_text()
    assert 'id="what-this-shows"' in html and "<strong>Warning:</strong> the pool never filled" in html


def test_cli_table_shows_intervals_and_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    print_results_table(_results(pool=4582, peak=847))
    out = capsys.readouterr().out
    assert "10.10 s [9.80, 10.50]" in out and "8.17 s [8.00, 8.40]" in out
    assert "3 runs each (means: mean [min, max] over the runs)" in out
    assert "warning: the pool never filled: at most 847 of 4,582 blocks" in out
    assert "pool 4582 blocks" in out
    # an http run's pool is the server's: not "pool None blocks"
    http = _results()
    http = http.model_copy(update={"run": http.run.model_copy(update={"backend": "http", "kv_blocks": None})})
    print_results_table(http)
    out = capsys.readouterr().out
    assert "pool" not in out.split("\n")[0] + out.split("\n")[1] and "None" not in out


def test_sim_repeats_draw_fresh_workloads(tmp_path: Path) -> None:
    from eval.bench import BenchConfig, repeat_seed, run_bench

    cfg = BenchConfig(backend="sim", policies=("vllm-apc",), jobs=4, concurrency=2, repeats=3, seed=5, out=tmp_path)
    assert [repeat_seed(cfg, r) for r in range(3)] == [5, 6, 7]
    results, _ = run_bench(cfg)
    runs = results.policies["vllm-apc"].runs
    # a deterministic clock with one seed would repeat the same run exactly
    assert len({(r.jct_mean, r.computed_tokens) for r in runs}) == 3
    assert any("seeds 5..7" in note for note in results.run.notes)
    real = BenchConfig(backend="real", repeats=3, seed=5)
    assert [repeat_seed(real, r) for r in range(3)] == [5, 5, 5]


def test_a_tie_is_no_win() -> None:
    results = _results(asym_runs=(10.0, 10.5, 9.8))  # the same means as the baseline
    text = what_this_shows(results)
    assert "No policy finished jobs faster than vllm-apc (10.10 s [9.80, 10.50] mean JCT; asymcache matched it within 0.5%)." in text
    assert "lowest mean job completion time" not in text and "Mean JCT of the others" not in text


def test_each_warning_is_its_own_paragraph(tmp_path: Path) -> None:
    results = _results(pool=4582, peak=847)
    single = results.model_copy(
        update={"policies": {n: p.model_copy(update={"runs": []}) for n, p in results.policies.items()}}
    )
    write_report(single, tmp_path)
    lines = (tmp_path / "report.md").read_text().splitlines()
    quoted = [i for i, line in enumerate(lines) if line.startswith("> **Warning:**")]
    assert len(quoted) == 2 and lines[quoted[0] + 1] == ""
