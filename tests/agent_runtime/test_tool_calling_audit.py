"""Tool calling on ``/v1/chat/completions`` against vLLM 0.32's rules: ``tools`` and
``tool_choice`` checked against each other (400s naming the field), a Hermes call cut off by
``max_tokens`` or a stop never returned as content (streamed or not), and the chat history's
tool calls read as vLLM reads them (empty lists dropped, malformed arguments an empty object).

The reply-level tests drive :class:`ChatChunks` with scripted replies (SmolLM2 writes no
unconstrained call); the request-level ones run against the live server."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from agent_runtime.output_processor import OutputOptions, _parse
from agent_runtime.server.choices import ChatChunks
from agent_runtime.server.streamed_text import unparsed_call_start
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput
from tests.agent_runtime.live_server import MODEL, TOOLS, sse

NAMED = {"type": "function", "function": {"name": "read_file"}}
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "todo.md"}}\n</tool_call>'
#: where a cut call's head (``{"name": "read_file", "arguments": {``) is complete
HEAD = CALL.index('"path"')


def _event(text: str, finish: str | None, max_calls: int | None = None) -> StreamEvent:
    """One event of a scripted reply (``finish`` None: still running)."""
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finish_time=2.0)
    out = RequestOutput("r", [], [1] * len(text), text, finish is not None, finish, metrics, 4)
    parsed = None
    if finish is not None:
        parsed = _parse(text, OutputOptions(parse_format="hermes"))
        if max_calls is not None and parsed is not None:
            parsed = parsed.__class__(parsed.content, parsed.tool_calls[:max_calls])
    return StreamEvent(out, None, parsed, None)


def _chunks(**options: Any) -> ChatChunks:
    stream = SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3, 4])
    return ChatChunks(stream, 0, None, True, **options)  # type: ignore[arg-type]


def _reply(text: str, finish: str, steps: int = 7, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The streamed reply (its content, its calls rebuilt by index, its reason) and the body's
    choice, of ``text`` generated in ``steps`` pieces."""
    chunks = _chunks(**options)
    cuts = sorted({max(1, len(text) * k // steps) for k in range(1, steps)})
    events = [_event(text[:cut], None) for cut in cuts] + [_event(text, finish, options.get("max_tool_calls"))]
    content, calls, reason = "", {}, None
    for event in events:
        for choice in chunks.on_event(event):
            delta = choice.delta.model_dump(exclude_none=True)
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in piece:
                    assert call["id"] is None, "a call's id goes out once, on its first piece"
                    call.update(id=piece["id"], name=piece["function"]["name"], type=piece["type"])
                else:
                    assert "name" not in piece["function"], piece
                call["arguments"] += piece["function"].get("arguments") or ""
            reason = choice.finish_reason or reason
    body = _chunks(**options).final_choice(events[-1]).model_dump()
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "reason": reason}, body


# ----------------------------------------------------------------------------------------------
# A call cut off is never content
# ----------------------------------------------------------------------------------------------


def test_the_cut_off_rule_finds_only_a_call_the_parse_did_not_take() -> None:
    assert unparsed_call_start("Sure. <tool_call>") == 6
    assert unparsed_call_start('Sure. <tool_call>\n{"na') == 6
    assert unparsed_call_start("Sure. " + CALL[:HEAD + 4]) == 6
    # a whole call, prose naming the tag, a closed value that is no call: not cut off
    assert unparsed_call_start(CALL) is None
    assert unparsed_call_start("Use the <tool_call> tag like this.") is None
    assert unparsed_call_start('<tool_call>{"path": "a"}</tool_call> ok') is None
    # a call whose head a stream announced and the parse refused: cut, whatever closed it
    assert unparsed_call_start('ok <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> ok') == 3
    assert unparsed_call_start('<tool_call>{"name": "f", "arguments": {"a": 1}} and</tool_call>') == 0
    assert unparsed_call_start('<tool_call>{"name": "f", "arguments": {"a": </tool_call>') == 0
    # the tag inside a finished call's arguments is the call's text; a second call cut off is found
    quoted = '<tool_call>{"name": "w", "arguments": {"text": "<tool_call>{"}}</tool_call>'
    assert unparsed_call_start(quoted) is None
    assert unparsed_call_start(quoted + "\n<tool_call>\n{") == len(quoted) + 1


@pytest.mark.parametrize("cut", [len("<tool_call>"), len('<tool_call>\n{"na'), HEAD - 2, HEAD + 6])
def test_an_auto_call_cut_off_by_the_length_limit_is_not_content(cut: int) -> None:
    """vLLM's hermes parser streams the text before the tag and nothing of the markup (its
    non-streamed body returned the markup as content: not kept, the stream is the bar)."""
    text = "Sure. " + CALL[:cut]
    streamed, body = _reply(text, "length")
    assert streamed["content"] == "Sure. " and body["message"]["content"] == "Sure. "
    assert streamed["reason"] == body["finish_reason"] == "length"
    assert body["message"]["tool_calls"] == []
    # a call whose head was written went out as its pieces (vLLM's partial deltas), never more
    if cut > HEAD - 2:
        assert [c["name"] for c in streamed["calls"]] == ["read_file"]
        assert streamed["calls"][0]["arguments"] == CALL[HEAD - 1 : cut]
    else:
        assert streamed["calls"] == []


def test_a_call_cut_off_by_a_stop_is_not_content() -> None:
    streamed, body = _reply('Let me read it.\n<tool_call>\n{"name": "read_', "stop")
    assert streamed["content"] == body["message"]["content"] == "Let me read it.\n"
    assert streamed["reason"] == body["finish_reason"] == "stop" and streamed["calls"] == []


def test_a_second_call_cut_off_after_a_whole_one_is_not_content() -> None:
    text = "Reading.\n" + CALL + "\n" + CALL[: HEAD - 4]
    streamed, body = _reply(text, "length")
    assert "<tool_call>" not in streamed["content"] and "<tool_call>" not in (body["message"]["content"] or "")
    assert body["message"]["content"] == "Reading." and streamed["content"].strip() == "Reading."
    [call] = body["message"]["tool_calls"]
    assert call["function"] == {"name": "read_file", "arguments": '{"path": "todo.md"}'}
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("read_file", '{"path": "todo.md"}')]
    assert streamed["reason"] == body["finish_reason"] == "tool_calls"


def test_whole_and_malformed_calls_keep_their_rules() -> None:
    """A whole call is a call (reason ``tool_calls``); a tag that holds no call stays the text
    it was (vLLM's non-streamed body keeps it too), and the text before the first call is the
    content (vLLM's hermes parser drops what follows it)."""
    streamed, body = _reply("Reading.\n" + CALL + "\nDone.", "stop")
    assert body["finish_reason"] == streamed["reason"] == "tool_calls"
    assert body["message"]["content"] == streamed["content"].strip() == "Reading."
    assert json.loads(streamed["calls"][0]["arguments"]) == {"path": "todo.md"}
    assert streamed["calls"][0]["id"] == streamed["calls"][0]["id"].strip() and streamed["calls"][0]["type"] == "function"
    malformed = "<tool_call>not json</tool_call>"
    streamed, body = _reply(malformed, "stop")
    assert body["message"]["content"] == streamed["content"] == malformed and body["finish_reason"] == "stop"
    # plain text with no call at all is returned as written, unstripped
    streamed, body = _reply("  Paris is the capital.  ", "length")
    assert body["message"]["content"] == streamed["content"] == "  Paris is the capital.  "


def test_parallel_tool_calls_false_keeps_the_first_call_in_stream_and_body() -> None:
    text = CALL + "\n" + CALL.replace("todo.md", "notes.txt")
    streamed, body = _reply(text, "stop", max_tool_calls=1)
    assert [json.loads(c["arguments"]) for c in streamed["calls"]] == [{"path": "todo.md"}]
    assert [json.loads(c["function"]["arguments"]) for c in body["message"]["tool_calls"]] == [{"path": "todo.md"}]
    assert not streamed["content"].strip() and not body["message"]["content"]
    # both calls otherwise, each with its own id, at its own index
    streamed, body = _reply(text, "stop")
    ids = [c["id"] for c in streamed["calls"]] + [c["id"] for c in body["message"]["tool_calls"]]
    assert len(streamed["calls"]) == 2 and len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)


