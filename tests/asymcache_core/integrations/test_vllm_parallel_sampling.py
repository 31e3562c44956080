"""Parallel sampling (``n > 1``) through the plugin's scheduler over a fake vLLM.

vLLM 0.32 fans a request with ``n`` choices out into ``n`` child requests ``f"{i}_{parent}"``
that carry the parent's hints (``vllm_plugin_fakes.fan_out``). The choices are one turn of the
job: one pin holds every choice's blocks, and the job's statistics count the turn once.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from vllm_plugin_fakes import (
    Request,
    RequestStatus,
    fan_out,
    load_scheduler_module,
    make_scheduler,
)

JOB = {"job_id": "j", "pin_ttl_s": 60}
PROMPT = ["p0", "p1"]


@pytest.fixture
def sched_mod(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.delenv("ASYMCACHE_VLLM_OPTIONS", raising=False)
    return load_scheduler_module(monkeypatch)


make = make_scheduler


def start(sched: Any, requests: list[Request]) -> None:
    for request in requests:
        sched.add_request(request)
    sched.schedule()


def finish(sched: Any, request: Request, status: Any = RequestStatus.FINISHED_STOPPED) -> None:
    sched.asymcache_clock.t += 1.0
    sched.finish_requests(request.request_id, status)


def cached_ids(sched: Any, keys: list[str]) -> set[int]:
    return {sched.kv_cache_manager.block_pool.cached[k].block_id for k in keys}


def test_every_choice_of_a_finished_turn_stays_pinned_until_the_next_turn(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod)
    pins = sched.asymcache_pins
    children = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0", "b1"], ["c0"]], JOB)
    start(sched, children)
    for child in children[:2]:
        finish(sched, child)
        assert not pins.is_pinned("j")  # the turn is not over while a choice runs
    finish(sched, children[2])
    # one pin, made once, over the prompt and every choice's blocks
    assert set(pins.pins["j"].block_ids) == cached_ids(sched, PROMPT + ["a0", "b0", "b1", "c0"])
    assert (pins.stats.pins, pins.stats.released_other) == (1, 0)
    assert len(sched.asymcache_controller.decisions) == 1
    # the next turn (continuing choice b) releases all of it once it is scheduled
    nxt = Request("cmpl-2-0000ffff", PROMPT + ["b0", "b1", "n0"], extra_args=JOB)
    start(sched, [nxt])
    assert pins.pins == {} and pins.num_pinned_blocks == 0
    assert pins.stats.released_next_request == 1
    finish(sched, nxt)
    assert set(pins.pins["j"].block_ids) == cached_ids(sched, PROMPT + ["b0", "b1", "n0"])
    assert sched._asymcache_hints == {} and sched._asymcache_first_scheduled == set()
    assert sched.asymcache_turns.in_flight() == 0


def test_the_pin_of_every_choice_expires_at_its_ttl(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod)
    pins = sched.asymcache_pins
    children = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0"]], JOB)
    start(sched, children)
    finish(sched, children[1])
    finish(sched, children[0])
    assert pins.num_pinned_blocks == 4
    sched.asymcache_clock.t += 59.5  # the TTL runs from the end of the turn's last choice
    sched.schedule()
    assert pins.num_pinned_blocks == 4
    sched.asymcache_clock.t += 1.0
    sched.schedule()
    assert pins.pins == {} and pins.num_pinned_blocks == 0 and pins.stats.expired == 1
    assert sched.asymcache_queue.num_free_blocks == 32


def test_a_turn_of_n_choices_counts_once_in_the_jobs_statistics(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod)
    stats, controller = sched.asymcache_job_stats, sched.asymcache_controller
    extra = {"job_id": "j", "tool_name": "grep"}
    first = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0"], ["c0"]], extra)
    start(sched, first)
    state = stats.state("j")
    assert state.running == 1 and len(state.new_tokens) == 1
    finish(sched, first[0])
    finish(sched, first[1])
    assert stats.reuse_probability("j", sched.asymcache_clock()) == 1.0  # still running
    finish(sched, first[2])
    assert state.running == 0 and state.last_finish == sched.asymcache_clock()
    assert state.context_tokens == 12  # the longest choice's context
    assert controller.paused_jobs() == ["j"] and len(controller.decisions) == 1
    sched.asymcache_clock.t += 5.0  # the tool runs 5 s
    last = fan_out("cmpl-2-0000ffff", PROMPT + ["b0", "n0"], [["x0"], ["y0"]], {**extra, "is_last_step": 1})
    start(sched, last)
    assert state.gaps == [5.0] and len(state.new_tokens) == 2
    assert controller.durations.samples("grep") == [5.0]
    finish(sched, last[0])
    finish(sched, last[1])
    # a job of two turns, not of five requests
    assert controller.memoryfulness._jobs[-1] == 2 and state.finished
    assert len(controller.decisions) == 1 and sched.asymcache_pins.pins == {}


def test_the_cap_refuses_the_whole_turn_and_leaks_nothing(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod, {"max_pinned_fraction": 0.125})  # 4 of 32 blocks
    pins = sched.asymcache_pins
    children = fan_out("cmpl-1-abcd1234", PROMPT, [["a0", "a1"], ["b0", "b1"]], JOB)
    start(sched, children)
    finish(sched, children[0])
    finish(sched, children[1])
    assert pins.pins == {} and pins.num_pinned_blocks == 0 and pins._last == {}
    assert pins.stats.released_pressure == 1
    assert sched.asymcache_queue.num_free_blocks == 32


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_a_turn_with_an_aborted_choice_is_not_pinned(sched_mod: types.ModuleType, status: RequestStatus) -> None:
    sched = make(sched_mod)
    children = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0"]], JOB)
    start(sched, children)
    finish(sched, children[0])
    finish(sched, children[1], status)
    assert sched.asymcache_pins.pins == {} and sched.asymcache_controller.paused_jobs() == []
    assert sched.asymcache_job_stats.state("j").running == 0
    assert sched.asymcache_turns.in_flight() == 0


def test_a_choice_block_that_lost_its_content_before_the_turn_ended_is_not_pinned(
    sched_mod: types.ModuleType,
) -> None:
    sched = make(sched_mod)
    pool = sched.kv_cache_manager.block_pool
    children = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0"]], JOB)
    start(sched, children)
    finish(sched, children[0])
    gone = pool.cached["a0"].block_id
    pool.evict_blocks({gone})  # its id may hold other content by the time the turn ends
    finish(sched, children[1])
    assert set(sched.asymcache_pins.pins["j"].block_ids) == cached_ids(sched, PROMPT + ["b0"])


def test_the_choices_of_a_request_without_a_job_share_one_implicit_job(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod, {"implicit_jobs": True})
    implicit = sched.asymcache_implicit_jobs
    first = fan_out("cmpl-1-abcd1234", PROMPT, [["a0"], ["b0"]])
    start(sched, first)
    assert {sched._asymcache_hints[c.request_id].job_id for c in first} == {"implicit-0"}
    finish(sched, first[1])
    finish(sched, first[0])
    # the next turn may continue either choice: both are the conversation's
    nxt = Request("cmpl-2-0000ffff", PROMPT + ["b0", "n0"])
    start(sched, [nxt])
    assert sched._asymcache_hints[nxt.request_id].job_id == "implicit-0"
    assert (implicit.matched, implicit.started) == (1, 1)
    implicit.check_integrity()


def test_a_single_request_with_a_child_like_id_is_a_turn_of_its_own(sched_mod: types.ModuleType) -> None:
    sched = make(sched_mod)
    request = Request("0_mine-abcd1234", PROMPT + ["a0"], extra_args=JOB)
    start(sched, [request])
    finish(sched, request)
    assert set(sched.asymcache_pins.pins["j"].block_ids) == cached_ids(sched, PROMPT + ["a0"])
    assert sched.asymcache_turns.in_flight() == 0
