"""The harness and the CLI: sim vs real ranking, an end-to-end bench, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from eval.bench import BenchConfig, run_bench
from eval.cli import app
from eval.results_io import load_results
from tests.eval.bench_configs import small

runner = CliRunner()


def calibrated_profile(smollm, path) -> str:
    """A quick latency profile of this machine (the sim is only as good as its profile)."""
    from asymcache_core.profiler import ProfileGrid, fit, measure
    from tests.conftest import make_engine

    grid = ProfileGrid(chunk_tokens=(1, 16, 64, 160), contexts=(0, 192), decode_batches=(1, 2, 4),
                       decode_contexts=(160,), repeats=2)
    engine = make_engine(smollm, num_kv_blocks=64)
    fit(measure(engine, grid), model="smollm2-135m", source=str(path)).to_json(path)
    return str(path)


@pytest.mark.slow  # NOTE: compares wall-clock TTFT of real runs: a benchmark, not for a loaded machine
def test_sim_reproduces_real_ranking(smollm, tmp_path):
    policies = ("lru", "asymcache")
    profile = calibrated_profile(smollm, tmp_path / "profile.json")
    real, _ = run_bench(small("real", policies, tmp_path / "real", latency_profile=profile))
    sim, _ = run_bench(small("sim", policies, tmp_path / "sim", latency_profile=profile))
    for results in (real, sim):
        assert set(results.policies) == set(policies)
        assert results.run.latency_profile == profile
    # the prefix-only LRU recomputes far more than hole-aware AsymCache, in both backends
    r = {p: real.policies[p].computed_tokens for p in policies}
    s = {p: sim.policies[p].computed_tokens for p in policies}
    assert r["lru"] > r["asymcache"] and s["lru"] > s["asymcache"]
    # NOTE: TTFT, where recomputation shows; JCT here is mostly think time, a few % apart.
    rank_real = sorted(policies, key=lambda p: real.policies[p].ttft.mean)
    rank_sim = sorted(policies, key=lambda p: sim.policies[p].ttft.mean)
    assert rank_real == rank_sim


def test_cli_bench_end_to_end_writes_valid_results(tmp_path):
    out = tmp_path / "run"
    # NOTE: a 96-token context keeps two turns of each job (a returning turn that reuses its
    # cache after a tool pause): 4 requests and 12 output tokens a run, where 160 kept 9 and 36
    # for the same paths, three runs over (two policies and the lossless reference).
    result = runner.invoke(
        app,
        ["bench", "--workload", "swe", "--jobs", "2", "--concurrency", "2", "--token-scale", "0.03",
         "--time-scale", "0.01", "--max-context", "96", "--kv-fraction", "0.9",
         "--policies", "vllm-apc,asymcache+continuum", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    results = load_results(out)
    assert list(results.policies) == ["vllm-apc", "asymcache+continuum"]
    for r in results.policies.values():
        assert r.num_jobs == 2 and r.lossless_agreement == 1.0
        assert r.num_requests == 4 and r.hit_tokens > 0  # the returning turns ran on their cache
        assert r.jct.count == 2 and r.jct.mean > 0
    schema = json.loads((out / "results.schema.json").read_text())
    assert "policies" in schema["properties"]
    for name in ("report.md", "report.html", "jct_cdf.png"):
        assert (out / name).is_file()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0


def test_cli_sim_bench_scales(tmp_path):
    # NOTE: 96 jobs through 32 slots refill the closed loop three times over with every default
    # policy; the sim's cost is linear in the jobs (200 took twice as long for the same paths).
    result = runner.invoke(
        app, ["bench", "--backend", "sim", "--jobs", "96", "--concurrency", "32", "--out", str(tmp_path / "s")]
    )
    assert result.exit_code == 0, result.output
    results = load_results(tmp_path / "s")
    assert all(r.num_jobs == 96 for r in results.policies.values())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workload", "nope"], "workload"),
        (["--policies", "vllm-apc,bogus"], "policy"),
        (["--policies", "asymcache/bogus"], "ablation"),
        (["--model", "no-such-model", "--backend", "sim"], "model"),
        (["--kv-blocks", "3", "--backend", "sim"], "num_kv_blocks"),
        (["--num-kv-blocks", "3", "--backend", "sim"], "num_kv_blocks"),
        (["--kv-fraction", "0.01", "--backend", "sim"], "kv_fraction"),
        (["--max-model-len", "0", "--backend", "sim"], "max_model_len"),
        (["--max-num-seqs", "0", "--backend", "sim"], "max_num_seqs"),
        (["--dtype", "int8", "--backend", "sim"], "dtype"),
        (["--backend", "carrier-pigeon"], "backend"),
        (["--backend", "http"], "url"),
    ],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, args, needle):
    result = runner.invoke(app, ["bench", "--jobs", "2", "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and needle in lines[-1], result.output
    assert "Traceback" not in result.output


def test_cli_malformed_trace_names_the_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"job_id": "a", "arrival_s": 0, "turns": [{"input_tokens": 5, "output_tokens": 2}]}\n{broken\n')
    result = runner.invoke(app, ["bench", "--workload", f"trace:{trace}", "--backend", "sim", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "t.jsonl:2:" in result.output and "Traceback" not in result.output


def test_cli_report_on_missing_run(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "error:" in result.output


def test_warm_up_runs_every_launch_shape_on_its_own_engine(smollm, monkeypatch):
    """The GPU warm-up drives short prompts and a long context extended by short suffixes on a
    throwaway engine; here, on the CPU, it must run them all and leave a sound pool."""
    from asymcache_core import Engine, EngineConfig
    from eval.harness import warm_up

    seen: list[tuple[int, int, int]] = []
    original = Engine.generate

    def spy(self, prompts, params=None, job_ids=None):  # type: ignore[no-untyped-def]
        outputs = original(self, prompts, params, job_ids)
        seen.append((len(prompts[0]), outputs[0].metrics.cached_tokens, self.num_blocks))
        return outputs

    monkeypatch.setattr(Engine, "generate", spy)
    warm_up(smollm, EngineConfig(model="smollm2-135m", num_kv_blocks=8), long_context=160)
    assert [n for n, _, _ in seen] == [3, 6, 12, 24, 48, 100, 160, 163, 166, 172, 184, 208]
    # the suffixed prompts reuse the long context, so each computes only its short suffix
    assert all(cached >= 144 for n, cached, _ in seen[7:])
    assert all(blocks > 8 for _, _, blocks in seen)  # its own pool, sized for the long context


def _outcome(ttfts: list[float], computed: int, tokens: list[int]):
    from eval.harness import RequestRecord, RunOutcome

    records = [
        RequestRecord(f"j{i}", 0, 0.0, 0.0, t, 1.0, 10, 4, tokens, t, 0.01 * (i + 1))
        for i, t in enumerate(ttfts)
    ]
    stats = {
        "prompt_tokens": 10 * len(ttfts), "hit_tokens": 4 * len(ttfts), "hole_tokens": 0,
        "suffix_recomputed_tokens": 0, "preempted_tokens": 0, "computed_tokens": computed,
        "generated_tokens": 3 * len(ttfts), "evictions": computed // 10, "peak_blocks_in_use": 5,
        "num_preemptions": 0,
    }
    return RunOutcome("p", records, {r.job_id: 1.0 + r.ttft for r in records}, 2.0, stats)


def test_repeated_result_pools_latencies_and_keeps_each_run():
    from eval.harness import repeated_result

    reference = {(f"j{i}", 0): [1, 2, 3] for i in range(3)}
    first = _outcome([0.1, 0.2, 0.3], 900, [1, 2, 3])
    second = _outcome([0.5, 0.6, 0.7], 1100, [9, 9, 9])  # a run whose tokens all differ
    result = repeated_result([first, second], reference)
    assert result.ttft.count == 6 and result.ttft.mean == pytest.approx(0.4)
    assert result.jct.count == 6 and result.num_jobs == 3
    assert result.computed_tokens == 1000 and result.evictions == 100  # per-run means
    assert result.lossless_agreement == pytest.approx(0.5)
    assert [r.ttft_mean for r in result.runs] == pytest.approx([0.2, 0.6])
    assert [r.computed_tokens for r in result.runs] == [900, 1100]
    single = repeated_result([first], reference)
    assert single.runs == [] and single.ttft.count == 3 and single.lossless_agreement == 1.0
    with pytest.raises(ValueError, match="outcomes"):
        repeated_result([], None)


def _sim_outcome(policy: str = "asymcache+continuum", **kw):
    """One sim run of a small tool-loop workload (the sim is deterministic for a seed)."""
    from asymcache_core import EngineConfig
    from eval.bench import load_workload
    from eval.harness import drive, make_engine
    from eval.variants import BenchVariant

    cfg = BenchConfig(workload="toolloop", backend="sim", jobs=6, concurrency=3, max_model_len=131072,
                      num_kv_blocks=4000)
    engine = make_engine(EngineConfig(num_kv_blocks=4000), "sim")  # NOTE: the model's own limit (8192 < 131072)
    args = dict(time_scale=1.0, seed=0, concurrency=3, sleep=None) | kw
    return drive(engine, load_workload(cfg), BenchVariant.parse(policy), **args)


def test_repeats_of_identical_runs_report_one_runs_throughputs():
    from eval.harness import PER_RUN_SERVING_KEYS, policy_result, repeated_result
    from eval.results import SLO

    slo = SLO(jct_s=1e6, ttft_ms=1e6)
    runs = [_sim_outcome() for _ in range(3)]
    assert runs[0].duration_s == runs[1].duration_s > 0  # the same run three times over
    one = policy_result(runs[0], None, slo)
    three = repeated_result(runs, None, slo)
    assert three.ttft.count == 3 * one.ttft.count  # latencies pool every run's requests
    for name in ("num_jobs", "num_requests", "jobs_per_hour", "throughput_tok_s", "goodput_jobs_per_hour",
                 "computed_tokens", "duration_s"):
        assert getattr(three, name) == pytest.approx(getattr(one, name)), name
    assert one.serving["job_throughput"] > 0 and one.serving["request_goodput"] > 0
    for key in PER_RUN_SERVING_KEYS:
        assert three.serving[key] == pytest.approx(one.serving[key]), key


def test_cli_bench_repeats_reports_each_run(tmp_path):
    out = tmp_path / "rep"
    result = runner.invoke(
        app, ["bench", "--backend", "sim", "--jobs", "4", "--concurrency", "2", "--repeats", "3",
              "--policies", "vllm-apc,asymcache", "--step-log", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    results = load_results(out)
    for pol in results.policies.values():
        assert len(pol.runs) == 3 and pol.num_jobs == 4 and pol.jct.count == 12
    assert "## Run to run" in (out / "report.md").read_text()
    assert sorted(p.name for p in (out / "steps").iterdir())[:3] == [
        "asymcache-run1.jsonl", "asymcache-run2.jsonl", "asymcache-run3.jsonl",
    ]
    steps = [json.loads(line) for line in (out / "steps" / "asymcache-run1.jsonl").read_text().splitlines()]
    # the sim prices each step with the model itself: prediction and duration coincide
    assert steps and all(s["predicted_s"] == pytest.approx(s["duration_s"]) for s in steps)
    assert sum(s["num_tokens"] for s in steps) == results.policies["asymcache"].runs[0].computed_tokens
    requests = [json.loads(line) for line in (out / "requests" / "asymcache-run1.jsonl").read_text().splitlines()]
    # NOTE: sim repeats run fresh workload seeds, so each run has its own number of requests
    per_run = [len((out / "requests" / f"asymcache-run{k}.jsonl").read_text().splitlines()) for k in (1, 2, 3)]
    assert len(requests) == per_run[0] and round(sum(per_run) / 3) == results.policies["asymcache"].num_requests
    assert sum(r["computed_tokens"] for r in requests) == results.policies["asymcache"].runs[0].computed_tokens
    for r in requests:
        assert 0 <= r["arrival"] <= r["first_scheduled"] <= r["first_token"] <= r["finish"]
        assert r["ttft"] == pytest.approx(r["first_token"] - r["arrival"])
    with pytest.raises(ValueError, match="repeats"):
        run_bench(small("sim", ("lru",), tmp_path / "bad", repeats=0))


def test_a_host_tier_shows_in_the_results_and_the_report(tmp_path):
    # a bench with --num-host-kv-blocks: every variant's results carry the tier's counters
    # (the unbounded ceiling has no tier), the copies replace recomputation, and the report has
    # the tier's table
    cfg = BenchConfig(
        workload="swe", jobs=30, concurrency=12, backend="sim", model="dummy:tiny", num_kv_blocks=120,
        num_host_kv_blocks=600, policies=("vllm-apc", "asymcache+continuum", "vllm-apc/unbounded"),
        out=tmp_path / "run", check_lossless=False, time_scale=0.05, token_scale=0.05, plots=False,
    )
    results, folder = run_bench(cfg)
    tiered = results.policies["vllm-apc"].host_tier
    assert tiered is not None and tiered.blocks == 600
    assert tiered.offloaded_blocks > 0 and tiered.reloaded_blocks > 0 and tiered.reload_tokens > 0
    ours = results.policies["asymcache+continuum"].host_tier
    assert ours is not None and tiered.gate_blocks == 0  # vllm-apc has no job admission
    # the gate counts the device pool, and at most half of the tier beyond it
    assert 120 <= ours.gate_blocks <= 120 + (600 - 120) // 2
    assert results.policies["vllm-apc/unbounded"].host_tier is None
    report = (folder / "report.md").read_text()
    assert "## Host KV tier" in report and "Job gate at the end (blocks)" in report
    without, _ = run_bench(replace(cfg, num_host_kv_blocks=None, policies=("vllm-apc",), out=tmp_path / "b"))
    assert without.policies["vllm-apc"].host_tier is None
    assert results.policies["vllm-apc"].computed_tokens < without.policies["vllm-apc"].computed_tokens


def test_job_time_places_every_second_of_a_job():
    from eval.harness import RequestRecord, RunOutcome, job_time

    def record(job: str, turn: int, arrival: float, scheduled: float | None, first: float | None, finish: float):
        return RequestRecord(job, turn, arrival, scheduled, first, finish, 10, 0, [1], None, None)

    # job a: turn 0 queued 1 s, 2 s to its first token, 3 s decoding; a 4 s tool call; turn 1
    # queued 0.5 s, 1 s to first token, 0.5 s decoding: JCT 12 s
    # job b: one turn, never queued, its first token is its end (one output token): JCT 2 s
    records = [
        record("a", 0, 0.0, 1.0, 3.0, 6.0),
        record("a", 1, 10.0, 10.5, 11.5, 12.0),
        record("b", 0, 0.0, 0.0, None, 2.0),
    ]
    outcome = RunOutcome("p", records, {"a": 12.0, "b": 2.0}, 12.0, {})
    t = job_time(outcome)
    assert t is not None
    assert (t.queue_s, t.prefill_s, t.decode_s, t.pause_s) == pytest.approx((0.75, 2.5, 1.75, 2.0))
    assert t.queue_s + t.prefill_s + t.decode_s + t.pause_s == pytest.approx(7.0)  # the mean JCT
    assert job_time(RunOutcome("p", [], {}, 0.0, {})) is None


def test_repeated_result_weighs_each_runs_job_time_by_its_jobs():
    from eval.harness import repeated_result

    first = _outcome([0.1, 0.2, 0.3], 900, [1, 2, 3])
    second = _outcome([0.5, 0.6, 0.7], 1100, [9, 9, 9])
    result = repeated_result([first, second], None)
    # every record: arrival 0, scheduled 0, first token at its TTFT, finish 1, JCT 1 + TTFT
    assert result.job_time is not None
    assert result.job_time.queue_s == pytest.approx(0.0)
    assert result.job_time.prefill_s == pytest.approx(0.4)
    assert result.job_time.decode_s == pytest.approx(0.6)
    assert result.job_time.pause_s == pytest.approx(0.4)  # JCT 1 + TTFT against 1 s of requests


def test_each_request_feeds_t_queue_once_when_first_admitted():
    """The pin benefit's queueing delay (T_queue) is recorded by the engine when a request is
    first admitted, once: the harness reports nothing a second time at the request's end."""
    from asymcache_core import EngineConfig
    from eval.bench import load_workload
    from eval.harness import drive, make_engine
    from eval.variants import BenchVariant

    cfg = BenchConfig(workload="toolloop", backend="sim", jobs=6, concurrency=3, max_model_len=131072,
                      num_kv_blocks=4000)
    trace = load_workload(cfg)
    engine = make_engine(EngineConfig(num_kv_blocks=4000), "sim")  # NOTE: the model's own limit (8192 < 131072)
    engine.continuum.queue.window = 10_000
    outcome = drive(engine, trace, BenchVariant.parse("asymcache+continuum"), time_scale=1.0, seed=0,
                    concurrency=3, sleep=None)
    samples = [delay for _, delay in engine.continuum.queue._samples]
    assert len(samples) == len(outcome.records) > 6
    expected = sorted(r.first_scheduled - r.arrival for r in outcome.records)
    assert sorted(samples) == pytest.approx(expected)


