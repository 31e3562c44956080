"""Reasoning models' thinking split off the reply (vLLM's ``--reasoning-parser``): the parsers,
the streamed chat deltas, and the server with the real SmolLM2."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from agent_runtime.output_processor import OutputOptions, _parse
from agent_runtime.reasoning import split_reasoning, stream_split
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.choices import ChatChunks
from agent_runtime.types import StreamEvent
from asymcache_core.request import RequestMetrics, RequestOutput
from tests.agent_runtime.live_server import MODEL, serving
from tests.conftest import make_engine

#: greedy defaults (vLLM's --override-generation-config): these tests compare replies
GREEDY = {"temperature": 0}

THOUGHT = "<think>\nThe sky scatters blue light.\n</think>\n\nBlue."


def test_parsers_split_the_thinking_as_vllms_do():
    assert split_reasoning(THOUGHT, "deepseek_r1") == ("\nThe sky scatters blue light.\n", "\n\nBlue.")
    assert split_reasoning(THOUGHT, "qwen3") == ("\nThe sky scatters blue light.\n", "\n\nBlue.")
    # R1's template opens the block in the prompt: the reply may hold only its end
    assert split_reasoning("thinking...</think>Blue.", "deepseek_r1") == ("thinking...", "Blue.")
    # qwen3 (thinking on) starts in its thinking too (Qwen3-*-Thinking-2507 templates open it)
    assert split_reasoning("thinking...</think>Blue.", "qwen3") == ("thinking...", "Blue.")
    # never closed (cut by the length limit): all thinking
    assert split_reasoning("<think>still going", "qwen3") == ("still going", "")
    assert split_reasoning("still going", "deepseek_r1") == ("still going", "")
    assert split_reasoning("Blue.", "qwen3") == ("Blue.", "")
    # streaming holds back what may still become a tag
    assert stream_split("<thi", "qwen3") == ("", None)
    assert stream_split("<think>abc</thi", "qwen3") == ("abc", None)
    assert stream_split("Blu", "qwen3") == ("Blu", None)


def _event(text: str, parser: str | None, fmt: str | None = None, finished: bool = False) -> StreamEvent:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finish_time=2.0)
    out = RequestOutput("r", [], [1] * len(text), text, finished, "stop" if finished else None, metrics, 4)
    parsed = _parse(text, OutputOptions(parse_format=fmt, reasoning_parser=parser)) if finished else None  # type: ignore[arg-type]
    return StreamEvent(out, None, parsed, None)


def _deltas(texts: list[str], parser: str | None, fmt: str | None = None) -> list[dict[str, Any]]:
    chunks = ChatChunks(SimpleNamespace(request_id="r", prompt_token_ids=[1, 2, 3, 4]), 0, None, fmt is not None,  # type: ignore[arg-type]
                        reasoning_parser=parser)
    out = []
    for i, text in enumerate(texts):
        for choice in chunks.on_event(_event(text, parser, fmt, finished=i == len(texts) - 1)):
            out.append(choice.delta.model_dump())
    return out


def test_streamed_chat_sends_the_thinking_as_reasoning_content():
    steps = [THOUGHT[:k] for k in (3, 9, 20, 40, 44, 48, 52)] + [THOUGHT]
    deltas = _deltas(steps, "deepseek_r1")
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "\nThe sky scatters blue light.\n" and content == "\n\nBlue."
    # no content goes out before the block closes, and no piece of the closing tag ever does
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])
    assert "</" not in reasoning + content and "think>" not in reasoning + content
    # without a parser the tags are content, as before
    plain = _deltas(steps, None)
    assert "".join(d.get("content") or "" for d in plain) == THOUGHT
    # tool calls are parsed from what follows the thinking
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    with_call = _deltas(["<think>look</think>\n" + call[:12], "<think>look</think>\n" + call], "qwen3", "hermes")
    assert "".join(d.get("reasoning_content") or "" for d in with_call) == "look"
    calls = [tc for d in with_call for tc in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["read_file"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"path": "a"}
    assert not "".join(d.get("content") or "" for d in with_call).strip()
    # text around the calls: the stream's content is the body's (the text after a call too)
    for text in (call + "\nDone.", "Let me look. " + call + "\nDone.", "Hi " + call):
        around = _deltas([text[:20], text], None, "hermes")
        body = _event(text, None, "hermes", finished=True).parsed
        assert "".join(d.get("content") or "" for d in around).strip() == body.content, text
    # a call cut off by the length limit went out as tool-call pieces, and only so
    cut = _deltas(["Sure. " + call[:40], "Sure. " + call[:60]], None, "hermes")
    assert "".join(d.get("content") or "" for d in cut) == "Sure. "
    pieces = [tc for d in cut for tc in d.get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "read_file"
    assert "".join(p["function"]["arguments"] for p in pieces) == call[call.index("{\"path"):60]


#: SmolLM2's turns, the assistant's opened with a thinking block (as DeepSeek-R1's template does).
THINKING_PROMPT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_server_returns_reasoning_content(smollm, parser):
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_PROMPT_TEMPLATE,
                           reasoning_parser=parser)
    try:
        with serving(create_app(runtime, MODEL, override_generation_config=GREEDY)) as base:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                    "max_tokens": 12, "ignore_eos": True}
            if parser == "qwen3":  # thinking off: vLLM's qwen3 parser reads the reply as all content
                body["chat_template_kwargs"] = {"enable_thinking": False}
            message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
            raw = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 12, "ignore_eos": True,
                "prompt": runtime.engine.tokenizer.decode(httpx.post(f"{base}/tokenize", json={
                    "messages": body["messages"]}, timeout=60).json()["tokens"])}).json()["choices"][0]["text"]
            with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                          if line.startswith("data: {") and json.loads(line[6:])["choices"]]
            # vLLM's include_reasoning=false: the thinking stays out, streamed or not
            hidden = {**body, "include_reasoning": False}
            bare = httpx.post(f"{base}/v1/chat/completions", json=hidden, timeout=60).json()["choices"][0]["message"]
            with httpx.stream("POST", f"{base}/v1/chat/completions", json={**hidden, "stream": True},
                              timeout=60) as r:
                bare_deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                               if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    finally:
        runtime.close_sync()
        runtime.engine.close()
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    assert "</think>" not in raw  # SmolLM2 never closes the block: 12 tokens of thinking
    assert "reasoning_content" not in bare and not any(d.get("reasoning_content") for d in bare_deltas)
    assert bare.get("content") == message.get("content")
    if parser == "deepseek_r1":  # the block opened in the prompt: all of it is thinking
        assert message["reasoning_content"] == raw and message["content"] is None
        assert streamed_reasoning == raw and streamed_content == ""
    else:  # qwen3 with thinking off: all of it is content
        # the content as generated: the body's is the stream's
        assert "reasoning_content" not in message and message["content"] == raw
        assert streamed_reasoning == "" and streamed_content == raw


def test_reasoning_parser_is_checked(smollm):
    engine = make_engine(smollm)
    try:
        with pytest.raises(ValueError, match="^reasoning_parser: one of deepseek_r1, qwen3"):
            AgentRuntime(engine, reasoning_parser="granite")
    finally:
        engine.close()


def _sse(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_responses_and_messages_return_the_thinking_as_their_own_items(smollm, parser):
    # NOTE: qwen3 with the runtime's thinking off (Responses sends no template variables)
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_PROMPT_TEMPLATE,
                           reasoning_parser=parser,
                           chat_template_kwargs={"enable_thinking": False} if parser == "qwen3" else None)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    try:
        with serving(create_app(runtime, MODEL, override_generation_config=GREEDY)) as base:
            chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": ask, "max_tokens": 12}).json()
            resp_body = {"model": MODEL, "input": ask, "max_output_tokens": 12}
            resp = httpx.post(f"{base}/v1/responses", json=resp_body, timeout=60).json()
            resp_events = _sse(base, "/v1/responses", resp_body)
            msg_body = {"model": MODEL, "messages": ask, "max_tokens": 12}
            msg = httpx.post(f"{base}/v1/messages", json=msg_body, timeout=60).json()
            msg_events = _sse(base, "/v1/messages", msg_body)
    finally:
        runtime.close_sync()
        runtime.engine.close()
    message = chat["choices"][0]["message"]
    thought, generated = message.get("reasoning_content"), chat["usage"]["completion_tokens"]
    streamed = "".join(e["delta"] for e in resp_events if e["type"] == "response.reasoning_text.delta")
    thinking_deltas = [e["delta"]["thinking"] for e in msg_events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]
    if parser == "deepseek_r1":  # all of the reply is thinking
        assert thought
        # no empty message item after the thinking (nor an empty text block): it was cut off
        assert [i["type"] for i in resp["output"]] == ["reasoning"]
        assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": thought}]
        assert resp["output"][0]["status"] == "incomplete"
        assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == generated == resp["usage"]["output_tokens"]
        # the chat's usage counts the same thinking (vLLM's completion_tokens_details)
        assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": generated}
        assert streamed == thought
        final = resp_events[-1]["response"]
        assert [i["type"] for i in final["output"]] == ["reasoning"]
        assert final["output"][0]["content"][0]["text"] == thought
        assert [e["output_index"] for e in resp_events if e["type"] == "response.output_item.done"] == [0]
        # the reasoning item's part is announced and ended around its deltas (content_index 0)
        kinds = [e["type"] for e in resp_events]
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert resp_events[3]["part"] == {"type": "reasoning_text", "text": ""}
        assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert msg["content"][0] == {"type": "thinking", "thinking": thought, "signature": ""}
        assert "".join(thinking_deltas) == thought
        starts = [e["content_block"]["type"] for e in msg_events if e["type"] == "content_block_start"]
        assert starts == ["thinking"] and [b["type"] for b in msg["content"]] == ["thinking"]
        # the thinking block ends with its (empty) signature, then stops
        kinds = [(e["type"], e.get("delta", {}).get("type")) for e in msg_events]
        assert kinds.index(("content_block_delta", "signature_delta")) + 1 == kinds.index(("content_block_stop", None))
    else:  # qwen3 with thinking off: no thinking anywhere
        assert thought is None and not streamed and not thinking_deltas
        assert [i["type"] for i in resp["output"]] == ["message"]
        assert resp["output"][0]["content"][0]["text"] == message["content"]
        assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
        assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        assert [b["type"] for b in msg["content"]] == ["text"]


def test_thinking_blocks_go_back_into_the_assistant_messages():
    from agent_runtime.server.anthropic_messages import chat_messages

    messages = chat_messages([
        {"role": "user", "content": "Read notes."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use a tool.", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
    ])
    assert messages[1]["reasoning_content"] == "Use a tool." and messages[1]["tool_calls"][0]["id"] == "t1"
    for bad, where in (({"type": "thinking", "thinking": 3}, "messages[1].content[0].thinking"),
                       ({"type": "redacted_thinking", "data": "x"}, "messages[0].content[0].type")):
        # NOTE: an assistant's redacted_thinking is left out (tests/agent_runtime/test_messages_audit.py);
        # a user's is not a block a user message has
        convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [bad]}]
        with pytest.raises(ValueError, match=rf"^{re.escape(where)}"):
            chat_messages(convo if bad["type"] == "thinking" else [{"role": "user", "content": [bad]}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]\.type"):
        chat_messages([{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}])
