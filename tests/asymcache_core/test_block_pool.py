"""Block pool and cache manager invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.block_pool import BlockPool, OutOfBlocksError
from asymcache_core.eviction import PolicyContext, create_policy, registered_policies
from asymcache_core.job_stats import JobStats

OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "cache", "touch", "pin", "unpin", "evict"]),
        st.integers(min_value=0, max_value=10_000),
        st.integers(min_value=1, max_value=4),
    ),
    max_size=120,
)


@pytest.mark.parametrize("policy_name", registered_policies())
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_random_operations_keep_invariants(policy_name, ops):
    ticks = itertools.count()
    clock = lambda: float(next(ticks))  # noqa: E731
    ctx = PolicyContext(block_size=16, job_stats=JobStats())
    pool = BlockPool(12, create_policy(policy_name, ctx), clock)
    held: list[int] = []  # one entry per reference we own
    pinned: list[int] = []
    contents: dict[int, int] = {}  # block -> hash it must keep while referenced or pinned
    next_hash = itertools.count(1)
    for op, pick, count in ops:
        if op == "alloc":
            if count > pool.num_free_blocks:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(count)
                continue
            got = pool.allocate(count, job_id=f"s{pick % 3}")
            assert len(set(got)) == count
            assert not set(got) & set(held), "allocated a referenced block"
            assert not set(got) & set(pinned), "allocated a pinned block"
            for b in got:
                contents.pop(b, None)
            held += got
        elif op == "free" and held:
            block = held.pop(pick % len(held))
            pool.free([block])
        elif op == "cache" and held:
            block = held[pick % len(held)]
            h = next(next_hash)
            if pool.cache_block(block, h, position=pick % 7):
                contents[block] = pool.blocks[block].block_hash  # type: ignore[assignment]
        elif op == "touch" and pool.cached:
            hashes = sorted(pool.cached)
            block = pool.cached[hashes[pick % len(hashes)]]
            pool.touch([block], job_id="t")
            held.append(block)
        elif op == "pin" and (held or pool.cached):
            candidates = held + sorted(pool.cached.values())
            block = candidates[pick % len(candidates)]
            pool.pin([block])
            pinned.append(block)
        elif op == "unpin" and pinned:
            pool.unpin([pinned.pop(pick % len(pinned))])
        elif op == "evict" and pool.num_free_blocks:
            # allocation under pressure: every free block is taken, candidates are evicted
            got = pool.allocate(pool.num_free_blocks)
            assert not set(got) & (set(held) | set(pinned))
            for b in got:
                contents.pop(b, None)
            held += got
        # a block we hold or pin keeps its cached content
        for block in set(held) | set(pinned):
            if block in contents:
                assert pool.blocks[block].block_hash == contents[block], "held block lost content"
        pool.check_integrity()
    # releasing everything returns the whole pool
    for block in held:
        pool.free([block])
    for block in pinned:
        pool.unpin([block])
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_double_free_and_bad_unpin_raise():
    pool = BlockPool(4, create_policy("lru", PolicyContext(16)), lambda: 0.0)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    with pytest.raises(RuntimeError, match="unpin"):
        pool.unpin([block])


def test_vllm_apc_evicts_in_free_order_tail_first():
    pool = BlockPool(4, create_policy("vllm-apc", PolicyContext(16)), lambda: 0.0)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, i)
    pool.free(reversed(blocks))  # a request frees its tail first
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order == list(reversed(blocks))


def test_lru_evicts_least_recent_then_shallowest():
    t = [0.0]
    pool = BlockPool(4, create_policy("lru", PolicyContext(16)), lambda: t[0])
    a = pool.allocate(2)
    for i, b in enumerate(a):
        pool.cache_block(b, 10 + i, i)
    pool.free(reversed(a))
    t[0] = 5.0
    b = pool.allocate(2)
    for i, blk in enumerate(b):
        pool.cache_block(blk, 20 + i, i)
    pool.free(b)
    # all four blocks are candidates; the older request's blocks go first, head before tail
    assert [pool.allocate(1)[0] for _ in range(4)] == [a[0], a[1], b[0], b[1]]


# -- one-call admission (KVCacheManager.try_admit / try_allocate) -------------------------------
def _manager(num_blocks: int, policy: str = "vllm-apc"):
    from asymcache_core.kv_cache_manager import KVCacheManager

    ticks = itertools.count()
    pool = BlockPool(num_blocks, create_policy(policy, PolicyContext(block_size=4)), lambda: float(next(ticks)))
    return KVCacheManager(pool, block_size=4, hole_reuse=True)


def _request(rid: str, tokens: list[int]):
    from asymcache_core.request import Request
    from asymcache_core.sampling_params import SamplingParams

    return Request(rid, tokens, SamplingParams(max_tokens=1), arrival_time=0.0, job_id=rid)


def _whole(request) -> list[tuple[int, int]]:
    return [(request.num_computed_tokens, request.num_tokens)]


def _cache_prompt(kv, tokens: list[int]) -> list[int]:
    """Runs ``tokens`` through admission and frees them: their full blocks stay cached."""
    request = _request("warm", tokens)
    assert kv.try_admit(request, _whole) is not None
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)
    cached = kv.held_blocks(request)[: len(tokens) // 4]
    kv.free(request)
    return cached


def test_try_admit_holds_hits_and_takes_fresh_blocks():
    kv = _manager(10)
    cached = _cache_prompt(kv, list(range(12)))  # 3 full blocks
    request = _request("r", list(range(12)) + [50, 51, 52, 53, 54])  # 3 hits + 2 new blocks
    order: list[tuple[int, int]] = []

    def on_hold(r) -> None:  # hits held, fresh blocks not taken yet
        order.append((min(kv.pool.blocks[b].ref_cnt for b in cached), len(r.block_ids)))

    allocation = kv.try_admit(request, _whole, on_hold=on_hold)
    assert allocation is not None and allocation.hit is not None
    assert allocation.hit.hit_tokens == 12 and allocation.segments == [(12, 17)]
    assert len(allocation.new_block_ids) == 2 and not set(allocation.new_block_ids) & set(cached)
    assert order == [(1, 3)]
    assert request.block_ids == cached + allocation.new_block_ids
    assert request.num_computed_tokens == 12 and request.hit_end == 12
    assert kv.pool.num_in_use == 5
    kv.pool.check_integrity()


def test_try_admit_that_does_not_fit_changes_nothing():
    kv = _manager(6)
    cached = _cache_prompt(kv, list(range(12)))  # 3 candidates + 3 uncached free blocks
    before = {b: kv.pool.blocks[b].last_access for b in cached}
    # NOTE: 3 hits + 5 new blocks: the 5 alone fit the 6 free ones, but holding the hits takes
    # them out of the free count (8 > 6)
    request = _request("r", list(range(12)) + list(range(100, 116)) + [7])
    calls: list[int] = []

    def reclaim() -> bool:
        calls.append(1)
        return len(calls) < 3  # releases twice (nothing real), then has nothing left

    assert kv.try_admit(request, _whole, reclaim=reclaim, on_hold=lambda r: calls.append(99)) is None
    assert calls == [1, 1, 1]  # retried while reclaim released something; on_hold never ran
    assert request.block_ids == [] and request.num_computed_tokens == 0 and request.hit_end == 0
    assert {b: kv.pool.blocks[b].last_access for b in cached} == before
    assert all(kv.pool.is_candidate(b) for b in cached) and kv.pool.num_in_use == 0
    # an empty plan (the budget's remainder is under a block) also leaves it unadmitted
    assert kv.try_admit(_request("s", list(range(12)) + [9]), lambda r: []) is None
    assert all(kv.pool.is_candidate(b) for b in cached)
    kv.pool.check_integrity()


def test_try_admit_reserve_prompt_checks_the_whole_prompt():
    kv = _manager(6)
    request = _request("r", list(range(40)))  # 10 blocks; a first chunk of 8 tokens needs 2
    first_chunk = lambda r: [(0, 8)]  # noqa: E731
    assert kv.try_admit(request, first_chunk, reserve_prompt=True) is None
    assert kv.pool.num_in_use == 0
    allocation = kv.try_admit(request, first_chunk)
    assert allocation is not None and len(allocation.new_block_ids) == 2


def test_try_allocate_fits_or_takes_nothing():
    kv = _manager(4)
    request = _request("r", list(range(10)))
    assert kv.try_admit(request, lambda r: [(0, 8)]) is not None  # 2 blocks
    request.num_computed_tokens = 8
    assert kv.try_allocate(request, [(8, 10)]).new_block_ids == [request.block_ids[2]]
    other = _request("o", list(range(200, 212)))
    assert kv.try_allocate(other, [(0, 12)]) is None  # 3 blocks, 1 free
    assert other.block_ids == [] and kv.pool.num_in_use == 3
    kv.pool.check_integrity()


def test_pinned_idle_count_follows_every_transition():
    """A cached block pinned while idle, taken by a request, released, and unpinned: the count
    of pinned blocks no request holds (what Continuum's pin cap reads) at each step."""
    ctx = PolicyContext(block_size=16, job_stats=JobStats())
    pool = BlockPool(4, create_policy("lru", ctx), lambda: 0.0)
    (block,) = pool.allocate(1)
    pool.cache_block(block, 7, position=0)
    pool.pin([block])  # held and pinned: not idle
    assert pool.num_pinned_idle == 0
    pool.free([block])  # the request lets go: pinned and idle
    assert pool.num_pinned_idle == 1
    pool.touch([block])  # the job's next turn takes it
    assert pool.num_pinned_idle == 0
    pool.free([block])
    pool.pin([block])  # nested pin
    assert pool.num_pinned_idle == 1
    pool.unpin([block])
    assert pool.num_pinned_idle == 1, "still pinned once"
    pool.unpin([block])  # a candidate again
    assert pool.num_pinned_idle == 0 and pool.num_free_blocks == 4
    pool.check_integrity()
