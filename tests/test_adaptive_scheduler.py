"""Adaptive chunking: scheduler tests on a fake runner with a synthetic latency profile."""

from __future__ import annotations

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.latency_model import LatencyModel
from asymcache_core.sim_runner import SimulatedRunner, VirtualClock
from tests.conftest import make_engine

PROFILE = LatencyModel(floor_s=0.010, per_token_s=0.0002, per_attn_s=1e-8, knee_tokens=64, source="synthetic")


def sim_engine(tmp_path, **overrides) -> tuple[Engine, VirtualClock]:
    path = tmp_path / "profile.json"
    PROFILE.to_json(path)
    clock = VirtualClock()
    overrides.setdefault("num_kv_blocks", 512)
    engine = Engine(
        model="dummy:smollm2-135m",
        latency_profile=str(path),
        clock=clock,
        runner_factory=lambda eng: SimulatedRunner(eng.latency, clock, eng.model_config.vocab_size),
        **overrides,
    )
    return engine, clock


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.to_json(path)
    assert LatencyModel.from_json(path) == PROFILE
    with pytest.raises(ValueError, match="latency_profile"):
        LatencyModel.from_json(tmp_path / "missing.json")


@pytest.mark.parametrize("slo_ms", [20.0, 40.0, 80.0])
def test_budget_follows_profile_and_meets_tpot(tmp_path, slo_ms):
    engine, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=slo_ms, max_num_batched_tokens=4096)
    decodes = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request([10 + i] * 8, decodes)
    while any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.add_request(list(range(20, 400)) * 4, SamplingParams(max_tokens=2, ignore_eos=True))  # a long prefill
    mixed = []
    while engine.has_unfinished():
        engine.step()
        last = engine.step_log[-1]
        if last.num_decodes and last.num_tokens > last.num_decodes:
            mixed.append(last)
    assert mixed, "the prefill never shared a step with the decodes"
    slo = slo_ms / 1e3
    for step in mixed:
        # the chosen budget keeps the predicted step within the TPOT target (or is the minimum)
        prefill = step.num_tokens - step.num_decodes
        assert step.duration_s <= slo * 1.05 or prefill <= engine.block_size
    # a looser target admits bigger chunks
    engine2, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=slo_ms * 2, max_num_batched_tokens=4096)
    b1 = engine.budget.history
    assert max(b1) >= engine.block_size
    assert engine2.budget(engine.scheduler.running, []) >= 1


def test_budget_grows_with_the_slo(tmp_path):
    small, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=15.0)
    large, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=60.0)
    for engine in (small, large):
        for i in range(4):
            engine.add_request([5 + i] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()  # now all four decode
    b_small = small.budget(small.scheduler.running, [])
    b_large = large.budget(large.scheduler.running, [])
    assert b_small < b_large
    assert (b_small - 4) % small.block_size == 0 and (b_large - 4) % large.block_size == 0
    # predicted latency of the large budget stays within its target
    assert PROFILE.step_latency(b_large, 0) <= 0.060


def test_no_decodes_takes_at_least_the_knee(tmp_path):
    engine, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=1.0, max_num_batched_tokens=2048)
    engine.add_request(list(range(30, 330)), SamplingParams(max_tokens=1))
    budget = engine.budget([], engine.scheduler.waiting)
    assert budget >= PROFILE.knee_tokens


def test_decodes_never_starve_and_chunks_align(tmp_path):
    engine, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=15.0, max_num_batched_tokens=256)
    engine.add_request([7] * 4, SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    decode_id = next(iter(engine.requests))
    for i in range(5):
        engine.add_request(list(range(40 + i, 540 + i)), SamplingParams(max_tokens=2, ignore_eos=True))
    progress = []
    while engine.has_unfinished():
        before = len(engine.requests[decode_id].output_token_ids) if decode_id in engine.requests else None
        engine.step()
        if before is not None and decode_id in engine.requests:
            progress.append(len(engine.requests[decode_id].output_token_ids) - before)
        for r in engine.scheduler.running:
            # budget-cut chunks end on block boundaries: any partially computed prefill stops
            # at a multiple of the block size
            if r.num_computed_tokens < r.num_prompt_tokens:
                assert r.num_computed_tokens % engine.block_size == 0
    assert progress and all(p == 1 for p in progress), "the decode missed a step"
    engine.check_integrity()


def test_no_request_waits_forever_under_arrivals(tmp_path):
    engine, _ = sim_engine(tmp_path, chunking="adaptive", tpot_slo_ms=20.0, max_num_batched_tokens=256, num_kv_blocks=128)
    first = engine.add_request(list(range(50, 450)), SamplingParams(max_tokens=4, ignore_eos=True))
    finished_at = None
    for step in range(400):
        engine.add_request(list(range(60 + step % 7, 160)), SamplingParams(max_tokens=3, ignore_eos=True))
        for out in engine.step():
            if out.request_id == first and out.finished:
                finished_at = step
        if finished_at is not None:
            break
    assert finished_at is not None and finished_at < 100
    engine.check_integrity()


def test_adaptive_and_fixed_give_identical_tokens(smollm, chat_prompts):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fixed = make_engine(smollm, chunking="fixed:64").generate(chat_prompts, params)
    adaptive = make_engine(smollm, chunking="adaptive", tpot_slo_ms=5.0).generate(chat_prompts, params)
    assert [o.token_ids for o in fixed] == [o.token_ids for o in adaptive]
