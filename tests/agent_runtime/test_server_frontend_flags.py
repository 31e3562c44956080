"""vLLM's frontend flags over HTTP (``create_app(..., frontend=FrontendOptions(...))``): CORS,
``root_path`` (the key still asked for under the prefix), the docs routes, ``max_logprobs``,
forced usage, request logging and the chat reply's role."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import ServeOptions, create_app
from agent_runtime.server.frontend import FrontendOptions
from tests.conftest import make_engine

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def runtime(smollm):
    rt = AgentRuntime(make_engine(smollm, max_model_len=256, num_kv_blocks=64))
    yield rt
    rt.close_sync()


def _client(runtime, api_key: str | None = None, **frontend) -> TestClient:
    return TestClient(create_app(runtime, "m", api_key, frontend=FrontendOptions(**frontend)))


def test_cors_is_off_by_default_and_on_for_the_allowed_origins(runtime):
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    with _client(runtime, api_key="k") as client:
        r = client.get("/health", headers={"Origin": "https://ui.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert client.options("/v1/chat/completions", headers=preflight).status_code in (400, 401, 405)
    with _client(runtime, api_key="k", allowed_origins=["https://ui.example"], allow_credentials=True,
                 allowed_methods=["POST"]) as client:
        # a preflight carries no key: answered before the key is asked for (vLLM lets OPTIONS through)
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = client.options("/v1/chat/completions", headers={**preflight, "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 400
        r = client.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"
        r = client.get("/v1/models", headers={"Origin": "https://other.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_root_path_serves_under_the_prefix_and_keeps_the_key(runtime):
    with _client(runtime, api_key="k", root_path="/api") as client:
        for path in ("/api/v1/models", "/v1/models"):
            assert client.get(path).status_code == 401, path
            r = client.get(path, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m", path
        assert client.get("/api/health").status_code == 200
        assert client.get("/api/openapi.json").json()["servers"] == [{"url": "/api"}]
    with _client(runtime, root_path="/api/") as client:
        assert client.get("/api/v1/models").status_code == 200 and client.get("/v1/models").status_code == 200


def test_disable_fastapi_docs_drops_the_docs_routes(runtime):
    with _client(runtime) as client:
        assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200
    with _client(runtime, disable_fastapi_docs=True) as client:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert client.get(path).status_code == 404, path
        assert client.get("/health").status_code == 200


def test_max_logprobs_caps_the_requests_with_vllms_message(runtime):
    with _client(runtime, max_logprobs=2) as client:
        for path, body, field in (
            ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
            ("/v1/completions", {"prompt": "Hi", "logprobs": 3}, "logprobs"),
            ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 5}, "prompt_logprobs"),
            ("/v1/responses", {"input": "Hi", "top_logprobs": 3, "store": False}, "top_logprobs"),
        ):
            r = client.post(path, json={"model": "m", "max_tokens": 2, "max_output_tokens": 2, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and "which is greater than max allowed: 2" in error["message"], r.text
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2, "logprobs": 2,
                                                 "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    with _client(runtime) as client:
        # vLLM's default cap, 20, with its message
        for path, body, field in (
            ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
            ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ):
            r = client.post(path, json={"model": "m", "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert r.json()["error"]["message"] in (
                "Requested sample logprobs of 21, which is greater than max allowed: 20",
                "Requested prompt logprobs of 21, which is greater than max allowed: 20"), r.text


def _stream(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={"model": "m", "max_tokens": 3, "ignore_eos": True, "stream": True,
                                           **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_force_include_usage_reports_usage_on_every_stream(runtime):
    with _client(runtime) as client:
        chunks = _stream(client, "/v1/chat/completions", {"messages": USER})
        assert all("usage" not in c or c["usage"] is None for c in chunks)
    with _client(runtime, enable_force_include_usage=True) as client:
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})):
            chunks = _stream(client, path, body)
            # vLLM's should_include_usage: final usage and continuous usage, as if both were asked for
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3, chunks[-1]
            assert all(c["usage"] is not None for c in chunks), chunks


def test_enable_log_requests_logs_each_completion(runtime, caplog):
    caplog.set_level(logging.INFO, logger="agent_runtime.server.requests_log")
    with _client(runtime) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1})
    assert not [r for r in caplog.records if r.name == "agent_runtime.server.requests_log"]
    with _client(runtime, enable_log_requests=True) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1},
                        headers={"X-Request-Id": "abc"})
        client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1})
    logged = [r.getMessage() for r in caplog.records if r.name == "agent_runtime.server.requests_log"]
    assert len(logged) == 2 and logged[0].startswith("Received request cmpl-abc: params: "), logged
    assert "max_tokens=1" in logged[0] and logged[1].startswith("Received request chatcmpl-")


def test_response_role_names_the_reply_after_a_generation_prompt(runtime):
    with _client(runtime, response_role="bot") as client:
        body = {"model": "m", "messages": USER, "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "bot", r.text
        chunks = _stream(client, "/v1/chat/completions", {"messages": USER})
        assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
        # vLLM's get_chat_request_role: without the generation prompt, the last message's role
        r = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})
        assert r.json()["choices"][0]["message"]["role"] == "user", r.text
    with _client(runtime) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 2})
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("kwargs,field", [
    ({"allowed_origins": "*"}, "allowed_origins"),
    ({"allowed_headers": [1]}, "allowed_headers"),
    ({"root_path": "api"}, "root_path"),
    ({"max_logprobs": 21}, "max_logprobs"),
    ({"max_logprobs": -1}, "max_logprobs"),
    ({"response_role": " "}, "response_role"),
    ({"allow_credentials": "yes"}, "allow_credentials"),
])
def test_bad_frontend_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        FrontendOptions(**kwargs)


def test_serve_options_route_the_frontend_flags_and_check_the_tls_files(tmp_path):
    opts = ServeOptions.from_kwargs({"max_logprobs": 5, "root_path": "/api", "device": "cpu"})
    assert (opts.frontend.max_logprobs, opts.frontend.root_path) == (5, "/api")
    assert dict(opts.engine_settings) == {"device": "cpu"}
    assert ServeOptions.from_kwargs({}).frontend == FrontendOptions()
    assert FrontendOptions(root_path="/api/").root_path == "/api" and FrontendOptions(root_path="/").root_path == ""
    with pytest.raises(ValueError, match="^ssl_keyfile: cannot read"):
        ServeOptions(ssl_keyfile=str(tmp_path / "missing.pem"))


def test_max_log_len_cuts_the_logged_body_as_vllm_does(runtime, caplog):
    caplog.set_level(logging.DEBUG, logger="agent_runtime.server.requests_log")
    body = {"model": "m", "prompt": "Hi there, a prompt longer than the cap", "max_tokens": 1}
    whole = ""
    for max_log_len in (None, 12, 0):
        caplog.clear()
        with _client(runtime, enable_log_requests=True, max_log_len=max_log_len) as client:
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc"})
        lines = [r.getMessage() for r in caplog.records if r.name == "agent_runtime.server.requests_log"]
        (logged,) = [line for line in lines if line.startswith("Request cmpl-abc JSON body: ")]
        if max_log_len is None:
            whole = logged.removeprefix("Request cmpl-abc JSON body: ")
            assert json.loads(whole) == body
        # vLLM's log_request_body: the body's JSON cut to its first max_log_len characters
        assert logged == "Request cmpl-abc JSON body: " + whole[:max_log_len], logged
        # the INFO line (the parameters) is not cut, as vLLM's log_inputs'
        assert any(line.startswith("Received request cmpl-abc: params: ") and "max_tokens=1" in line
                   for line in lines), lines
    with pytest.raises(ValueError, match="^max_log_len: must be an integer >= 0"):
        FrontendOptions(max_log_len=-1)


def test_continuous_usage_chunks_carry_counts_and_the_final_chunk_the_cache_details(runtime):
    """vLLM 0.32: a continuous-usage chunk's usage is the choice's prompt, tokens so far and
    total; ``prompt_tokens_details`` only on the final usage chunk (chat and completions)."""
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with _client(runtime) as client:
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})):
            chunks = _stream(client, path, {**body, **options})
            *running, final = chunks
            assert running and all(set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
                                   for c in running), running
            assert running[-1]["usage"]["completion_tokens"] == 3
            assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
            assert final["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0, final
            r = client.post(path, json={"model": "m", "max_tokens": 1, **body})
            assert "cached_tokens" in r.json()["usage"]["prompt_tokens_details"], r.text
