"""A bad request hurts only itself: caps, validation, auth on every route, error isolation,
against uvicorn over the real SmolLM2 (the bounded queue and the shutdown drain:
``test_server_queue.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from agent_runtime.server.auth import key_matches
from asymcache_core.batched_sampling import SampledRows
from asymcache_core.sampler import NON_FINITE
from tests.agent_runtime.live_server import failing_steps
from tests.agent_runtime.uvicorn_server import Server
from tests.conftest import make_engine

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
BODY_CAP = 64 * 1024
FAIL_SEED = 424242


@pytest.fixture(scope="module")
def srv(smollm) -> Iterator[Server]:
    engine = make_engine(smollm, max_model_len=1024)
    sampler = engine.runner.sampler
    original = sampler.sample_on_device

    def faulty(logits, request_ids, params, draws, *histories, **options):
        # NOTE: a fault injected into one request's sampling (its row drawn with no finite
        # logit from its third token on): only it may fail.
        drawn = original(logits, request_ids, params, draws, *histories, **options)
        bad = [p.seed == FAIL_SEED and d >= 2 for p, d in zip(params, draws, strict=True)]
        marks = torch.tensor(bad, device=drawn.tokens.device)
        return SampledRows(drawn.tokens, marks if drawn.failed is None else drawn.failed | marks)

    sampler.sample_on_device = faulty
    runtime = AgentRuntime(engine)
    server = Server(create_app(runtime, MODEL, max_request_body_bytes=BODY_CAP), runtime)
    try:
        yield server
    finally:
        server.stop()
        runtime.close_sync()


def _post(srv: Server, body, path: str = CHAT, client: httpx.Client | None = None, **kw) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    c = client or httpx
    return c.post(f"{srv.base}{path}", timeout=60, headers={"content-type": "application/json"}, **kwargs, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


SAMPLING_CASES = [
    ("temperature", 1e-300), ("temperature", 1e6), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("top_k", -7), ("min_p", 3.0), ("presence_penalty", 9.0), ("frequency_penalty", -9.0),
    ("repetition_penalty", 0.0), ("max_tokens", 10**12), ("stop", ["x" * 5000]),
    ("logit_bias", {"10000000": 5}), ("logit_bias", {"5": 1000}), ("stop_token_ids", [10**9]),
]


@pytest.mark.parametrize("field,value", SAMPLING_CASES, ids=[f"{f}={str(v)[:20]}" for f, v in SAMPLING_CASES])
def test_sampling_values_the_sampler_cannot_take_are_a_400(srv, field, value):
    err = _error(_post(srv, {"model": MODEL, "messages": USER, field: value}), 400)
    assert err["param"].split("[")[0] == field
    srv.clean()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_a_400(srv, literal):
    raw = '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + "}"
    assert _error(_post(srv, raw.encode()), 400)["param"] == "temperature"


UNSUPPORTED = [("echo", True), ("best_of", 3), ("n", 0),
               ("guided_whitespace_pattern", " "), ("functions", [{"name": "f"}]), ("suffix", "x"),
               # vLLM's fields that change what is generated or returned, not served here
               ("watermarking", True), ("priority", 5), ("truncation_side", "right"),
               ("add_special_tokens", True), ("logprob_token_ids", [5]),
               ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}), ("kv_transfer_params", {"x": 1})]


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
def test_unsupported_openai_fields_are_a_400_naming_them(srv, field, value):
    path = "/v1/completions" if field in ("best_of", "suffix") else CHAT  # echo: chat's, not served
    body = {"model": MODEL, "prompt": "hi"} if path != CHAT else {"model": MODEL, "messages": USER}
    assert _error(_post(srv, {**body, field: value}, path), 400)["param"] == field


def test_off_values_of_unsupported_fields_are_accepted(srv):
    r = _post(srv, {"model": MODEL, "messages": USER, "max_tokens": 2, "logprobs": False, "n": 1,
                    "response_format": {"type": "text"}, "top_logprobs": None, "priority": 0,
                    "include_reasoning": True, "truncation_side": "left", "add_special_tokens": False})
    assert r.status_code == 200, r.text


def test_logit_bias_and_penalties_change_the_output(srv):
    prompt = list(range(300, 320))
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
            "temperature": 0}
    plain = _post(srv, base, "/v1/completions").json()["choices"][0]["token_ids"]
    again = _post(srv, {**base, "presence_penalty": 0.0, "logit_bias": {}}, "/v1/completions").json()
    assert again["choices"][0]["token_ids"] == plain  # off means off: greedy is unchanged
    forced = _post(srv, {**base, "logit_bias": {"1234": 100}}, "/v1/completions").json()
    assert forced["choices"][0]["token_ids"] == [1234] * 6
    penalised = _post(srv, {**base, "logit_bias": {"1234": 100}, "frequency_penalty": 2.0,
                            "presence_penalty": 2.0, "repetition_penalty": 2.0}, "/v1/completions").json()
    assert penalised["choices"][0]["token_ids"][0] == 1234
    srv.clean()


def test_body_over_the_cap_is_a_413_and_the_server_goes_on(srv):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * (BODY_CAP + 10)}]}).encode()
    err = _error(r := _post(srv, big), 413)
    assert err["code"] == "request_too_large" and r.headers["connection"] == "close"

    def chunks():
        for _ in range(BODY_CAP // 4096 + 4):
            yield b" " * 4096  # no Content-Length: the cap is counted on the stream

    r = httpx.post(f"{srv.base}{CHAT}", content=chunks(), timeout=60)
    assert _error(r, 413)["code"] == "request_too_large"
    assert _post(srv, {"model": MODEL, "messages": USER, "max_tokens": 2}).status_code == 200
    srv.clean()


def test_prompt_longer_than_any_context_is_rejected_before_tokenizing(srv):
    encoder = srv.runtime._client.encoder
    text = "x" * (encoder.max_chars + 1)
    calls = []
    original = encoder.tokenizer.encode
    encoder.tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        err = _error(_post(srv, {"model": MODEL, "prompt": text[: BODY_CAP - 200]}, "/v1/completions"), 400)
        assert err["param"] == "prompt"  # over max_model_len after tokenizing (short enough to tokenize)
        with pytest.raises(ValueError, match="characters cannot fit"):
            encoder.check(text)
        assert encoder.max_chars >= 1024
    finally:
        encoder.tokenizer.encode = original
    srv.clean()


@pytest.mark.parametrize("depth", [65, 2000, 30_000])
def test_deep_json_is_a_400(srv, depth):
    raw = ('{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}], "x": '
           + "[" * depth + "]" * depth + "}").encode()
    assert _error(_post(srv, raw), 400)["code"] == "invalid_json"


def test_deep_tool_schema_is_a_400(srv):
    node: dict = {"type": "string"}
    for _ in range(80):
        node = {"type": "object", "properties": {"a": node}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": node}}]
    assert _error(_post(srv, {"model": MODEL, "messages": USER, "tools": tools}), 400)["code"] == "invalid_json"


def test_lone_surrogate_is_a_400(srv):
    raw = ('{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "a\\ud800b"}]}').encode()
    err = _error(_post(srv, raw), 400)
    assert err["param"] == "messages[0].content"
    raw = ('{"model": "' + MODEL + '", "prompt": "\\udfff"}').encode()
    assert _error(_post(srv, raw, "/v1/completions"), 400)["param"] == "prompt"


BAD_SCHEMAS = [
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
]


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=["pattern", "range", "ref"])
@pytest.mark.parametrize("choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
                         ids=["default", "auto", "none", "required", "named"])
def test_schema_xgrammar_cannot_compile_is_a_400_under_every_tool_choice(srv, schema, choice):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    if choice is not None:
        body["tool_choice"] = choice
    err = _error(_post(srv, body), 400)
    assert err["param"] == "tools[0].function.parameters"
    srv.clean()


def test_an_exception_in_a_route_is_a_json_500_and_the_connection_survives(srv, monkeypatch):
    async def broken(*args, **kwargs):
        raise KeyError("handler bug")

    monkeypatch.setattr(srv.runtime, "start_chat_choices", broken)
    with httpx.Client() as client:
        err = _error(_post(srv, {"model": MODEL, "messages": USER}, client=client), 500)
        assert err["type"] == "server_error" and "handler bug" in err["message"]
        monkeypatch.undo()
        ok = _post(srv, {"model": MODEL, "messages": USER, "max_tokens": 2}, client=client)
        assert ok.status_code == 200  # same pooled connection, still usable
    srv.clean()


def _stream(srv: Server, body: dict) -> list[str]:
    with httpx.stream("POST", f"{srv.base}{CHAT}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_request_that_fails_in_a_step_fails_alone(srv):
    """An injected sampler fault in one of four concurrent streams: it gets an error event and
    ``[DONE]``; the other three stream to their end; nothing leaks."""
    good = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 12,
            "ignore_eos": True}
    bad = {**good, "temperature": 1.0, "seed": FAIL_SEED}
    results: dict[int, list[str]] = {}

    def run(i: int, body: dict) -> None:
        results[i] = _stream(srv, body)

    threads = [threading.Thread(target=run, args=(i, bad if i == 1 else good)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, lines in results.items():
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        events = [json.loads(line[6:]) for line in lines[:-1]]
        if i == 1:
            assert events[-1]["error"]["code"] == "request_failed"
            assert NON_FINITE in events[-1]["error"]["message"]
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("error" in e for e in events)
    assert len(results) == 4
    r = _post(srv, {**bad, "stream": False})
    assert _error(r, 500)["type"] == "server_error"
    srv.clean()


def test_a_failing_choice_ends_its_response_and_frees_every_choice(srv):
    """``n=3`` seeded so that choice 1 samples with the faulty seed: the stream ends with an
    error event and ``[DONE]``, the JSON response is a 500, and no choice keeps its blocks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 40,
            "ignore_eos": True, "temperature": 1.0, "seed": FAIL_SEED - 1, "n": 3}
    lines = _stream(srv, body)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_failed"
    srv.clean()
    assert _error(_post(srv, body), 500)["type"] == "server_error"
    srv.clean()


