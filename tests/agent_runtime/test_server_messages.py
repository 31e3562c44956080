"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the
``anthropic`` client, against the chat completions of the same conversation on the same server
(greedy: the same tokens); errors in Anthropic's shape, its ``x-api-key``."""

from __future__ import annotations

import json

import httpx
import pytest

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, TOOLS, leave_stream_early, serving
from tests.conftest import make_engine

anthropic = pytest.importorskip("anthropic")

#: The chat tools in Anthropic's form.
CLIENT_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]
QUESTION = "Name a colour of the sky."
#: greedy replies, which these tests compare (the SDK has no temperature argument; the server's
#: default is vLLM's, temperature 1)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ac(live):
    return anthropic.Anthropic(base_url=live.base, api_key="unused", max_retries=0, timeout=120)


def test_text_reply_equals_the_chat_completion(live, oa, ac):
    msg = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=12, system="Answer in one word.",
                             messages=[{"role": "user", "content": QUESTION}])
    chat = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    want = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert msg.stop_reason == want and msg.stop_sequence is None
    # Anthropic counts the prompt's cache hits and cache writes apart (whole blocks of 16)
    use = msg.usage
    assert use.input_tokens + use.cache_creation_input_tokens + use.cache_read_input_tokens == chat.usage.prompt_tokens
    assert use.cache_creation_input_tokens % 16 == use.cache_read_input_tokens % 16 == 0 and use.input_tokens <= 16
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    again = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=1, system="Answer in one word.",
                               messages=[{"role": "user", "content": QUESTION}])
    assert again.stop_reason == "max_tokens" and again.usage.cache_read_input_tokens > 0
    # the same prompt again reads what the first wrote and writes nothing
    assert again.usage.cache_read_input_tokens == (chat.usage.prompt_tokens - 1) // 16 * 16
    assert again.usage.cache_creation_input_tokens == 0
    counted = ac.messages.count_tokens(model=MODEL, system="Answer in one word.",
                                       messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == chat.usage.prompt_tokens
    # a stop sequence is named
    stopped = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=30, messages=[{"role": "user", "content": QUESTION}],
                                 stop_sequences=[" ", "."])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence in (" ", ".")
    live.check()


