"""Llama 3.1+'s tool calls (``tool_call_format="llama3_json"``, vLLM's ``--tool-call-parser
llama3_json``) with the real SmolLM2 and a Llama-style template that renders tools itself: a
forced call is decoded as the bare ``{"name", "parameters"}`` JSON, parsed into a call, rendered
back by the template on the next turn, and never streamed as content."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agent_runtime.output_processor import build_turn
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.choices import safe_text_len
from asymcache_core import SamplingParams
from tests.agent_runtime.live_server import MODEL, TOOLS, serving
from tests.conftest import make_engine

#: Tools in the system turn, calls written back as Llama writes them, results in an ``ipython``
#: turn (Llama 3.1's roles, with SmolLM2's turn tokens).
LLAMA_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTo call a function, answer with JSON {\"name\": function name, "
    "\"parameters\": its arguments}. Functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is in notes.txt?"}]
FORCED = {"type": "function", "function": {"name": "read_file"}}


def test_llama3_json_holds_a_reply_that_may_be_a_call():
    assert safe_text_len('{"name": "f"', True, "llama3_json") == 0
    assert safe_text_len("  ", True, "llama3_json") == 0
    assert safe_text_len("<|python", True, "llama3_json") == 0
    assert safe_text_len("Sure, here", True, "llama3_json") == len("Sure, here")
    assert safe_text_len('{"a": 1}', False, "llama3_json") == len('{"a": 1}')
    assert safe_text_len('{"a": 1}', True, "hermes") == len('{"a": 1}')


def test_a_forced_call_is_llamas_json_and_comes_back_in_the_template(smollm):
    pytest.importorskip("xgrammar")

    async def main():
        runtime = AgentRuntime(make_engine(smollm), chat_template=LLAMA_STYLE_TEMPLATE, tool_call_format="llama3_json")
        try:
            stream, _ = await runtime.start_chat(ASK, tools=TOOLS, tool_choice=FORCED,
                                                 params=SamplingParams(max_tokens=48))
            final = await stream.result()
            turn_text = final.output.text
            turn = build_turn(stream, final)
            history = [*ASK, turn.message, {"role": "tool", "tool_call_id": turn.message["tool_calls"][0]["id"],
                                             "content": "Buy milk."}]
            second = await runtime.tokenize(messages=history, tools=TOOLS)
            text = runtime.engine.tokenizer.decode(second)
            return turn_text, turn, text, list(stream.prompt_token_ids), list(final.output.token_ids), second
        finally:
            await runtime.close()

    raw, turn, text, prompt, _, second = asyncio.run(main())
    call = json.loads(raw)
    assert call["name"] == "read_file" and call["parameters"]["path"] in ("notes.txt", "todo.md")
    assert turn.finish_reason == "tool_calls" and turn.message["content"] is None
    assert [c["function"]["name"] for c in turn.message["tool_calls"]] == ["read_file"]
    # the next turn renders the call as Llama writes it; its prompt extends this turn's
    assert '<|im_start|>ipython\nBuy milk.' in text and '"parameters": {"path": ' in text
    assert second[: len(prompt)] == prompt


def test_llama3_json_needs_a_template_that_renders_tools(smollm):
    engine = make_engine(smollm)
    try:
        with pytest.raises(ValueError, match="^tool_call_format: llama3_json needs a chat template"):
            AgentRuntime(engine, tool_call_format="llama3_json")  # SmolLM2's own: no tools section
        with pytest.raises(ValueError, match="^tool_call_format: one of hermes, llama3_json"):
            AgentRuntime(engine, tool_call_format="mistral")  # type: ignore[arg-type]
    finally:
        engine.close()


def test_the_server_streams_llamas_calls_as_tool_calls(smollm):
    pytest.importorskip("xgrammar")
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=LLAMA_STYLE_TEMPLATE,
                           tool_call_format="llama3_json")
    try:
        with serving(create_app(runtime, MODEL)) as base:
            body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": FORCED, "max_tokens": 48, "temperature": 0}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
            # a named tool_choice forced the call: "stop", as OpenAI and vLLM say
            assert reply["finish_reason"] == "stop" and reply["message"]["content"] is None
            calls = reply["message"]["tool_calls"]
            assert [c["function"]["name"] for c in calls] == ["read_file"]
            with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            assert not "".join(d.get("content") or "" for d in deltas)  # the JSON is never content
            streamed = [tc for d in deltas for tc in d.get("tool_calls") or []]
            assert [tc["function"]["arguments"] for tc in streamed] == [c["function"]["arguments"] for c in calls]
            # a reply of plain text under auto is content, as it comes
            plain = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "tools": TOOLS,
                "tool_choice": "none", "max_tokens": 4}).json()["choices"][0]
            assert plain["message"]["content"] and plain["finish_reason"] in ("stop", "length")
    finally:
        runtime.close_sync()
        runtime.engine.close()
