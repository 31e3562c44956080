"""Blocks' job sets: each block's set is its own jobs plus the new one, and the blocks one
call extends from the same set share the new set (the eviction policy's group lookups then
compare sets by identity)."""

from __future__ import annotations

import itertools
import random

from asymcache_core.block_pool import BlockPool
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.job_stats import JobStats


def _pool(num_blocks: int) -> BlockPool:
    ticks = itertools.count()
    ctx = PolicyContext(block_size=16, job_stats=JobStats())
    return BlockPool(num_blocks, create_policy("asymcache", ctx), lambda: float(next(ticks)))


def test_allocated_blocks_share_one_job_set():
    pool = _pool(8)
    taken = pool.allocate(5, "job-a")
    sets = {id(pool.blocks[b].jobs) for b in taken}
    assert len(sets) == 1
    assert pool.blocks[taken[0]].jobs == frozenset({"job-a"})


def test_touch_extends_each_block_by_its_own_set():
    pool = _pool(8)
    first = pool.allocate(3, "job-a")
    second = pool.allocate(2, "job-b")
    pool.touch(first + second, "job-c")
    for b in first:
        assert pool.blocks[b].jobs == frozenset({"job-a", "job-c"})
    for b in second:
        assert pool.blocks[b].jobs == frozenset({"job-b", "job-c"})
    assert len({id(pool.blocks[b].jobs) for b in first}) == 1
    assert len({id(pool.blocks[b].jobs) for b in second}) == 1
    assert pool.blocks[first[0]].jobs is not pool.blocks[second[0]].jobs


def test_random_touches_match_plain_unions():
    """Whatever mix of sets a call extends, each block ends with exactly its old set plus
    the job (a cache keyed wrongly would hand a block another block's set)."""
    rng = random.Random(7)
    pool = _pool(40)
    expected: dict[int, frozenset[str]] = {}
    held: list[int] = []
    jobs = [f"job-{i}" for i in range(6)]
    for _ in range(300):
        if held and rng.random() < 0.6:
            picked = rng.sample(sorted(set(held)), rng.randint(1, min(4, len(set(held)))))
            job = rng.choice(jobs)
            pool.touch(picked, job)
            for b in picked:
                expected[b] = expected[b] | {job}
            held.extend(picked)
        elif pool.num_free_blocks:
            job = rng.choice(jobs)
            for b in pool.allocate(rng.randint(1, min(3, pool.num_free_blocks)), job):
                expected[b] = frozenset({job})
                held.append(b)
        if held and rng.random() < 0.3:
            pool.free([held.pop(rng.randrange(len(held)))])
        for b in held:
            assert pool.blocks[b].jobs == expected[b]
        pool.check_integrity()
