"""Scheduling order: by arrival (vLLM's) or least work first (``least_work_first``); the
scheduler's update after a step (token append, stop checks, freeing)."""

from __future__ import annotations

import pytest

from asymcache_core import EngineConfig, SamplingParams
from asymcache_core.request import Request
from tests.asymcache_core.test_adaptive_scheduler import sim_engine

ONE = SamplingParams(max_tokens=1, ignore_eos=True)
FOUR = SamplingParams(max_tokens=4, ignore_eos=True)


def first_token_order(engine, ids: list[str]) -> list[str]:
    """Runs the engine dry; returns ``ids`` in the order their first tokens came."""
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in ids and out.request_id not in order and out.token_ids:
                order.append(out.request_id)
        engine.check_integrity()
    return order


@pytest.mark.parametrize("least_work", [False, True])
def test_a_cached_turn_overtakes_a_long_prefill_only_with_least_work_first(least_work):
    engine = sim_engine(max_num_batched_tokens=64, least_work_first=least_work)
    first_turn = list(range(100, 196))  # 6 blocks, cached once the turn ends
    answer = engine.generate([first_turn], FOUR, job_ids=["b"])[0].token_ids
    long_prompt = list(range(500, 820))  # 320 uncached tokens: 5 steps of 64
    a = engine.add_request(long_prompt, ONE, job_id="a")
    b = engine.add_request(first_turn + answer + list(range(900, 908)), ONE, job_id="b")
    waiting = {r.request_id: r for r in engine.scheduler.waiting}
    # the returning turn only lacks its last partial block: 108 tokens, 96 cached
    assert engine.scheduler.remaining_work(waiting[b]) == 12
    assert engine.scheduler.remaining_work(waiting[a]) == 320
    assert first_token_order(engine, [a, b]) == ([b, a] if least_work else [a, b])


