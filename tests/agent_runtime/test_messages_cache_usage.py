"""Messages ``usage``: the prompt as ``input_tokens`` + ``cache_creation_input_tokens`` (the
tokens the request wrote to the prefix cache) + ``cache_read_input_tokens`` (its hits), as vLLM's
``_build_anthropic_usage`` splits it, in the body and in a stream's ``message_start`` and
``message_delta``; and the same writes on the OpenAI routes that vLLM reports them on."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from agent_runtime.server.anthropic_replies import message_events, usage
from agent_runtime.server.completion_stream import usage_of
from agent_runtime.server.responses_output import usage as responses_usage
from agent_runtime.server.streamed_text import StreamedText
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput
from tests.agent_runtime.scripted_stream import ScriptedStream

PROMPT = 43  # tokens: hits 16, writes 16, 11 more


def _event(text: str, finished: bool) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.5, cached_tokens=16, cache_creation_tokens=16)
    out = RequestOutput("r", [], [1] * len(text), text, finished, "stop" if finished else None, metrics, PROMPT)
    return StreamEvent(out, None, None, None)


    def abort(self) -> None:
        raise AssertionError("a finished stream is not aborted")


def test_usage_splits_the_prompt_into_writes_reads_and_the_rest():
    events = [_event("Bl", False), _event("Blue", True)]
    want = {"input_tokens": 11, "cache_creation_input_tokens": 16, "cache_read_input_tokens": 16, "output_tokens": 4}
    assert usage(events[-1]) == want
    metrics = SimpleNamespace(observe=lambda ev: None, count_abort=lambda ev=None: None)

    async def collect() -> list[dict[str, Any]]:
        frames = message_events(ScriptedStream(events, PROMPT), "msg_r", "m", StreamedText(True), metrics)  # type: ignore[arg-type]
        return [json.loads(f.split("data: ", 1)[1]) async for f in frames]

    sent = {ev["type"]: ev for ev in asyncio.run(collect())}
    # the start already has the prompt's split (both counts are fixed by the first token)
    assert sent["message_start"]["message"]["usage"] == {**want, "output_tokens": 0}
    assert sent["message_delta"]["usage"] == want


def test_openai_routes_report_the_writes_where_vllm_does():
    """vLLM's ``_make_prompt_tokens_details``: chat has ``created_cache_tokens`` beside
    ``cached_tokens``, completions only ``cached_tokens``; Responses' ``input_tokens_details``
    has ``cache_write_tokens`` (``InputTokensDetails``)."""
    finals = [_event("Blue", True), _event("Red", True)]  # n=2: one prompt, counted once
    chat = usage_of(finals, 2, cache_writes=True).model_dump()
    assert chat["prompt_tokens_details"] == {"cached_tokens": 16, "created_cache_tokens": 16}
    assert chat["prompt_tokens"] == PROMPT and chat["completion_tokens"] == 7
    assert usage_of(finals, 2).model_dump()["prompt_tokens_details"] == {"cached_tokens": 16}
    assert responses_usage(finals[0])["input_tokens_details"] == {"cached_tokens": 16, "cache_write_tokens": 16}