def test_api_key_guards_the_v1_routes_and_the_resets_as_vllm_does(srv):
    # NOTE: vLLM's rule: Prometheus, the Gateway API's endpoint picker and load balancers scrape
    # and probe /metrics, /health, /ping and /version with no key
    app = create_app(srv.runtime, MODEL, api_key="sekret")
    open_paths = ("/metrics", "/health", "/ping", "/version", "/docs", "/openapi.json")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            out = {p: (await c.get(p)).status_code for p in (*open_paths, "/v1/models", "/v1", "/nope")}
            out["post"] = (await c.post(CHAT, json={"model": MODEL, "messages": USER})).status_code
            out["tokenize"] = (await c.post("/tokenize", json={"prompt": "hi"})).status_code
            out["reset"] = (await c.post("/reset_prefix_cache")).status_code
            out["non-ascii"] = (await c.get("/v1/models", headers={"Authorization": "Bearer ключ".encode()})).status_code
            out["latin1"] = (await c.get("/v1/models", headers={"Authorization": b"Bearer s\xe9kret"})).status_code
            out["keyed"] = (await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code
            out["x-api-key"] = (await c.get("/v1/models", headers={"x-api-key": "sekret"})).status_code
            return out

    out = asyncio.run(main())
    assert out == {**dict.fromkeys(open_paths, 200), "/v1/models": 401, "/v1": 401, "/nope": 404, "post": 401,
                   "tokenize": 200, "reset": 401, "non-ascii": 401, "latin1": 401, "keyed": 200, "x-api-key": 200}
    assert key_matches(b"Bearer sekret", "sekret") and key_matches(b"bearer  sekret ", "sekret")
    assert not key_matches(b"Bearer \xff\xfe", "sekret") and not key_matches(None, "sekret")


def test_an_exception_in_the_model_step_fails_only_its_culprit_and_serving_goes_on(srv):
    """Four concurrent streams; the forward pass raises whenever one of them (``max_tokens``
    29) is in the step, and once more for a whole step. The culprit gets an error event and
    ``[DONE]``; the other three stream to their end (the engine retries the step without it)."""
    runner = srv.runtime.engine.runner
    original = runner.execute
    calls = {"n": 0, "whole_step": 0}

    def flaky(plan):
        calls["n"] += 1
        if any(item.request.params.max_tokens == 29 for item in plan.scheduled):
            raise RuntimeError("injected forward-pass fault")
        # NOTE: the one-off fault hits a step of several innocent requests (a retry of one
        # request alone would make that request its culprit): the retry of its halves passes.
        if not calls["whole_step"] and len(plan.scheduled) >= 2:
            calls["whole_step"] = 1
            raise RuntimeError("injected forward-pass fault")
        return original(plan)

    good = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 30,
            "ignore_eos": True}
    bodies = [good, good, {**good, "max_tokens": 29}, good]
    results: dict[int, list[str]] = {}
    srv.engine(lambda e: setattr(e.runner, "execute", flaky))
    try:
        threads = [threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, _stream(srv, b)))
                   for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        srv.engine(lambda e: setattr(e.runner, "execute", original))
    assert len(results) == 4 and calls["whole_step"] == 1
    for i, lines in results.items():
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        last = json.loads(lines[-2][6:])
        if i == 2:
            assert "injected forward-pass fault" in last["error"]["message"]
        else:
            assert "error" not in last
            assert last["choices"][0]["finish_reason"] == "length"
    srv.clean()
    assert _post(srv, {"model": MODEL, "messages": USER, "max_tokens": 2}).status_code == 200


