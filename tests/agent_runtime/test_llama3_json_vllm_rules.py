"""Llama 3.1+'s tool calls (``llama3_json``) against vLLM 0.32's ``llama3_json`` parser
(``vllm/tool_parsers/llama_tool_parser.py``: ``Llama3JsonToolParser.extract_tool_calls`` and
``extract_tool_calls_streaming``), streamed and not, on scripted replies (no model is loaded):

* a call is an object with a ``name`` and ``arguments`` (else ``parameters``), anywhere in the
  reply, several joined by anything (``;``); any other ``{`` makes the whole reply text, as
  written;
* with calls, the content is the text before the first (vLLM's non-streamed content is empty,
  its stream sends that text as content): the stream and the body agree;
* a stream holds the text from the first ``{`` while the reply may be calls, and lets it go as
  soon as it cannot be (code, prose with braces).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest

from agent_runtime.output_processor import OutputOptions, _parse
from agent_runtime.server.choices import ChatChunks
from agent_runtime.server.streamed_text import safe_text_len
from agent_runtime.types import StreamEvent
from asymcache_core.llama3_calls import Llama3JsonHold, parse_llama3_json
from asymcache_core.request import RequestMetrics, RequestOutput
from asymcache_core.tool_parsing import parse_tool_calls

CALL = '{"name": "read_file", "parameters": {"path": "todo.md"}}'
CALL2 = '{"name": "grep", "arguments": {"pattern": "x{2}", "path": "."}}'


def _event(text: str, finish: str | None) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finish_time=2.0)
    out = RequestOutput("r", [], [1] * len(text), text, finish is not None, finish, metrics, 4)
    parsed = _parse(text, OutputOptions(parse_format="llama3_json")) if finish is not None else None
    return StreamEvent(out, None, parsed, None)


def _chunks() -> ChatChunks:
    stream = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3, 4])
    return ChatChunks(stream, 0, None, True, call_format="llama3_json")  # type: ignore[arg-type]


def _reply(text: str, finish: str = "stop") -> tuple[dict[str, Any], dict[str, Any]]:
    """The streamed reply of ``text`` generated a character at a time (content sent before the
    end, all content, calls rebuilt by index, reason) and the body's choice."""
    chunks, early, content, calls, reason = _chunks(), "", "", {}, None
    events = [_event(text[:cut], None) for cut in range(1, len(text))] + [_event(text, finish)]
    for event in events:
        for choice in chunks.on_event(event):
            delta = choice.delta.model_dump(exclude_none=True)
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
                call["name"] = piece["function"].get("name") or call["name"]
                call["arguments"] += piece["function"].get("arguments") or ""
            reason = choice.finish_reason or reason
        if not event.output.finished:
            early = content
    body = _chunks().final_choice(events[-1]).model_dump()
    streamed = {"early": early, "content": content, "calls": [calls[i] for i in sorted(calls)], "reason": reason}
    return streamed, body


def _calls(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in body["message"]["tool_calls"] or []]


def test_calls_anywhere_in_the_reply_are_read_and_what_counts_as_one() -> None:
    msg = parse_llama3_json("Let me look.\n" + CALL + "; " + CALL2 + "\nDone.")
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("read_file", {"path": "todo.md"}), ("grep", {"pattern": "x{2}", "path": "."})]
    assert msg.content == "Let me look."  # the text before the first call; between and after: dropped
    # a python tag, a list, blanks lead the calls: no content
    for lead in ("<|python_tag|>", "[", " <|python_tag|> [ ", "\n"):
        msg = parse_llama3_json(lead + CALL + ", " + CALL2 + ("]" if "[" in lead else ""))
        assert [c.name for c in msg.tool_calls] == ["read_file", "grep"] and msg.content == "", lead
    # arguments before parameters; any JSON value is the arguments, as vLLM writes them out
    both = parse_llama3_json('{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}').tool_calls[0]
    assert both.arguments == {"b": 2} and both.arguments_json() == '{"b": 2}'
    odd = parse_llama3_json('{"name": "f", "parameters": "{\\"a\\": 1}"} {"name": "g", "arguments": null}').tool_calls
    assert [c.arguments_json() for c in odd] == ['"{\\"a\\": 1}"', "null"] and odd[0].arguments == {"a": 1}
    assert parse_llama3_json('{"name": "f", "parameters": {"s": "é"}}').tool_calls[0].arguments_json() == '{"s": "é"}'
    # the model's own "id" is not the call's
    assert parse_llama3_json('{"id": "mine", "name": "f", "parameters": {}}').tool_calls[0].id != "mine"


