"""results.json and sweep.json that cannot be true are refused, naming the field: negative
latencies, percentiles out of order, more hits than prompt tokens, NaN or infinities."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eval.bench import BenchConfig, run_bench
from eval.cli import app
from eval.results_io import load_results
from eval.sweep_results import PointFigures, SweepPoint, SweepResults, load_sweep, save_sweep

runner = CliRunner()


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("good") / "run"
    run_bench(BenchConfig(workload="chat", backend="sim", jobs=4, concurrency=2, policies=("vllm-apc",), out=out,
                          plots=False, check_lossless=False, slo="jct:100"))
    return json.loads((out / "results.json").read_text())


def _set(path: str, value: object) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[int(key)] if key.isdigit() else doc[key]
        doc[int(last) if last.isdigit() else last] = value
    return edit


BAD = [
    ("policies.vllm-apc.ttft", "mean is negative", _set("policies.vllm-apc.ttft.mean", -0.5)),
    ("policies.vllm-apc.jct", "p90 is negative", _set("policies.vllm-apc.jct.p90", -1.0)),
    ("policies.vllm-apc.jct", "is below p50", _set("policies.vllm-apc.jct.p50", 1e6)),
    ("policies.vllm-apc.ttft", "p99 (0.0) is below p95", _set("policies.vllm-apc.ttft.p99", 0.0)),
    ("policies.vllm-apc", "hit_tokens (999999) exceed prompt_tokens", _set("policies.vllm-apc.hit_tokens", 999999)),
    ("policies.vllm-apc.series.ttft.0", "greater than or equal to 0", _set("policies.vllm-apc.series.ttft.0", -1.0)),
    ("policies.vllm-apc.series.jct.0", "finite number", _set("policies.vllm-apc.series.jct.0", float("nan"))),
    ("policies.vllm-apc.serving.mean_ttft_ms", "finite number",
     _set("policies.vllm-apc.serving.mean_ttft_ms", float("inf"))),
    ("policies.vllm-apc.duration_s", "finite number", _set("policies.vllm-apc.duration_s", float("-inf"))),
]


@pytest.mark.parametrize(("field", "needle", "edit"), BAD, ids=[b[1][:20] for b in BAD])
def test_impossible_results_are_refused_naming_the_field(good_run, tmp_path, field, needle, edit):
    doc = json.loads(json.dumps(good_run))
    assert doc["policies"]["vllm-apc"]["ttft"]["p95"] > 0  # the edits below break a real run's figures
    edit(doc)
    run = tmp_path / "bad"
    run.mkdir()
    # NOTE: Python's json writes NaN and Infinity literally, as a careless writer would
    (run / "results.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not match the results schema") as info:
        load_results(run)
    assert field in str(info.value) and needle in str(info.value)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0]


def test_percentiles_apart_by_float_noise_still_load(good_run, tmp_path):
    doc = json.loads(json.dumps(good_run))
    ttft = doc["policies"]["vllm-apc"]["ttft"]
    ttft["p95"] = ttft["p99"] * (1 + 1e-13)  # an ulp or so above p99, as interpolation may give
    (tmp_path / "results.json").write_text(json.dumps(doc))
    assert load_results(tmp_path).policies["vllm-apc"].ttft.p95 == ttft["p95"]


def _sweep(tmp_path: Path) -> Path:
    figures = PointFigures(jct_mean=2.0, jct_p90=3.0, jct_p99=4.0, ttft_mean=0.1, ttft_p99=0.3, tpot_mean=0.01,
                           jobs_per_hour=100.0, hit_rate=0.5, computed_tokens=10, recomputed_tokens=1,
                           preempted_tokens=0)
    sweep = SweepResults(command="asymcache bench", started="2026-01-01T00:00:00", duration_s=1.0, machine="m",
                         backend="sim", model="m", points=[SweepPoint(workload="swe", seed=0, concurrency=4,
                                                                      run_dir="points/p", policies={"lru": figures})])
    save_sweep(sweep, tmp_path)
    assert load_sweep(tmp_path) == sweep
    return tmp_path / "sweep.json"


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("jct_p90", "NaN", "finite number"), ("jobs_per_hour", "Infinity", "finite number"),
    ("hit_rate", "1.5", "less than or equal to 1"),
])
def test_a_bad_sweep_is_refused_naming_the_field(tmp_path, key, value, needle):
    path = _sweep(tmp_path)
    doc = json.loads(path.read_text())
    doc["points"][0]["policies"]["lru"][key] = "@@"
    path.write_text(json.dumps(doc).replace('"@@"', value))
    with pytest.raises(ValueError, match="not a sweep document") as info:
        load_sweep(tmp_path)
    assert f"points.0.policies.lru.{key}" in str(info.value) and needle in str(info.value)
    result = runner.invoke(app, ["report", str(tmp_path)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and f"points.0.policies.lru.{key}" in lines[0]


@pytest.mark.parametrize(("text", "problem"), [
    (None, "{kind} file not found"),
    ('{"schema_version": 1, "points": ', "not valid JSON (line 1, column 33)"),
    ("[1, 2]", "expected a JSON object at the top level, got list"),
    ('{"schema_version": 1}', None),
])
def test_a_bad_results_or_sweep_file_is_refused_in_the_same_words(tmp_path, text, problem):
    """One loader reads both documents (eval.results_io.load_document): a sweep.json that was
    not JSON was once "not a sweep document, 1 problem(s): (top level): Invalid JSON"."""
    for name, load, kind, mismatch in (
        ("results.json", load_results, "results", "does not match the results schema (version "),
        ("sweep.json", load_sweep, "sweep", "not a sweep document, "),
    ):
        folder = tmp_path / kind
        folder.mkdir()
        if text is not None:
            (folder / name).write_text(text)
        with pytest.raises(ValueError) as info:
            load(folder)
        want = f"{folder / name}: " + (problem.format(kind=kind) if problem is not None else mismatch)
        assert str(info.value).startswith(want), str(info.value)