def test_remaining_work_counts_holes_and_matches_what_is_computed():
    engine = sim_engine(max_num_batched_tokens=32, eviction_policy="asymcache", least_work_first=True)
    first_turn = list(range(100, 228))  # 8 blocks
    answer = engine.generate([first_turn], FOUR, job_ids=["s"])[0].token_ids
    prompt = first_turn + answer + list(range(900, 940))
    probe = Request("probe", prompt, ONE, 0.0)
    hashes = engine.kv.ensure_hashes(probe)
    for i in (2, 5):  # two holes in the middle of the history
        engine.pool.evict_block(engine.pool.lookup(hashes[i]))
    rid = engine.add_request(prompt, ONE, job_id="s")
    request = engine.requests[rid]
    bs = engine.block_size
    expected = len(prompt) - (len(first_turn) // bs - 2) * bs  # all but the 6 cached blocks
    assert engine.scheduler.remaining_work(request) == expected
    computed = 0
    while request.metrics.first_token_time is None:
        engine.step()
        step = engine.step_log[-1]
        computed += step.num_tokens
        if request.metrics.first_token_time is None:
            # running: the work left is what the following steps will compute
            assert engine.scheduler.remaining_work(request) == expected - computed
    assert computed == expected == request.metrics.computed_tokens
    assert request.metrics.hole_tokens == 2 * bs
    engine.check_integrity()


def test_a_step_serves_decodes_then_the_smallest_prefill():
    engine = sim_engine(max_num_batched_tokens=64, least_work_first=True)
    decoding = engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # prefilled: it decodes from now on
    big = engine.add_request(list(range(200, 400)), ONE)
    small = engine.add_request(list(range(600, 650)), ONE)
    sampled = {out.request_id for out in engine.step() if out.new_token_ids}
    # one step of 64: the decode (1), the whole small prefill (50), the rest to the big one (13)
    assert sampled == {decoding, small}
    assert engine.requests[big].num_computed_tokens == 64 - 1 - 50
    assert engine.scheduler.remaining_work(engine.requests[decoding]) == 1
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_explicit_priority_still_comes_before_the_work():
    engine = sim_engine(max_num_batched_tokens=64, least_work_first=True)
    small = engine.add_request(list(range(600, 650)), ONE)
    urgent = engine.add_request(list(range(200, 400)), ONE, priority=-1.0)
    assert first_token_order(engine, [small, urgent]) == [urgent, small]


def test_least_work_first_must_be_a_bool():
    with pytest.raises(ValueError, match="least_work_first"):
        EngineConfig(model="dummy:smollm2-135m", least_work_first="yes")


# -- least_work_patience: admission by arrival + P x own estimated prefill time ----------------
# NOTE: with the synthetic profile, a cold 320-token prompt is estimated at ~64.5 ms and a
# 50-token one at ~10 ms, so with P = 2 the small request overtakes the long one only when it
# arrives less than ~109 ms after it.
@pytest.mark.parametrize(
    ("patience", "gap_s", "small_first"),
    [(None, 0.2, True), (2.0, 0.05, True), (2.0, 0.2, False)],
)
def test_patience_lets_a_later_small_request_overtake_only_within_its_bound(patience, gap_s, small_first):
    engine = sim_engine(
        max_num_batched_tokens=64, least_work_first=True, least_work_patience=patience
    )
    long_ = engine.add_request(list(range(500, 820)), ONE)
    engine.idle_until(engine.clock() + gap_s)
    small = engine.add_request(list(range(600, 650)), ONE)
    estimate = engine.latency.prefill_latency
    if patience is not None:
        assert estimate(320, 320) == pytest.approx(0.0645, rel=0.01)
        assert (gap_s + patience * estimate(50, 50) < patience * estimate(320, 320)) is small_first
    assert first_token_order(engine, [long_, small]) == ([small, long_] if small_first else [long_, small])


def test_patience_bounds_the_wait_of_a_long_prompt_behind_a_stream_of_short_ones():
    # a 64-token request arrives before every step and fills the step's budget: under the least
    # work first alone the 320-token prompt that came first never starts; with P = 2 it starts
    # once it has waited about twice its own estimated prefill time
    waits = {}
    for patience in (None, 2.0):
        engine = sim_engine(
            max_num_batched_tokens=64, least_work_first=True, least_work_patience=patience
        )
        long_ = engine.add_request(list(range(500, 820)), ONE)
        request = engine.requests[long_]
        longest_step = 0.0
        for i in range(40):
            if request.num_computed_tokens:
                break
            engine.add_request([1000 + i] * 64, ONE)
            before = engine.clock()
            engine.step()
            longest_step = max(longest_step, engine.clock() - before)
            engine.check_integrity()
        waits[patience] = engine.clock() if request.num_computed_tokens else None
        bound = 2.0 * engine.latency.prefill_latency(320, 320)
    assert waits[None] is None  # starved for all 40 steps
    assert waits[2.0] is not None and bound - 2 * longest_step <= waits[2.0] <= bound + 2 * longest_step


def test_prefill_latency_prices_the_pairs_the_scheduler_counts():
    engine = sim_engine()
    model = engine.latency
    # 40 tokens ending at position 300 attend like the segment [260, 300) of a step
    pairs = 40 * 260 + 40 * 41 / 2
    assert model.prefill_latency(40, 300) == pytest.approx(model.per_token_s * 40 + model.per_attn_s * pairs)
    assert model.prefill_latency(0, 300) == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"least_work_first": True, "least_work_patience": 0.0}, "least_work_patience: must be a positive"),
        ({"least_work_first": True, "least_work_patience": float("nan")}, "least_work_patience: must be a positive"),
        ({"least_work_first": True, "least_work_patience": True}, "least_work_patience: must be a positive"),
        ({"least_work_first": True, "least_work_patience": "8"}, "least_work_patience: must be a positive"),
        ({"least_work_patience": 8.0}, "least_work_patience: needs least_work_first"),
    ],
)
def test_bad_least_work_patience_is_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(model="dummy:smollm2-135m", **overrides)


