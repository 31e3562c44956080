"""AsymCache's expected-latency order, pinned down case by case (no model needed)."""

from __future__ import annotations

from asymcache_core.block_pool import BlockPool
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.eviction.asymcache import expected_latency_cost
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

LAT = LatencyModel(floor_s=0.01, per_token_s=1e-4, per_attn_s=1e-8, knee_tokens=64)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(blocks: int = 16):
    clock = Clock()
    stats = JobStats()
    policy = create_policy("asymcache", PolicyContext(16, LAT, stats))
    return BlockPool(blocks, policy, clock), stats, clock


def cached(pool: BlockPool, job: str, positions: list[int], base_hash: int) -> list[int]:
    """Blocks of ``job`` at ``positions``, computed, cached and released."""
    ids = pool.allocate(len(positions), job_id=job)
    for bid, pos in zip(ids, positions, strict=True):
        pool.cache_block(bid, base_hash + pos, pos)
    pool.free(reversed(ids))
    return ids


def victims(pool: BlockPool, count: int) -> list[int]:
    return [b.block_id for b in pool.policy.pop_victims(count, pool.clock())]


def test_deep_block_of_active_job_outlives_shallow_block_of_finished_job():
    pool, stats, clock = make_pool()
    stats.on_arrival("active", 0.0, 100)
    stats.on_arrival("done", 0.0, 100)
    (deep,) = cached(pool, "active", [30], 1000)
    (shallow,) = cached(pool, "done", [0], 2000)
    stats.on_finish("active", 1.0, last_step=False)
    stats.on_finish("done", 1.0, last_step=True)
    clock.now = 1.5
    assert victims(pool, 1) == [shallow]
    assert victims(pool, 1) == [deep]


def test_deeper_blocks_cost_more_to_rebuild_within_a_job():
    pool, stats, clock = make_pool()
    stats.on_arrival("s", 0.0, 100)
    blocks = cached(pool, "s", [0, 5, 20, 60], 1000)
    stats.on_finish("s", 1.0, last_step=False)
    clock.now = 1.1
    assert victims(pool, 4) == blocks  # position 0 first, position 60 last


def test_job_that_overstays_its_usual_gap_loses_priority():
    pool, stats, clock = make_pool()
    # "regular" comes back every ~2 s; "stale" used to, but has now been idle for 60 s
    for sid in ("regular", "stale"):
        stats.on_arrival(sid, 0.0, 50)
        stats.on_finish(sid, 1.0, last_step=False)
        stats.on_arrival(sid, 3.0, 50)
    (stale_block,) = cached(pool, "stale", [10], 1000)
    stats.on_finish("stale", 4.0, last_step=False)
    clock.now = 62.0
    stats.on_finish("regular", 61.0, last_step=False)
    (regular_block,) = cached(pool, "regular", [10], 2000)
    assert stats.reuse_probability("stale", 64.0) < 0.01 < stats.reuse_probability("regular", 64.0)
    clock.now = 64.0
    assert victims(pool, 1) == [stale_block]
    assert regular_block in {b.block_id for b in pool.policy.candidates()}


def test_tool_pause_hint_protects_a_job_and_shared_prefix_aggregates():
    pool, stats, clock = make_pool()
    for sid in ("a", "b", "c"):
        stats.on_arrival(sid, 0.0, 50)
    shared = pool.allocate(1, job_id="a")[0]
    pool.cache_block(shared, 77, 3)
    pool.touch([shared], job_id="b")  # a shared-prefix block held by two jobs
    pool.free([shared, shared])
    (own_a,) = cached(pool, "a", [3], 1000)
    (own_c,) = cached(pool, "c", [3], 3000)
    stats.on_finish("a", 1.0, last_step=True)   # a is done ...
    stats.on_finish("b", 1.0, last_step=False)  # ... b will come back after its tool
    stats.hint("b", expected_gap_s=5.0)
    stats.on_finish("c", 1.0, last_step=False)  # c: no history, prior probability
    clock.now = 2.0
    # a's own block goes first (P=0); the block shared with b outlives c's (b's hint > prior)
    assert victims(pool, 1) == [own_a]
    assert victims(pool, 1) == [own_c]
    assert victims(pool, 1) == [shared]


def test_pinned_and_referenced_blocks_are_never_candidates():
    pool, stats, clock = make_pool(blocks=4)
    stats.on_arrival("s", 0.0, 10)
    blocks = cached(pool, "s", [0, 1, 2], 1000)
    pool.pin([blocks[0]])
    pool.touch([blocks[1]], job_id="s")
    stats.on_finish("s", 1.0, last_step=True)  # zero reuse: first in line if it could go
    got = pool.allocate(2)
    assert blocks[0] not in got and blocks[1] not in got
    assert pool.blocks[blocks[0]].block_hash is not None and pool.blocks[blocks[1]].block_hash is not None
    pool.check_integrity()


def test_marginal_cost_is_cheaper_under_the_knee():
    under = expected_latency_cost(1.0, position=10, block_size=16, base_tokens=0, latency=LAT)
    over = expected_latency_cost(1.0, position=10, block_size=16, base_tokens=500, latency=LAT)
    assert 0 < under < over
    assert expected_latency_cost(0.0, 10, 16, 500, LAT) == 0.0


