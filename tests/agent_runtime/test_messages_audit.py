"""Anthropic's Messages API against what its clients send (the ``anthropic`` SDK, Claude Code) and
what vLLM 0.32's route does with it: Claude Code's per-request billing block left out of the
prompt (its turns then reuse the cached prefix), ``system`` messages anywhere in ``messages``
(merged into the leading system prompt for a template that takes one only first),
``output_config`` (a JSON schema the reply follows, the template's ``reasoning_effort``), empty
text blocks, a call cut off after a complete one, and ``count_tokens``' body."""

from __future__ import annotations

import json

import httpx
import pytest

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.anthropic_messages import chat_messages
from agent_runtime.server.anthropic_system import merge_inline_system
from tests.agent_runtime.live_server import MODEL, TOOLS, serving
from tests.conftest import make_engine

anthropic = pytest.importorskip("anthropic")

#: The chat tools in Anthropic's form.
CLIENT_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}
#: Claude Code's system prompt: its billing block (a hash new on every request) first
SYSTEM_TEXT = "You are a coding agent. Answer in one short sentence. Prefer plain words."


def _claude_code_system(cch: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral"}}]


#: ChatML that takes a system message only first (as Qwen3's template) and renders the
#: ``reasoning_effort`` variable when it is set.
SYSTEM_FIRST_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if reasoning_effort is defined %}{{ '<|im_start|>effort\\n' + reasoning_effort + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def ac(live):
    return anthropic.Anthropic(base_url=live.base, api_key="unused", max_retries=0, timeout=120)


def _tokenize(base: str, messages: list[dict], **fields) -> list[int]:
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": messages, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_billing_block_is_left_out_and_the_next_turn_reuses_the_prefix(live, ac):
    """Claude Code's first system block changes on every request; left in the prompt it would
    make every turn's prefix new (no cached KV reused)."""
    ask = [{"role": "user", "content": "Say hello to the team and wish them a good week."}]
    counted = ac.messages.count_tokens(model=MODEL, system=_claude_code_system("fa690"), messages=ask)
    plain = _tokenize(live.base, [{"role": "system", "content": SYSTEM_TEXT}, *ask])
    assert counted.input_tokens == len(plain)
    first = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=4, system=_claude_code_system("fa690"),
                               messages=ask)
    second = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=4, system=_claude_code_system("0aaa9"),
                                messages=ask)
    assert second.content[0].text == first.content[0].text
    prompt = second.usage.input_tokens + second.usage.cache_creation_input_tokens + second.usage.cache_read_input_tokens
    assert prompt == len(plain)
    # every full block of the prompt but the one its last token is in came from the cache
    assert second.usage.cache_read_input_tokens == (prompt - 1) // 16 * 16 > 0
    assert second.usage.cache_creation_input_tokens == 0
    # a string system prompt that is the billing line alone adds nothing either
    only = httpx.post(f"{live.base}/v1/messages/count_tokens", timeout=60, json={
        "model": MODEL, "system": _claude_code_system("1")[0]["text"], "messages": ask})
    assert only.json() == {"input_tokens": len(_tokenize(live.base, ask)),
                           "context_management": {"original_input_tokens": len(_tokenize(live.base, ask))}}
    live.check()


def test_system_messages_inside_messages_stay_in_place(live, ac):
    """Anthropic's API (the SDK's ``SystemMessageParam``) and vLLM take ``system`` messages
    anywhere in ``messages``; a template that renders them there gets them there."""
    convo = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
             {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
             {"role": "user", "content": "How are you?"}]
    chat = [{"role": "system", "content": "Be brief."}, convo[0], convo[1],
            {"role": "system", "content": "Answer in French."}, convo[3]]
    counted = ac.messages.count_tokens(model=MODEL, system="Be brief.", messages=convo)
    assert counted.input_tokens == len(_tokenize(live.base, chat))
    msg = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=8, system="Be brief.", messages=convo)
    r = httpx.post(f"{live.base}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": chat, "max_tokens": 8, **GREEDY})
    assert msg.content[0].text == r.json()["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + msg.usage.cache_creation_input_tokens + msg.usage.cache_read_input_tokens == (
        r.json()["usage"]["prompt_tokens"])
    # a system message's blocks are text only; a conversation of system messages alone has none
    for body, where in (
        ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]},
                       {"role": "user", "content": "hi"}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "system", "content": 3}, {"role": "user", "content": "hi"}]}, "messages[0].content"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ):
        r = httpx.post(f"{live.base}/v1/messages", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["message"].startswith(f"{where}:"), r.text
    live.check()


def test_a_system_first_template_gets_them_merged_and_effort_is_its_variable(smollm):
    """A template that takes a system message only first gets the later ones appended to the
    leading system prompt (vLLM's fallback) instead of failing; ``output_config.effort`` is its
    ``reasoning_effort`` variable."""
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=SYSTEM_FIRST_TEMPLATE)
    try:
        with serving(create_app(runtime, MODEL)) as base:
            convo = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                     {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "How are you?"}]
            merged = [{"role": "system", "content": "Be brief.\nAnswer in French."}, *convo[:2], convo[3]]
            body = {"model": MODEL, "system": "Be brief.", "messages": convo}
            r = httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["input_tokens"] == len(_tokenize(base, merged))
            r = httpx.post(f"{base}/v1/messages", json={**body, "max_tokens": 2, **GREEDY}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text
            # the chat route renders as it is told: the template refuses the unmerged chat
            r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": [
                {"role": "system", "content": "Be brief."}, *convo]}, timeout=60)
            assert r.status_code == 400, r.text
            effort = httpx.post(f"{base}/v1/messages/count_tokens", timeout=60,
                                json={**body, "output_config": {"effort": "max"}}).json()["input_tokens"]
            assert effort == len(_tokenize(base, merged, chat_template_kwargs={"reasoning_effort": "max"}))
            assert effort > len(_tokenize(base, merged))
    finally:
        runtime.close_sync()
        runtime.engine.close()