@pytest.mark.parametrize("text", [
    '{"name": "f"}',  # no arguments or parameters
    '{"function": {"name": "f", "arguments": {}}}',  # OpenAI's wrapper: no name at the top
    '{"name": 3, "parameters": {}}',
    '{"name": "", "parameters": {}}',
    CALL + " then {braces}",  # a later { that opens no JSON object
    'Use {x} first. ' + CALL,  # an earlier one
    CALL + '; {"answer": 4}',  # a later object that is no call
    CALL + "; " + CALL2[:-3],  # a later call cut off
    "  plain words\n",
    "",
])
def test_any_brace_that_is_no_call_makes_the_whole_reply_text(text: str) -> None:
    msg = parse_tool_calls(text, "llama3_json")
    assert msg.tool_calls == [] and msg.content == text  # vLLM's content: the reply as written


@pytest.mark.parametrize("text", [
    CALL,
    "<|python_tag|>" + CALL + "; " + CALL2,
    "Sure, reading it now: " + CALL,
    "I will read it.\n\n[" + CALL + ", " + CALL2 + "]\nand grep.",
    "Sure, here is code:\nint main() { return 0; }\nDone.",
    "JSON: " + CALL + ' and {"answer": 4}',
    'A set {1, 2} and ' + CALL,
    "<|python_tag|> plain after all",
    CALL + CALL,  # vLLM reads on past the "{" right at a call's end: no calls
])
def test_the_stream_and_the_body_agree(text: str) -> None:
    streamed, body = _reply(text)
    parsed = parse_llama3_json(text)
    assert _calls(body) == [(c.name, c.arguments_json()) for c in parsed.tool_calls]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == _calls(body)
    assert streamed["content"] == (body["message"]["content"] or "")
    assert streamed["reason"] == body["finish_reason"] == ("tool_calls" if parsed.tool_calls else "stop")
    if parsed.tool_calls:
        assert body["message"]["content"] == (parsed.content or None)
        # what went out before the end is the text before the first call, nothing of the calls
        assert streamed["early"] == streamed["content"] or streamed["content"].startswith(streamed["early"])
        assert "{" not in streamed["content"]
    else:
        assert body["message"]["content"] == text


def test_random_replies_stream_as_the_body_says() -> None:
    pieces = ["{", "}", "[", "]", '"name"', '"parameters"', ":", ",", ";", " ", '"f"', "\n", "Sure", "x", "null",
              "<|python_tag|>", '{"a": 1}', CALL, CALL2, '"{"', '"', '{"name": "f", "arguments": ']
    rng = random.Random(5)
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        for finish in ("stop", "length"):
            streamed, body = _reply(text, finish)
            assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == _calls(body), text
            assert streamed["content"].strip() == (body["message"]["content"] or "").strip(), text
            assert streamed["reason"] == body["finish_reason"], text


def test_text_that_cannot_be_calls_streams_before_the_end() -> None:
    code = "Here:\nint main() { return 0; }\nand more words"
    assert _reply(code)[0]["early"] == code[:-1]  # all but the last character, sent as it came
    # a complete object that is no call: the reply is text from then on
    data = 'The config is {"debug": true} and that is all'
    assert _reply(data)[0]["early"] == data[:-1]
    # while a { may still open a call, the text from it on is held
    streamed, _ = _reply("Sure: " + CALL)
    assert streamed["early"] == "Sure:" and streamed["content"] == "Sure:"


def test_a_call_cut_off_by_the_length_limit_is_not_content() -> None:
    text = "Sure. " + CALL[:30]
    streamed, body = _reply(text, "length")
    assert streamed["content"] == body["message"]["content"] == "Sure."
    assert streamed["calls"] == [] and body["message"]["tool_calls"] == []
    assert streamed["reason"] == body["finish_reason"] == "length"


def test_the_hold_reads_the_reply_as_it_grows() -> None:
    hold, text = Llama3JsonHold(), "Ok <|python_tag|>" + CALL
    sent = [hold.safe_len(text[:k], k) for k in range(len(text) + 1)]
    assert sent == sorted(sent) and max(sent) == len("Ok")
    assert safe_text_len("Ok <|pyt", True, "llama3_json") == len("Ok")
    assert safe_text_len("Ok [ ", True, "llama3_json") == len("Ok")
    assert safe_text_len("Ok [1, 2]", True, "llama3_json") == len("Ok [1, 2]")
    assert safe_text_len("f() {\n  return", True, "llama3_json") == len("f() {\n  return")
    assert safe_text_len('x {"na', True, "llama3_json") == len("x")
    assert safe_text_len('x {"na', False, "llama3_json") == len('x {"na')


def test_the_runtime_reads_the_same_calls() -> None:
    msg = parse_tool_calls("Reading.\n" + CALL, "llama3_json")
    assert msg.to_openai_message()["content"] == "Reading."
    assert json.loads(msg.to_openai_message()["tool_calls"][0]["function"]["arguments"]) == {"path": "todo.md"}
