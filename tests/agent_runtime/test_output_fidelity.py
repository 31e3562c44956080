"""Output fidelity against vLLM's OpenAI-compatible server: JSON-schema key order, forced tool
calls cut by ``max_tokens``, ``logprobs: 0``, and text cut mid UTF-8 character."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

xgr = pytest.importorskip("xgrammar")

from agent_runtime.grammar_cache import GrammarCache  # noqa: E402
from tests.agent_runtime.live_server import MODEL, sse  # noqa: E402

VOCAB = 49152
COT = {"reasoning": {"type": "string", "maxLength": 40}, "answer": {"type": "integer"}}


def _object_schema(order: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: COT[name] for name in order},
        "required": order,
        "additionalProperties": False,
    }


def _accepts(compiled: Any, text: str) -> bool:
    return xgr.GrammarMatcher(compiled).accept_string(text)


def test_json_schema_grammar_keeps_property_order(hf_smollm_tokenizer: Any) -> None:
    cache = GrammarCache(max_threads=1)
    first = cache.json_schema_grammar(hf_smollm_tokenizer, _object_schema(["reasoning", "answer"]), VOCAB)
    second = cache.json_schema_grammar(hf_smollm_tokenizer, _object_schema(["answer", "reasoning"]), VOCAB)
    assert first is not second and len(cache) == 2
    # the first key is the schema's first property, in each ordering
    assert _accepts(first, '{"reasoning": ') and not _accepts(first, '{"answer": ')
    assert _accepts(second, '{"answer": ') and not _accepts(second, '{"reasoning": ')
    # the same schema again is the cached grammar
    assert cache.json_schema_grammar(hf_smollm_tokenizer, _object_schema(["answer", "reasoning"]), VOCAB) is second


def test_tool_call_grammars_keep_argument_order(hf_smollm_tokenizer: Any) -> None:
    def tools(order: list[str]) -> list[dict[str, Any]]:
        # NOTE: the same ``required`` list in both: only the properties' order differs
        params = {"type": "object", "properties": {k: {"type": "string"} for k in order},
                  "required": ["alpha_date", "zeta_city"]}
        return [{"type": "function", "function": {"name": "book", "parameters": params}}]

    cache = GrammarCache(max_threads=1)
    zeta_first = cache.tool_call_grammar(hf_smollm_tokenizer, tools(["zeta_city", "alpha_date"]), "required", VOCAB)
    alpha_first = cache.tool_call_grammar(hf_smollm_tokenizer, tools(["alpha_date", "zeta_city"]), "required", VOCAB)
    assert zeta_first is not alpha_first
    head = '<tool_call>\n{"name": "book", "arguments": {"'
    assert _accepts(zeta_first, head + 'zeta_city": ') and not _accepts(zeta_first, head + 'alpha_date": ')
    assert _accepts(alpha_first, head + 'alpha_date": ') and not _accepts(alpha_first, head + 'zeta_city": ')


@pytest.mark.parametrize("order", [["reasoning", "answer"], ["answer", "reasoning"]])
def test_structured_output_keys_follow_the_schema_over_http(live, order: list[str]) -> None:
    schema = _object_schema(order)
    messages = [{"role": "user", "content": "What is 2+3? Think first."}]
    bodies = [
        ("/v1/chat/completions", {"messages": messages, "response_format": {
            "type": "json_schema", "json_schema": {"name": "cot", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": messages, "structured_outputs": {"json": schema}}),
        ("/v1/completions", {"prompt": "JSON:", "response_format": {
            "type": "json_schema", "json_schema": {"name": "cot", "schema": schema}}}),
    ]
    for path, body in bodies:
        r = httpx.post(live.base + path, json={"model": MODEL, "max_tokens": 60, "temperature": 0, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] == "stop":
            assert list(json.loads(text)) == order, text
        else:  # cut by max_tokens: the keys written so far are in order
            assert text.startswith('{"' + order[0] + '": '), text


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
#: too few tokens for ``<tool_call>\n{"name": "get_weather", "arguments": {...}}\n</tool_call>``
CUT = 12


def _events(live, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed request (Anthropic's and Responses' end without [DONE])."""
    with httpx.stream("POST", live.base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_off_is_not_content_in_chat(live, tool_choice: Any) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}], "tool_choice": tool_choice, "max_tokens": CUT,
        "temperature": 0}
    r = httpx.post(live.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and not choice["message"]["tool_calls"]

    events = sse(live, "/v1/chat/completions", body)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert all(not d.get("content") for d in deltas), deltas
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # what went out of the call is tool-call pieces (vLLM's partial deltas), never its markup
    args = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or [])
    assert "<tool_call>" not in args

    # with room to finish, the same request calls the tool
    whole = httpx.post(live.base + "/v1/chat/completions", json={**body, "max_tokens": 60}, timeout=120).json()
    names = [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]]
    assert names and set(names) == {"get_weather"}


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_call_cut_off_is_not_text_in_messages(live, tool_choice: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": tool_choice, "max_tokens": CUT, "temperature": 0}
    r = httpx.post(live.base + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["stop_reason"] == "max_tokens"
    assert all(b["type"] == "text" and b["text"] == "" for b in reply["content"]), reply["content"]
    for event in _events(live, "/v1/messages", body):
        if event["type"] == "content_block_delta":
            assert "<tool_call>" not in json.dumps(event), event


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_call_cut_off_is_not_text_in_responses(live, tool_choice: Any) -> None:
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [{"type": "function", "name": "get_weather",
            "parameters": WEATHER}], "tool_choice": tool_choice, "max_output_tokens": CUT, "temperature": 0}
    r = httpx.post(live.base + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "<tool_call>" not in json.dumps(r.json()["output"])
    assert "<tool_call>" not in json.dumps(_events(live, "/v1/responses", body))


def test_completion_logprobs_zero_gives_the_sampled_token(live) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "logprobs": 0, "temperature": 0}
    lp = httpx.post(live.base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    # vLLM: per token a dict of the sampled token alone (logprobs + 1 entries), not null
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    streamed = [c["choices"][0]["logprobs"] for c in sse(live, "/v1/completions", body) if c["choices"]]
    assert [top for part in streamed if part for top in part["top_logprobs"]] == lp["top_logprobs"]
    # echoed: the prompt's first token reads null, the others their own token
    echoed = httpx.post(live.base + "/v1/completions", json={**body, "echo": True, "max_tokens": 1},
                        timeout=120).json()["choices"][0]["logprobs"]
    assert echoed["top_logprobs"][0] is None
    assert echoed["top_logprobs"][1:] == [{t: v} for t, v in zip(echoed["tokens"][1:], echoed["token_logprobs"][1:],
                                                                  strict=True)]
    # chat's top_logprobs 0: no alternatives (vLLM's empty list)
    chat = httpx.post(live.base + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 0, "temperature": 0}, timeout=120).json()["choices"][0]["logprobs"]["content"]
    assert len(chat) == 2 and all(entry["top_logprobs"] == [] for entry in chat)
    # -1 (vLLM's whole vocabulary, past its default --max-logprobs 20 there too): a 400 naming the field
    bad = httpx.post(live.base + "/v1/completions", json={**body, "logprobs": -1}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_text_cut_mid_character_ends_at_a_whole_character(live) -> None:
    """``max_tokens`` cutting an emoji: no trailing U+FFFD, streamed or not, chat or
    completions (vLLM's detokenizer never emits an incomplete UTF-8 sequence); every token and
    its log probability is still reported."""
    prompt = "I love pizza 🍕🍕🍕 and sushi 🍣"
    cut_texts = 0
    # NOTE: limits that cut an emoji's bytes (5, 7) and one that ends on a whole character (6)
    for max_tokens in (5, 6, 7):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
                "ignore_eos": True}
        r = httpx.post(live.base + "/v1/completions", json=body, timeout=120).json()
        choice = r["choices"][0]
        assert r["usage"]["completion_tokens"] == max_tokens == len(choice["logprobs"]["tokens"])
        assert not choice["text"].endswith("\ufffd"), choice["text"]
        # the reported tokens read U+FFFD where they hold part of a character: the text is cut
        cut_texts += choice["logprobs"]["tokens"][-1].endswith("\ufffd")
        streamed = "".join(c["choices"][0]["text"] for c in sse(live, "/v1/completions", body) if c["choices"])
        assert streamed == choice["text"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat exactly: " + prompt}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        content = httpx.post(live.base + "/v1/chat/completions", json=chat, timeout=120).json()[
            "choices"][0]["message"]["content"]
        assert not content.endswith("\ufffd"), content
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in sse(live, "/v1/chat/completions", chat)
                  if c["choices"]]
        assert "".join(deltas) == content
    assert cut_texts > 0  # some of the limits did cut an emoji
