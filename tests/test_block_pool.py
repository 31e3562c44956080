"""Block pool and cache manager invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.block_pool import BlockPool, OutOfBlocksError
from asymcache_core.eviction import PolicyContext, create_policy, registered_policies
from asymcache_core.session_stats import SessionStats

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
    ctx = PolicyContext(block_size=16, sessions=SessionStats())
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
            got = pool.allocate(count, session_id=f"s{pick % 3}")
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
            pool.touch([block], session_id="t")
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
