"""``Engine.has_unfinished`` counts an abort's final output until a step has reported it, so the
usual ``while engine.has_unfinished(): engine.step()`` loop delivers ``finish_reason="abort"``."""

from __future__ import annotations

import pytest

from asymcache_core import Engine, SamplingParams
from asymcache_core.sim_runner import VirtualClock


def _drain(engine: Engine, max_steps: int = 100) -> list[tuple[str, str | None]]:
    """Steps while the engine says it has work; returns the final outputs, in order."""
    finals: list[tuple[str, str | None]] = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        finals += [(o.request_id, o.finish_reason) for o in engine.step() if o.finished]
    raise AssertionError(f"has_unfinished() still True after {max_steps} steps")


def _engine(kind: str) -> Engine:
    """The simulated engine, or the tiny dummy model's runner with async scheduling (CPU)."""
    if kind == "simulated":
        return Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    return Engine(model="dummy:tiny", num_kv_blocks=32, block_size=4, async_scheduling=True, clock=VirtualClock())


@pytest.mark.parametrize("kind", ["simulated", "async"])
def test_the_loop_delivers_the_abort_of_the_only_request(kind: str) -> None:
    engine = _engine(kind)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert engine.abort(rid)
    assert engine.has_unfinished()
    assert _drain(engine) == [(rid, "abort")]
    # nothing left: the pending output went out, and the next step reports nothing
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_abort_before_the_first_step_is_reported() -> None:
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.abort(rid)
    assert _drain(engine) == [(rid, "abort")]


def test_abort_without_emit_leaves_nothing_to_report() -> None:
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.abort(rid, emit=False)
    assert not engine.has_unfinished()


def test_abort_of_one_request_among_others_is_reported_once() -> None:
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = engine.add_request([5, 6, 7], params)
    b = engine.add_request([8, 9, 10], params)
    engine.step()
    assert engine.abort(a)
    finals = _drain(engine)
    assert sorted(finals) == sorted([(a, "abort"), (b, "length")])