def test_a_responses_stream_that_fails_ends_with_response_failed(srv):
    """A Responses stream whose request fails in a step: an ``error`` event, then the spec's
    terminal ``response.failed`` with status failed and the error; nothing is left running."""
    with failing_steps(srv, 27), httpx.stream("POST", f"{srv.base}/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Count to ten.", "max_output_tokens": 27, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "injected forward-pass fault" in failed["error"]["message"]
    assert failed["error"]["code"] == "server_error"
    srv.clean()


def test_a_batch_whose_later_prompt_is_refused_leaves_none_running(srv):
    # NOTE: the first prompt's choices are submitted (and running) when the second is refused
    too_long = list(range(300, 300 + srv.runtime.max_model_len + 5))
    body = {"model": MODEL, "prompt": [list(range(300, 340)), too_long], "n": 2, "max_tokens": 900,
            "ignore_eos": True}
    refused = _post(srv, body, "/v1/completions")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    deadline = time.monotonic() + 5  # 2 x 900 tokens would run for minutes on a CPU
    while srv.runtime.call_threadsafe(lambda e: e.has_unfinished()).result(timeout=30):
        assert time.monotonic() < deadline, "a refused batch left choices running"
        time.sleep(0.1)
    srv.clean()


def test_a_completion_cancelled_between_its_choices_leaves_none_running(srv, monkeypatch):
    # NOTE: the echoed prompt is decoded after the choices are submitted; a client gone there
    # (the handler cancelled) must abort the choices already running
    async def gone(token_ids):
        raise asyncio.CancelledError

    monkeypatch.setattr(srv.runtime, "detokenize", gone)
    body = {"model": MODEL, "prompt": list(range(300, 340)), "n": 3, "echo": True, "max_tokens": 900,
            "ignore_eos": True}
    with contextlib.suppress(httpx.HTTPError):
        _post(srv, body, "/v1/completions")
    deadline = time.monotonic() + 5  # 3 x 900 tokens would run for minutes on a CPU
    while srv.runtime.call_threadsafe(lambda e: e.has_unfinished()).result(timeout=30):
        assert time.monotonic() < deadline, "choices left running"
        time.sleep(0.1)
    srv.runtime.call_threadsafe(lambda e: e.check_integrity()).result(timeout=30)
