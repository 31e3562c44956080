"""vLLM's request options over HTTP: ``continue_final_message`` (the chat rendered open inside
its final message, the reply its continuation; also in Python), ``allowed_token_ids``,
``truncate_prompt_tokens``, ``return_tokens_as_token_ids``, ``request_id`` and the
``X-Request-Id`` header; its ``/ping``; a stated ``max_tokens`` past the context is a 400, as
vLLM's (and Anthropic's, OpenAI's Responses') servers answer it."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from agent_runtime.runtime import AgentRuntime
from asymcache_core import SamplingParams
from tests.agent_runtime.live_server import MODEL, sse
from tests.conftest import make_engine

PREFIX = 'The capital of France is'
MESSAGES = [{"role": "user", "content": "What is the capital of France? One sentence."},
            {"role": "assistant", "content": PREFIX}]


def _post(live, path: str, body: dict) -> httpx.Response:
    # NOTE: greedy unless the body says otherwise: these tests compare replies (the server's
    # default is vLLM's, temperature 1)
    return httpx.post(f"{live.base}{path}", json={"temperature": 0, **body}, timeout=120)


def test_continue_final_message_continues_the_assistant_prefix(live):
    ids = _post(live, "/tokenize", {"messages": MESSAGES, "continue_final_message": True}).json()["tokens"]
    closed = _post(live, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    text = _post(live, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith(PREFIX) and len(closed) > len(ids) and closed[: len(ids) - 1] == ids[:-1]
    chat = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                                                "continue_final_message": True, "add_generation_prompt": False})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    plain = _post(live, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 8}).json()
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    # add_generation_prompt left out reads as false with continue_final_message (vLLM needs it sent)
    again = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                                                 "continue_final_message": True}).json()
    assert again["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
    live.check()


def test_continue_final_message_with_the_generation_prompt_is_a_400(live):
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}), ("/tokenize", {"messages": MESSAGES})):
        r = _post(live, path, {**body, "continue_final_message": True, "add_generation_prompt": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def test_continue_final_message_in_python(smollm, live):
    async def main():
        runtime = AgentRuntime(make_engine(smollm))
        try:
            stream, _ = await runtime.start_chat(
                MESSAGES, params=SamplingParams(max_tokens=8), add_generation_prompt=False, continue_final_message=True
            )
            final = await stream.result()
            ids = await runtime.tokenize(messages=MESSAGES, add_generation_prompt=False, continue_final_message=True)
            try:
                await runtime.start_chat(MESSAGES, continue_final_message=True)
            except ValueError as e:
                refused = str(e)
            return final, ids, refused
        finally:
            await runtime.close()

    final, ids, refused = asyncio.run(main())
    assert final.output.num_prompt_tokens == len(ids) and final.output.text
    assert refused.startswith("continue_final_message:")
    served = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                                                  "continue_final_message": True}).json()
    assert served["choices"][0]["message"]["content"] == final.output.text


def test_allowed_token_ids_restrict_the_sampled_tokens(live):
    base = {"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 6, "ignore_eos": True,
            "return_token_ids": True}
    greedy = _post(live, "/v1/completions", base).json()["choices"][0]["token_ids"]
    allowed = [11, 4096, greedy[0]]
    for extra in ({}, {"temperature": 1.0, "seed": 3}):
        r = _post(live, "/v1/completions", {**base, **extra, "allowed_token_ids": allowed, "logprobs": 1})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["token_ids"]
        assert len(tokens) == 6 and set(tokens) <= set(allowed)
    # the greedy first token is allowed, so it is still the first pick
    assert tokens and _post(live, "/v1/completions", {**base, "allowed_token_ids": allowed}).json()[
        "choices"][0]["token_ids"][0] == greedy[0]
    for bad in ([], [-1], [10**9], "12"):
        r = _post(live, "/v1/completions", {**base, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    live.check()


def test_truncate_prompt_tokens_keeps_the_prompts_end(live):
    ids = list(range(300, 350))
    base = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    cut = _post(live, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": 10}).json()
    tail = _post(live, "/v1/completions", {**base, "prompt": ids[-10:]}).json()
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["prompt_token_ids"] == ids[-10:]
    assert cut["choices"][0]["token_ids"] == tail["choices"][0]["token_ids"]
    whole = _post(live, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 50
    echoed = _post(live, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": 10, "echo": True})
    text = _post(live, "/detokenize", {"tokens": ids[-10:]}).json()["prompt"]
    assert echoed.json()["choices"][0]["text"].startswith(text)
    chat = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES[:1], "max_tokens": 2,
                                                "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5
    for bad in (0, -2, "5"):
        r = _post(live, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    live.check()


def test_return_tokens_as_token_ids_in_log_probabilities(live):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _post(live, "/v1/completions", body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES[:1], "max_tokens": 3,
                                                "logprobs": True, "return_tokens_as_token_ids": True}).json()
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])
    live.check()


def test_skip_special_tokens_false_shows_them_in_the_text(live):
    chat = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    ids = _post(live, "/tokenize", {"messages": chat}).json()["tokens"]
    base = {"model": MODEL, "prompt": ids, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    hidden = _post(live, "/v1/completions", base).json()["choices"][0]
    shown = _post(live, "/v1/completions", {**base, "skip_special_tokens": False}).json()["choices"][0]
    assert shown["token_ids"] == hidden["token_ids"]
    assert "<|im_end|>" in shown["text"] and "<|im_end|>" not in hidden["text"]
    assert shown["text"] == _post(live, "/detokenize", {"tokens": shown["token_ids"]}).json()["prompt"]
    live.check()


def test_bad_words_over_http(live):
    base = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "ignore_eos": True}
    free = _post(live, "/v1/completions", base).json()["choices"][0]["text"]
    clean = _post(live, "/v1/completions", {**base, "bad_words": ["Paris"]}).json()["choices"][0]["text"]
    assert "Paris" in free and "Paris" not in clean
    r = _post(live, "/v1/completions", {**base, "bad_words": "Paris"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    live.check()


def test_stop_reason_in_every_finished_choice(live):
    prompt = "The capital of France is"
    comp = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "stop": ["!", "."], "temperature": 0}
    body = _post(live, "/v1/completions", comp).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == "."
    chunks = sse(live, "/v1/completions", comp)
    assert [c["choices"][0]["stop_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["."]
    length = _post(live, "/v1/completions", {**comp, "max_tokens": 1, "stop": None}).json()["choices"][0]
    assert length["finish_reason"] == "length" and "stop_reason" in length and length["stop_reason"] is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "ignore_eos": True, "temperature": 0}
    assert _post(live, "/v1/chat/completions", chat).json()["choices"][0]["stop_reason"] is None
    # a stop id the reply is sure to sample: its own third token
    first = _post(live, "/tokenize", {"messages": chat["messages"]}).json()["tokens"]
    gen = _post(live, "/v1/completions", {"model": MODEL, "prompt": first, "max_tokens": 8, "ignore_eos": True,
                                          "return_token_ids": True}).json()["choices"][0]["token_ids"]
    stopped = _post(live, "/v1/chat/completions", {**chat, "stop_token_ids": [gen[2]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == gen[2], stopped
    streamed = sse(live, "/v1/chat/completions", {**chat, "stop_token_ids": [gen[2]]})
    assert [c["choices"][0]["stop_reason"] for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]] \
        == [gen[2]]
    live.check()


def test_job_hints_in_vllm_xargs_as_the_plugin_reads_them(live):
    """A client written for a stock vLLM with the AsymCache plugin sends its hints in
    ``vllm_xargs`` (strings and numbers only): the embedded server reads them the same way."""
    decisions = lambda: live.engine(lambda e: list(live.runtime.controller.decisions))  # noqa: E731
    before = len(decisions())
    ids = list(range(300, 340))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    ok = _post(live, "/v1/completions", {**body, "vllm_xargs": {"job_id": "xjob", "is_last_step": 0,
                                                                "tool_name": "grep"}})
    assert ok.status_code == 200, ok.text
    decision = decisions()[-1]
    assert len(decisions()) == before + 1 and (decision.job_id, decision.tool) == ("xjob", "grep")
    # the last step: no pause follows, so no decision; a number job id reads as text
    last = _post(live, "/v1/completions", {**body, "vllm_xargs": {"job_id": "xjob", "is_last_step": "true"}})
    assert last.status_code == 200 and len(decisions()) == before + 1
    # vLLM's session_id names the job when nothing else does; the body's own fields win
    _post(live, "/v1/completions", {**body, "session_id": "sess-1", "tool_name": "ls"})
    assert (decisions()[-1].job_id, decisions()[-1].tool) == ("sess-1", "ls")
    _post(live, "/v1/completions", {**body, "job_id": "own", "vllm_xargs": {"job_id": 42}, "tool_name": "ls"})
    assert decisions()[-1].job_id == "own"
    _post(live, "/v1/completions", {**body, "vllm_xargs": {"job_id": 42}, "tool_name": "ls"})
    assert decisions()[-1].job_id == "42"
    for xargs, param in (({"job_id": "j", "is_last_step": "maybe"}, "vllm_xargs.is_last_step"),
                         ({"job_id": "j", "is_last_step": [1]}, "vllm_xargs.is_last_step"),
                         ({"job_id": "j", "is_last_step": {"a": 1}}, "vllm_xargs.is_last_step"),
                         ({"job_id": {"a": 1}}, "vllm_xargs.job_id"),
                         ({"job_id": True}, "vllm_xargs.job_id"),
                         ({"job_id": "j", "pin_ttl_s": 30}, "vllm_xargs.pin_ttl_s")):
        for path, fields in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = _post(live, path, {**body, **fields, "vllm_xargs": xargs})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = _post(live, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "vllm_xargs": {"job_id": "cj", "is_last_step": 1}})
    assert chat.status_code == 200, chat.text
    live.check()


def test_request_id_names_the_response_and_ping_answers(live):
    # vLLM's request_id: the response's id (each streamed chunk's too), else a fresh one per request
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    named = _post(live, "/v1/chat/completions", {**chat, "request_id": "trace-42"})
    assert named.status_code == 200 and named.json()["id"] == "chatcmpl-trace-42", named.text
    text = _post(live, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": "t-7"})
    assert text.json()["id"] == "cmpl-t-7"
    streamed = sse(live, "/v1/chat/completions", {**chat, "request_id": "s-1"})
    assert streamed and {frame["id"] for frame in streamed} == {"chatcmpl-s-1"}
    ids = {_post(live, "/v1/chat/completions", chat).json()["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-") for i in ids)
    for bad in ("", 7):
        r = _post(live, "/v1/chat/completions", {**chat, "request_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    # an id a header cannot carry (not latin-1) was a 500: it comes back percent-encoded there
    wide = _post(live, "/v1/chat/completions", {**chat, "request_id": "job \u0100-1"})
    assert wide.status_code == 200 and wide.json()["id"] == "chatcmpl-job \u0100-1", wide.text
    assert wide.headers["x-request-id"] == "job%20%C4%80-1"
    # vLLM's X-Request-Id header names the completion over the body's field, and comes back
    headed = httpx.post(f"{live.base}/v1/chat/completions", json={**chat, "request_id": "body-1"},
                        headers={"X-Request-Id": "hdr-1"}, timeout=120)
    assert headed.json()["id"] == "chatcmpl-hdr-1" and headed.headers["x-request-id"] == "hdr-1", headed.text
    assert named.headers["x-request-id"] == "trace-42" and text.headers["x-request-id"] == "t-7"
    with httpx.stream("POST", f"{live.base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                      "stream": True}, headers={"X-Request-Id": "hs-2"}, timeout=120) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.headers["x-request-id"] == "hs-2" and {f["id"] for f in frames} == {"cmpl-hs-2"}
    for bad in ("", "x" * 257):
        r = httpx.post(f"{live.base}/v1/chat/completions", json=chat, headers={"X-Request-Id": bad}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
    # vLLM's /ping (GET and POST): the health check
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{live.base}/ping", timeout=10).status_code == 200
    live.check()


def test_max_tokens_past_the_context_is_a_400_and_runs_nothing(live):
    # NOTE: the prompt counts as the engine would run it; max_model_len is 1024. Without
    # max_tokens a reply runs up to the limit (vLLM's default); with one past it, vLLM's 400.
    prompt = list(range(300, 340))
    before = live.engine(lambda e: e.stats().requests_total)
    text = _post(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 985})
    err = text.json()["error"]
    assert text.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert "maximum context length is 1024 tokens and your request has 40 input tokens" in err["message"]
    cut = _post(live, "/v1/completions", {"model": MODEL, "prompt": list(range(300, 1400)), "max_tokens": 1000,
                                          "truncate_prompt_tokens": 30})
    assert cut.status_code == 400 and "has 30 input tokens" in cut.json()["error"]["message"], cut.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        r = _post(live, "/v1/chat/completions", {**chat, field: 1020})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    streamed = _post(live, "/v1/chat/completions", {**chat, "max_tokens": 1020, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "max_tokens"
    responses = _post(live, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1020})
    err = responses.json()["error"]
    assert responses.status_code == 400 and (err["param"], err["code"]) == ("max_output_tokens", "context_length_exceeded")
    # Anthropic's wording, which its clients parse to retry with less
    messages = _post(live, "/v1/messages", {"model": MODEL, "max_tokens": 1020, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    assert re.fullmatch(r"input length and `max_tokens` exceed context limit: (\d+) \+ 1020 > 1024, decrease input "
                        r"length or `max_tokens` and try again", messages.json()["error"]["message"])
    # refused before the engine took them: nothing ran, nothing is held
    assert live.engine(lambda e: (e.has_unfinished(), e.stats().requests_total)) == (False, before)
    # within the context: served; and without max_tokens a chat is not refused
    ok = _post(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert _post(live, "/v1/chat/completions", {**chat, "stop": ["."], "max_tokens": None}).status_code == 200
    live.check()


def test_the_context_check_counts_the_prompt_the_engine_runs():
    from agent_runtime.protocol import ContextLengthError, check_fits_context

    check_fits_context(list(range(60)), SamplingParams(max_tokens=40), 100)  # exactly the limit
    with pytest.raises(ContextLengthError) as over:
        check_fits_context(list(range(60)), SamplingParams(max_tokens=41), 100)
    assert (over.value.prompt_tokens, over.value.max_tokens, over.value.param) == (60, 41, "max_tokens")
    assert str(over.value).startswith("max_tokens: too large: 41.")
    check_fits_context(list(range(500)), SamplingParams(max_tokens=90, truncate_prompt_tokens=10), 100)
    with pytest.raises(ContextLengthError):
        check_fits_context(list(range(500)), SamplingParams(max_tokens=91, truncate_prompt_tokens=10), 100)
    # a prompt with no room at all is the engine's own error (``prompt``), not this one
    check_fits_context(list(range(100)), SamplingParams(max_tokens=5), 100)


def test_reset_prefix_cache_drops_what_no_request_holds(live):
    prompt = ("The tide came in over the flats while the gulls circled the old harbour wall, and the boats "
              "that had lain on their sides all afternoon lifted, one after another, as the water reached them")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    assert _post(live, "/v1/completions", body).status_code == 200
    warm = _post(live, "/v1/completions", body).json()["usage"]
    assert warm["prompt_tokens_details"]["cached_tokens"] > 0
    # vLLM's route, and SGLang's name for it; a reset of an empty cache drops nothing
    reset = httpx.post(f"{live.base}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json()["success"] is True and reset.json()["device_blocks"] > 0
    assert reset.json()["host_blocks"] == 0  # no host tier here
    cold = _post(live, "/v1/completions", body).json()["usage"]
    assert not cold.get("prompt_tokens_details") or cold["prompt_tokens_details"]["cached_tokens"] == 0
    again = httpx.post(f"{live.base}/flush_cache?reset_external=true", timeout=30)
    assert again.status_code == 200 and again.json()["device_blocks"] > 0
    assert live.engine(lambda e: len(e.pool.cached)) == 0
    # a flag that is not a boolean, and preempting running requests, are 400s naming the parameter
    for query, param in (("reset_external=maybe", "reset_external"),
                         ("reset_running_requests=true", "reset_running_requests")):
        bad = httpx.post(f"{live.base}/reset_prefix_cache?{query}", timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert httpx.get(f"{live.base}/reset_prefix_cache", timeout=30).status_code == 405
    live.check()


def test_unknown_routes_and_methods_answer_in_the_apis_error_body(live):
    for method, path, status in (("POST", "/v1/chat/completion", 404), ("GET", "/v2/models", 404),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/health", 405)):
        r = httpx.request(method, f"{live.base}{path}", timeout=30)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and path in error["message"], r.text
    assert "POST" in httpx.get(f"{live.base}/v1/chat/completions", timeout=30).headers["allow"]
    r = httpx.get(f"{live.base}/v1/messages", timeout=30)  # Anthropic's route: Anthropic's body
    assert r.status_code == 405 and r.json()["type"] == "error", r.text
    live.check()


def test_constraints_that_allow_no_token_are_a_400_not_token_0(live):
    """allowed_token_ids holding only the end of text, which min_tokens forbids: once a 200
    with token 0 repeated; now the request fails alone, a 400 (an error event when streamed),
    and the engine keeps nothing of it."""
    eos = live.engine(lambda e: e.tokenizer.eos_token_id)
    body = {"model": MODEL, "prompt": "Say yes or no:", "max_tokens": 4, "allowed_token_ids": [eos], "min_tokens": 3}
    for path, fields in (("/v1/completions", {}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yes or no?"}]})):
        r = _post(live, path, {**body, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "constraints_unsatisfiable", r.text
        events = sse(live, path, {**body, **fields})
        assert events[-1]["error"]["code"] == "constraints_unsatisfiable", events
        assert not any(0 in (c.get("token_ids") or []) for e in events for c in e.get("choices", []))
    live.check()