# -- after the step: Scheduler.update_from_output -------------------------------------------------
def test_update_from_output_appends_stops_and_frees_in_batch_order():
    from asymcache_core.block_pool import BlockPool
    from asymcache_core.budget import FixedBudget
    from asymcache_core.eviction import PolicyContext, create_policy
    from asymcache_core.kv_cache_manager import KVCacheManager
    from asymcache_core.request import RequestStatus
    from asymcache_core.scheduler import Scheduler

    pool = BlockPool(64, create_policy("vllm-apc", PolicyContext(block_size=4)), lambda: 0.0)
    kv = KVCacheManager(pool, 4, hole_reuse=True)
    finished: list[tuple[str, float, int]] = []
    scheduler = Scheduler(
        kv, 4, 16, FixedBudget(91),
        on_finish=lambda r, now: finished.append((r.request_id, now, len(kv.held_blocks(r)))),
        eos_token_ids=(2,), max_model_len=64, clock=lambda: 1.5,
    )
    ten = SamplingParams(max_tokens=10)
    cases = {  # request id -> (prompt, params, sampled token)
        "eos": ([5] * 5, ten, 2),
        "ignored-eos": ([6] * 5, SamplingParams(max_tokens=10, ignore_eos=True), 2),
        "stop-id": ([7] * 5, SamplingParams(max_tokens=10, stop_token_ids=(9,)), 9),
        "max-tokens": ([8] * 5, SamplingParams(max_tokens=1), 3),
        "max-model-len": ([10] * 63, ten, 3),  # 63 + 1 reaches max_model_len
        "chunk": ([11] * 60, ten, None),  # 8 of its 60 tokens fit the budget: no sample
    }
    for rid, (prompt, params, _) in cases.items():
        scheduler.add(Request(rid, prompt, params, arrival_time=0.0))
    plan = scheduler.schedule()
    assert [item.request.request_id for item in plan.scheduled] == list(cases)
    assert all(item.request.metrics.first_scheduled_time == 1.5 for item in plan.scheduled)
    sampled = {rid: token for rid, (_, _, token) in cases.items() if token is not None}
    updates = scheduler.update_from_output(plan, sampled, now=2.0)

    got = {u.request.request_id: (u.new_token_ids, u.finish_reason, u.stop_reason) for u in updates}
    assert list(got) == list(sampled)  # batch order; the unsampled chunk has no update
    stopped, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
    assert got == {
        "eos": ([2], stopped, 2),
        "ignored-eos": ([2], None, None),
        "stop-id": ([9], stopped, 9),
        "max-tokens": ([3], length, None),
        "max-model-len": ([3], length, None),
    }
    # the finish hook ran in batch order at the step's end, while the blocks were still held
    assert finished == [("eos", 2.0, 2), ("stop-id", 2.0, 2), ("max-tokens", 2.0, 2), ("max-model-len", 2.0, 16)]
    left = {r.request_id for r in scheduler.running}
    assert left == {"ignored-eos", "chunk"} and not scheduler.waiting
    by_id = {u.request.request_id: u.request for u in updates}
    assert by_id["eos"].metrics.finish_time == 2.0 and by_id["eos"].block_ids == []
    assert by_id["ignored-eos"].metrics.token_times == [2.0] and by_id["ignored-eos"].metrics.finish_time is None
    assert pool.num_in_use == 2 + 2  # the running request's 2 blocks and the chunk's 2
    pool.check_integrity()

    # a stop string found later only relabels a finished request; a running one is freed
    scheduler.finish_request(by_id["max-tokens"], stopped, 3.0, "stop")
    assert by_id["max-tokens"].stop_reason == "stop" and by_id["max-tokens"].metrics.finish_time == 2.0
    scheduler.finish_request(by_id["ignored-eos"], stopped, 3.0, "text")
    assert finished[-1] == ("ignored-eos", 3.0, 2) and pool.num_in_use == 2
    with pytest.raises(ValueError, match="status"):
        scheduler.finish_request(by_id["eos"], RequestStatus.RUNNING, 3.0)
