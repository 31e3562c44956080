"""The least-work order's tracker of each waiting request's cache hit
(:mod:`asymcache_core.waiting_hits`): always what a full lookup would find, on both tiers, with
hole reuse on and off; requests join when they wait and leave when they run or end."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from asymcache_core import EngineConfig, SamplingParams
from asymcache_core.engine import Engine
from asymcache_core.kv_cache_manager import CacheHit
from asymcache_core.request import Request
from asymcache_core.waiting_hits import DEVICE, HOST, WaitingHits
from tests.asymcache_core.test_adaptive_scheduler import PROFILE

BS = 4


def sim_engine(**overrides) -> Engine:
    """A simulated least-work engine on a pool of 4-token blocks, priced by the synthetic
    profile (with a host tier, it reloads some runs of host blocks and recomputes others)."""
    config = dict(
        model="dummy:tiny", num_kv_blocks=64, block_size=BS, eviction_policy="asymcache", least_work_first=True
    )
    config.update(overrides)
    return Engine.simulated(EngineConfig(**config), latency=PROFILE)


def tracker(engine: Engine) -> WaitingHits:
    hits = engine.scheduler.waiting_hits
    assert hits is not None
    return hits


def check_entries(engine: Engine) -> None:
    """Every tracked request is waiting and every waiting request is tracked; each indexed
    block's state and the counts are what the pools hold now."""
    hits = tracker(engine)
    assert set(hits._entries) == {r.request_id for r in engine.scheduler.waiting}
    host = engine.kv.tier.pool.cached if engine.kv.tier is not None else {}
    for entry in hits._entries.values():
        if not entry.registered:
            continue
        state = [(DEVICE if h in engine.pool.cached else 0) | (HOST if h in host else 0) for h in entry.keys]
        assert entry.state == state
        assert entry.num_device == sum(1 for s in state if s & DEVICE)
        assert entry.num_any == sum(1 for s in state if s)
        assert entry.num_host_only == state.count(HOST)
        assert entry.first_miss == (state.index(0) if 0 in state else len(state))
        for position, block_hash in enumerate(entry.keys):
            assert hits._index[block_hash][entry] == position
    indexed = {(h, e.request.request_id, p) for h, holders in hits._index.items() for e, p in holders.items()}
    expected = {
        (h, e.request.request_id, p) for e in hits._entries.values() if e.registered for p, h in enumerate(e.keys)
    }
    assert indexed == expected, "the index holds entries of requests that left"


def assert_matches_lookup(engine: Engine, request: Request) -> CacheHit:
    """The tracker's answer for ``request`` against a fresh full lookup; returns the lookup."""
    tracked = tracker(engine).hit_tokens(request)
    hit = engine.kv.lookup(request)
    assert tracked == hit.hit_tokens, f"{request.request_id}: tracked {tracked}, lookup {hit.hit_tokens}"
    return hit


def checking_hits(engine: Engine, seen: list[int]) -> Callable[[Request], int | None]:
    """``waiting_hits.hit_tokens`` checked against a lookup at the moment the scheduler asks
    (inside ``schedule``: after the running requests' allocations of that step)."""
    hits = tracker(engine)
    plain = hits.hit_tokens

    def checked(request: Request) -> int | None:
        tracked = plain(request)
        hit = engine.kv.lookup(request).hit_tokens
        assert tracked == hit, f"{request.request_id}: tracked {tracked}, lookup {hit}"
        seen[0] += 1
        return tracked

    return checked


def run_sessions(engine: Engine, seed: int, sessions: int = 12, turns: int = 3) -> dict[str, int]:
    """Multi-turn sessions with a shared system prompt, arriving at random steps; checks the
    tracker against a full lookup for every waiting request after every step, and at every
    question the scheduler asks. Returns counters of the run."""
    rng = random.Random(seed)
    system = list(range(400, 400 + 3 * BS))  # 3 shared blocks
    history = {f"s{i}": system + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 3 * BS))] for i in range(sessions)}
    left = {s: turns for s in history}
    live: dict[str, str] = {}  # session -> request id in flight
    asked = [0]
    tracker(engine).hit_tokens = checking_hits(engine, asked)  # type: ignore[method-assign]
    counters = {"steps": 0, "checked": 0, "reloads": 0, "recomputed": 0}
    for _ in range(20_000):
        for session in history:
            if session not in live and left[session] and rng.random() < 0.3:
                params = SamplingParams(max_tokens=rng.randrange(1, 8 * BS), ignore_eos=True)
                prompt = history[session] + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 2 * BS))]
                if len(prompt) + params.max_tokens > (engine.num_blocks - 2) * BS:
                    left[session] = 0  # NOTE: the session outgrew the pool: it ends here
                    continue
                history[session] = prompt
                live[session] = engine.add_request(prompt, params, job_id=session, is_last_step=left[session] == 1)
                left[session] -= 1
        if not live and not any(left.values()):
            break
        for out in engine.step():
            if out.finished:
                session = next(s for s, rid in live.items() if rid == out.request_id)
                history[session] = history[session] + list(out.token_ids)
                del live[session]
        if engine.stalled:
            engine.idle_until(engine.clock() + 0.01)
        counters["steps"] += 1
        engine.check_integrity()
        check_entries(engine)
        for request in engine.scheduler.waiting:
            hit = assert_matches_lookup(engine, request)
            counters["checked"] += 1
            counters["reloads"] += bool(hit.reloads)
            counters["recomputed"] += bool(hit.host_recomputed_tokens)
        check_entries(engine)
    else:
        raise AssertionError("the sessions did not finish")
    counters["asked"] = asked[0]
    counters["evictions"] = engine.pool.num_evictions
    return counters


