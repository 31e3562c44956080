"""Output fidelity against vLLM's OpenAI-compatible server: JSON-schema key order, forced tool
calls cut by ``max_tokens``, ``logprobs: 0``, and text cut mid UTF-8 character."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

xgr = pytest.importorskip("xgrammar")

from agent_runtime.grammar_cache import GrammarCache  # noqa: E402
from tests.agent_runtime.live_server import MODEL  # noqa: E402

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