def test_clients_without_job_ids_get_the_jobs_of_their_conversations(tmp_path):
    from eval.variants import BenchVariant

    # SWE agents on a pool that binds: the default serves clients that send no job ids as it
    # serves those that do, where without implicit jobs it serves them as vllm-apc does
    names = ("vllm-apc", "asymcache+continuum", "asymcache+continuum/anonymous",
             "asymcache+continuum/anonymous/no-implicit-jobs")
    results, _ = run_bench(small("sim", names, tmp_path / "a", workload="swe", jobs=16, concurrency=8,
                                 token_scale=0.2, time_scale=0.05, num_kv_blocks=200, max_model_len=2048, plots=False))
    jct = {name: results.policies[name].jct.mean for name in names}
    computed = {name: results.policies[name].computed_tokens for name in names}
    assert jct["asymcache+continuum/anonymous"] == pytest.approx(jct["asymcache+continuum"], rel=0.02)
    assert computed["asymcache+continuum/anonymous"] <= computed["asymcache+continuum"] * 1.02
    assert computed["asymcache+continuum/anonymous/no-implicit-jobs"] > computed["asymcache+continuum"] * 1.1
    assert BenchVariant.parse("asymcache/anonymous").anonymous and not BenchVariant.parse("asymcache").anonymous


