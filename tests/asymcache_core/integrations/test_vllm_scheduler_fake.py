"""The plugin's scheduler mixin (``scheduler.py``) over a fake vLLM (no vLLM needed).

``vllm_plugin_fakes`` stands in for the vLLM modules ``scheduler.py`` imports; the real
scheduler mixin, free queue, pins, controller and job statistics run on top of it.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from vllm_plugin_fakes import (
    Request,
    RequestStatus,
    load_scheduler_module,
    make_scheduler,
    vllm_config,
)


@pytest.fixture
def sched_mod(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.delenv("ASYMCACHE_VLLM_OPTIONS", raising=False)
    return load_scheduler_module(monkeypatch)


make = make_scheduler


def run(sched: Any, req: Request, status: Any = RequestStatus.FINISHED_STOPPED) -> None:
    sched.add_request(req)
    sched.schedule()
    sched.asymcache_clock.t += 1.0
    sched.finish_requests(req.request_id, status)


def test_a_job_id_back_after_its_last_step_is_scored_as_live(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod, {"pinning": False})
    stats = sched.asymcache_job_stats
    run(sched, Request("t1", ["c0", "c1"], session_id="chat-1", extra_args={"is_last_step": 1}))
    assert stats.reuse_probability("chat-1", sched.asymcache_clock()) == 0.0
    run(sched, Request("t2", ["c0", "c1", "c2"], session_id="chat-1"))
    now = sched.asymcache_clock()
    assert stats.reuse_probability("chat-1", now) > 0.0
    # its blocks are worth keeping again (a finished job's score 0 made them go first)
    block = sched.kv_cache_manager.block_pool.cached["c2"]
    assert sched.asymcache_scorer.score(block, now) > 0.0


@pytest.mark.parametrize(
    ("options", "env", "field"),
    [
        ({"prior_reuse": "0.2"}, None, "prior_reuse"),
        ({"prior_reuse": 7}, None, "prior_reuse"),
        ({"prior_reuse": True}, None, "prior_reuse"),
        ({"max_pinned_fraction": "0.3"}, None, "max_pinned_fraction"),
        ({"max_pinned_fraction": float("nan")}, None, "max_pinned_fraction"),
        ({"pinning": "false"}, None, "pinning"),
        ({"implicit_jobs": 1}, None, "implicit_jobs"),
        ({"ttl_rule": "Preview"}, None, "ttl_rule"),
        ({"eviction": "LRU"}, None, "eviction"),
        ({"order": ["fcfs"]}, None, "order"),
        ({"latency_profile": 3}, None, "latency_profile"),
        ({"order": "least-work", "least_work_patience": -1}, None, "least_work_patience"),
        (None, "null", "ASYMCACHE_VLLM_OPTIONS"),
        (None, "[1, 2]", "ASYMCACHE_VLLM_OPTIONS"),
        (None, '"x"', "ASYMCACHE_VLLM_OPTIONS"),
        (None, "{bad", "ASYMCACHE_VLLM_OPTIONS"),
        (None, '{"prior_reuse": -0.1}', "prior_reuse"),
    ],
)
def test_bad_options_fail_at_startup_naming_the_field(
    sched_mod: types.ModuleType, monkeypatch: pytest.MonkeyPatch, options: Any, env: str | None, field: str
) -> None:
    if env is not None:
        monkeypatch.setenv("ASYMCACHE_VLLM_OPTIONS", env)
    with pytest.raises(ValueError, match=field):
        sched_mod.AsymCacheOptions.from_vllm_config(vllm_config(options))


def test_good_options_pass_and_a_non_object_section_is_refused(
    sched_mod: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = sched_mod.AsymCacheOptions.from_vllm_config(vllm_config(
        {"prior_reuse": 0, "max_pinned_fraction": 1, "pinning": False, "ttl_rule": "preview",
         "order": "least-work", "least_work_patience": 2, "latency_profile": None}))
    assert (opts.prior_reuse, opts.max_pinned_fraction, opts.ttl_rule, opts.least_work_patience) == (0, 1, "preview", 2)
    monkeypatch.setenv("ASYMCACHE_VLLM_OPTIONS", '{"prior_reuse": 0.25}')
    assert sched_mod.AsymCacheOptions.from_vllm_config(vllm_config({"prior_reuse": 0.9})).prior_reuse == 0.25
    config = types.SimpleNamespace(additional_config={"asymcache": "fast"})
    with pytest.raises(ValueError, match="additional_config.asymcache"):
        sched_mod.AsymCacheOptions.from_vllm_config(config)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_an_aborted_or_failed_turn_is_neither_pinned_nor_a_tool_pause(
    sched_mod: types.ModuleType, status: RequestStatus
) -> None:
    sched = make(sched_mod)
    run(sched, Request("r1", ["a0", "a1"], extra_args={"job_id": "j", "pin_ttl_s": 60}), status)
    assert not sched.asymcache_pins.is_pinned("j") and sched.asymcache_pins.stats.pins == 0
    assert sched.asymcache_controller.paused_jobs() == []
    # the job's next request records no tool duration
    run(sched, Request("r2", ["a0", "a1", "a2"], extra_args={"job_id": "j", "pin_ttl_s": 60}))
    assert sched.asymcache_controller.durations.samples("tool") == []
    # a turn that stopped normally is pinned
    assert sched.asymcache_pins.is_pinned("j")


def test_a_prefix_cache_reset_drops_every_pin(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod, num_blocks=8)
    pool = sched.kv_cache_manager.block_pool
    run(sched, Request("a", ["a0", "a1", "a2"], extra_args={"job_id": "j1", "pin_ttl_s": 600}))
    assert sched.asymcache_pins.num_pinned_blocks == 3
    assert pool.reset_prefix_cache()
    assert sched.asymcache_pins.pins == {} and sched.asymcache_pins.num_pinned_blocks == 0
    # the old ids hold other content now: all of it can be evicted, no pin is released for it
    run(sched, Request("b", ["b0", "b1", "b2", "b3", "b4", "b5", "b6"]))
    run(sched, Request("c", ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"]))
    assert sched.asymcache_queue.stats.pressure_unpins == 0


def test_a_block_evicted_by_vllm_leaves_its_pin(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod, num_blocks=8)
    pool = sched.kv_cache_manager.block_pool
    run(sched, Request("a", ["a0", "a1", "a2"], extra_args={"job_id": "j1", "pin_ttl_s": 600}))
    leaf = pool.cached["a2"].block_id
    pool.evict_blocks({leaf})  # a KV connector dropped it
    pins = sched.asymcache_pins
    assert not pins.holds_block(leaf) and leaf not in pins.pins["j1"].block_ids
    assert pins.num_pinned_blocks == 2 and pins.is_pinned("j1")
