"""The load sweep: SLO parsing, vLLM-named serving figures, goodput, capacity at the SLO, and
``asymcache bench`` with several points end to end on the simulator."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eval.cli import app
from eval.harness import RequestRecord, RunOutcome, serving_metrics
from eval.results import SLO
from eval.results_io import load_results
from eval.sweep import LoadPoint, sweep_points
from eval.sweep_results import Curve, capacity_at_slo, curve, load_sweep

runner = CliRunner()


def test_slo_parse_and_errors():
    assert SLO.parse("jct:300,ttft:2000") == SLO(jct_s=300.0, ttft_ms=2000.0)
    assert SLO.parse(" tpot:50 ") == SLO(tpot_ms=50.0)
    for bad, match in (("jct:-1", "jct needs a positive number"), ("latency:3", "unknown target 'latency'"),
                       ("ttft:x", "ttft needs a positive number"), (",", "an empty item"),
                       ("jct:1,jct:2", "jct is given twice"), ("jct:1,", "an empty item")):
        with pytest.raises(ValueError, match=f"^slo: {match}"):
            SLO.parse(bad)


def record(job: str, turn: int, arrival: float, ttft: float, tpot: float, finish: float, n: int = 3) -> RequestRecord:
    return RequestRecord(job, turn, arrival, arrival, arrival + ttft, finish, 100, 40, [1] * n, ttft, tpot,
                         itl=[tpot] * (n - 1))


def test_serving_metrics_use_vllm_names_and_count_goodput_per_job():
    records = [
        record("a", 0, 0.0, 0.1, 0.02, 1.0), record("a", 1, 2.0, 0.2, 0.02, 3.0),
        record("b", 0, 0.0, 0.9, 0.02, 2.0),  # misses the TTFT target: job b is not good
        record("c", 0, 0.0, 0.1, 0.02, 9.0),  # meets TTFT/TPOT but its JCT misses the target
    ]
    outcome = RunOutcome("p", records, {"a": 3.0, "b": 2.0, "c": 9.0}, duration_s=10.0)
    serving, goodput = serving_metrics(outcome, SLO(jct_s=5.0, ttft_ms=500.0))
    assert serving["completed"] == 4 and serving["completed_jobs"] == 3
    assert serving["request_throughput"] == pytest.approx(0.4)
    assert serving["total_input_tokens"] == 400 and serving["total_output_tokens"] == 12
    assert serving["mean_ttft_ms"] == pytest.approx(325.0)
    assert serving["median_ttft_ms"] == pytest.approx(150.0)
    assert serving["mean_itl_ms"] == pytest.approx(20.0)
    assert {"p90_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "p90_jct_ms", "std_jct_ms"} <= set(serving)
    assert serving["request_goodput"] == pytest.approx(3 / 10.0)
    assert serving["job_goodput"] == pytest.approx(1 / 10.0)  # only job a
    assert goodput == pytest.approx(360.0)
    assert serving_metrics(outcome, None)[1] is None


def test_capacity_interpolates_the_first_crossing():
    c = Curve(loads=(16, 32, 64, 128), mean=(10.0, 20.0, 40.0, 15.0), low=(0,) * 4, high=(0,) * 4)
    assert capacity_at_slo(c, 30.0) == pytest.approx(48.0)  # halfway from 32 (20 s) to 64 (40 s)
    assert capacity_at_slo(c, 5.0) is None  # even the lowest load misses
    assert capacity_at_slo(c, 50.0) == 128  # never crosses: the last load (a lower bound)


def test_sweep_points_order():
    points = sweep_points(["swe", "chat"], [1, 2], [32, 16], [0.5])
    assert points[0] == LoadPoint("swe", 1, 16, None) and points[2] == LoadPoint("swe", 1, None, 0.5)
    assert len(points) == 12 and points[0].label == "swe-s1-c16"
    assert LoadPoint("bfcl:bench_traces/x.jsonl", 3, None, 0.25).label == "x-s3-r0.25"


SIM = [
    "bench", "--backend", "sim", "--model", "dummy:llama-3.1-8b", "--jobs", "8", "--time-scale", "1",
    "--token-scale", "0.3", "--max-model-len", "32768", "--max-num-batched-tokens", "8192",
    "--gpu-memory-utilization", "0.2", "--device-memory-gib", "100", "--no-lossless-check",
    "--latency-profile", "bench_traces/profile_h200_llama8b_live.json",
]


def test_cli_sweep_writes_every_point_and_the_capacity(tmp_path):
    out = tmp_path / "sweep"
    result = runner.invoke(
        app, [*SIM, "--workload", "swe", "--concurrency", "2,8", "--seeds", "1,2", "--slo", "jct:400,ttft:3000",
              "--policies", "vllm-apc,asymcache+continuum,vllm-apc/unbounded", "--out", str(out), "--no-plots"],
    )
    assert result.exit_code == 0, result.output
    sweep = load_sweep(out)
    assert [(p.seed, p.concurrency) for p in sweep.points] == [(1, 2), (1, 8), (2, 2), (2, 8)]
    assert sweep.slo == SLO(jct_s=400.0, ttft_ms=3000.0)
    for point in sweep.points:
        results = load_results(out / point.run_dir)
        assert results.run.concurrency == point.concurrency and results.run.seed == point.seed
        # the pool is what 20% of a 100 GiB device leaves after 15 GiB of bf16 weights
        assert any("--gpu-memory-utilization 0.2" in n for n in results.run.notes)
        assert point.kv_blocks == results.run.kv_blocks and 0 < point.kv_blocks < 2000
        for name, figures in point.policies.items():
            policy = results.policies[name]
            assert figures.jct_p90 == policy.jct.p90 and policy.serving["p90_jct_ms"] == pytest.approx(policy.jct.p90 * 1e3)
            assert policy.goodput_jobs_per_hour is not None and policy.goodput_jobs_per_hour <= policy.jobs_per_hour
        for name, figures in point.policies.items():
            # where the job time goes: the four parts add up to the mean JCT
            parts = (figures.queue_s, figures.prefill_s, figures.decode_s, figures.pause_s)
            assert all(x is not None and x >= 0 for x in parts), name
            assert sum(parts) == pytest.approx(figures.jct_mean, rel=1e-6), name
    c = curve(sweep, "swe", "vllm-apc/unbounded", "jct_p90")
    assert c.loads == (2.0, 8.0) and all(lo <= m <= hi for m, lo, hi in zip(c.mean, c.low, c.high, strict=True))
    md = (out / "sweep.md").read_text()
    assert "## Capacity: load within the JCT p90 target" in md and "| swe | asymcache+continuum | 400.0 |" in md
    # each variant's job time by part, with its difference to the ceiling's at the same load
    assert "## Where the job time goes" in md and "difference to `vllm-apc/unbounded`" in md
    rows = [line for line in md.splitlines() if line.startswith("| vllm-apc | 8 |")]
    assert len(rows) == 1 and rows[0].count("(") == 5, rows  # four parts and the JCT, each with its delta
    assert "capacity within the JCT p90 target" in result.output
    # --no-plots: neither the sweep nor a point drew a plot, and their reports say so
    assert not list(out.rglob("*.png")) and "data:image/png" not in (out / "sweep.html").read_text()
    assert md.rstrip().endswith("_Not drawn (--no-plots); `asymcache report SWEEP_DIR` draws them._")
    point_md = (out / sweep.points[0].run_dir / "report.md").read_text()
    assert point_md.count("not drawn (--no-plots)") == 4
    # rebuilt from sweep.json alone, with its plot
    (out / "sweep.md").unlink()
    again = runner.invoke(app, ["report", str(out)])
    assert again.exit_code == 0
    rebuilt = (out / "sweep.md").read_text()
    assert rebuilt.split("## Plots")[0] == md.split("## Plots")[0] and "![swe: JCT p90 and goodput against load](sweep_swe.png)" in rebuilt
    assert (out / "sweep_swe.png").stat().st_size > 1000 and "data:image/png;base64," in (out / "sweep.html").read_text()


def test_cli_rate_points(tmp_path):
    out = tmp_path / "rates"
    result = runner.invoke(app, [*SIM, "--workload", "toolloop", "--rate", "0.5,2", "--policies", "vllm-apc",
                                 "--out", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    sweep = load_sweep(out)
    assert [(p.concurrency, p.rate) for p in sweep.points] == [(None, 0.5), (None, 2.0)]
    assert json.loads((out / sweep.points[0].run_dir / "results.json").read_text())["run"]["rate"] == 0.5
    # a sweep folder resumes: a finished point is read back, a missing one runs
    kept = out / sweep.points[0].run_dir / "results.json"
    before = kept.stat().st_mtime_ns
    import shutil

    shutil.rmtree(out / sweep.points[1].run_dir)
    again = runner.invoke(app, [*SIM, "--workload", "toolloop", "--rate", "0.5,2", "--policies", "vllm-apc",
                                "--out", str(out), "--no-plots"])
    assert again.exit_code == 0, again.output
    assert kept.stat().st_mtime_ns == before and (out / sweep.points[1].run_dir / "results.json").is_file()
    assert "[2/2] toolloop-s0-r2 done" in again.output and "r0.5 done" not in again.output
    assert load_sweep(out).points[0] == sweep.points[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "4,x"], "error: concurrency: expected comma-separated numbers"),
        (["--concurrency", "0,4"], "error: concurrency: must be >= 1"),
        (["--rate", "-1"], "error: rate: must be > 0"),
        (["--suite", "nope"], "error: suite: unknown suite 'nope'; known: agents"),
        (["--slo", "jct:0"], "error: slo: jct needs a positive number"),
        (["--gpu-memory-utilization", "0.05"], "error: gpu_memory_utilization: 0.05 of 100.0 GiB leaves no room"),
        (["--gpu-memory-utilization", "0.5", "--device-memory-gib", "0", "--backend", "sim"],
         "error: device_memory_gib: must be a positive number"),
    ],
)
def test_cli_sweep_bad_input_is_one_line(tmp_path, args, message):
    result = runner.invoke(app, [*SIM, "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith(message), result.output


def test_suite_sets_its_settings_and_the_command_line_wins(tmp_path):
    out = tmp_path / "suite"
    result = runner.invoke(app, ["bench", "--suite", "agents", "--workload", "toolloop", "--concurrency", "2",
                                 "--seeds", "1", "--jobs", "3", "--policies", "vllm-apc", "--device-memory-gib", "139",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    run = load_results(out).run  # one point: a plain bench folder
    assert (run.backend, run.model, run.workload, run.concurrency, run.num_jobs, run.seed) == (
        "sim", "dummy:llama-3.1-8b", "toolloop", 2, 3, 1)
    assert run.latency_profile.endswith("bench_traces/profile_h200_llama8b_live_async_2026_12_03.json")
    # the suite's pool: 90% of the 139 GiB given, after bf16 weights: tens of thousands of blocks
    assert any("--gpu-memory-utilization 0.9" in n for n in run.notes) and run.kv_blocks > 40_000


def test_job_goodput_keeps_job_ids_holding_a_hash():
    from eval.harness import RequestRecord, RunOutcome, repeated_result, serving_metrics

    slo = SLO(ttft_ms=1000.0)

    def outcome(bad_ttft: float) -> RunOutcome:
        # job "a#1" has a request past the TTFT target; jobs "a" and "b#x#2" meet it
        records = [RequestRecord(job, 0, 0.0, 0.0, ttft, 1.0, 10, 0, [1, 2], ttft, 0.01)
                   for job, ttft in (("a#1", bad_ttft), ("a", 0.1), ("b#x#2", 0.2))]
        return RunOutcome("p", records, {r.job_id: 1.0 for r in records}, 1.0, {})

    serving, goodput = serving_metrics(outcome(5.0), slo)
    assert serving["job_goodput"] == pytest.approx(2.0) and goodput == pytest.approx(2 * 3600.0)
    assert serving_metrics(outcome(0.5), slo)[0]["job_goodput"] == pytest.approx(3.0)
    stats = {k: 0 for k in ("prompt_tokens", "hit_tokens", "hole_tokens", "suffix_recomputed_tokens",
                            "preempted_tokens", "computed_tokens", "generated_tokens", "evictions",
                            "peak_blocks_in_use", "num_preemptions")}
    runs = [outcome(5.0), outcome(5.0)]
    for run in runs:
        run.engine_stats = stats
    pooled = repeated_result(runs, None, slo)
    assert pooled.serving["job_goodput"] == pytest.approx(2.0) and pooled.jct.count == 6


def test_workloads_sharing_a_stem_get_their_own_points_and_plots(tmp_path):
    from eval.sweep_results import workload_slugs

    paths = []
    for folder, tokens in (("A", 40), ("B", 90)):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "w.jsonl"
        path.write_text("".join(json.dumps({"job_id": f"{folder}{i}", "turns": [
            {"input_tokens": tokens, "output_tokens": 4, "tool": "t", "tool_duration_s": 0.5},
            {"input_tokens": 10, "output_tokens": 4}]}) + "\n" for i in range(4)))
        paths.append(f"trace:{path}")
    assert list(workload_slugs([*paths, "swe"]).values()) == ["A-w", "B-w", "swe"]
    assert sweep_points(paths, [0], [2], [])[1].label == "B-w-s0-c2"
    out = tmp_path / "sw"
    args = ["bench", "--backend", "sim", "--workload", ",".join(paths), "--concurrency", "1,2", "--policies",
            "vllm-apc", "--out", str(out), "--max-model-len", "4096"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    sweep = load_sweep(out)
    assert len({p.run_dir for p in sweep.points}) == 4
    for point in sweep.points:
        assert load_results(out / point.run_dir).run.workload == point.workload
    prompts = {p.workload: p.policies["vllm-apc"].computed_tokens for p in sweep.points if p.concurrency == 1}
    assert prompts[paths[0]] < prompts[paths[1]]  # each point ran its own file
    assert (out / "sweep_A-w.png").is_file() and (out / "sweep_B-w.png").is_file()
    md = (out / "sweep.md").read_text()
    assert "**A-w**" in md and "**B-w**" in md

    # a point folder holding another point's run is not read back as this one's
    (out / "points" / "A-w-s0-c1").rename(out / "points" / "keep")
    (out / "points" / "B-w-s0-c1").rename(out / "points" / "A-w-s0-c1")
    again = runner.invoke(app, args)
    assert again.exit_code == 2
    line = [x for x in again.output.splitlines() if x.strip()][-1]
    assert line.startswith("error: out: ") and "A-w-s0-c1 holds the results of another point: workload" in line