def test_output_config_format_constrains_the_reply(live, ac):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    msg = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=30,
                             messages=[{"role": "user", "content": "Name a person."}],
                             output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"]
    reply = json.loads(msg.content[0].text)
    assert list(reply) == ["name"] and isinstance(reply["name"], str)
    with ac.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=30,
                            messages=[{"role": "user", "content": "Name a person."}],
                            output_config={"format": {"type": "json_schema", "schema": schema}}) as s:
        assert s.get_final_message().content[0].text == msg.content[0].text
    base = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for fields, where in (
        ({"output_config": {"effort": "huge"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
          "tools": CLIENT_TOOLS, "tool_choice": {"type": "any"}}, "output_config.format"),
        ({"output_config": 3}, "output_config"),
    ):
        r = httpx.post(f"{live.base}/v1/messages", json={**base, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{where}:"), r.text
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def test_a_call_cut_off_after_a_complete_one_is_no_text(live, ac):
    """``any`` with parallel calls: the limit cuts a second call short after a complete one.
    The complete call is a ``tool_use`` block; the cut-off one's open tag is not text; the reason
    is ``max_tokens`` (vLLM's and Anthropic's: the limit always wins)."""
    forced = dict(model=MODEL, extra_body=GREEDY, max_tokens=36, messages=[{"role": "user", "content": "Read todo.md."}],
                  tools=CLIENT_TOOLS, tool_choice={"type": "any"})
    message = ac.messages.create(**forced)
    assert message.usage.output_tokens == 36 and message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["tool_use"] and message.content[0].input == {"path": "todo.md"}
    with ac.messages.stream(**forced) as s:
        events = list(s)
        final = s.get_final_message()
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == message.content[0].input
    assert final.stop_reason == "max_tokens"
    # the Responses route shares the rule: its call is an item, the cut-off one no message text
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    r = httpx.post(f"{live.base}/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Read todo.md.", "tools": flat, "tool_choice": "required",
        "max_output_tokens": 36, **GREEDY})
    assert r.status_code == 200, r.text
    assert [i["type"] for i in r.json()["output"]] == ["function_call"], r.json()["output"]
    assert r.json()["usage"]["output_tokens"] == 36
    live.check()


def test_empty_text_blocks_add_nothing():
    """Anthropic refuses empty text blocks and vLLM skips them: no stray newline joins them."""
    out = chat_messages(
        [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Fix it"}]},
         {"role": "assistant", "content": [{"type": "text", "text": ""},
                                           {"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                       "content": [{"type": "text", "text": ""}, {"type": "text", "text": "ok"}]}]}],
        system=[{"type": "text", "text": ""}, {"type": "text", "text": "Be brief."}])
    assert [(m["role"], m["content"]) for m in out] == [
        ("system", "Be brief."), ("user", "Fix it"), ("assistant", None), ("tool", "ok")]
    assert merge_inline_system([{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                                {"role": "user", "content": "c"}]) == [
        {"role": "system", "content": "b"}, {"role": "user", "content": "a"}, {"role": "user", "content": "c"}]


def test_routes_under_messages_and_an_empty_model_answer_anthropic_errors(live, ac):
    """An SDK call to a route not served here (message batches) reads Anthropic's 404, as the
    SDK maps it; an empty ``model`` is a 400, as vLLM's Messages route answers it."""
    with pytest.raises(anthropic.NotFoundError) as missing:
        ac.messages.batches.list()
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "Invalid URL (GET /v1/messages/batches)"}}
    r = httpx.post(f"{live.base}/v1/messages", timeout=60,
                   json={"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("model:"), r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_redacted_thinking_sent_back_is_left_out(live, ac):
    """A conversation begun on Anthropic's API sends its encrypted ``redacted_thinking`` back;
    no model here can read it: it is left out (as vLLM leaves it out), not a 400."""
    said = [{"type": "thinking", "thinking": "Greet back.", "signature": "sig"}, {"type": "text", "text": "Hello."}]
    convo = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": said},
             {"role": "user", "content": "Bye."}]
    with_redacted = [convo[0], {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwK..."},
                                                                  *said]}, convo[2]]
    assert chat_messages(with_redacted) == chat_messages(convo)
    assert chat_messages(with_redacted)[1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}
    counts = [ac.messages.count_tokens(model=MODEL, messages=m).input_tokens for m in (convo, with_redacted)]
    assert counts[0] == counts[1] > 0
    msg = ac.messages.create(model=MODEL, extra_body=GREEDY, max_tokens=2, messages=with_redacted)
    assert msg.usage.input_tokens + msg.usage.cache_creation_input_tokens + msg.usage.cache_read_input_tokens == counts[0]