def test_a_tool_loop_in_blocks(live, oa, ac):
    ask = {"role": "user", "content": "What is in notes.txt?"}
    first = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=48, messages=[ask], tools=CLIENT_TOOLS,
                               tool_choice={"type": "tool", "name": "read_file"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "read_file"
    assert uses[0].input["path"] in ("notes.txt", "todo.md")
    history = [ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "Buy milk."}]}]
    second = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=16, messages=history, tools=CLIENT_TOOLS,
                                tool_choice={"type": "none"})
    text = "".join(b.text for b in first.content if b.type == "text")
    chat = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, tools=TOOLS, tool_choice="none", messages=[
        ask, {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": uses[0].id, "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Buy milk."}])
    assert second.usage.input_tokens + second.usage.cache_creation_input_tokens + second.usage.cache_read_input_tokens == (
        chat.usage.prompt_tokens)
    assert second.content[0].text == chat.choices[0].message.content
    # the turn's prompt starts with the first turn's prompt and the tokens it generated
    first_prompt = first.usage.input_tokens + first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= (first_prompt + first.usage.output_tokens - 16) // 16 * 16 > 0
    live.check()


def test_streamed_events_add_up_to_the_message(live, ac):
    want = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=12, messages=[{"role": "user", "content": QUESTION}])
    with ac.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=12, messages=[{"role": "user", "content": QUESTION}]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    # the start's usage already splits the cached part of the prompt out (the same prompt ran
    # above, so it reads that and writes nothing), and the delta's says the same
    start = events[0].message.usage
    whole = want.usage.input_tokens + want.usage.cache_creation_input_tokens + want.usage.cache_read_input_tokens
    assert start.cache_read_input_tokens == (whole - 1) // 16 * 16 > 0 and start.cache_creation_input_tokens == 0
    assert start.input_tokens + start.cache_read_input_tokens == whole
    delta = next(e for e in events if e.type == "message_delta").usage
    assert (delta.input_tokens, delta.cache_creation_input_tokens, delta.cache_read_input_tokens) == (
        start.input_tokens, 0, start.cache_read_input_tokens)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text.strip() == want.content[0].text and final.content[0].text == text
    assert final.stop_reason == want.stop_reason and final.usage.output_tokens == want.usage.output_tokens
    # a forced call streams as a tool_use block, its input as it is written (input_json_delta
    # pieces that join to the non-streamed message's input)
    forced = dict(model=MODEL, extra_body=GREEDY, max_tokens=48, messages=[{"role": "user", "content": "Read todo.md."}],
                  tools=CLIENT_TOOLS, tool_choice={"type": "tool", "name": "read_file"})
    with ac.messages.stream(**forced) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].name == "read_file" and final.content[-1].input["path"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == final.content[-1].input
    assert final.content[-1].input == ac.messages.create(**forced).content[-1].input
    live.check()


def test_message_ids_follow_the_request_id_header(live):
    # as on chat completions (vLLM names a message by its chat completion's id): the header
    # names the message and comes back, streamed or not; without one both are a fresh id
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headed = httpx.post(f"{live.base}/v1/messages", json=body, headers={"X-Request-Id": "hdr-m1"}, timeout=120)
    assert headed.status_code == 200, headed.text
    assert headed.json()["id"] == "msg_hdr-m1" and headed.headers["x-request-id"] == "hdr-m1"
    with httpx.stream("POST", f"{live.base}/v1/messages", json={**body, "stream": True},
                      headers={"X-Request-Id": "hdr-m2"}, timeout=120) as r:
        frames = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        assert r.headers["x-request-id"] == "hdr-m2"
    assert frames[0]["type"] == "message_start" and frames[0]["message"]["id"] == "msg_hdr-m2"
    bare = [httpx.post(f"{live.base}/v1/messages", json=body, timeout=120) for _ in range(2)]
    ids = [r.json()["id"] for r in bare]
    assert ids[0] != ids[1] and all(i == "msg_" + r.headers["x-request-id"] for i, r in zip(ids, bare, strict=True))
    # a header out of bounds is Anthropic's 400, as the chat route's
    r = httpx.post(f"{live.base}/v1/messages", json=body, headers={"X-Request-Id": "x" * 257}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("X-Request-Id:"), r.text
    live.check()


def test_a_client_leaving_a_stream_frees_its_request(live):
    body = {"model": MODEL, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
    leave_stream_early(live, "/v1/messages", body, "text_delta")


@pytest.mark.parametrize(("fields", "where"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "any"}}, "thinking"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema.type"),
    ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
])
def test_bad_bodies_are_anthropic_400s_naming_the_field(live, fields, where):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(f"{live.base}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(f"{where}:"), err
    assert live.engine(lambda e: e.has_unfinished()) is False


def test_anthropic_errors_keys_and_models(smollm):
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024))
    try:
        with serving(create_app(runtime, MODEL, "sekret")) as base:
            client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0, timeout=60)
            ok = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert ok.usage.output_tokens == 2
            # Anthropic's own header alone, as Claude Code sends it (this SDK sends a Bearer too)
            only_x = {"x-api-key": "sekret", "anthropic-version": "2023-06-01"}
            r = httpx.post(f"{base}/v1/messages", headers=only_x, timeout=60, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text
            r = httpx.post(f"{base}/v1/messages/count_tokens", headers=only_x, timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
            r = httpx.post(f"{base}/v1/messages", headers={"x-api-key": "wrong"}, timeout=60, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.AuthenticationError) as bad_key:
                anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert bad_key.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.NotFoundError) as bad_model:
                client.messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert bad_model.value.body["type"] == "error"
            # x-api-key is the key on every route (Claude Code lists the models with it alone);
            # the OpenAI routes keep OpenAI's error body
            r = httpx.get(f"{base}/v1/models", headers=only_x, timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, r.text
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(f"{base}/v1/chat/completions", headers={"x-api-key": "sekret"}, json=chat, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{base}/v1/chat/completions", headers={"x-api-key": "wrong"}, json=chat, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert "type" not in r.json()  # OpenAI's body, not Anthropic's
    finally:
        runtime.close_sync()
        runtime.engine.close()


def test_a_prefilled_assistant_message_is_continued(live, ac):
    convo = [{"role": "user", "content": "What is the capital of France? One sentence."},
             {"role": "assistant", "content": "The capital of France is"}]
    msg = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=8, messages=convo)
    r = httpx.post(f"{live.base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": convo, "max_tokens": 8, "continue_final_message": True, **GREEDY})
    assert msg.content[0].text == r.json()["choices"][0]["message"]["content"] and msg.content[0].text
    counted = ac.messages.count_tokens(model=MODEL, messages=convo)
    assert counted.input_tokens == r.json()["usage"]["prompt_tokens"]
    with ac.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=8, messages=convo) as s:
        assert s.get_final_message().content[0].text == msg.content[0].text
    live.check()


def test_text_blocks_are_joined_by_newlines_and_flags_are_strict():
    """Several text blocks (Claude Code's reminder, then the request; a system prompt of
    blocks; a tool result of blocks) are joined by a newline, vLLM's join, never run together."""
    from agent_runtime.server.anthropic_messages import chat_messages, chat_tool_choice

    out = chat_messages(
        [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>Use tabs.</system-reminder>"},
                                      {"type": "text", "text": "Fix the bug"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                           {"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                       "content": [{"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]}]}],
        system=[{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "Be concise."}])
    assert [m["content"] for m in out] == [
        "You are Claude Code.\nBe concise.", "<system-reminder>Use tabs.</system-reminder>\nFix the bug", "Reading.",
        "line1\nline2"]
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    with pytest.raises(ValueError, match="^tool_choice.disable_parallel_tool_use: must be a boolean"):
        chat_tool_choice({"type": "any", "disable_parallel_tool_use": "false"})


def test_a_call_cut_off_is_no_text(live, ac, oa):
    """A forced call the length limit cuts off is not returned as its markup in a text block (the
    Messages and Responses routes carry calls as blocks and items of their own); its stream sent
    it as call pieces, and their text before it agrees."""
    forced = dict(model=MODEL, extra_body=GREEDY, max_tokens=6, messages=[{"role": "user", "content": "Read todo.md."}],
                  tools=CLIENT_TOOLS, tool_choice={"type": "tool", "name": "read_file"})
    message = ac.messages.create(**forced)
    assert message.stop_reason == "max_tokens"
    assert not any("<tool_call>" in getattr(b, "text", "") for b in message.content), message.content
    with ac.messages.stream(**forced) as s:
        events = list(s)
    texts = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert texts == "".join(b.text for b in message.content if b.type == "text")
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = oa.responses.create(model=MODEL, input="Read todo.md.", tools=flat, max_output_tokens=6,
                               tool_choice={"type": "function", "name": "read_file"})
    assert resp.status == "incomplete" and "<tool_call>" not in resp.output_text
    live.check()