def test_a_named_tool_choice_ends_with_stop() -> None:
    """vLLM and OpenAI: a named tool_choice's call ends with ``stop``, ``auto`` /
    ``required`` calls with ``tool_calls``."""
    streamed, body = _reply(CALL, "stop", named_tool=True)
    assert streamed["reason"] == body["finish_reason"] == "stop"
    assert [c["name"] for c in streamed["calls"]] == [body["message"]["tool_calls"][0]["function"]["name"]]
    streamed, body = _reply(CALL, "stop", forced_tool=True)
    assert streamed["reason"] == body["finish_reason"] == "tool_calls"


# ----------------------------------------------------------------------------------------------
# The chat history's tool calls
# ----------------------------------------------------------------------------------------------

#: Llama 3.1's rule: a message with a ``tool_calls`` key renders exactly one call
LLAMA31_STYLE_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and 'tool_calls' in m %}"
    "{% if m.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls at once!') }}"
    "{% endif %}<|assistant|>{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments | tojson }})\n"
    "{% elif m.role == 'tool' %}<|ipython|>{{ m.content }}\n{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _renderer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from asymcache_core.chat_template import ChatRenderer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = LLAMA31_STYLE_TEMPLATE
    renderer = ChatRenderer(tok)
    assert renderer.native_tools
    return renderer