def test_a_turn_due_mid_step_counts_its_latencies_from_when_it_was_due():
    from asymcache_core import EngineConfig, SamplingParams
    from eval.harness import drive, make_engine
    from eval.variants import BenchVariant
    from workloads import Job, Trace, Turn

    # job a's long prompt makes a first step of seconds; job b is due 1 ms into it
    trace = Trace(name="t", jobs=[
        Job(job_id="a", arrival_s=0.0, turns=[Turn(input_tokens=2000, output_tokens=4)]),
        Job(job_id="b", arrival_s=0.001, turns=[Turn(input_tokens=8, output_tokens=4)]),
    ])
    engine = make_engine(EngineConfig(num_kv_blocks=400, max_model_len=4096), "sim")
    outcome = drive(engine, trace, BenchVariant.parse("vllm-apc"), time_scale=1.0, seed=0, concurrency=None,
                    sleep=None)
    b = next(r for r in outcome.records if r.job_id == "b")
    due = outcome.start + 0.001
    assert b.first_scheduled is not None and b.first_token is not None and b.ttft is not None
    assert b.first_scheduled - outcome.start > 0.5  # it reached the engine after the long step
    assert b.arrival == pytest.approx(due)
    assert b.ttft == pytest.approx(b.first_token - due)
    assert outcome.jct["b"] == pytest.approx(b.finish - due)
    # the engine takes a past arrival, not a future one
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), arrival_time=engine.clock() + 1.0)
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), arrival_time=float("nan"))
