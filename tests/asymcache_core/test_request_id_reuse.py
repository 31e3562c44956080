"""A request id stays in use until its final output has been reported: an aborted request's id
is refused until the step that reports its ``finish_reason="abort"`` output, and free after it
(as after any reported finish)."""

from __future__ import annotations

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.request import RequestOutput
from asymcache_core.sim_runner import VirtualClock

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _engine(kind: str) -> Engine:
    """The simulated engine, or the tiny dummy model's runner with async scheduling (CPU)."""
    if kind == "simulated":
        return Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    return Engine(model="dummy:tiny", num_kv_blocks=32, block_size=4, async_scheduling=True, clock=VirtualClock())


def _run_out(engine: Engine, max_steps: int = 200) -> list[RequestOutput]:
    """Steps until nothing is left; returns every output, in order."""
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"still unfinished after {max_steps} steps")


@pytest.mark.parametrize("kind", ["simulated", "async"])
def test_an_aborted_id_is_refused_until_its_abort_is_reported(kind: str) -> None:
    engine = _engine(kind)
    engine.add_request([5, 6, 7, 8], PARAMS, request_id="r")
    engine.step()
    assert engine.abort("r")
    with pytest.raises(ValueError, match=r"^request_id: 'r' is already in use"):
        engine.add_request([9, 10, 11], PARAMS, request_id="r")
    outputs = _run_out(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("r", "abort")]
    # reported: the id is free again, and the new request gets outputs of its own only
    engine.add_request([9, 10, 11], PARAMS, request_id="r")
    outputs = _run_out(engine)
    finals = [o for o in outputs if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("r", "length")]
    assert len(finals[0].token_ids) == 4
    engine.check_integrity()


def test_abort_before_any_step_keeps_the_id_until_reported() -> None:
    engine = _engine("simulated")
    engine.add_request([5, 6, 7, 8], PARAMS, request_id="r")
    assert engine.abort("r")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6, 7, 8], PARAMS, request_id="r")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("r", "abort")]
    assert engine.add_request([5, 6, 7, 8], PARAMS, request_id="r") == "r"


def test_a_reported_finish_frees_the_id() -> None:
    """What the engine did before: an id whose request finished and was reported is reusable."""
    engine = _engine("simulated")
    engine.add_request([5, 6, 7, 8], PARAMS, request_id="r")
    first = [o for o in _run_out(engine) if o.finished]
    assert [(o.request_id, o.finish_reason) for o in first] == [("r", "length")]
    assert engine.add_request([5, 6, 7, 8], PARAMS, request_id="r") == "r"
    again = [o for o in _run_out(engine) if o.finished]
    assert [(o.request_id, o.finish_reason) for o in again] == [("r", "length")]
    assert again[0].token_ids == first[0].token_ids


def test_an_abort_without_output_frees_the_id_at_once() -> None:
    engine = _engine("simulated")
    engine.add_request([5, 6, 7, 8], PARAMS, request_id="r")
    engine.step()
    assert engine.abort("r", emit=False)
    assert engine.add_request([5, 6, 7, 8], PARAMS, request_id="r") == "r"
    finals = [o for o in _run_out(engine) if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("r", "length")]


def test_generated_ids_skip_an_id_whose_abort_is_pending() -> None:
    engine = _engine("simulated")
    # the caller took the id the engine would give next, then aborted it
    engine.add_request([5, 6, 7, 8], PARAMS, request_id="req-0")
    assert engine.abort("req-0")
    rid = engine.add_request([9, 10, 11], PARAMS)
    assert rid != "req-0"
    finals = [(o.request_id, o.finish_reason) for o in _run_out(engine) if o.finished]
    assert sorted(finals) == sorted([("req-0", "abort"), (rid, "length")])
