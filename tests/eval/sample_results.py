"""Synthetic run results the eval report tests share: three policies with exact JCT means."""

from __future__ import annotations

import numpy as np

from eval.results import PolicyResult, Recompute, Results, RunInfo, Series, summarize


def sample_policy(jct_mean: float, seed: int, *, hit_rate: float, throughput: float) -> PolicyResult:
    """A synthetic policy whose JCT mean is exactly ``jct_mean`` and whose series are non-empty."""
    rng = np.random.default_rng(seed)
    jct = list(jct_mean + rng.normal(0.0, 0.1, size=20))
    jct = [v - (sum(jct) / len(jct) - jct_mean) for v in jct]  # shift so the mean is exact
    ttft = list(np.abs(rng.normal(0.2, 0.05, size=60)))
    tpot = list(np.abs(rng.normal(0.02, 0.005, size=60)))
    queue = list(np.abs(rng.normal(0.05, 0.01, size=60)))
    blocks = [(0.5 * i, int(40 + 30 * np.sin(i / 5.0 + seed))) for i in range(50)]
    return PolicyResult(
        jct=summarize(jct),
        ttft=summarize(ttft),
        tpot=summarize(tpot),
        queue=summarize(queue),
        hit_rate=hit_rate,
        recomputed_tokens=Recompute(
            hole=100 * seed, suffix=50, preempted=10, total=100 * seed + 60
        ),
        evictions=30 + seed,
        throughput_tok_s=throughput,
        lossless_agreement=1.0,
        num_jobs=20,
        num_requests=60,
        prompt_tokens=10_000,
        hit_tokens=int(10_000 * hit_rate),
        computed_tokens=10_000 - int(10_000 * hit_rate),
        generated_tokens=3_000,
        peak_blocks_in_use=70,
        pinned_blocks_peak=4,
        duration_s=25.0,
        series=Series(jct=jct, ttft=ttft, tpot=tpot, blocks_in_use=blocks, budget=[256] * 10),
    )


def sample_run_info(**overrides: object) -> RunInfo:
    fields: dict[str, object] = {
        "workload": "swe-agent-mini",
        "backend": "sim",
        "model": "smollm2-135m",
        "device": "cpu",
        "seed": 0,
        "num_jobs": 20,
        "kv_blocks": 128,
        "block_size": 16,
        "latency_profile": "h200-8b",
        "started": "2026-11-29T12:00:00+00:00",
        "duration_s": 75.0,
        "command": "asymcache eval --workload swe-agent-mini --policies lru,vllm-apc,asymcache",
        "machine": "test machine",
        "notes": ["synthetic results for tests", "<script>alert('x')</script> | pipe"],
    }
    fields.update(overrides)
    return RunInfo.model_validate(fields)


def sample_results() -> Results:
    """Three policies; the baseline ``vllm-apc`` is deliberately not first."""
    return Results(
        run=sample_run_info(),
        policies={
            "lru": sample_policy(12.0, 1, hit_rate=0.40, throughput=110.0),
            "vllm-apc": sample_policy(10.0, 2, hit_rate=0.50, throughput=120.0),
            "asymcache": sample_policy(8.2, 3, hit_rate=0.75, throughput=150.0),
        },
    )
