"""Open-loop arrivals: ``--rate`` is jobs per second of the run, whatever ``--time-scale``."""

from __future__ import annotations

import pytest

from eval.bench import BenchConfig, load_workload, run_bench


def test_rate_arrivals_are_run_seconds_and_only_pauses_are_scaled(tmp_path):
    from asymcache_core import EngineConfig
    from eval.harness import drive, make_engine
    from eval.variants import BenchVariant

    cfg = BenchConfig(workload="toolloop", backend="sim", jobs=20, rate=2.0, time_scale=0.05, max_model_len=131072,
                      num_kv_blocks=4000, seed=1)
    trace = load_workload(cfg)
    engine = make_engine(EngineConfig(num_kv_blocks=4000), "sim")  # NOTE: the model's own limit (8192 < 131072)
    outcome = drive(engine, trace, BenchVariant.parse("vllm-apc"), time_scale=cfg.time_scale, seed=0,
                    concurrency=None, sleep=None)
    first = {r.job_id: r.arrival - outcome.start for r in outcome.records if r.turn == 0}
    assert first == pytest.approx({j.job_id: j.arrival_s for j in trace.jobs})
    # NOTE: 20 arrivals at 2 jobs/s span about 10 s; scaled by 0.05 they would span 0.5 s
    assert 4.0 < max(first.values()) < 25.0
    # a tool pause still runs at time_scale x its trace length
    job = next(j for j in trace.jobs if len(j.turns) > 1 and j.pause_after(0) > 0)
    turns = sorted((r for r in outcome.records if r.job_id == job.job_id), key=lambda r: r.turn)
    assert turns[1].arrival - turns[0].finish == pytest.approx(job.pause_after(0) * cfg.time_scale)


def test_the_run_records_its_rate_and_time_scale(tmp_path):
    cfg = BenchConfig(workload="chat", backend="sim", jobs=4, rate=3.0, time_scale=0.25, policies=("vllm-apc",),
                      out=tmp_path / "r", plots=False, check_lossless=False)
    results, run_dir = run_bench(cfg)
    assert results.run.rate == 3.0 and results.run.time_scale == 0.25 and results.run.concurrency is None
    report = (run_dir / "report.md").read_text()
    assert "Poisson process at 3 jobs/s" in report and "0.25x" in report


def test_jobs_cut_to_max_model_len_are_counted_noted_and_warned(tmp_path):
    import json

    from typer.testing import CliRunner

    from eval.bench_workload import cut_jobs
    from eval.cli import app
    from eval.results_io import load_results
    from workloads import load_trace

    trace_path = tmp_path / "t.jsonl"
    jobs = [
        {"job_id": "long", "turns": [{"input_tokens": 150, "output_tokens": 4}]},  # dropped
        {"job_id": "two", "turns": [{"input_tokens": 40, "output_tokens": 4, "tool": "t", "tool_duration_s": 1.0},
                                    {"input_tokens": 80, "output_tokens": 4}]},  # shortened to one turn
        {"job_id": "fits", "turns": [{"input_tokens": 30, "output_tokens": 4}]},
    ]
    trace_path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    cut, cuts = cut_jobs(load_trace(f"trace:{trace_path}"), 100)
    assert (cuts.jobs, cuts.dropped, cuts.shortened) == (3, 1, 1)
    assert [j.job_id for j in cut.jobs] == ["two", "fits"] and len(cut.jobs[0].turns) == 1
    assert cut_jobs(load_trace(f"trace:{trace_path}"), 1000)[1].note() is None  # nothing cut, nothing said

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["bench", "--backend", "sim", "--workload", f"trace:{trace_path}",
                                      "--max-model-len", "100", "--policies", "vllm-apc", "--no-plots",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    warning = "warning: jobs cut to --max-model-len 100: 1 of 3 jobs dropped"
    assert any(line.startswith(warning) and "1 shortened" in line for line in result.output.splitlines())
    results = load_results(out)
    assert results.run.num_jobs == 2 and results.policies["vllm-apc"].num_jobs == 2
    assert any(note.startswith("jobs cut to --max-model-len 100") for note in results.run.notes)
    assert "1 of 3 jobs dropped" in (out / "report.md").read_text()
