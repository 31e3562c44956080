"""The free queue's groups ordered by bounds give the full scan's order while job statistics
change and scores decay with time, and an evicting pop prices only the groups it needs (no
vLLM needed)."""

from __future__ import annotations

import math
import random

import pytest
from free_queue_churn import check_whole_order, churn
from test_vllm_plugin_unit import BLOCK, FakePool, chain, check_every_pop, count_pricings

from asymcache_core.integrations.vllm import BlockScorer, PinSet
from asymcache_core.integrations.vllm.reference import reference_plan
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel

MODELS = {
    "strict": LatencyModel(floor_s=1e-3, per_token_s=1e-5, per_attn_s=1e-8, knee_tokens=64),
    "flat": LatencyModel(floor_s=1e-3, per_token_s=1e-5, per_attn_s=0.0, knee_tokens=0),
    "exact": LatencyModel(floor_s=1e-3, per_token_s=1.0, per_attn_s=1e-300, knee_tokens=0),
}


def _time_step(rng: random.Random) -> float:
    """Mostly small steps (scores near a decay start), some of several gaps (decay), a few
    long ones (P(reuse) below 1e-100, then 0)."""
    roll = rng.random()
    if roll < 0.6:
        return rng.uniform(0.0, 0.5)
    if roll < 0.95:
        return rng.uniform(0.0, 6.0)
    return rng.choice([300.0, 900.0, 3000.0]) * rng.uniform(0.5, 1.0)


@pytest.mark.parametrize(
    ("model", "seed", "num_jobs", "steal"),
    [("strict", s, 8, False) for s in range(4)]
    # many jobs: most have no gaps of their own and read the mean of all jobs' gaps
    + [("strict", s, 60, False) for s in range(4, 8)]
    + [
        ("flat", 8, 8, False),
        ("exact", 9, 8, False),
        ("exact", 10, 60, False),
        ("strict", 11, 8, True),
    ],
)
def test_pops_follow_the_full_scan_as_jobs_change_and_time_passes(
    model: str, seed: int, num_jobs: int, steal: bool
) -> None:
    rng = random.Random(seed)
    pins = PinSet(capacity_blocks=6)
    pool = FakePool(36, pins)
    pool.scorer = BlockScorer(pool.job_stats, MODELS[model], BLOCK)
    pins.listener = None  # NOTE: FakePool's own queue lets go of the pins
    from asymcache_core.integrations.vllm import ExpectedLatencyFreeQueue

    pool.queue = ExpectedLatencyFreeQueue(
        pool.blocks, pool.scorer.score, pool.clock, pool.forest, pins
    )
    compared = {"pops": 0, "orders": 0}
    check_every_pop(pool, pins, compared)
    queue, stats = pool.queue, pool.job_stats
    jobs = [f"j{i}" for i in range(num_jobs)]
    prefixes = [chain(f"sys{i}_", rng.randint(1, 3)) for i in range(3)]
    live: list[tuple[str, str | None]] = []
    for step in range(260):
        pool.clock.t += _time_step(rng)
        now = pool.clock()
        if steal and step == 130:
            BlockScorer(stats, MODELS[model], BLOCK)  # takes the job statistics' watcher over
        if step % 9 == 0:
            check_whole_order(pool, compared)
        roll = rng.random()
        if roll < 0.08:
            stats.hint(rng.choice(jobs), expected_gap_s=rng.choice([0.2, 1.0, 3.0, 10.0]))
            continue
        if roll < 0.11:
            stats.hint(rng.choice(jobs), finished=rng.random() < 0.5)
            continue
        if roll < 0.13:
            stats.drop_idle(now, rng.uniform(0.0, 20.0), 6, pins.is_pinned)
            continue
        if roll < 0.15:
            stats.state(rng.choice(jobs))  # a lookup that makes the job known
            continue
        if roll < 0.20 and queue.num_free_blocks >= 3:
            taken = pool.get_new_blocks(rng.randint(1, 3))  # an allocation that caches nothing
            pool.free(taken)
            continue
        finish = bool(live) and (roll < 0.55 or queue.num_free_blocks < 8)
        churn(pool, pins, rng, live, step, prefixes, finish, lambda: rng.choice([*jobs, None]), 0.15, 0.3)
    assert queue.stats.evicted_cached > 20 and compared["pops"] > 30 and compared["orders"] > 10