@pytest.mark.parametrize(
    ("hole_reuse", "host_blocks", "reload_by_cost"),
    [
        (True, None, True),
        (False, None, False),
        (True, 48, True),
        (True, 48, False),
        (False, 48, False),
    ],
    ids=["holes", "prefix", "holes+host-by-cost", "holes+host-reload-all", "prefix+host"],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_tracker_is_a_full_lookup_at_every_step(hole_reuse, host_blocks, reload_by_cost, seed):
    engine = sim_engine(num_kv_blocks=24, hole_reuse=hole_reuse, num_host_kv_blocks=host_blocks, max_num_batched_tokens=16)
    engine.kv.reload_by_cost = reload_by_cost  # NOTE: the engine's default is hole reuse's
    preempted = []
    plain_preempt = engine.scheduler.preempt

    def preempt(request: Request) -> None:
        preempted.append(request.request_id)
        plain_preempt(request)

    engine.scheduler.preempt = preempt  # type: ignore[method-assign]
    counters = run_sessions(engine, seed)
    hits = tracker(engine)
    assert len(hits) == 0 and not hits._index, "requests left the tracker at the end"
    # the run exercised what it checks: evictions, preemptions, waiting requests asked about
    assert counters["evictions"] > 0
    assert preempted, "no request was preempted back into the waiting queue"
    assert counters["asked"] > 0 and counters["checked"] > 0
    assert hits.num_tracked_answers > 0 and hits.num_lookup_answers == 0
    if host_blocks is not None:
        assert counters["reloads"] > 0, "no waiting request had blocks to reload from the host"
    if host_blocks is not None and hole_reuse and reload_by_cost:
        assert counters["recomputed"] > 0, "no host run was priced cheaper to recompute"


def test_the_host_tier_answers_change_with_copies_out_and_back():
    """Blocks move device -> host (a reset) and back (a reload): the tracker follows both."""
    engine = sim_engine(num_kv_blocks=24, num_host_kv_blocks=48, hole_reuse=False)
    prompt = list(range(100, 100 + 5 * BS))
    answer = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), job_ids=["a"])[0].token_ids
    engine.step()  # the finished turn's blocks become candidates: their copies are queued
    engine.reset_prefix_cache()
    engine.step()  # the copies out are issued: the blocks are on the host only
    hits = tracker(engine)
    # a second request, still waiting, keeps the first one company so that it is asked about
    turn = prompt + list(answer) + [7, 8, 9]
    blocker = Request("probe", turn, SamplingParams(max_tokens=1), 0.0)
    hits.join(blocker)
    on_host = hits.hit_tokens(blocker)
    assert on_host == engine.kv.lookup(blocker).hit_tokens == 5 * BS
    assert hits._entries["probe"].num_device == 0 and hits._entries["probe"].num_host_only == 5
    rid = engine.add_request(turn, SamplingParams(max_tokens=1, ignore_eos=True), job_id="a")
    for _ in range(50):
        if rid not in engine.requests:
            break
        engine.step()
        if engine.stalled:
            engine.idle_until(engine.clock() + 0.01)
        assert_matches_lookup(engine, blocker)
    assert rid not in engine.requests
    # the reload put the blocks back on the device: both tiers now
    entry = hits._entries["probe"]
    assert entry.num_device >= 5 and entry.num_host_only == 0
    hits.leave(blocker)
    assert not hits._index


def test_join_leave_and_rejoin_after_a_preemption():
    engine = sim_engine(max_num_batched_tokens=64)
    hits = tracker(engine)
    first = list(range(100, 100 + 6 * BS))
    answer = engine.generate([first], SamplingParams(max_tokens=4, ignore_eos=True), job_ids=["s"])[0].token_ids
    prompt = first + list(answer) + [300, 301, 302]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), job_id="s")
    request = engine.requests[rid]
    assert request in hits and not hits._entries[rid].registered  # joined, indexed lazily
    # 7 full blocks a lookup may find (the 8th holds the last token); the first turn computed 6
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 6 * BS
    assert hits._entries[rid].registered and len(hits._index) == 7
    engine.step()  # admitted: it leaves, and its hashes leave the index
    assert request in engine.scheduler.running and request not in hits and not hits._index
    engine.scheduler.preempt(request)  # back to waiting: it rejoins
    assert request in hits and request in engine.scheduler.waiting
    assert_matches_lookup(engine, request)
    check_entries(engine)
    engine.abort(rid)  # an abort while waiting: it leaves
    assert len(hits) == 0 and not hits._index
    # leaving twice, or a request never tracked, is a no-op
    hits.leave(request)
    assert len(hits) == 0


