"""A fault inside the model's forward pass fails only the requests that cause it (real SmolLM2).

A wrapper around the model raises when a chosen token is among the step's inputs (a request
that breaks the model) or on every call (the device is gone); the engine bisects the step and
retries the rest, and the pool holds nothing afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.request import RequestOutput
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
POISON = 12345


class FaultyModel:
    """Calls the real model unless the fault fires: on a poison token in the inputs, on every
    call while ``down``, or on the next ``fail_next`` calls."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.down = False
        self.fail_next = 0
        self.calls = 0
        self.faults = 0

    def __call__(self, input_ids, *args: Any, **kwargs: Any):
        self.calls += 1
        if self.down or self.fail_next > 0 or POISON in input_ids.tolist():
            self.fail_next = max(0, self.fail_next - 1)
            self.faults += 1
            raise RuntimeError("injected forward-pass fault")
        return self.model(input_ids, *args, **kwargs)


def faulty_engine(loaded, **overrides) -> tuple[Engine, FaultyModel]:
    overrides.setdefault("num_kv_blocks", 24)
    engine = make_engine(loaded, **overrides)
    wrapper = FaultyModel(engine.runner.model)
    engine.runner.model = wrapper
    return engine, wrapper


def run_all(engine: Engine, max_steps: int = 5_000) -> dict[str, RequestOutput]:
    """Steps until nothing is unfinished (a request stuck forever fails the test, not hangs it)."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(engine.requests)}")


def assert_clean(engine: Engine) -> None:
    engine.check_integrity()
    assert not engine.requests and not engine.has_unfinished()
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert engine.pool.num_in_use == 0 and engine.stats().pinned_blocks == 0


@pytest.fixture(scope="module")
def reference(smollm, chat_prompts) -> list[list[int]]:
    engine = make_engine(smollm, num_kv_blocks=64)
    return [engine.generate([p], GREEDY)[0].token_ids for p in chat_prompts]


def test_the_request_that_breaks_the_model_fails_alone(smollm, chat_prompts, reference):
    engine, model = faulty_engine(smollm)
    good = [engine.add_request(p, GREEDY) for p in chat_prompts]
    bad = engine.add_request([*chat_prompts[1][:5], POISON, 7, 8], GREEDY)
    finals = run_all(engine)
    assert model.faults >= 2  # the whole step, then the culprit alone
    assert finals[bad].finish_reason == "abort" and "injected forward-pass fault" in finals[bad].error
    assert finals[bad].token_ids == []
    assert [finals[r].token_ids for r in good] == reference
    assert all(finals[r].error is None for r in good)
    assert_clean(engine)


def test_a_culprit_fails_in_every_position_of_the_batch(smollm, chat_prompts, reference):
    for position in range(4):
        engine, _ = faulty_engine(smollm)
        prompts: list[list[int]] = list(chat_prompts)
        prompts.insert(position, [3, 4, POISON, 5])
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        finals = run_all(engine)
        bad = ids.pop(position)
        assert finals[bad].error is not None
        assert [finals[r].token_ids for r in ids] == reference
        assert_clean(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_reader_of_the_culprits_fresh_prefix_is_recomputed_not_failed(smollm, chat_prompts, reference, async_scheduling):
    # NOTE: both are admitted in one step; the second hits the prefix blocks the first caches at
    # admission and computes in that step, so it cannot run without the first's keys. With async
    # scheduling the failed launch runs again synchronously, and the preempted reader gives up
    # the token it was to sample there (else it would wait for it forever).
    engine, _ = faulty_engine(smollm, async_scheduling=async_scheduling)
    prefix = chat_prompts[2]
    bad = engine.add_request([*prefix, POISON], GREEDY)
    reader = engine.add_request(prefix, GREEDY)
    finals = run_all(engine)
    assert finals[bad].error is not None
    assert finals[reader].error is None and finals[reader].token_ids == reference[2]
    assert finals[reader].metrics.num_preemptions == 1
    assert_clean(engine)


def test_blocks_of_a_failed_request_are_not_cache_hits_afterwards(smollm, chat_prompts):
    engine, model = faulty_engine(smollm)
    prompt = [*chat_prompts[0], 17, 18]
    model.fail_next = 1
    rid = engine.add_request(prompt, GREEDY)
    finals = run_all(engine)
    assert "injected" in finals[rid].error  # alone in its step, so it is the culprit
    assert_clean(engine)
    assert not engine.pool.cached  # nothing it wrote is offered as a hit
    again = engine.generate([prompt], GREEDY)[0]
    assert again.metrics.cached_tokens == 0
    assert again.token_ids == make_engine(smollm, num_kv_blocks=64).generate([prompt], GREEDY)[0].token_ids


def test_a_transient_fault_fails_nobody(smollm, chat_prompts, reference):
    engine, model = faulty_engine(smollm)
    ids = [engine.add_request(p, GREEDY) for p in chat_prompts]
    engine.step()
    model.fail_next = 1
    finals = run_all(engine)
    assert model.faults == 1
    assert [finals[r].token_ids for r in ids] == reference and all(finals[r].error is None for r in ids)
    assert_clean(engine)


def test_the_device_gone_fails_every_request_and_the_engine_serves_on(smollm, chat_prompts, reference):
    engine, model = faulty_engine(smollm)
    ids = [engine.add_request(p, GREEDY) for p in chat_prompts]
    engine.step()  # a prefill step that worked: the requests hold blocks mid-generation
    model.down = True
    finals = run_all(engine)
    assert set(finals) == set(ids)
    for rid in ids:
        assert finals[rid].finish_reason == "abort"
        assert finals[rid].error.startswith("the model step failed: RuntimeError: injected forward-pass fault")
    assert model.faults <= 2 * len(ids)  # bisection: at most 2n - 1 attempts for n requests
    assert_clean(engine)
    model.down = False
    again = [engine.add_request(p, GREEDY) for p in chat_prompts]
    finals = run_all(engine)
    assert [finals[r].token_ids for r in again] == reference
    assert_clean(engine)


def test_a_pinned_job_survives_a_fault_of_another_request(smollm, chat_prompts):
    engine, _ = faulty_engine(smollm)
    engine.add_request(chat_prompts[0], GREEDY, job_id="job-a")
    run_all(engine)
    assert engine.pin_job("job-a", ttl_s=1e6) > 0
    pinned = engine.stats().pinned_blocks
    bad = engine.add_request([POISON, *chat_prompts[1]], GREEDY, job_id="job-b")
    ok = engine.add_request(chat_prompts[2], GREEDY, job_id="job-c")
    finals = run_all(engine)
    assert finals[bad].error is not None and finals[ok].error is None
    assert engine.stats().pinned_blocks == pinned
    assert engine.unpin_job("job-a")
    assert_clean(engine)


# -- the grouping, without a model ---------------------------------------------------------------
class _Held:
    """``held_blocks`` of a KV cache manager, from a dict."""

    def __init__(self, held: dict[int, list[int]]) -> None:
        self.held = held

    def held_blocks(self, request: Any) -> list[int]:
        return self.held[request.block_ids[0]]


def _item(first_block: int, blocks: list[int], segments: list[tuple[int, int]]) -> Any:
    from types import SimpleNamespace

    from asymcache_core.scheduler import ScheduledRequest

    return ScheduledRequest(SimpleNamespace(block_ids=[first_block, *blocks]), segments, True)


def test_written_blocks_are_those_under_the_segments():
    from asymcache_core.step_faults import written_blocks

    item = _item(10, [11, 12, 13], [(0, 3), (33, 40)])  # block size 16: blocks 0 and 2 of the table
    assert written_blocks(item, 16) == [10, 12]
    assert written_blocks(_item(10, [11], [(16, 17)]), 16) == [11]


def test_a_reader_of_a_block_written_in_the_step_joins_its_writers_group():
    from asymcache_core.scheduler import SchedulerOutput
    from asymcache_core.step_faults import step_groups

    # request 0 writes block 10; request 2 reads it (a prefix cached at admission), request 1
    # and request 3 share nothing with anyone; request 3 reads what 2 writes
    items = [_item(10, [], [(0, 16)]), _item(20, [], [(0, 4)]), _item(30, [], [(0, 4)]), _item(40, [], [(0, 4)])]
    kv = _Held({10: [10], 20: [20], 30: [10, 30], 40: [30, 40]})
    written = [[10], [20], [30], [40]]
    groups = step_groups(SchedulerOutput(items, [], 64, 28), written, kv)  # type: ignore[arg-type]
    assert groups == [[0, 2, 3], [1]]
