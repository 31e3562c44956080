"""Reasoning tokens in usage, as vLLM 0.32 reports them with a reasoning parser: the chat's
``completion_tokens_details.reasoning_tokens`` (body, ``continuous_usage_stats`` chunks, final
usage chunk), left out without a parser and on the completions route; counted from the output
token ids as the parsers' ``count_reasoning_tokens`` do (the block's tokens, its tags left out).
No model is loaded: the streams are scripted."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from agent_runtime.reasoning import ReasoningCount, reasoning_tokens, reply_parser
from agent_runtime.server.choices import ChatChunks
from agent_runtime.server.completion_stream import (
    CHAT,
    UsageReport,
    reasoning_counters,
    sse_events,
    usage_of,
)
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput
from tests.agent_runtime.scripted_stream import ScriptedStream

PIECES = ["<think>", "The", " sky", "</think>", "Blue", ".", "Red"]
THOUGHT = [0, 1, 2, 3, 4, 5]  # <think>The sky</think>Blue.
PLAIN = [6, 5]  # Red.
PROMPT = 5


def _decode(ids: Any) -> str:
    return "".join(PIECES[i] for i in ids)


def _event(ids: list[int], finished: bool) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=1.5)
    out = RequestOutput("r", ids[-1:], list(ids), _decode(ids), finished, "stop" if finished else None, metrics,
                        PROMPT)
    return StreamEvent(out, None, None, None)


def _events(ids: list[int]) -> list[StreamEvent]:
    return [_event(ids[: k + 1], k == len(ids) - 1) for k in range(len(ids))]


def test_the_block_is_counted_without_its_tags():
    # NOTE: vLLM's BaseThinkingReasoningParser.count_reasoning_tokens: the tokens between
    # <think> and </think>; the tags are not reasoning tokens
    assert reasoning_tokens(_decode(THOUGHT), THOUGHT, "qwen3", _decode) == 2
    assert reasoning_tokens(_decode(THOUGHT), THOUGHT, "deepseek_r1", _decode) == 2
    assert reasoning_tokens(_decode(THOUGHT[:3]), THOUGHT[:3], "qwen3", _decode) == 2  # still open: all but <think>
    # R1's template may open the block in the prompt: the reply's tokens up to </think>
    assert reasoning_tokens(_decode(THOUGHT[1:]), THOUGHT[1:], "deepseek_r1", _decode) == 2
    # no tags: qwen3 (thinking on) starts in its thinking, as R1: all of it; thinking off: 0
    assert reasoning_tokens(_decode(PLAIN), PLAIN, "qwen3", _decode) == 2
    off = reply_parser("qwen3", {"enable_thinking": False})
    assert reasoning_tokens(_decode(PLAIN), PLAIN, off, _decode) == 0
    # no parser or no tokenizer: 0
    assert reasoning_tokens(_decode(THOUGHT), THOUGHT, None, _decode) == 0
    assert reasoning_tokens(_decode(THOUGHT), THOUGHT, "qwen3", None) == 0


def test_a_growing_reply_is_counted_as_it_grows():
    counter = ReasoningCount("qwen3", _decode)
    counts = [counter.count(_decode(THOUGHT[: k + 1]), THOUGHT[: k + 1]) for k in range(len(THOUGHT))]
    assert counts == [0, 1, 2, 2, 2, 2]


def test_chat_usage_has_the_choices_reasoning_summed_only_with_a_parser():
    finals = [_events(THOUGHT)[-1], _events(PLAIN)[-1]]  # n=2
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=_decode))
    counters = reasoning_counters(engine, "qwen3", 2)
    body = usage_of(finals, 2, cache_writes=True, reasoning=counters).model_dump()
    assert body["completion_tokens_details"] == {"reasoning_tokens": 4}  # PLAIN: never closed, all thinking
    assert body["completion_tokens"] == 8 and body["prompt_tokens"] == PROMPT
    # no reasoning parser (and the completions route): the field is left out, as vLLM's
    assert reasoning_counters(engine, None, 2) is None
    assert "completion_tokens_details" not in usage_of(finals, 2, cache_writes=True).model_dump()
    # a continued message is not split: 0, still reported
    unsplit = reasoning_counters(engine, "qwen3", 2, split=False)
    assert usage_of(finals, 2, reasoning=unsplit).model_dump()["completion_tokens_details"] == {"reasoning_tokens": 0}


def _stream(parser: str | None, continuous: bool) -> list[dict[str, Any]]:
    chunks = [ChatChunks(ScriptedStream(_events(ids), PROMPT), i, None, False, reasoning_parser=parser)  # type: ignore[arg-type]
              for i, ids in enumerate([THOUGHT, PLAIN])]
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=_decode))
    report = UsageReport(True, continuous, 2, reasoning_counters(engine, parser, 2))
    metrics = SimpleNamespace(observe=lambda *a, **k: None, observe_choices=lambda *a: None,
                              count_abort=lambda *a: None)

    async def collect() -> list[dict[str, Any]]:
        frames = sse_events(chunks, CHAT, "chatcmpl-r", "m", report, metrics)  # type: ignore[arg-type]
        return [json.loads(f[len("data: "):]) async for f in frames if f != "data: [DONE]\n\n"]

    return asyncio.run(collect())


def test_stream_chunks_carry_the_reasoning_so_far_and_the_final_chunk_the_sum():
    chunks = _stream("qwen3", continuous=True)
    *running, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    # every running usage has the choice's count so far (0 on the opening chunks), never more
    # than its tokens so far
    by_choice: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for chunk in running:
        usage = chunk["usage"]
        by_choice[chunk["choices"][0]["index"]].append(
            (usage["completion_tokens_details"]["reasoning_tokens"], usage["completion_tokens"]))
    assert by_choice[0][0] == (0, 0) and by_choice[0][-1] == (2, 6)
    assert all(r <= c for r, c in by_choice[0]) and sorted(by_choice[0]) == by_choice[0]
    assert by_choice[1][-1] == (2, 2)  # never closed: all thinking
    # only the final usage chunk: the sum there, the other chunks' usage null
    *running, final = _stream("qwen3", continuous=False)
    assert all(c["usage"] is None for c in running)
    assert final["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_stream_without_a_reasoning_parser_leaves_the_details_out():
    for chunk in _stream(None, continuous=True):
        assert "completion_tokens_details" not in chunk["usage"]
