"""Bad input never costs more than a 4xx: schemathesis over ``/openapi.json`` and a hostile corpus.

One runtime over the real SmolLM2 (a small pool, a short context) serves the whole module,
in-process (ASGI). Every answer is below 500; every 4xx carries an OpenAI-style error body;
afterwards nothing is in flight, no block is referenced and a reference request gets the same
greedy answer as before.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.agent_runtime.hostile_bodies import CHAT, KEY, MODEL, corpus
from tests.conftest import make_engine

#: Longest generation a fuzzed body may ask for (the model runs on the CPU).
MAX_TOKENS = 3
REFERENCE = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": 8, "temperature": 0}
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def runtime(smollm) -> Iterator[AgentRuntime]:
    engine = make_engine(smollm, num_kv_blocks=96, max_model_len=512)
    rt = AgentRuntime(engine)
    try:
        yield rt
    finally:
        rt.close_sync()


@pytest.fixture(scope="module")
def reference(runtime) -> dict[str, Any]:
    return _call(create_app(runtime, MODEL), "POST", CHAT, REFERENCE).json()["choices"][0]["message"]


def _request(client: httpx.AsyncClient, method: str, path: str, body: Any = None,
                   headers: dict[str, Any] | None = None, timeout_s: float = 120.0):
    kwargs: dict[str, Any] = {"headers": headers or {}}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["content"] = json.dumps(body).encode("utf-8", "surrogatepass")
    return asyncio.wait_for(client.request(method, path, **kwargs), timeout_s)


def _call_many(app, calls: list[tuple[str, str, Any, dict[str, Any]]], concurrency: int = 16) -> list[httpx.Response]:
    """Sends ``(method, path, body, headers)`` calls, ``concurrency`` at a time (the engine batches
    the valid ones); a call that takes longer than its timeout fails the test (a hang)."""

    async def go() -> list[httpx.Response]:
        gate = asyncio.Semaphore(concurrency)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            async def one(call: tuple[str, str, Any, dict[str, Any]]) -> httpx.Response:
                async with gate:
                    return await _request(client, *call)

            return await asyncio.gather(*(one(c) for c in calls))

    return asyncio.run(go())


def _call(app, method: str, path: str, body: Any = None, headers: dict[str, Any] | None = None) -> httpx.Response:
    return _call_many(app, [(method, path, body, headers or {})])[0]


def _assert_clean(runtime: AgentRuntime) -> None:
    def idle(engine) -> bool:
        return not engine.has_unfinished()

    for _ in range(600):
        if runtime.call_threadsafe(idle).result(timeout=30):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert runtime.call_threadsafe(idle).result(timeout=30), "requests left in flight"
    runtime.call_threadsafe(lambda e: e.check_integrity()).result(timeout=30)
    assert runtime.call_threadsafe(lambda e: sum(b.ref_cnt for b in e.pool.blocks)).result(timeout=30) == 0


def _error_body(response: httpx.Response, path: str = "") -> dict[str, Any]:
    """The error of a 4xx: OpenAI's body, or Anthropic's on its Messages routes (``path``)."""
    body = response.json()
    err = body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(err) == {"type", "message"} and err["message"], body
        return err
    assert set(err) == ERROR_FIELDS and isinstance(err["message"], str) and err["message"], err
    return err


# -- schemathesis ------------------------------------------------------------------------------
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
#: Every route; a body can break the schema (negative mode), a route without inputs cannot.
ROUTES = [("GET", "/health", POSITIVE), ("GET", "/v1/models", POSITIVE), ("GET", "/metrics", POSITIVE),
          ("POST", CHAT, POSITIVE), ("POST", CHAT, NEGATIVE),
          ("POST", "/v1/completions", POSITIVE), ("POST", "/v1/completions", NEGATIVE),
          ("POST", "/v1/responses", POSITIVE), ("POST", "/v1/responses", NEGATIVE),
          ("POST", "/v1/messages", POSITIVE), ("POST", "/v1/messages", NEGATIVE)]
#: Statuses schemathesis saw, per route (read by the summary test below).
SEEN: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def api_schema(runtime):
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(runtime, MODEL))


def _tiny(case) -> None:
    """Caps the generation a fuzzed body asks for: the point is the input, not long runs on a CPU."""
    if not isinstance(case.body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = case.body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_TOKENS:
            case.body[name] = MAX_TOKENS
    # NOTE: a null limit is the server's default (the rest of the context): capped as absent
    if "input" in case.body and case.body.get("max_output_tokens") is None:
        case.body["max_output_tokens"] = MAX_TOKENS
    elif case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = MAX_TOKENS


@pytest.mark.parametrize(("method", "path", "mode"), ROUTES)
def test_schemathesis_every_route_answers_below_500(api_schema, method: str, path: str, mode) -> None:
    # NOTE: schemathesis' own pytest plugin (``from_fixture``) does not run under pytest 9; its
    # strategies do, driven here by hypothesis.
    operation = api_schema[path][method]
    examples = 30 if method == "POST" else 5

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def check(case) -> None:
        _tiny(case)
        response = case.call()
        SEEN[(path, response.status_code)] += 1
        assert response.status_code < 500, response.text[:500]
        if response.status_code >= 400:
            _error_body(response, path)

    check()


def test_schemathesis_left_nothing_behind(runtime, reference) -> None:
    # NOTE: runs after the parametrized test above (file order).
    assert {path for path, _ in SEEN} >= {"/health", "/v1/models", "/metrics", CHAT, "/v1/completions",
                                          "/v1/responses", "/v1/messages"}
    assert any(status == 200 for path, status in SEEN if path == CHAT)
    assert any(400 <= status < 500 for path, status in SEEN if path == CHAT)
    _assert_clean(runtime)
    again = _call(create_app(runtime, MODEL), "POST", CHAT, REFERENCE).json()["choices"][0]["message"]
    assert again == reference


# -- the hostile corpus ------------------------------------------------------------------------
def test_hostile_corpus_gets_only_4xx_with_an_openai_body(runtime, reference) -> None:
    app = create_app(runtime, MODEL, api_key=KEY, default_max_tokens=MAX_TOKENS)
    cases = corpus(random.Random(0), 60)
    assert len(cases) >= 300
    calls = []
    for _, path, body, headers in cases:
        # NOTE: bytes, so that a non-ASCII key reaches the server as the client sent it.
        hdrs = {"Authorization": f"Bearer {KEY}", "content-type": "application/json", **headers}
        calls.append(("GET" if body is None else "POST", path, body, {k: v.encode("utf-8") for k, v in hdrs.items()}))
    statuses: Counter[int] = Counter()
    kinds = Counter(name.split(":")[0] for name, *_ in cases)
    wrong: list[str] = []
    for (name, path, *_), r in zip(cases, _call_many(app, calls), strict=True):
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            wrong.append(f"{name}: {r.status_code} {r.text[:200]}")
        elif r.status_code != 200:
            try:
                _error_body(r, path)
            except (AssertionError, ValueError, KeyError) as exc:
                wrong.append(f"{name}: {r.status_code} without an OpenAI error body ({exc})")
    assert not wrong, wrong[:10]
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= 300
    # every family of hostile input was tried
    assert {"type", "nonfinite", "raw", "size", "depth", "ids", "prompt", "schema", "tool_choice", "field",
            "messages", "auth", "random", "response_format"} <= set(kinds)
    _assert_clean(runtime)
    again = _call(app, "POST", CHAT, REFERENCE, {"Authorization": f"Bearer {KEY}"}).json()
    assert again["choices"][0]["message"] == reference


def test_the_families_that_must_be_rejected_are(runtime) -> None:
    """The cases no server may accept: each is a 4xx naming what is wrong."""
    app = create_app(runtime, MODEL)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases: list[tuple[Any, int]] = [
        (json.dumps(chat)[:-1].encode() + b', "temperature": NaN}', 400),
        (json.dumps(chat)[:-1].encode() + b', "top_p": Infinity}', 400),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
        (json.dumps({**chat, "messages": [{"role": "user", "content": "a" * (10 << 20)}]}).encode(), 413),
        ((json.dumps(chat)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}").encode(), 400),
        ({**chat, "messages": [{"role": "user", "content": "word " * 3000}]}, 400),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}],
          "tool_choice": "required"}, 400),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          "tool_choice": {"type": "function", "function": {"name": "rm"}}}, 400),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}}, 400),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          "tool_choice": "required", "response_format": {"type": "json_object"}}, 400),
    ]
    for body, status in cases:
        r = _call(app, "POST", CHAT, body, {"content-type": "application/json"})
        assert r.status_code == status, (str(body)[:80], r.status_code, r.text[:200])
        _error_body(r)
    for ids in ([10**9], [-1], [49152], [1.5], []):
        r = _call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2})
        assert r.status_code == 400 and _error_body(r)["param"] == "prompt", (ids, r.text)
    _assert_clean(runtime)
