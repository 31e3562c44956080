"""The ``qwen3`` reasoning parser as vLLM 0.32's ``Qwen3Parser`` state machine reads a reply
(``vllm/parser/qwen3.py`` ``qwen3_config``): in its thinking from the start while the template's
``enable_thinking`` is on (Qwen3-*-Thinking-2507 writes ``<think>`` into the prompt), ``<think>``
absorbed, ``</think>`` or a ``<tool_call>`` ending it, a duplicate ``</think>`` dropped, all
content with thinking off; streamed and not, and counted alike. No model is loaded."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from agent_runtime.output_processor import OutputOptions, _parse
from agent_runtime.reasoning import ReasoningCount, reply_parser, split_reasoning
from agent_runtime.runtime_chat import ChatTurns
from agent_runtime.server.choices import ChatChunks
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'

#: reply -> (reasoning, content), as vLLM's Qwen3ParserReasoningAdapter.extract_reasoning reads
#: it with thinking on (its empty content is None; ours "")
CASES = {
    "<think>a</think>b": ("a", "b"),
    "I should answer.</think>\n\nBlue.": ("I should answer.", "\n\nBlue."),  # Thinking-2507
    "still thinking": ("still thinking", ""),  # cut by the length limit
    "<think>\n\n</think>\n\nhi": ("\n\n", "\n\nhi"),
    "x<think>y</think>z": ("xy", "z"),  # <think> absorbed while thinking
    "a</think>b</think>c": ("a", "bc"),  # a duplicate </think> dropped
    "a</think>b<think>c</think>d": ("a", "b<think>cd"),  # <think> in the content stays
    "  <think>a</think>b": ("  a", "b"),
    "</think>b": (None, "b"),
    "": (None, ""),
    "look" + CALL: ("look", CALL),  # the call ends the thinking and is content
    "look</think>" + CALL: ("look", CALL),
}


@pytest.mark.parametrize("text", list(CASES))
def test_the_split_is_vllms(text: str) -> None:
    assert split_reasoning(text, "qwen3") == CASES[text]


def test_enable_thinking_picks_the_parser_per_request() -> None:
    assert reply_parser("qwen3", None) == reply_parser("qwen3", {"enable_thinking": True}) == "qwen3"
    assert reply_parser("qwen3", {"enable_thinking": False}) is None  # all content, as generated
    assert reply_parser("deepseek_r1", {"enable_thinking": False}) == "deepseek_r1"
    assert reply_parser(None, None) is None
    # the runtime's defaults under the request's own; a continued message is never split
    rt: Any = SimpleNamespace(reasoning_parser="qwen3", templates=SimpleNamespace(default_kwargs={"enable_thinking": False}))
    assert ChatTurns.reply_reasoning_parser(rt, False, None) is None
    assert ChatTurns.reply_reasoning_parser(rt, False, {"enable_thinking": True}) == "qwen3"
    assert ChatTurns.reply_reasoning_parser(rt, True, {"enable_thinking": True}) is None
    rt.templates = None
    assert ChatTurns.reply_reasoning_parser(rt, False, {"reasoning_effort": "low"}) == "qwen3"


def _event(text: str, parser: str | None, finished: bool) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finish_time=2.0)
    out = RequestOutput("r", [], [1] * len(text), text, finished, "stop" if finished else None, metrics, 4)
    parsed = _parse(text, OutputOptions(parse_format="hermes", reasoning_parser=parser)) if finished else None  # type: ignore[arg-type]
    return StreamEvent(out, None, parsed, None)


def _streamed(text: str, parser: str | None) -> tuple[str, str, list[dict[str, Any]]]:
    """The reasoning, content and tool-call pieces of a chat stream of ``text``, a character an event."""
    chunks = ChatChunks(SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3, 4]), 0, None, True,  # type: ignore[arg-type]
                        reasoning_parser=parser)
    deltas = [choice.delta.model_dump() for k in range(1, len(text) + 1)
              for choice in chunks.on_event(_event(text[:k], parser, finished=k == len(text)))]
    return ("".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            [tc for d in deltas for tc in d.get("tool_calls") or []])


@pytest.mark.parametrize("text", [t for t in CASES if t and "<tool_call>" not in t])
def test_the_stream_joins_to_the_split(text: str) -> None:
    reasoning, content = CASES[text]
    assert _streamed(text, "qwen3")[:2] == (reasoning or "", content)


def test_a_call_straight_out_of_the_thinking_is_a_call() -> None:
    text = "I'll read it." + CALL
    parsed = _event(text, "qwen3", True).parsed
    assert parsed is not None and parsed.reasoning == "I'll read it." and not parsed.content
    assert [(c.name, json.loads(c.arguments_json())) for c in parsed.tool_calls] == [("read_file", {"path": "a"})]
    reasoning, content, calls = _streamed(text, "qwen3")
    assert reasoning == "I'll read it." and not content.strip()
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["read_file"]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"path": "a"}


def test_thinking_off_is_all_content_streamed_or_not() -> None:
    off = reply_parser("qwen3", {"enable_thinking": False})
    for text in ("Blue.", "a</think>b", "<think>\n\n</think>\n\nhi"):
        assert _streamed(text, off)[:2] == ("", text)
        parsed = _event(text, off, True).parsed
        assert parsed is not None and parsed.reasoning is None and parsed.content == text


PIECES = ["<think>", "Hm", "</think>", "Blue", ".", "<tool_call>", "x", "</tool_call>", " ok"]


def _decode(ids: Any) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize(("ids", "expected"), [
    ([1, 2, 3, 4], 1),  # Thinking-2507: no <think>, the reply's tokens up to </think>
    ([0, 1, 2, 3], 1),
    ([1, 1, 5, 6, 7], 2),  # the call ends the thinking
    ([1, 2, 3, 2, 8], 1),  # a duplicate </think> is content, not thinking
    ([1, 0, 1], 2),  # never closed: all but the tags
])
def test_the_count_is_the_split_span(ids: list[int], expected: int) -> None:
    assert ReasoningCount("qwen3", _decode).count(_decode(ids), ids) == expected
    assert ReasoningCount(reply_parser("qwen3", {"enable_thinking": False}), _decode).count(_decode(ids), ids) == 0
