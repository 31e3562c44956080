"""Fixtures shared by the agent_runtime tests: the live server over the real SmolLM2 (``live``),
and the official openai client pointed at it (``oa``); both one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, Live, serving
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def live(smollm) -> Iterator[Live]:
    engine = make_engine(smollm, max_model_len=1024, **resolve_preset("continuum").engine_overrides)
    runtime = AgentRuntime(engine, policy="continuum")
    try:
        with serving(create_app(runtime, MODEL)) as base:
            yield Live(base, runtime)
    finally:
        runtime.close_sync()


@pytest.fixture(scope="module")
def oa(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=120)
