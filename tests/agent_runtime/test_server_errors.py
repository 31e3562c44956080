"""The live server's errors, auth and disconnects: bad input is a 4xx with an OpenAI error body
(raw and through the openai client), the API key guards /v1, and a client that leaves frees its
request and every choice."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, TOOLS, Live


def _bad_cases() -> list[tuple[str, str, object, int, str | None, str | None]]:
    user = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    return [
        ("malformed json", chat, b'{"model": "smollm2-135m", "messages": [', 400, None, "invalid_json"),
        ("body not an object", chat, b"[1, 2]", 400, None, "invalid_json"),
        ("unknown model", chat, {"model": "gpt-9", "messages": user}, 404, "model", "model_not_found"),
        ("missing messages", chat, {"model": MODEL}, 400, "messages", None),
        ("bad role", chat, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
        ("prompt over max_model_len", chat, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1100}]},
         400, "messages", "context_length_exceeded"),
        ("invalid tool schema", chat, {"model": MODEL, "messages": user, "tools": [
            {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}]},
         400, "tools[0].function.name", None),
        ("tool param type", chat, {"model": MODEL, "messages": user, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": {"type": "strng"}}}}}]},
         400, "tools[0].function.parameters.properties.x.type", None),
        ("bad tool_choice", chat, {"model": MODEL, "messages": user, "tools": TOOLS, "tool_choice": "sometimes"},
         400, "tool_choice", None),
        ("required without tools", chat, {"model": MODEL, "messages": user, "tool_choice": "required"},
         400, "tool_choice", None),
        ("unknown named tool", chat, {"model": MODEL, "messages": user, "tools": TOOLS,
                                      "tool_choice": {"type": "function", "function": {"name": "rm"}}},
         400, "tool_choice.function.name", None),
        ("zero max_tokens", chat, {"model": MODEL, "messages": user, "max_tokens": 0}, 400, "max_tokens", None),
        ("negative max_tokens", chat, {"model": MODEL, "messages": user, "max_tokens": -5}, 400, "max_tokens", None),
        ("bad temperature", chat, {"model": MODEL, "messages": user, "temperature": "hot"}, 400, "temperature", None),
        ("bad job_id", chat, {"model": MODEL, "messages": user, "job_id": 7}, 400, "job_id", None),
        ("bad prompt", "/v1/completions", {"model": MODEL, "prompt": {"x": 1}}, 400, "prompt", None),
        ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", None),
        ("negative completion max_tokens", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -1},
         400, "max_tokens", None),
        ("model of another type", chat, {"model": 7, "messages": user}, 404, "model", "model_not_found"),
        ("string max_tokens", chat, {"model": MODEL, "messages": user, "max_tokens": "8"}, 400, "max_tokens", None),
        ("bad max_completion_tokens", chat, {"model": MODEL, "messages": user, "max_completion_tokens": 0},
         400, "max_completion_tokens", None),
        ("n over 16", chat, {"model": MODEL, "messages": user, "n": 17}, 400, "n", None),
        ("n zero", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n", None),
        ("n > 1 in a job", chat, {"model": MODEL, "messages": user, "n": 2, "job_id": "j"}, 400, "job_id", None),
        ("top_p zero", chat, {"model": MODEL, "messages": user, "top_p": 0}, 400, "top_p", None),
        ("bad stop", chat, {"model": MODEL, "messages": user, "stop": ["ok", ""]}, 400, "stop", None),
        ("bad ignore_eos", chat, {"model": MODEL, "messages": user, "ignore_eos": "yes"}, 400, "ignore_eos", None),
        ("bad is_last_step", chat, {"model": MODEL, "messages": user, "is_last_step": 1}, 400, "is_last_step", None),
        ("bad stream", chat, {"model": MODEL, "messages": user, "stream": "yes"}, 400, "stream", None),
        ("stream_options without stream", chat, {"model": MODEL, "messages": user,
                                                 "stream_options": {"include_usage": True}}, 400, "stream_options",
         None),
        ("bad include_usage", chat, {"model": MODEL, "messages": user, "stream": True,
                                     "stream_options": {"include_usage": "y"}}, 400, "stream_options.include_usage", None),
        ("message not an object", chat, {"model": MODEL, "messages": [user[0], "hi"]}, 400, "messages[1]", None),
        ("null user content", chat, {"model": MODEL, "messages": [{"role": "user", "content": None}]},
         400, "messages[0].content", None),
        ("tool_call_id not a string", chat, {"model": MODEL, "messages": [
            *user, {"role": "tool", "tool_call_id": 5, "content": "x"}]}, 400, "messages[1].tool_call_id", None),
        ("bad tool call in history", chat, {"model": MODEL, "messages": [*user, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]},
         400, "messages[1].tool_calls[0].function.name", None),
        ("user not a string", chat, {"model": MODEL, "messages": user, "user": 5}, 400, "user", None),
        ("tool strict not a boolean", chat, {"model": MODEL, "messages": user, "tools": [
            {"type": "function", "function": {"name": "f", "strict": "x"}}]}, 400, "tools[0].function.strict", None),
        ("tools not a list", chat, {"model": MODEL, "messages": user, "tools": TOOLS[0]}, 400, "tools", None),
        ("mixed prompt batch", "/v1/completions", {"model": MODEL, "prompt": ["a", [1, 2]]}, 400, "prompt", None),
        ("empty prompt in a batch", "/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt[1]", None),
        ("batch in a job", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "job_id": "j"}, 400, "job_id",
         None),
        ("batch over the bound", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 20, "n": 16}, 400, "prompt",
         None),
        ("bad tool_name", "/v1/completions", {"model": MODEL, "prompt": "a", "tool_name": 3}, 400, "tool_name", None),
        ("tokenize neither", "/tokenize", {"model": MODEL}, 400, "prompt", None),
        ("tokenize both", "/tokenize", {"prompt": "a", "messages": user}, 400, "messages", None),
        ("tokenize bad role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]},
         400, "messages[0].role", None),
        ("tokenize wrong model", "/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model", "model_not_found"),
        ("detokenize out of vocab", "/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", None),
        ("detokenize not ids", "/detokenize", {"tokens": "abc"}, 400, "tokens", None),
        ("bad min_tokens", chat, {"model": MODEL, "messages": user, "min_tokens": -1}, 400, "min_tokens", None),
        ("min_tokens over max_tokens", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 4,
                                                           "min_tokens": 5}, 400, "min_tokens", None),
        ("vLLM's length_penalty", chat, {"model": MODEL, "messages": user, "length_penalty": 2.0},
         400, "length_penalty", "unsupported_field"),
        ("blank bad word", chat, {"model": MODEL, "messages": user, "bad_words": [" "]}, 400, "bad_words", None),
        ("bad skip_special_tokens", chat, {"model": MODEL, "messages": user, "skip_special_tokens": "no"},
         400, "skip_special_tokens", None),
        ("vLLM's beam search", "/v1/completions", {"model": MODEL, "prompt": "a", "use_beam_search": True},
         400, "use_beam_search", "unsupported_field"),
        ("bad parallel_tool_calls", chat, {"model": MODEL, "messages": user, "parallel_tool_calls": "no"},
         400, "parallel_tool_calls", None),
        ("top_logprobs without logprobs", chat, {"model": MODEL, "messages": user, "top_logprobs": 2},
         400, "top_logprobs", None),
        ("top_logprobs over 20", chat, {"model": MODEL, "messages": user, "logprobs": True, "top_logprobs": 21},
         400, "top_logprobs", None),
        ("chat logprobs not a boolean", chat, {"model": MODEL, "messages": user, "logprobs": 2}, 400, "logprobs", None),
        ("completion logprobs over 20", "/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21},
         400, "logprobs", None),
        ("prompt_logprobs over 20", "/v1/completions", {"model": MODEL, "prompt": "a", "prompt_logprobs": 21},
         400, "prompt_logprobs", None),
        ("streamed chat prompt_logprobs", chat, {"model": MODEL, "messages": user, "prompt_logprobs": 1,
                                                 "stream": True}, 400, "prompt_logprobs", None),
        ("chat echo", chat, {"model": MODEL, "messages": user, "echo": True}, 400, "echo", "unsupported_field"),
        ("max_tokens 0 without echo", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0},
         400, "max_tokens", None),
        ("bad echo", "/v1/completions", {"model": MODEL, "prompt": "a", "echo": "yes"}, 400, "echo", None),
    ]


@pytest.mark.parametrize("name,path,body,status,param,code", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_a_4xx_with_openai_error_body(live, name, path, body, status, param, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{live.base}{path}", timeout=30, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def test_bad_input_through_openai_client(live, oa):
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    live.check()


def _wait_all_freed(live: Live) -> None:
    """Every request ends soon after its client left, and no block stays held."""
    deadline = time.monotonic() + 30
    while live.engine(lambda e: e.has_unfinished()):
        assert time.monotonic() < deadline, "a request kept running after its client left"
        time.sleep(0.1)
    assert live.engine(lambda e: sum(b.ref_cnt for b in e.pool.blocks)) == 0


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(live):
    before = live.engine(lambda e: e.counters.generated_tokens)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                got += 1
                if got == 3:
                    break  # leaving the block closes the connection mid-stream
    _wait_all_freed(live)
    generated = live.engine(lambda e: e.counters.generated_tokens) - before
    assert generated < 400
    assert "asymcache_aborted_requests_total 1" in httpx.get(f"{live.base}/metrics", timeout=10).text
    live.check()


def test_api_key(live):
    app = create_app(live.runtime, MODEL, api_key="sekret")  # a second app over the same runtime

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            missing = await c.get("/v1/models")
            wrong = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": []},
                                 headers={"Authorization": "Bearer nope"})
            right = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
            health = await c.get("/health")
            metrics = await c.get("/metrics", headers={"Authorization": "Bearer sekret"})
            return missing, wrong, right, health, metrics

    missing, wrong, right, health, metrics = asyncio.run(main())
    for r in (missing, wrong):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error"
    assert right.status_code == 200 and right.json()["data"][0]["id"] == MODEL
    assert health.status_code == 200
    # each app counts in its own registry
    def unauthorized(text: str) -> float | None:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "asymcache_requests_total" and s.labels == {
                        "endpoint": "/v1/models", "status": "401", "model": MODEL}:
                    return s.value
        return None

    assert unauthorized(metrics.text) == 1
    assert unauthorized(httpx.get(f"{live.base}/metrics", timeout=10).text) is None
    live.check()




def _aborted(live: Live) -> float:
    text = httpx.get(f"{live.base}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "asymcache_aborted_requests_total")


def test_client_disconnect_aborts_every_choice(live):
    before = _aborted(live)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "n": 3,
            "max_tokens": 400, "ignore_eos": True, "temperature": 0.7, "stream": True}
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for got, _line in enumerate(r.iter_lines()):
            if got == 12:
                break  # leaving the block closes the connection mid-stream
    _wait_all_freed(live)
    assert _aborted(live) == before + 3
    live.check()

