"""Hermes tool-call output against vLLM 0.32's hermes parser (``extract_tool_calls`` and
``extract_tool_calls_streaming``) and its Messages route (``_to_anthropic_stop_reason``,
``_build_anthropic_usage``), streamed and not, on scripted replies (no model is loaded):

* the content of a reply with calls is the text before the first ``<tool_call>``; text between
  and after calls is dropped, as vLLM drops it;
* a call whose head a stream announced and the parse refused (malformed JSON after its name) is
  no call and no content in either form, and the reply's reason is the engine's;
* any non-empty name is a call's, in the request's tools or not, and a tool's;
* Messages: the length limit is ``max_tokens`` even after complete calls, ``usage`` splits the
  prompt into ``input_tokens``, ``cache_creation_input_tokens`` and ``cache_read_input_tokens``,
  ``temperature`` is vLLM's 0..2.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from agent_runtime.constrained import tool_call_grammar, tool_call_json_schema
from agent_runtime.output_processor import OutputOptions, _parse, build_turn
from agent_runtime.protocol import normalize_tools
from agent_runtime.server.anthropic_messages import MessagesRequest
from agent_runtime.server.anthropic_replies import (
    content_blocks,
    message_events,
    stop_reason,
    usage,
)
from agent_runtime.server.streamed_text import StreamedText, without_cut_off_call
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput
from asymcache_core.tool_call_stream import HermesCallStream
from tests.agent_runtime.scripted_stream import ScriptedStream
from tests.agent_runtime.test_tool_calling_audit import CALL, _reply

#: a call whose head is complete and whose object is not JSON (a key without a value after it)
BROKEN = '<tool_call>\n{"name": "read_file", "arguments": {"path": "todo.md"}, "oops"}\n</tool_call>'


def test_text_between_and_after_calls_is_not_content() -> None:
    text = "Reading both.\n" + CALL + "\nand then\n" + CALL.replace("todo.md", "notes.txt") + "\nDone."
    streamed, body = _reply(text, "stop")
    assert body["message"]["content"] == streamed["content"].strip() == "Reading both."
    assert [json.loads(c["function"]["arguments"]) for c in body["message"]["tool_calls"]] == [
        {"path": "todo.md"}, {"path": "notes.txt"}]
    assert [json.loads(c["arguments"]) for c in streamed["calls"]] == [{"path": "todo.md"}, {"path": "notes.txt"}]
    assert streamed["reason"] == body["finish_reason"] == "tool_calls"
    # nothing before the call: no content (null), streamed or not
    streamed, body = _reply(CALL + "\nDone.", "stop")
    assert body["message"]["content"] is None and streamed["content"] == ""


@pytest.mark.parametrize("after", ["", "\nSorry, let me retry.", '\n<tool_call>\n{"name": "read_file"'])
def test_a_malformed_call_after_its_name_went_out_is_neither_call_nor_content(after: str) -> None:
    """vLLM streams the name and arguments of such a call and returns the whole markup as the
    non-streamed content: here neither form holds the markup; the stream's call pieces cannot be
    taken back, and both end with the engine's reason (no call a client could run)."""
    streamed, body = _reply("Let me read it.\n" + BROKEN + after, "stop")
    # no call: the text as written up to the markup, as the stream sent it
    assert body["message"]["content"] == streamed["content"] == "Let me read it.\n"
    assert body["message"]["tool_calls"] == []
    assert streamed["reason"] == body["finish_reason"] == "stop"
    assert [c["name"] for c in streamed["calls"]][:1] == ["read_file"]
    # invalid JSON inside the arguments (the object closes, the value does not parse)
    streamed, body = _reply('Ok.\n<tool_call>\n{"name": "read_file", "arguments": {"path": todo.md}}\n</tool_call>',
                            "stop")
    assert body["message"]["content"] == streamed["content"] == "Ok.\n"
    assert body["message"]["tool_calls"] == [] and streamed["reason"] == body["finish_reason"] == "stop"