def test_a_waiting_request_that_grows_is_indexed_to_its_new_end():
    engine = sim_engine()
    hits = tracker(engine)
    prompt = list(range(100, 100 + 6 * BS))
    engine.generate([prompt + [1, 2, 3, 4, 5]], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["s"])
    request = Request("r", prompt, SamplingParams(max_tokens=4), 0.0)
    hits.join(request)
    # the last token's block is never a hit: 5 of the 6 full blocks
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 5 * BS
    for token in (1, 2, 3, 4, 5):  # tokens of a step in flight land while it waits (async)
        request.append_output(token)
        assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens
    assert hits.hit_tokens(request) == 7 * BS
    assert len(hits._entries["r"].keys) == 7
    # the bound shrinks (the context cut back below its indexed blocks): the tail leaves
    del request.all_token_ids[-2 * BS :]
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 5 * BS
    entry = hits._entries["r"]
    assert len(entry.keys) == 5 and entry.num_device == 5 and set(hits._index) == set(entry.keys)
    # its hashes replaced by another chain's: indexed again from the start
    request.block_hashes = []
    request.all_token_ids[0] = 499
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 0
    assert len(entry.keys) == 5 and set(hits._index) == set(request.block_hashes[:5])
    assert entry.num_device == 0 and entry.first_miss == 0


def test_prompt_logprobs_bound_the_hit_while_they_advance():
    from asymcache_core.logprobs import TokenLogprob

    engine = sim_engine()
    hits = tracker(engine)
    prompt = list(range(100, 100 + 6 * BS))
    engine.generate([prompt + [1]], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["s"])
    request = Request("r", prompt + [1], SamplingParams(max_tokens=1, prompt_logprobs=0), 0.0)
    hits.join(request)
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 0  # position 0's logits needed
    entry = TokenLogprob(token_id=0, logprob=0.0, rank=1, top=())
    request.add_prompt_logprobs(0, [entry] * (2 * BS + 1))  # positions 0..2*BS computed
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 2 * BS
    request.add_prompt_logprobs(2 * BS, [entry] * (len(prompt) - 2 * BS))  # complete: no bound
    assert request.prompt_logits_from is None
    assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens == 6 * BS


def test_evictions_and_uncache_reach_the_waiting_requests_holding_the_block():
    engine = sim_engine(eviction_policy="asymcache", hole_reuse=True)
    hits = tracker(engine)
    prompt = list(range(100, 100 + 8 * BS))
    engine.generate([prompt + [1]], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["s"])
    a = Request("a", prompt + [1], SamplingParams(max_tokens=1), 0.0)
    b = Request("b", prompt[: 4 * BS] + [5], SamplingParams(max_tokens=1), 0.0)
    for request in (a, b):
        hits.join(request)
        assert hits.hit_tokens(request) == engine.kv.lookup(request).hit_tokens
    hashes = a.block_hashes
    engine.pool.evict_block(engine.pool.lookup(hashes[2]))  # a hole in both
    engine.pool.evict_block(engine.pool.lookup(hashes[6]))  # a hole in a only
    assert hits.hit_tokens(a) == engine.kv.lookup(a).hit_tokens == 6 * BS
    assert hits.hit_tokens(b) == engine.kv.lookup(b).hit_tokens == 3 * BS
    # a held block that a failed step uncaches stops being a hit
    block = engine.pool.lookup(hashes[0])
    engine.pool.touch([block])
    engine.pool.uncache(block)
    assert hits.hit_tokens(a) == engine.kv.lookup(a).hit_tokens == 5 * BS
    assert hits._entries["a"].first_miss == 0
    engine.pool.free([block])
    check_entries_of(hits, engine, {"a", "b"})


def check_entries_of(hits: WaitingHits, engine: Engine, ids: set[str]) -> None:
    for rid in ids:
        entry = hits._entries[rid]
        assert entry.state == [DEVICE if h in engine.pool.cached else 0 for h in entry.keys]


def test_a_repeated_hash_is_left_to_the_lookup():
    engine = sim_engine()
    hits = tracker(engine)
    request = Request("r", list(range(100, 100 + 4 * BS)), SamplingParams(max_tokens=1), 0.0)
    engine.kv.ensure_hashes(request)
    request.block_hashes[2] = request.block_hashes[1]  # a collision (hashes chain: no real repeat)
    hits.join(request)
    assert hits.hit_tokens(request) is None
    assert hits.num_lookup_answers == 1
    hits.leave(request)
    assert not hits._index


def test_only_least_work_keeps_a_tracker():
    assert Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=BS)).scheduler.waiting_hits is None
