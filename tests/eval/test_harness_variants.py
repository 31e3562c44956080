"""Policy variants in a bench: ablation suffixes, the order runs take, and the scheduling orders
on the simulated GPU long-chat grid."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from eval.bench import BenchConfig, run_bench
from tests.eval.bench_configs import small


def test_unbounded_ablation_is_the_ceiling_of_eviction(tmp_path):
    # a pool of 20 blocks thrashes; the same policy with the whole working set evicts nothing
    results, _ = run_bench(small("sim", ("vllm-apc", "asymcache", "vllm-apc/unbounded"), tmp_path / "u", plots=False))
    ceiling = results.policies["vllm-apc/unbounded"]
    assert ceiling.evictions == 0 and ceiling.recomputed_tokens.total == 0
    assert results.policies["vllm-apc"].evictions > 0
    for name in ("vllm-apc", "asymcache"):
        assert ceiling.computed_tokens < results.policies[name].computed_tokens
        assert ceiling.ttft.mean <= results.policies[name].ttft.mean
    assert results.run.kv_blocks == 20  # the run's pool is still the one the others got


def test_rounds_rotate_so_each_policy_runs_first_equally_often():
    from eval.bench import run_order
    from eval.variants import BenchVariant

    policies = [BenchVariant.parse(n) for n in ("vllm-apc", "lru", "asymcache")]
    order = [(p.name, r) for p, r in run_order(policies, 3)]
    assert order == [
        ("vllm-apc", 0), ("lru", 0), ("asymcache", 0),
        ("lru", 1), ("asymcache", 1), ("vllm-apc", 1),
        ("asymcache", 2), ("vllm-apc", 2), ("lru", 2),
    ]
    firsts = [order[i][0] for i in range(0, len(order), len(policies))]
    assert sorted(firsts) == sorted(p.name for p in policies)
    assert [(p.name, r) for p, r in run_order(policies[:1], 2)] == [("vllm-apc", 0), ("vllm-apc", 1)]


def test_reserve_prompt_ablation_turns_on_full_prompt_admission():
    from eval.variants import BenchVariant

    assert BenchVariant.parse("vllm-apc/reserve-prompt").engine_overrides["admit_full_prompt"] is True
    assert "admit_full_prompt" not in BenchVariant.parse("vllm-apc").engine_overrides


def test_fcfs_ablation_replaces_only_the_presets_order():
    from eval.variants import BenchVariant

    default, plain = BenchVariant.parse("asymcache+continuum"), BenchVariant.parse("asymcache+continuum/fcfs")
    assert default.engine_overrides["priority"] == "adaptive" and plain.engine_overrides["priority"] == "fcfs"
    assert {k: v for k, v in plain.engine_overrides.items() if k != "priority"} == {
        k: v for k, v in default.engine_overrides.items() if k != "priority"
    }
    assert plain.pinning and plain.ttl_rule == default.ttl_rule


def gpu_longchat_sim(policies: tuple[str, ...], out: Path) -> BenchConfig:
    """The GPU long-chat grid (pool 35%, 2,048-token budget) on the simulator, H200 profile."""
    traces = Path(__file__).resolve().parents[2] / "bench_traces"
    return BenchConfig(
        workload=f"trace:{traces / 'gpu_longchat.jsonl'}", jobs=20, concurrency=10, time_scale=0.05,
        kv_fraction=0.35, max_model_len=65536, model="dummy:llama-3.1-8b", backend="sim",
        latency_profile=str(traces / "profile_h200_llama8b_live.json"), max_num_batched_tokens=2048,
        policies=policies, out=out, check_lossless=False, plots=False,
    )


def test_least_work_first_keeps_returning_turns_from_losing_their_cache(tmp_path):
    # The long-chat grid again (BENCHMARKS.md): under FCFS, returning turns whose
    # context is cached wait behind long prefills while vLLM's order evicts their blocks; with
    # the least work first they run before that happens.
    from eval.variants import BenchVariant

    assert BenchVariant.parse("vllm-apc/least-work").engine_overrides["least_work_first"] is True
    policies = ("vllm-apc/reserve-prompt", "vllm-apc/reserve-prompt/least-work")
    results, _ = run_bench(gpu_longchat_sim(policies, tmp_path / "order"))
    fcfs, least_work = (results.policies[name] for name in policies)
    assert least_work.ttft.mean < 0.7 * fcfs.ttft.mean
    assert least_work.computed_tokens < 0.8 * fcfs.computed_tokens


def test_least_work_patience_shortens_the_ttft_tail_under_pressure(tmp_path):
    # The long-chat grid at pool 25%, vLLM's 8,192-token budget, the whole system (BENCHMARKS.md): the least work first alone leaves long cold prompts waiting behind streams of
    # returning turns (p99 15.8 s here, up to 24 s on the H200); a patience of 4 bounds that wait.
    traces = Path(__file__).resolve().parents[2] / "bench_traces"
    policies = (
        "asymcache/reserve-prompt/least-work/adaptive/slo:35",
        "asymcache/reserve-prompt/least-work:4/adaptive/slo:35",
    )
    config = replace(
        gpu_longchat_sim(policies, tmp_path / "patience"), kv_fraction=0.25, max_num_batched_tokens=8192,
        latency_profile=str(traces / "profile_h200_llama8b_live_decode_kv.json"),
    )
    results, _ = run_bench(config)
    pure, patient = (results.policies[name] for name in policies)
    assert patient.ttft.p99 < 0.85 * pure.ttft.p99


def test_long_context_chat_trace_favours_position_aware_eviction(tmp_path):
    # The GPU grid's long-chat trace (BENCHMARKS.md, eviction on the GPU), simulated with the H200
    # profile: with contexts up to 64k a token's attention costs as much as its linear layers,
    # so evicting shallow blocks (refilled as holes) beats vLLM's tail-first order.
    from workloads.schema import Trace

    traces = Path(__file__).resolve().parents[2] / "bench_traces"
    trace = Trace.load_jsonl(traces / "gpu_longchat.jsonl")
    assert trace.params["user_median"] == 4000.0 and len(trace.jobs) == 40
    policies = ("vllm-apc", "lru", "asymcache")
    results, _ = run_bench(gpu_longchat_sim(policies, tmp_path / "long"))
    p = results.policies
    for baseline in ("vllm-apc", "lru"):
        assert p["asymcache"].computed_tokens < 0.85 * p[baseline].computed_tokens
        assert p["asymcache"].ttft.mean < 0.8 * p[baseline].ttft.mean
    assert p["asymcache"].recomputed_tokens.hole > 0 and p["vllm-apc"].recomputed_tokens.hole == 0


def test_ablation_suffixes_combine():
    from eval.variants import BenchVariant

    full = BenchVariant.parse("asymcache/reserve-prompt/adaptive:slack")
    assert full.engine_overrides["admit_full_prompt"] is True
    assert full.engine_overrides["chunking"] == "adaptive:slack"
    assert full.engine_overrides["eviction_policy"] == "asymcache"
    assert BenchVariant.parse("vllm-apc/unbounded/reserve-prompt").unbounded_pool
    assert BenchVariant.parse("asymcache/adaptive/slo:28").engine_overrides["tpot_slo_ms"] == 28.0
    patient = BenchVariant.parse("asymcache/least-work:8").engine_overrides
    assert patient["least_work_first"] is True and patient["least_work_patience"] == 8.0
    assert "tpot_slo_ms" not in BenchVariant.parse("asymcache/adaptive").engine_overrides
    for bad, field in (("asymcache/adaptive/fixed:512", "chunking"), ("lru/no-holes/no-holes", "repeats"),
                       ("lru/reserve-prompt/bogus", "bogus"), ("asymcache/slo:28", "adaptive"),
                       ("asymcache/fixed:512/slo:28", "adaptive"), ("asymcache/adaptive/slo:0", "positive"),
                       ("asymcache/adaptive/slo:fast", "positive"), ("asymcache/adaptive/slo:inf", "positive"),
                       ("asymcache/least-work:0", "least-work:N needs a positive"), ("lru/least-work:soon", "positive")):
        with pytest.raises(ValueError, match=field):
            BenchVariant.parse(bad)


def test_slo_suffix_gives_each_policy_its_own_tpot_target(tmp_path):
    # One run sweeps adaptive targets side by side (BENCHMARKS.md): the tighter
    # target must give smaller steps, so lower TPOT, whatever the run's --tpot-slo-ms says.
    from dataclasses import replace

    policies = ("asymcache/adaptive/slo:20", "asymcache/adaptive/slo:60")
    cfg = replace(gpu_longchat_sim(policies, tmp_path / "slo"), tpot_slo_ms=40.0, max_num_batched_tokens=8192)
    results, _ = run_bench(cfg)
    tight, loose = (results.policies[name] for name in policies)
    assert tight.tpot.mean < 0.8 * loose.tpot.mean
    assert tight.tpot.p99 < 0.8 * loose.tpot.p99