def test_a_malformed_call_before_a_whole_one_leaves_the_whole_one() -> None:
    streamed, body = _reply("Try.\n" + BROKEN + "\n" + CALL, "stop")
    assert body["message"]["content"] == streamed["content"].strip() == "Try."
    [call] = body["message"]["tool_calls"]
    assert streamed["calls"][-1]["arguments"] == call["function"]["arguments"] == '{"path": "todo.md"}'
    assert streamed["reason"] == body["finish_reason"] == "tool_calls"


def test_a_tag_that_holds_no_call_is_text() -> None:
    for text in ('See <tool_call>{"path": "a"}</tool_call> here.', "Use the <tool_call> tag.",
                 '<tool_call>{"name": "", "arguments": {}}</tool_call> empty'):
        streamed, body = _reply(text, "stop")
        assert body["message"]["content"] == streamed["content"] == text and streamed["calls"] == []
    # an empty name is no call: the stream does not announce one the parse refuses
    assert HermesCallStream().feed('<tool_call>{"name": "", "arguments": {"a": 1}}</tool_call>') == []


@pytest.mark.parametrize("name", ["get.weather", "ns:tool/x", "mcp__srv__a-b", "x" * 100, "météo", 'a "quoted" b',
                                  "not_in_the_tools"])
def test_any_name_is_a_calls_name(name: str) -> None:
    """vLLM's parsers take the name as written, in the request's tools or not."""
    text = "<tool_call>\n" + json.dumps({"name": name, "arguments": {"k": 1}}) + "\n</tool_call>"
    streamed, body = _reply(text, "stop")
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == [c["name"] for c in streamed["calls"]] == [
        name]


# ----------------------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------------------


def _event(text: str, finish: str | None, cached: int = 0) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finish_time=2.0,
                             cached_tokens=cached)
    out = RequestOutput("r", [], [1] * len(text), text, finish is not None, finish, metrics, 40)
    parsed = _parse(text, OutputOptions(parse_format="hermes")) if finish is not None else None
    return StreamEvent(out, None, parsed, None)


    def abort(self) -> None:
        raise AssertionError("a finished stream is not aborted")


