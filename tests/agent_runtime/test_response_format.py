"""``response_format`` on the real SmolLM2: JSON replies constrained by xgrammar, bad formats a 400.

The model is tiny and greedy, so without a constraint it answers in prose; with one its reply
parses and validates against the schema. A schema constrained decoding cannot use, a malformed
format, or a JSON format together with a forced tool call is a 400 naming ``response_format``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

xgr = pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

from agent_runtime.grammar_cache import GrammarCache, make_request_processor  # noqa: E402
from agent_runtime.protocol import normalize_response_format  # noqa: E402
from agent_runtime.runtime import AgentRuntime  # noqa: E402
from agent_runtime.server import create_app  # noqa: E402
from tests.conftest import make_engine  # noqa: E402

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Name a fruit and its color, as JSON."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "color"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA, "strict": True}}
TOOL = {"type": "function", "function": {"name": "get_color", "parameters": {
    "type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}}}


@pytest.fixture(scope="module")
def runtime(smollm) -> Iterator[AgentRuntime]:
    rt = AgentRuntime(make_engine(smollm, num_kv_blocks=64, max_model_len=512))
    try:
        yield rt
    finally:
        rt.close_sync()


@pytest.fixture(scope="module")
def client(runtime: AgentRuntime) -> Iterator[TestClient]:
    # NOTE: greedy defaults (vLLM's --override-generation-config): these tests compare replies
    with TestClient(create_app(runtime, MODEL, override_generation_config={"temperature": 0})) as c:
        yield c


def _chat(client: TestClient, max_tokens: int = 32, **extra: Any) -> dict[str, Any]:
    r = client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _clean(runtime: AgentRuntime) -> None:
    def check(engine: Any) -> int:
        engine.check_integrity()
        return sum(b.ref_cnt for b in engine.pool.blocks)

    assert runtime.call_threadsafe(check).result(timeout=30) == 0


def test_json_schema_reply_parses_and_validates(client: TestClient, runtime: AgentRuntime) -> None:
    choice = _chat(client, response_format=JSON_SCHEMA)
    assert choice["finish_reason"] == "stop"
    reply = json.loads(choice["message"]["content"])
    jsonschema.validate(reply, SCHEMA)
    # streamed: the deltas add up to the same reply
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "stream": True, "response_format": JSON_SCHEMA}
    with client.stream("POST", CHAT, json=body) as r:
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["finish_reason"] == "stop"
    _clean(runtime)


def test_json_object_reply_is_an_object_on_both_endpoints(client: TestClient) -> None:
    choice = _chat(client, response_format={"type": "json_object"})
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "A JSON object describing a cat:",
                                              "max_tokens": 32, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


def test_text_format_changes_nothing(client: TestClient) -> None:
    plain = _chat(client, max_tokens=6)
    text = _chat(client, max_tokens=6, response_format={"type": "text"})
    assert text == plain
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain["message"]["content"])  # the unconstrained reply is prose


def test_json_with_tools_under_auto_is_a_call_or_json(client: TestClient) -> None:
    choice = _chat(client, tools=[TOOL], response_format={"type": "json_object"})
    calls = choice["message"].get("tool_calls")
    if calls:
        assert choice["finish_reason"] == "tool_calls"
        assert calls[0]["function"]["name"] == "get_color"
        assert isinstance(json.loads(calls[0]["function"]["arguments"])["fruit"], str)
    else:
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_json_or_call_grammar_admits_both_and_nothing_else(smollm) -> None:
    cache = GrammarCache(max_threads=1)
    fmt = normalize_response_format(JSON_SCHEMA)
    assert fmt is not None
    proc = make_request_processor(cache, smollm.tokenizer, [TOOL], "auto", fmt, vocab_size=49152)
    assert proc is not None
    matcher = xgr.GrammarMatcher(proc._compiled)
    for text, ok in [('{"name": "kiwi", "color": "green"}', True),
                     ('<tool_call>\n{"name": "get_color", "arguments": {"fruit": "kiwi"}}\n</tool_call>', True),
                     ('{"name": "kiwi", "color": "pink"}', False), ('{"name": "kiwi"}', False),
                     ("A kiwi is green.", False)]:
        matcher.reset()
        assert (matcher.accept_string(text) and matcher.is_terminated() is False and matcher.accept_token(
            proc.stop_token_ids[0])) is ok, text
    # with tool_choice none the tools are out of reach
    only_json = make_request_processor(cache, smollm.tokenizer, [TOOL], "none", fmt, vocab_size=49152)
    assert only_json is not None
    matcher = xgr.GrammarMatcher(only_json._compiled)
    assert not matcher.accept_string("<tool_call>")


def test_runtime_api_takes_response_format(runtime: AgentRuntime) -> None:
    async def turn() -> Any:
        return await runtime.job("rf-job").chat(MESSAGES, max_tokens=32, response_format=JSON_SCHEMA,
                                                is_last_step=True)

    reply = json.loads(asyncio.run(turn()).text)
    jsonschema.validate(reply, SCHEMA)

    async def conflicting() -> None:
        await runtime.chat(MESSAGES, tools=[TOOL], tool_choice="required", max_tokens=4,
                           response_format={"type": "json_object"})

    with pytest.raises(ValueError, match=r"^response_format: .*forces a tool call"):
        asyncio.run(conflicting())


def _schema_format(schema: Any, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **spec}}


BAD_FORMATS: list[tuple[str, Any, str]] = [
    ("pattern", _schema_format({"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}),
     "response_format.json_schema.schema"),
    ("bad-type", _schema_format({"type": "strng"}), "response_format.json_schema.schema"),
    ("empty-enum", _schema_format({"enum": []}), "response_format.json_schema.schema"),
    ("min>max", _schema_format({"type": "integer", "minimum": 5, "maximum": 1}), "response_format.json_schema.schema"),
    ("dangling-ref", _schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema"),
    ("schema-not-object", _schema_format("object"), "response_format.json_schema.schema"),
    ("schema-missing", {"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ("name-missing", {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ("name-bad", _schema_format(SCHEMA) | {"json_schema": {"name": "a b", "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ("name-long", {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ("strict-str", _schema_format(SCHEMA, strict="yes"), "response_format.json_schema.strict"),
    ("spec-missing", {"type": "json_schema"}, "response_format.json_schema"),
    ("type-unknown", {"type": "xml"}, "response_format.type"),
    ("type-missing", {}, "response_format.type"),
    ("not-object", "json", "response_format"),
    ("list", [{"type": "json_object"}], "response_format"),
]


@pytest.mark.parametrize("fmt,param", [(f, p) for _, f, p in BAD_FORMATS], ids=[n for n, _, _ in BAD_FORMATS])
def test_bad_response_formats_are_a_400_naming_the_field(client: TestClient, fmt: Any, param: str) -> None:
    r = client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"].startswith(param + ":")


def test_json_format_with_a_forced_tool_call_is_a_400(client: TestClient, runtime: AgentRuntime) -> None:
    named = {"type": "function", "function": {"name": "get_color"}}
    for choice in ("required", named):
        for fmt in ({"type": "json_object"}, JSON_SCHEMA):
            r = client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "tools": [TOOL],
                                        "tool_choice": choice, "response_format": fmt})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "response_format"
    # the text format does not conflict: the forced call goes through
    ok = _chat(client, max_tokens=40, tools=[TOOL], tool_choice=named, response_format={"type": "text"})
    assert ok["message"]["tool_calls"][0]["function"]["name"] == "get_color"
    _clean(runtime)


def test_a_json_schema_reply_keeps_async_scheduling_overlapped(smollm, runtime: AgentRuntime) -> None:
    """xgrammar's mask only masks: under async scheduling the constrained reply's steps are each
    launched while the one before runs (its masks built meanwhile), and the reply is the
    synchronous engine's."""
    from tests.asymcache_core.test_async_scheduling import LaunchCounter

    engine = make_engine(smollm, num_kv_blocks=64, max_model_len=512, async_scheduling=True)
    counter = LaunchCounter(engine)
    overlapped = AgentRuntime(engine)
    try:
        got = asyncio.run(overlapped.chat(MESSAGES, max_tokens=32, response_format=JSON_SCHEMA))
    finally:
        overlapped.close_sync()
    want = asyncio.run(runtime.chat(MESSAGES, max_tokens=32, response_format=JSON_SCHEMA))
    assert got.token_ids == want.token_ids
    jsonschema.validate(json.loads(got.text), SCHEMA)
    assert counter.launches > 5 and counter.overlapped == counter.launches - 1
