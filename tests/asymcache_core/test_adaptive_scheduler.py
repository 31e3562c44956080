"""Adaptive chunking: scheduler tests on a fake runner with a synthetic latency profile."""

from __future__ import annotations

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.latency_model import LatencyModel
from tests.conftest import make_engine

PROFILE = LatencyModel(floor_s=0.010, per_token_s=0.0002, per_attn_s=1e-8, knee_tokens=64, source="synthetic")


def sim_engine(**overrides) -> Engine:
    """A simulated engine (virtual clock, no weights) planning with the synthetic profile."""
    overrides.setdefault("num_kv_blocks", 512)
    overrides.setdefault("latency", PROFILE)
    return Engine.simulated(model="dummy:smollm2-135m", **overrides)


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.to_json(path)
    assert LatencyModel.from_json(path) == PROFILE
    with pytest.raises(ValueError, match="latency_profile"):
        LatencyModel.from_json(tmp_path / "missing.json")


@pytest.mark.parametrize("slo_ms", [20.0, 40.0, 80.0])
def test_budget_follows_profile_and_meets_tpot(slo_ms):
    engine = sim_engine(chunking="adaptive", tpot_slo_ms=slo_ms, max_num_batched_tokens=4096)
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
    engine2 = sim_engine(chunking="adaptive", tpot_slo_ms=slo_ms * 2, max_num_batched_tokens=4096)
    b1 = engine.budget.history
    assert max(b1) >= engine.block_size
    assert engine2.budget(engine.scheduler.running, []) >= 1


def test_budget_grows_with_the_slo():
    small = sim_engine(chunking="adaptive", tpot_slo_ms=15.0)
    large = sim_engine(chunking="adaptive", tpot_slo_ms=60.0)
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


def test_budget_leaves_room_for_what_long_decodes_read():
    """Decodes on long contexts read more KV: the same number of them leaves a smaller prefill
    share under the same target, and the step the budget allows stays within it."""
    from dataclasses import replace

    from asymcache_core.budget import AdaptiveBudget
    from asymcache_core.request import Request

    profile = replace(PROFILE, per_decode_kv_s=2e-7)
    slo = 0.040
    waiting = [Request("w", list(range(5000)), SamplingParams(max_tokens=1), arrival_time=0.0)]
    budgets = {}
    for prompt in (100, 20_000):
        decodes = []
        for i in range(4):
            request = Request(f"d{i}", list(range(prompt)), SamplingParams(max_tokens=50), arrival_time=0.0)
            request.append_output(7)
            request.num_computed_tokens = request.num_tokens - 1
            decodes.append(request)
        budgets[prompt] = AdaptiveBudget(profile, slo, 16, 8192)(decodes, waiting)
        keys = sum(r.num_tokens for r in decodes)
        # the step: 4 decodes reading their keys, the rest a prefill at depth 0
        assert profile.step_latency(budgets[prompt], keys, False, keys) <= slo
    assert budgets[20_000] < budgets[100]
    # the same decodes priced without the term would take the larger share
    assert AdaptiveBudget(PROFILE, slo, 16, 8192)(decodes, waiting) > budgets[20_000]


def test_no_decodes_takes_at_least_the_knee():
    engine = sim_engine(chunking="adaptive", tpot_slo_ms=1.0, max_num_batched_tokens=2048)
    engine.add_request(list(range(30, 330)), SamplingParams(max_tokens=1))
    budget = engine.budget([], engine.scheduler.waiting)
    assert budget >= PROFILE.knee_tokens


def test_decodes_never_starve_and_chunks_align():
    engine = sim_engine(chunking="adaptive", tpot_slo_ms=15.0, max_num_batched_tokens=256)
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


def test_no_request_waits_forever_under_arrivals():
    engine = sim_engine(chunking="adaptive", tpot_slo_ms=20.0, max_num_batched_tokens=256, num_kv_blocks=128)
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


def _decoding(first_token_time: float, tokens: int):
    from asymcache_core.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=500), arrival_time=0.0)
    for t in range(tokens):
        request.append_output(4 + t)
    request.num_computed_tokens = request.num_tokens - 1
    request.metrics.first_token_time = first_token_time
    return request


def test_slack_sets_the_step_target():
    """A request ahead of its TPOT target lends the step half its excess slack; one behind it
    gets one target-sized step; the per-step variant always targets the TPOT."""
    from asymcache_core.budget import AdaptiveBudget
    from asymcache_core.request import Request

    slo = 0.020
    ahead = _decoding(0.0, 100)  # 100 tokens in 1.0 s: a step may last 2.0 - 1.0 = 1.0 s
    behind = _decoding(0.0, 10)  # 10 tokens in 1.0 s: 100 ms each
    slack = AdaptiveBudget(PROFILE, slo, 16, 8192, clock=lambda: 1.0, slack=True)
    per_step = AdaptiveBudget(PROFILE, slo, 16, 8192, clock=lambda: 1.0)
    assert slack.step_target([ahead]) == pytest.approx(slo + 0.5 * (1.0 - slo))
    assert slack.step_target([ahead, behind]) == slo  # the tightest request decides
    assert per_step.step_target([ahead]) == slo
    waiting = [Request("w", list(range(5000)), SamplingParams(max_tokens=1), arrival_time=0.0)]
    assert slack([ahead], waiting) > per_step([ahead], waiting)
    assert slack([ahead, behind], waiting) == per_step([ahead, behind], waiting)
    with pytest.raises(ValueError, match="clock"):
        AdaptiveBudget(PROFILE, slo, 16, 8192, slack=True)