def _messages_reply(text: str, finish: str, steps: int = 6) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Messages body and the streamed message (blocks rebuilt from the events, its stop
    reason and usage) of ``text`` generated in ``steps`` pieces."""
    cuts = sorted({max(1, len(text) * k // steps) for k in range(1, steps)})
    events = [_event(text[:c], None, 32) for c in cuts] + [_event(text, finish, 32)]
    final = events[-1]
    turn = build_turn(ScriptedStream(events, 40), final)  # type: ignore[arg-type]
    kept = without_cut_off_call(turn.message.get("content") or "", finish == "length", True)
    body = {"content": content_blocks(turn, kept), "stop_reason": stop_reason(turn, final)[0], "usage": usage(final)}
    metrics = SimpleNamespace(observe=lambda ev: None, count_abort=lambda ev=None: None)

    async def collect() -> list[dict[str, Any]]:
        frames = message_events(ScriptedStream(events, 40), "msg_r", "m", StreamedText(True), metrics,  # type: ignore[arg-type]
                                HermesCallStream())
        return [json.loads(f.split("data: ", 1)[1]) async for f in frames]

    blocks: list[dict[str, Any]] = []
    streamed: dict[str, Any] = {"content": blocks}
    for ev in asyncio.run(collect()):
        if ev["type"] == "content_block_start":
            blocks.append({**ev["content_block"], "partial": ""})
        elif ev["type"] == "content_block_delta":
            delta = ev["delta"]
            if delta["type"] == "text_delta":
                blocks[ev["index"]]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                blocks[ev["index"]]["partial"] += delta["partial_json"]
        elif ev["type"] == "message_delta":
            streamed.update(stop_reason=ev["delta"]["stop_reason"], usage=ev["usage"])
        elif ev["type"] == "message_start":
            streamed["start_usage"] = ev["message"]["usage"]
    return body, streamed


def test_messages_the_length_limit_is_max_tokens_after_complete_calls_too() -> None:
    """vLLM's ``_to_anthropic_stop_reason`` (and Anthropic's API): ``max_tokens`` always wins; a
    call the limit cut short must not run as ``tool_use``."""
    body, streamed = _messages_reply("Reading.\n" + CALL + "\n" + CALL[:30], "length")
    assert body["stop_reason"] == streamed["stop_reason"] == "max_tokens"
    assert [b["type"] for b in body["content"]] == [b["type"] for b in streamed["content"]] == ["text", "tool_use"]
    assert body["content"][0]["text"] == streamed["content"][0]["text"].strip() == "Reading."
    assert json.loads(streamed["content"][1]["partial"]) == body["content"][1]["input"] == {"path": "todo.md"}
    # the limit inside the only call: max_tokens, the text before it, no tool_use block in the body
    body, streamed = _messages_reply("Reading.\n" + CALL[:50], "length")
    assert body["stop_reason"] == streamed["stop_reason"] == "max_tokens"
    assert [b["type"] for b in body["content"]] == ["text"] and body["content"][0]["text"] == "Reading.\n"
    # a whole call that stopped is tool_use; text after it is no block
    body, streamed = _messages_reply("Reading.\n" + CALL + "\nDone.", "stop")
    assert body["stop_reason"] == streamed["stop_reason"] == "tool_use"
    assert [b["type"] for b in body["content"]] == [b["type"] for b in streamed["content"]] == ["text", "tool_use"]
    assert "Done." not in json.dumps(body) + json.dumps(streamed)


def test_messages_a_malformed_call_is_no_tool_use_and_no_text() -> None:
    body, streamed = _messages_reply("Let me read it.\n" + BROKEN + "\nMore.", "stop")
    assert body["stop_reason"] == streamed["stop_reason"] == "end_turn"
    assert body["content"] == [{"type": "text", "text": "Let me read it.\n"}]
    assert streamed["content"][0] == {"type": "text", "text": "Let me read it.\n", "partial": ""}
    assert "More." not in json.dumps(streamed)


def test_messages_usage_reports_the_cache_reads_and_writes() -> None:
    """``cache_read_input_tokens`` is the prompt's cached share, ``cache_creation_input_tokens``
    what it wrote to the cache (none here), ``input_tokens`` the rest (vLLM's
    ``_build_anthropic_usage``; more in ``test_messages_cache_usage``)."""
    body, streamed = _messages_reply("Hello there.", "stop")
    assert body["usage"] == streamed["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0,
                                                  "cache_read_input_tokens": 32, "output_tokens": len("Hello there.")}
    assert streamed["start_usage"] == {**body["usage"], "output_tokens": 0}


def test_messages_temperature_is_vllms_range() -> None:
    """vLLM's Messages route passes ``temperature`` to its sampling parameters, which take 0..2
    (Anthropic documents 0..1; vLLM serves 1..2 too)."""
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for value in (0, 1, 1.5, 2):
        assert MessagesRequest.model_validate({**base, "temperature": value}).temperature == value
    for value in (-0.1, 2.5, "1"):
        with pytest.raises(ValidationError, match="temperature"):
            MessagesRequest.model_validate({**base, "temperature": value})


def test_any_non_empty_tool_name_is_served() -> None:
    """vLLM takes a client's tool by any name (its ``FunctionDefinition.name`` is a plain str):
    dotted MCP names, slashes, spaces, long ones; a forced call's grammar reaches the tool's
    ``$defs`` whatever its name (a JSON pointer escapes ``/`` and ``~``)."""
    names = ["mcp.github.create_issue", "ns/tool~1", "get weather", "x" * 100]
    defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
            "$defs": {"P": {"type": "integer"}}}
    tools = normalize_tools([{"type": "function", "function": {"name": n, "parameters": defs}} for n in names])
    assert [t["function"]["name"] for t in tools] == names
    schema = tool_call_json_schema(tools, {"type": "function", "function": {"name": "ns/tool~1"}})
    assert schema["properties"]["arguments"]["properties"]["p"] == {"$ref": "#/$defs/ns~1tool~01__P"}
    tool_call_grammar(schema)  # compiles: the reference resolves
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name: must be a non-empty string"):
        normalize_tools([{"type": "function", "function": {"name": ""}}])
