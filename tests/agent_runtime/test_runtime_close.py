"""A runtime closes the engine it built (its KV event sockets, tensor-parallel workers), and
only that one."""

from __future__ import annotations

import asyncio

from agent_runtime.runtime import AgentRuntime
from asymcache_core import SamplingParams
from tests.conftest import make_engine


def _count_closes(engine) -> list[int]:  # type: ignore[no-untyped-def]
    calls: list[int] = []
    original = engine.close
    engine.close = lambda: (calls.append(1), original())[1]
    return calls


def test_a_runtime_from_model_closes_its_engine(smollm) -> None:
    runtime = AgentRuntime.from_model("smollm2-135m", "asymcache", loaded=smollm, num_kv_blocks=64)
    calls = _count_closes(runtime.engine)
    runtime.close_sync()
    assert calls == [1] and runtime.closed


def test_a_runtime_over_a_given_engine_leaves_it_open(smollm) -> None:
    engine = make_engine(smollm, num_kv_blocks=64)
    calls = _count_closes(engine)
    runtime = AgentRuntime(engine, policy="asymcache")
    asyncio.run(runtime.close())
    assert calls == [] and runtime.closed
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids  # still usable by its owner