def test_slack_keeps_every_request_on_target():
    """With ``adaptive:slack`` some prefill steps run longer than the TPOT target, yet every
    decoding request's TPOT (mean time per output token) stays on it."""
    slo = 0.030
    engine = sim_engine(chunking="adaptive:slack", tpot_slo_ms=slo * 1e3, max_num_batched_tokens=4096)
    decode_ids = [engine.add_request([10 + i] * 8, SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(4)]
    for _ in range(12):  # decode-only steps (10 ms) build slack
        engine.step()
    for i in range(3):
        engine.add_request(list(range(20 + i, 1220 + i)), SamplingParams(max_tokens=2, ignore_eos=True))
    finished, mixed = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        last = engine.step_log[-1]
        if last.num_decodes and last.num_tokens > last.num_decodes:
            mixed.append(last)
    for rid in decode_ids:
        m = finished[rid].metrics
        tpot = (m.finish_time - m.first_token_time) / (len(finished[rid].token_ids) - 1)
        assert tpot <= slo * 1.02, f"{rid}: TPOT {tpot * 1e3:.1f} ms over {slo * 1e3} ms"
    assert max(step.duration_s for step in mixed) > slo * 1.5


def test_feedback_corrects_a_model_that_runs_fast():
    """The device is 8 ms slower per step than the profile says: with the measured residuals
    the adaptive budget brings mixed steps back within the TPOT target; without, they overshoot."""
    from dataclasses import replace

    slo = 0.040
    slow = replace(PROFILE, floor_s=PROFILE.floor_s + 0.008)

    def run(feedback: bool) -> list:
        engine = sim_engine(
            chunking="adaptive", tpot_slo_ms=slo * 1e3, max_num_batched_tokens=4096, device_latency=slow
        )
        engine.latency_feedback.alpha = 0.3
        if not feedback:
            engine.budget.feedback = None
        for i in range(4):
            engine.add_request([10 + i] * 8, SamplingParams(max_tokens=200, ignore_eos=True))
        for i in range(12):
            engine.add_request(list(range(30 + i, 630 + i)), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        if feedback:
            assert engine.latency_feedback.mixed_residual_s == pytest.approx(0.008, rel=0.05)
            assert engine.latency_feedback.decode_residual_s == pytest.approx(0.008, rel=0.05)
        mixed = [s for s in engine.step_log if s.num_decodes and s.num_tokens - s.num_decodes > engine.block_size]
        return mixed[len(mixed) // 2 :]  # once the residuals have settled

    assert all(s.duration_s <= slo * 1.02 for s in run(feedback=True))
    assert any(s.duration_s > slo * 1.1 for s in run(feedback=False))


@pytest.mark.parametrize("policy", ["vllm-apc", "lru", "asymcache"])
def test_waiting_request_that_does_not_fit_leaves_its_blocks_alone(policy):
    # As in vLLM, room is checked before references are taken: a waiting request that does not
    # fit must not refresh (and so protect) its cached blocks on every step it waits.
    engine = sim_engine(num_kv_blocks=24, max_num_batched_tokens=1024, eviction_policy=policy)
    first = list(range(1000, 1080))  # 5 blocks, cached once the turn ends
    out = engine.generate([first], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["b"])[0]
    cached = [b for b in engine.pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
    assert len(cached) == 5
    engine.add_request(list(range(2000, 2240)), SamplingParams(max_tokens=40, ignore_eos=True), job_id="a")
    engine.step()  # "a" holds 15 blocks: 4 uncached + 5 candidates stay free
    before = {b.block_id: b.last_access for b in cached}
    engine.idle_until(engine.clock() + 1.0)
    second = first + out.token_ids + list(range(3000, 3200))  # its 5 hits + 13 new blocks
    rid = engine.add_request(second, SamplingParams(max_tokens=1, ignore_eos=True), job_id="b")
    for _ in range(3):
        engine.step()
        assert any(r.request_id == rid for r in engine.scheduler.waiting)
        assert {b.block_id: b.last_access for b in cached} == before
        assert all(b.ref_cnt == 0 and b.block_hash is not None for b in cached)
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("reserve", [False, True])
def test_admit_full_prompt_waits_for_room_for_the_whole_prompt(reserve):
    # 24 blocks; "a" holds 9 and decodes. "b" (16 blocks of prompt) fits its first 4-block chunk
    # but not its whole prompt beside "a": admitted at once on its first chunk, or held back
    # until "a" finishes when the whole prompt must fit.
    # NOTE: vLLM's LRU and no job-level admission: the test is about the prompt reservation.
    engine = sim_engine(num_kv_blocks=24, max_num_batched_tokens=64, admit_full_prompt=reserve,
                        eviction_policy="vllm-apc")
    a = engine.add_request(list(range(2000, 2140)), SamplingParams(max_tokens=30, ignore_eos=True), job_id="a")
    while not any(r.num_computed_tokens >= 140 for r in engine.scheduler.running):
        engine.step()  # "a" prefilled: the next steps have room in their budget for "b"
    b = engine.add_request(list(range(3000, 3256)), SamplingParams(max_tokens=1, ignore_eos=True), job_id="b")
    engine.step()
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert (b in waiting) == reserve
    done: set[str] = set()
    while engine.has_unfinished():
        done |= {out.request_id for out in engine.step() if out.finished}
        engine.check_integrity()
    assert set(done) == {a, b}
    preemptions = engine.stats().preemptions_total
    if reserve:
        assert preemptions == 0
    else:
        assert preemptions > 0  # "a" grows into blocks the half-prefilled "b" took
