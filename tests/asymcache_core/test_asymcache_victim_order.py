"""AsymCache's victims against a brute-force sort of every candidate by its key.

``pop_victims`` merges per-group heaps whose removed rows stay until they surface (lazy
deletion); a block removed and added again leaves a stale row behind. Whatever the mix of adds,
removes and pops, the victims must come in the order of ``key_function`` (ties by when the
blocks became candidates), and only live candidates.
"""

from __future__ import annotations

import random

import pytest

from asymcache_core.block_pool import KVBlock
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel


@pytest.mark.parametrize("seed", range(6))
def test_victims_follow_the_key_order_under_random_churn(seed):
    rng = random.Random(seed)
    stats = JobStats()
    ctx = PolicyContext(
        block_size=16, latency_model=LatencyModel(1e-3, 1e-5, 1e-9, 64), job_stats=stats
    )
    policy = create_policy("asymcache", ctx)
    jobs = [f"job-{i}" for i in range(2)]
    blocks = [KVBlock(i) for i in range(60)]
    candidates: dict[int, int] = {}  # block id -> order it became a candidate in
    order = 0
    now = 0.0
    for _ in range(1500):
        now += rng.random()
        action = rng.random()
        job = rng.choice(jobs)
        if action < 0.1:
            stats.on_arrival(job, now, rng.randint(1, 4000))
        elif action < 0.2:
            stats.on_finish(job, now, last_step=rng.random() < 0.3)
        elif action < 0.6:
            idle = [b for b in blocks if b.block_id not in candidates]
            if idle:
                block = rng.choice(idle)
                block.position = rng.randint(0, 200)
                block.last_access = now
                block.job_id = job
                block.jobs = frozenset(rng.sample(jobs, rng.randint(0, 1)))
                policy.add(block, now)
                candidates[block.block_id] = order
                order += 1
        elif action < 0.85:
            if candidates:
                block_id = rng.choice(sorted(candidates))
                policy.remove(blocks[block_id])
                del candidates[block_id]
        else:
            key = policy.key_function(now)
            expected = sorted(candidates, key=lambda b: (key(blocks[b]), candidates[b]))
            count = rng.randint(1, 5)
            victims = [b.block_id for b in policy.pop_victims(count, now)]
            assert victims == expected[:count]
            for block_id in victims:
                del candidates[block_id]
        assert len(policy) == len(candidates)
        assert {b.block_id for b in policy.candidates()} == set(candidates)
