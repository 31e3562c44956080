"""Async scheduling: a launched step whose collect fails runs again without the requests that
stopped since it was planned. The blocks those were to write follow the engine's fault rule
(``step_faults.py``): they stop being cache hits, and the requests that read them are preempted
and recomputed. Tiny dummy model on the CPU, virtual clock: every step is deterministic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asymcache_core import Engine, SamplingParams
from asymcache_core.block_pool import BlockPool
from asymcache_core.eviction import PolicyContext, create_policy
from asymcache_core.sim_runner import VirtualClock
from tests.asymcache_core.test_step_faults import run_all

PROMPT = list(range(10, 30))  # 20 tokens: 5 blocks of 4
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _engine(**overrides: Any) -> Engine:
    """An async engine whose steps compute 8 tokens (two blocks of 4) at most."""
    kwargs: dict[str, Any] = dict(
        model="dummy:tiny", num_kv_blocks=64, block_size=4, async_scheduling=True, clock=VirtualClock(),
        max_num_batched_tokens=8, eviction_policy="lru", job_admission=False,
    )
    kwargs.update(overrides)
    return Engine(**kwargs)


def _fail_next_collect(engine: Engine) -> Callable[[], None]:
    """Wraps the runner's collect; the returned function makes the next collect raise."""
    collect = engine.runner.collect
    armed: list[bool] = []

    def flaky(step: Any) -> Any:
        if armed:
            armed.clear()
            raise RuntimeError("injected device fault at collect")
        return collect(step)

    engine.runner.collect = flaky  # type: ignore[method-assign]
    return lambda: armed.append(True)


def _alone(prompt: list[int]) -> list[int]:
    """The greedy tokens of ``prompt`` on a fresh synchronous engine."""
    engine = _engine(async_scheduling=False)
    rid = engine.add_request(prompt, PARAMS)
    return run_all(engine)[rid].token_ids


def test_blocks_of_an_aborted_request_stop_being_hits_when_its_step_fails() -> None:
    engine = _engine()
    fail_next = _fail_next_collect(engine)
    a = engine.add_request(PROMPT, PARAMS)
    engine.step()  # launches A's first chunk (positions 0-7): blocks 0 and 1 registered
    hashes = list(engine.requests[a].block_hashes[:2])
    assert all(engine.pool.lookup(h) is not None for h in hashes)
    assert engine.abort(a)
    fail_next()
    outputs = engine.step()  # collects the launched step: it fails, and A does not run again
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(a, "abort")]
    assert [engine.pool.lookup(h) for h in hashes] == [None, None]
    engine.check_integrity()
    b = engine.add_request(PROMPT, PARAMS)
    final = run_all(engine)[b]
    assert final.metrics.cached_tokens == 0
    assert final.token_ids == _alone(PROMPT)
    engine.pool.check_integrity()


def test_a_request_that_read_those_blocks_is_preempted_and_recomputed() -> None:
    engine = _engine()
    fail_next = _fail_next_collect(engine)
    a = engine.add_request(PROMPT, PARAMS)
    engine.step()  # A's first chunk is in flight
    hashes = list(engine.requests[a].block_hashes)
    assert engine.abort(a)
    b = engine.add_request(PROMPT, PARAMS)
    fail_next()
    # plans B (a cache hit on A's two blocks) and launches it, then collects A's step: it fails
    engine.step()
    assert engine.requests[b].metrics.cached_tokens == 8
    # B read blocks that were never written: it starts over, and nothing of either step is a hit
    assert engine.requests[b].metrics.num_preemptions == 1
    assert engine.requests[b].num_computed_tokens == 0
    assert [engine.pool.lookup(h) for h in hashes[:4]] == [None] * 4
    engine.check_integrity()
    final = run_all(engine)[b]
    assert final.finish_reason == "length"
    assert final.token_ids == _alone(PROMPT)
    engine.pool.check_integrity()


def test_host_copies_of_those_blocks_stop_being_hits_too() -> None:
    """A's blocks are evicted before the failed collect: their content is copied to the host
    tier at the next planning, and those copies must not serve a later request either."""
    engine = _engine(num_host_kv_blocks=16)
    tier = engine.kv.tier
    assert tier is not None
    fail_next = _fail_next_collect(engine)
    a = engine.add_request(PROMPT, PARAMS)
    engine.step()
    hashes = list(engine.requests[a].block_hashes[:2])
    blocks = [engine.pool.lookup(h) for h in hashes]
    assert engine.abort(a)
    for block in blocks:
        assert block is not None
        engine.pool.evict_block(block)  # pressure: their copies go to the host tier
    other = engine.add_request(list(range(100, 112)), PARAMS)
    fail_next()
    engine.step()  # plans the other request (and the copies), then A's step fails
    assert [tier.pool.lookup(h) for h in hashes] == [None, None]
    assert [engine.pool.lookup(h) for h in hashes] == [None, None]
    engine.check_integrity()
    b = engine.add_request(PROMPT, PARAMS)
    finals = run_all(engine)
    assert finals[b].metrics.cached_tokens == 0 and finals[b].metrics.reload_tokens == 0
    assert finals[b].token_ids == _alone(PROMPT)
    assert finals[other].finish_reason == "length"


def test_without_a_stopped_request_the_failed_step_runs_again_and_stays_cached() -> None:
    """The contrast: a request still running is recomputed by the rerun, its blocks stay hits."""
    engine = _engine()
    fail_next = _fail_next_collect(engine)
    a = engine.add_request(PROMPT, PARAMS)
    engine.step()
    hashes = list(engine.requests[a].block_hashes[:2])
    blocks = [engine.pool.lookup(h) for h in hashes]
    fail_next()
    engine.step()
    assert engine.requests[a].metrics.num_preemptions == 0
    assert [engine.pool.lookup(h) for h in hashes] == blocks
    assert run_all(engine)[a].token_ids == _alone(PROMPT)


def _pool(num_blocks: int = 4) -> BlockPool:
    return BlockPool(num_blocks, create_policy("lru", PolicyContext(4)), lambda: 0.0)


def test_uncache_of_an_idle_cached_block_frees_it_uncached() -> None:
    pool = _pool()
    [block] = pool.allocate(1)
    assert pool.cache_block(block, 1234, 0)
    pool.free([block])
    assert pool.is_candidate(block)
    pool.uncache(block)
    assert pool.lookup(1234) is None and not pool.is_candidate(block)
    assert block in pool.free_uncached
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_uncache_of_a_pinned_block_drops_its_hash_and_frees_it_at_unpin() -> None:
    pool = _pool()
    [block] = pool.allocate(1)
    assert pool.cache_block(block, 99, 0)
    pool.pin([block])
    pool.free([block])
    pool.uncache(block)
    assert pool.lookup(99) is None
    pool.check_integrity()
    pool.unpin([block])
    assert block in pool.free_uncached
    pool.check_integrity()


def test_uncache_of_a_held_block_recycles_it_on_release() -> None:
    pool = _pool()
    [block] = pool.allocate(1)
    assert pool.cache_block(block, 7, 0)
    pool.uncache(block)
    assert pool.lookup(7) is None
    pool.free([block])
    assert block in pool.free_uncached and not pool.is_candidate(block)
    pool.check_integrity()