def test_blocks_wanted_by_a_waiting_request_go_last_latest_arrival_first():
    pool, stats, clock = make_pool()
    # "idle" finished its turn and is thinking; "early" and "late" have requests waiting for
    # admission (arrived, not yet holding their cached blocks), "late" arrived after "early"
    for sid in ("idle", "early", "late"):
        stats.on_arrival(sid, 0.0, 100)
        stats.on_finish(sid, 1.0, last_step=False)
    stats.hint("idle", expected_gap_s=10.0)  # it will come back, but not for a while
    (idle_deep,) = cached(pool, "idle", [200], 1000)
    early = cached(pool, "early", [0, 1], 2000)
    late = cached(pool, "late", [0, 1], 3000)
    stats.on_arrival("early", 2.0, 100)
    stats.on_arrival("late", 2.5, 100)
    clock.now = 3.0
    # the idle block has the highest expected cost (the old order kept it over both waiting
    # requests' blocks), but its reuse is the furthest off
    assert pool.policy.score(pool.blocks[idle_deep], 3.0) > pool.policy.score(pool.blocks[late[0]], 3.0)
    assert victims(pool, 1) == [idle_deep]
    # then the request admitted last (FCFS) loses its blocks, cheapest rebuild first
    assert victims(pool, 2) == late
    assert victims(pool, 2) == early


def test_pop_victims_follows_the_expected_cost_on_a_mixed_pool():
    """The per-job victim search gives exactly the order of the policy's definition:
    blocks in demand last (latest arrival first among them), then expected cost
    (``score``, the function shared with the vLLM integration), then LRU."""
    import random

    rng = random.Random(7)
    pool, stats, clock = make_pool(blocks=120)
    names = [f"s{i}" for i in range(8)]
    for i, sid in enumerate(names):
        stats.on_arrival(sid, 0.1 * i, rng.randint(16, 600))
        stats.on_finish(sid, 0.5 + 0.1 * i, last_step=(i == 3), context_tokens=800)
    stats.hint("s5", expected_gap_s=0.2)
    positions = {sid: rng.sample(range(60), 10) for sid in names}
    for i, sid in enumerate(names):
        clock.now = 1.0 + i
        cached(pool, sid, positions[sid], 10_000 * (i + 1))
    # shared-prefix blocks: one hash reached by two stats (the second use finds it cached)
    for block in list(pool.policy.candidates())[:6]:
        pool.touch([block.block_id], job_id="s1")
        pool.touch([block.block_id], job_id="s6")
        pool.free([block.block_id, block.block_id])
    stats.on_arrival("s2", 9.0, 40)  # a request waiting for admission
    stats.on_arrival("s7", 9.5, 40)
    clock.now = 12.0
    def reference(block) -> tuple:
        demands = [stats.demand_since(sid) for sid in (block.jobs or {block.job_id})]
        demands = [d for d in demands if d is not None]
        tier = (1, -min(demands)) if demands else (0, 0.0)
        return (*tier, pool.policy.score(block, 12.0), block.last_access, -block.position)

    expected = sorted(pool.policy.candidates(), key=reference)
    assert [b.block_id for b in pool.policy.pop_victims(len(expected), 12.0)] == [b.block_id for b in expected]


def test_grouped_victim_search_matches_the_key_under_churn():
    """Blocks come and go (cache hits take them back, evictions pop them) while jobs
    arrive, finish and end: every call's victims are exactly the smallest keys of
    ``key_function`` over the candidates at that moment, ties by candidacy order."""
    import random

    rng = random.Random(11)
    pool, stats, clock = make_pool(blocks=400)
    names = [f"s{i}" for i in range(12)]
    next_hash = iter(range(1, 10**9))
    for step in range(60):
        clock.now = float(step)
        sid = rng.choice(names)
        event = rng.random()
        if event < 0.35:
            stats.on_arrival(sid, clock.now, rng.randint(16, 900))
        elif event < 0.7:
            stats.on_finish(sid, clock.now, last_step=rng.random() < 0.1, context_tokens=rng.randint(100, 900))
        if pool.num_free_blocks >= 8:
            ids = pool.allocate(rng.randint(1, 8), job_id=sid)
            for bid in ids:
                pool.cache_block(bid, next(next_hash), rng.randint(0, 80))
            pool.free(ids)
        held = list(pool.policy.candidates())
        if held and rng.random() < 0.5:  # cache hits by another job, released again
            hits = [b.block_id for b in rng.sample(held, min(len(held), 3))]
            pool.touch(hits, job_id=rng.choice(names))
            pool.free(hits)
        if len(pool.policy) > 20 and rng.random() < 0.4:
            count = rng.randint(1, 6)
            key = pool.policy.key_function(clock.now)
            expected = sorted(pool.policy.candidates(), key=key)[:count]
            got = pool.policy.pop_victims(count, clock.now)
            assert [b.block_id for b in got] == [b.block_id for b in expected]
            for block in got:  # evicted: the pool recycles them (as BlockPool.allocate does)
                del pool.cached[block.block_hash]
                block.reset()
                pool.free_uncached.append(block.block_id)
    assert len(pool.policy) > 0
