"""``Engine.reset_prefix_cache``: the device pool's unheld cached blocks go; with
``host_tier=True`` the host tier's copies too, so a later request finds nothing it dropped."""

from __future__ import annotations

import pytest

from asymcache_core import CacheReset, Engine, EngineConfig, SamplingParams

PROMPT = list(range(100, 140))  # ten blocks of 4 tokens


def _engine() -> Engine:
    return Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=32, block_size=4,
                                         num_host_kv_blocks=64, eviction_policy="asymcache"))


def _run(engine: Engine) -> int:
    """Runs :data:`PROMPT` to one token in a job (the tier keeps copies of jobs' blocks);
    returns the engine's cache-hit tokens so far."""
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1), job_id="a")
    while rid in engine.requests:
        engine.step()
        engine.check_integrity()
    return engine.stats().engine_cache_hit_tokens_total


def test_a_device_reset_leaves_the_host_copies_and_a_full_reset_leaves_nothing():
    engine = _engine()
    _run(engine)
    device_only = engine.reset_prefix_cache()
    assert isinstance(device_only, CacheReset) and device_only.device_blocks >= 10 and device_only.host_blocks == 0
    engine.step()  # issues the copies of what it evicted
    # the evicted blocks live on in the host tier
    assert not engine.pool.cached and len(engine.host_tier.pool.cached) >= 10
    full = engine.reset_prefix_cache(host_tier=True)
    assert full.device_blocks == 0 and full.host_blocks >= 10
    assert not engine.host_tier.pool.cached
    engine.check_integrity()
    # cold again: neither pool holds the prompt, so nothing is reloaded or rebuilt from the host
    stats = engine.stats()
    _run(engine)
    after = engine.stats()
    assert after.host_reloaded_blocks_total == stats.host_reloaded_blocks_total
    assert after.host_recompute_chosen_blocks_total == stats.host_recompute_chosen_blocks_total
    assert after.engine_cache_hit_tokens_total == stats.engine_cache_hit_tokens_total
    # copies queued but not issued yet are dropped too: none lands after the reset
    assert engine.reset_prefix_cache(host_tier=True).device_blocks >= 10
    engine.step()
    assert not engine.host_tier.pool.cached
    engine.check_integrity()


def test_a_reset_keeps_what_a_request_holds_and_without_a_tier_drops_no_host_slot():
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=32, block_size=4))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt computed and cached, the request still running
    held = engine.reset_prefix_cache(host_tier=True)
    assert held == CacheReset(0, 0) and engine.pool.cached
    while engine.has_unfinished():
        engine.step()
    assert rid not in engine.requests and engine.reset_prefix_cache().device_blocks >= 10
    engine.check_integrity()


def test_a_host_tier_flag_that_is_not_a_bool_is_refused_and_nothing_is_reset():
    engine = _engine()
    _run(engine)
    cached = len(engine.pool.cached)
    with pytest.raises(ValueError, match="host_tier"):
        engine.reset_prefix_cache(host_tier="x")  # type: ignore[arg-type]
    assert len(engine.pool.cached) == cached > 0