def _idle_jobs(num_jobs: int, gaps: bool) -> FakePool:
    """``num_jobs`` finished jobs of one 3-block chain each; with ``gaps``, each has had a pause
    of its own (a different decay scale per job)."""
    pool = FakePool(3 * num_jobs + 4)
    for j in range(num_jobs):
        job = f"j{j}"
        if gaps:
            pool.job_stats.on_arrival(job, pool.clock(), 10)
            pool.job_stats.on_finish(job, pool.clock(), False)
            pool.clock.t += 0.5 + (j % 7) * 0.25
        pool.run(f"r{j}", chain(f"c{j}_", 3), job=job)
        pool.finish(f"r{j}", job=job)
        pool.clock.t += 0.01
    return pool


def _pop(pool: FakePool, n: int, calls: dict[str, int]) -> tuple[list[int], int]:
    """Pops ``n`` evicting, checked against the full scan; returns them and the prices paid."""
    want = reference_plan(pool.queue, n, pool.clock(), pool.forest.copy())[0]
    before = calls["n"]
    got = [b.block_id for b in pool.queue.popleft_n(n)]
    assert got == want
    return got, calls["n"] - before


@pytest.mark.parametrize("gaps", [False, True])
def test_an_evicting_pop_prices_a_few_groups_not_every_group(gaps: bool) -> None:
    paid = {}
    for num_jobs in (300, 1200):
        pool = _idle_jobs(num_jobs, gaps)
        pool.clock.t += 30.0 if gaps else 0.0  # with gaps: every job decays, each at its own rate
        pool.queue.popleft_n(4)  # the uncached blocks
        calls = count_pricings(pool.scorer)
        _, first = _pop(pool, 2, calls)
        assert first >= num_jobs  # the first walk prices every group once (each was filed new)
        costs = []
        for step in range(6):
            pool.clock.t += 0.3 * (step % 2)
            costs.append(_pop(pool, 2, calls)[1])
        paid[num_jobs] = max(costs)
    # the groups the victims came from (their first block left) and those near the bottom,
    # however many groups there are
    assert paid[1200] <= 48 and paid[1200] <= paid[300] + 4, paid


def test_a_job_event_re_prices_only_that_jobs_groups() -> None:
    pool = _idle_jobs(200, gaps=False)
    pool.queue.popleft_n(4)  # the uncached blocks
    calls = count_pricings(pool.scorer)
    _pop(pool, 1, calls)
    pool.job_stats.hint("j150", finished=True)  # j150's blocks will not be reused: cheapest
    victims, paid = _pop(pool, 3, calls)
    assert victims == [452, 451, 450]  # j150's chain, tail first
    assert paid <= 16


@pytest.mark.parametrize("seed", range(4))
def test_a_bound_holds_until_its_horizon(seed: int) -> None:
    """``BlockScorer.group_bound`` never exceeds a block's score at any time up to its horizon,
    and an exact bound is the score there to the bit."""
    rng = random.Random(seed)
    stats = JobStats(prior_reuse=rng.choice([0.1, 0.5]))
    scorer = BlockScorer(stats, MODELS["strict"], BLOCK)
    t = 0.0
    jobs = [f"j{i}" for i in range(5)]
    for _ in range(400):
        t += rng.uniform(0.0, 3.0)
        job = rng.choice(jobs)
        roll = rng.random()
        if roll < 0.4:
            stats.on_arrival(job, t, rng.randint(1, 500))
        elif roll < 0.8:
            stats.on_finish(job, t, rng.random() < 0.1)
        elif roll < 0.9:
            stats.hint(job, expected_gap_s=rng.uniform(0.0, 5.0))
        members = tuple(rng.sample(jobs, rng.randint(0, 3)))
        group = (members, rng.choice([*jobs, None]))
        position = rng.randrange(64)
        now = t + rng.uniform(0.0, 10.0)
        level = rng.choice([0.0, 1e-9, 1e-4, 1e-2])
        bound = scorer.group_bound(group, position, now, level)  # type: ignore[arg-type]
        assert bound.until >= now
        span = 50.0 if math.isinf(bound.until) else bound.until - now
        for at in [now, bound.until if not math.isinf(bound.until) else now + 1e6] + [
            now + rng.uniform(0.0, 1.0) * span for _ in range(8)
        ]:
            for q in (position, position + rng.randrange(1, 64)):
                got = scorer.score_at(scorer.group_terms(group, at), q)  # type: ignore[arg-type]
                assert got >= bound.score
                if bound.exact and q == position:
                    assert got == bound.score
            if bound.exact and at >= now:
                # P(reuse) stays put: the group orders its blocks as it does now
                assert scorer.group_terms(group, at).p_reuse == bound.terms.p_reuse  # type: ignore[arg-type]