def test_a_reply_sent_back_as_it_came_renders_in_a_native_template() -> None:
    """A non-call reply carries ``"tool_calls": []`` (vLLM's body does too); a client that
    appends it to the history as it came must not break a template that reads the key."""
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Hello.", "refusal": None, "tool_calls": []},
               {"role": "user", "content": "Read todo.md"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "to'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Buy milk."}]}]
    text = _renderer().render(history, TOOLS)
    assert "<|assistant|>Hello.\n" in text
    # the cut-off call's partial arguments read as {} (vLLM's), the tool result's parts as text
    assert "<|assistant|>read_file({})\n<|ipython|>Buy milk.\n" in text


def test_a_cut_off_call_in_the_history_does_not_end_the_conversation(live) -> None:
    """A streamed call the length limit cut off reaches the client as partial arguments; the
    next turn carries it in its history, and is served (vLLM 0.32 reads it as ``{}``)."""
    body = {"model": MODEL, "tools": TOOLS, "tool_choice": NAMED, "temperature": 0,
            "messages": [{"role": "user", "content": "Read todo.md"}]}
    for limit in range(12, 30):  # the first limit that cuts the call inside its arguments
        events = sse(live, "/v1/chat/completions", {**body, "max_tokens": limit})
        pieces = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or []]
        arguments = "".join(p["function"].get("arguments") or "" for p in pieces)
        if arguments:
            break
    assert events[-1]["choices"][0]["finish_reason"] == "length" and pieces[0]["function"]["name"] == "read_file"
    first = pieces[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)
    history = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": first["id"], "type": "function", "function": {"name": first["function"]["name"], "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": first["id"], "content": "error: the call was cut off"}]
    r = httpx.post(live.base + "/v1/chat/completions", timeout=120, json={
        **body, "messages": history, "tool_choice": "auto", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    live.check()


# ----------------------------------------------------------------------------------------------
# tools and tool_choice checked against each other (vLLM 0.32's ChatCompletionRequest rules)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,param", [
    ({"tools": []}, "tools"),
    ({"tools": [], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_tool_fields_that_contradict_are_a_400_naming_the_field(live, fields: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        r = httpx.post(live.base + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert error["message"].startswith(param + ":"), error


@pytest.mark.parametrize("fields", [{}, {"tool_choice": "none"}, {"tool_choice": None}, {"tools": None},
                                    {"parallel_tool_calls": False}, {"tools": TOOLS, "tool_choice": "none"},
                                    {"tools": [*TOOLS, *TOOLS]}])  # a name given twice: vLLM does not check
def test_tool_fields_vllm_takes_are_served(live, fields: dict[str, Any]) -> None:
    r = httpx.post(live.base + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"] == [] and isinstance(message["content"], str)


def test_special_tokens_stay_in_the_text_while_hermes_calls_are_parsed(live) -> None:
    """vLLM's hermes parser turns ``skip_special_tokens`` off while tools may be called: a
    tokenizer that marks ``<tool_call>`` special (Hermes 2 Pro, Hermes 3) keeps its tags in the
    text the parser reads. SmolLM2's ``<|im_start|>`` (special, not a stop) shows it."""
    tokenizer = live.runtime.engine.tokenizer
    [start] = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert start in tokenizer.all_special_ids and start != tokenizer.eos_token_id
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            "allowed_token_ids": [start]}
    contents = {}
    for name, fields in (("auto", {"tools": TOOLS}), ("none", {"tools": TOOLS, "tool_choice": "none"}), ("no tools", {})):
        r = httpx.post(live.base + "/v1/chat/completions", json={**body, **fields}, timeout=120)
        assert r.status_code == 200, r.text
        contents[name] = r.json()["choices"][0]["message"]["content"]
    assert contents == {"auto": "<|im_start|><|im_start|>", "none": "", "no tools": ""}
