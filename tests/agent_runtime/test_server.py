"""The OpenAI-compatible server live on 127.0.0.1 (uvicorn in a thread) over the real SmolLM2:
the official openai client, raw httpx (SSE), our client, errors, auth, and disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.client import AsymCacheAPIError, AsymCacheClient
from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.conftest import make_engine

MODEL = "smollm2-135m"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the files of the project.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read one file of the project.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "enum": ["notes.txt", "todo.md"]}},
                "required": ["path"],
            },
        },
    },
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A running server and what the tests need to inspect it."""

    def __init__(self, base: str, runtime: AgentRuntime) -> None:
        self.base = base
        self.runtime = runtime

    def engine(self, fn):
        return self.runtime.call_threadsafe(fn).result(timeout=30)

    def check(self) -> None:
        """Integrity, and the server still answers."""
        self.engine(lambda e: e.check_integrity())
        assert httpx.get(f"{self.base}/health", timeout=10).json() == {"status": "ok"}


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serves ``app`` with uvicorn on a free local port, in a thread; yields its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def live(smollm) -> Iterator[Live]:
    engine = make_engine(smollm, max_model_len=1024, **resolve_preset("continuum").engine_overrides)
    runtime = AgentRuntime(engine, policy="continuum")
    try:
        with serving(create_app(runtime, MODEL)) as base:
            yield Live(base, runtime)
    finally:
        runtime.close_sync()


@pytest.fixture(scope="module")
def oa(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_health_metrics(live, oa):
    assert [m.id for m in oa.models.list().data] == [MODEL]
    # OpenAI's retrieve, and vLLM's version route
    assert oa.models.retrieve(MODEL).id == MODEL
    card = httpx.get(f"{live.base}/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == live.runtime.max_model_len and card["root"] == live.runtime.model_name
    with pytest.raises(openai.NotFoundError) as missing:
        oa.models.retrieve("org/other-model")
    assert missing.value.body["code"] == "model_not_found"
    from asymcache_core.version import package_version

    assert httpx.get(f"{live.base}/version", timeout=10).json() == {"version": package_version()}
    live.check()
    text = httpx.get(f"{live.base}/metrics", timeout=10).text
    for name in (
        "asymcache_requests_total", "asymcache_time_to_first_token_seconds_bucket",
        "asymcache_time_per_output_token_seconds_count", "asymcache_cache_hit_tokens_total",
        "asymcache_recomputed_tokens_total", "asymcache_pinned_blocks", "asymcache_evictions_total",
    ):
        assert name in text, name
    # vLLM's names beside ours, with its model_name label, from the same snapshot
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    label = (("model_name", MODEL),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert (name, label) in samples, name
    assert 0.0 <= samples[("vllm:kv_cache_usage_perc", label)] <= 1.0
    assert samples[("vllm:num_requests_running", label)] == 0
    stats = live.engine(lambda e: e.stats())
    assert samples[("asymcache_kv_blocks_total", ())] == stats.kv_blocks_total
    assert samples[("asymcache_evictions_total", ())] == stats.evictions_total


def test_completion_stream_usage_and_token_counters(live):
    def counters() -> dict[str, float]:
        text = httpx.get(f"{live.base}/metrics", timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                              "asymcache_completion_tokens_total", "asymcache_prompt_tokens_total")}

    before = counters()
    body = {"model": MODEL, "prompt": list(range(500, 520)), "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{live.base}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    usage = events[-1]
    assert usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"]["prompt_tokens"] == 20 and usage["usage"]["completion_tokens"] == 3
    # OpenAI's include_usage: every other chunk says "usage": null; without it, no chunk has the key
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    after = counters()
    for ours, theirs, want in (("asymcache_completion_tokens_total", "vllm:generation_tokens_total", 3),
                               ("asymcache_prompt_tokens_total", "vllm:prompt_tokens_total", 20)):
        assert after[ours] - before[ours] == after[theirs] - before[theirs] == want
    with httpx.stream("POST", f"{live.base}/v1/completions", json={**body, "stream_options": None}, timeout=60) as r:
        plain = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert plain and all("usage" not in e for e in plain)
    live.check()


def test_chat_return_token_ids_streamed_and_not(live):
    """vLLM's ``return_token_ids`` on chat (what agent-RL trainers read): the rendered chat's ids
    beside the choices, each choice's reply ids; streamed, the prompt's ids on the first chunk
    and every token once, also where the text is held back (a forced tool call)."""
    messages = [{"role": "user", "content": "What is in notes.txt?"}]
    for extra in ({}, {"tools": TOOLS, "tool_choice": "required"}):
        # NOTE: salted, so that its blocks are no cache hit of the later tests' tool prompts
        # NOTE: 4 tokens of a plain reply carry its ids as well as 10 (each reply runs twice)
        body = {"model": MODEL, "messages": messages, "max_tokens": 40 if extra else 4, "return_token_ids": True,
                "cache_salt": "return-token-ids", **extra}
        reply = httpx.post(f"{live.base}/v1/chat/completions", json=body, timeout=120).json()
        rendered = httpx.post(f"{live.base}/tokenize", json={"model": MODEL, "messages": messages,
                                                              **({"tools": TOOLS} if extra else {})}).json()
        assert reply["prompt_token_ids"] == rendered["tokens"]
        (choice,) = reply["choices"]
        assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"] > 0
        if extra:
            assert choice["message"]["tool_calls"]
        else:
            text = httpx.post(f"{live.base}/detokenize", json={"model": MODEL, "tokens": choice["token_ids"]}).json()
            assert text["prompt"].strip() == choice["message"]["content"].strip()
        chunks = _sse(live, "/v1/chat/completions", body)
        assert chunks[0]["prompt_token_ids"] == reply["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]
    plain = httpx.post(f"{live.base}/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                 "max_tokens": 2}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    live.check()


def test_cache_salt_keeps_tenants_prefix_caches_apart(live, oa):
    """vLLM's ``cache_salt``: a request reuses only the blocks of requests with its salt, even
    the chat template's shared system prompt; the reply is the unsalted one."""
    messages = [{"role": "user", "content": "Name a prime number larger than one hundred."}]

    def cached(**extra) -> tuple[int, str]:
        reply = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].message.content

    plain = cached()
    first, again, other = cached(cache_salt="tenant-a-7f3e"), cached(cache_salt="tenant-a-7f3e"), cached(
        cache_salt="tenant-b-91c2")
    assert first[0] == other[0] == 0 < again[0] and plain[0] >= 0
    assert plain[1] == first[1] == again[1] == other[1]
    r = httpx.post(f"{live.base}/v1/completions", json={"model": MODEL, "prompt": "hi", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    live.check()


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(live):
    """vLLM's ``continuous_usage_stats``: with ``include_usage`` every chunk carries its
    choice's prompt and tokens so far; the last chunk the whole response's usage."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}]}),
                       ("/v1/completions", {"prompt": ["One, two,", "Three, four,"]})):
        events = _sse(live, path, {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "n": 2, **body,
                                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        seen: dict[int, list[int]] = {}
        for e in events[:-1]:
            (choice,) = e["choices"]
            usage = e["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
            seen.setdefault(choice["index"], []).append(usage["completion_tokens"])
        assert sorted(seen) == [0, 1, 2, 3][:len(seen)] and len(seen) in (2, 4), path
        for counts in seen.values():
            assert counts == sorted(counts) and counts[-1] == 4, (path, counts)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4 * len(seen)
        # without include_usage the option asks for nothing (vLLM's rule)
        bare = _sse(live, path, {"model": MODEL, "max_tokens": 2, **body,
                                 "stream_options": {"continuous_usage_stats": True}})
        assert all(e.get("usage") is None for e in bare)
    live.check()


def test_tool_loop_through_openai_client(live, oa):
    messages = [{"role": "user", "content": "What is the secret word in notes.txt?"}]
    first = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        max_tokens=40, extra_body={"job_id": "job-http"},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "stop"  # a named tool_choice forced the call: OpenAI's and vLLM's reason
    assert choice.message.refusal is None and first.system_fingerprint is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments)["path"] in ("notes.txt", "todo.md")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "The secret word is banana."},
    ]
    second = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
        extra_body={"job_id": "job-http", "is_last_step": True},
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    raw = httpx.post(f"{live.base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages[:1], "max_tokens": 2}).json()["choices"][0]["message"]
    assert raw["tool_calls"] == [] and raw["refusal"] is None  # vLLM's keys, present when empty
    usage = second.usage
    # the first turn's prompt and generated call come from the cache
    prev = first.usage.prompt_tokens + first.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= (prev - 16) // 16 * 16 > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert live.engine(lambda e: e.pins.num_pinned_blocks) == 0  # last step released the job
    live.check()


def test_streaming_chat_with_required_tool_call(live, oa):
    stream = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Show me the files."}], tools=TOOLS,
        tool_choice="required", max_tokens=40, stream=True, stream_options={"include_usage": True},
        parallel_tool_calls=False,
    )
    chunks = list(stream)
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # the call streams as it is written (vLLM's streaming tool parser): its id, type and name
    # first, then its arguments piece by piece, which join to the non-streamed reply's
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name in ("list_files", "read_file")
    assert len(pieces) >= 2 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    arguments = "".join(p.function.arguments for p in pieces)
    whole = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Show me the files."}], tools=TOOLS,
        tool_choice="required", max_tokens=40, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(pieces[0].function.name, arguments)]
    json.loads(arguments)
    # one entry a call a chunk (OpenAI's and vLLM's): a client that reads only the first entry
    # of each chunk rebuilds the same call
    entries = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert all(len(e) == len({tc.index for tc in e}) for e in entries), entries
    assert "".join(e[0].function.arguments or "" for e in entries) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    live.check()


def test_required_tool_choice_may_call_several_tools(live, oa):
    """``parallel_tool_calls`` is on by default: "required" forces one call or more (OpenAI's and
    vLLM's rule); each is a whole, valid call, and the streamed calls are the reply's."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Read notes.txt and todo.md."}], tools=TOOLS,
                  tool_choice="required", max_tokens=120, temperature=0)
    reply = oa.chat.completions.create(**kwargs)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    for call in calls:
        assert call.function.name in ("list_files", "read_file")
        args = json.loads(call.function.arguments)
        assert call.function.name == "list_files" or args["path"] in ("notes.txt", "todo.md")
    chunks = list(oa.chat.completions.create(**kwargs, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    for c in chunks:
        entries = (c.choices[0].delta.tool_calls or []) if c.choices else []
        assert len(entries) == len({tc.index for tc in entries}), entries
    assert [(tc.index, tc.function.name) for tc in streamed if tc.function.name] == [
        (i, c.function.name) for i, c in enumerate(calls)]
    live.check()


def test_streaming_completions_raw_sse_and_our_client(live):
    body = {"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 4, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "job_id": "cjob", "tool_name": "sleep"}
    with httpx.stream("POST", f"{live.base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events)
    assert len([t for e in events for t in e["choices"][0]["token_ids"]]) == 4
    # a job's non-last completion is followed by a tool pause: Continuum decided on it
    decision = live.engine(lambda e: live.runtime.controller.decisions[-1])
    assert decision.job_id == "cjob" and decision.tool == "sleep" and decision.context_tokens == 44

    with AsymCacheClient(live.base) as client:
        assert client.health() and client.models() == [MODEL]
        same = client.completion(list(range(300, 340)), max_tokens=4, ignore_eos=True)
        assert same["choices"][0]["text"] == text
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the same 40 ids again
        chunks = list(client.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=3))
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=3)
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert reply["choices"][0]["message"]["content"] == streamed.strip()
        with pytest.raises(AsymCacheAPIError) as info:
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=0)
        assert info.value.status == 400 and info.value.param == "max_tokens"
    live.check()


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
            {"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}]},
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
        ("missing model", chat, {"messages": user}, 400, "model", None),
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
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         400, "messages[1].tool_calls[0].function.arguments", None),
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


def test_harness_http_backend_against_live_server(live, tmp_path):
    """``asymcache bench --backend http`` drives the same workload through the server."""
    from dataclasses import replace

    from eval.bench import BenchConfig, load_workload, run_bench

    # NOTE: token_scale 0.05 keeps every job's turns (1 to 3 a job, so later turns extend earlier
    # ones) and halves their replies: a run is as long as its longest job, ~33 decode steps for
    # the ~67 of 0.1, and the test makes two runs.
    cfg = BenchConfig(
        workload="chat", jobs=3, concurrency=3, token_scale=0.05, time_scale=0.01, max_model_len=256,
        seed=5, backend="http", url=live.base, policies=("our-server",), out=tmp_path / "http",
    )
    job_ids = {job.job_id for job in load_workload(cfg).jobs}
    # a label ending in /anonymous: clients that send no job ids
    anonymous, _ = run_bench(replace(cfg, policies=("our-server/anonymous",), out=tmp_path / "anonymous"))
    assert anonymous.policies["our-server/anonymous"].num_jobs == 3
    assert not job_ids & live.engine(lambda e: set(e.job_stats.jobs))
    results, run_dir = run_bench(cfg)
    assert job_ids <= live.engine(lambda e: set(e.job_stats.jobs))
    r = results.policies["our-server"]
    assert r.num_jobs == 3 and r.num_requests >= 3
    assert r.ttft.count == r.num_requests and r.ttft.mean > 0
    # later turns of each job extend the earlier ones: the server reports cache hits
    assert r.hit_tokens > 0 and 0 < r.hit_rate < 1
    assert (run_dir / "report.html").is_file()
    live.check()


def leave_stream_early(live: Live, path: str, body: dict, marker: str) -> None:
    """Opens a streamed request, leaves after the first line holding ``marker``, then checks
    that the server freed the request (its blocks back, nothing left running)."""
    with httpx.stream("POST", f"{live.base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if marker in line:
                break
    deadline = time.monotonic() + 10
    while live.engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def _sse(live: Live, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{live.base}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_logprobs_through_openai_client_streamed_and_not(live, oa):
    messages = [{"role": "user", "content": "Name three colours in French, with accents: é, è."}]
    # NOTE: the reply's first tokens are accented letters, some split over two tokens (a lead
    # byte, then a continuation byte): 8 tokens hold them; 24 repeated them at three times the cost
    reply = oa.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    assert any(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in content)  # a token that is no whole character
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob  # greedy
    # the tokens' exact bytes join into the reply's text, multi-byte characters included
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == choice.message.content  # as generated
    # streamed: the same entries, spread over the chunks
    chunks = _sse(live, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                 "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert len(streamed) == len(content)
    for got, want in zip(streamed, content, strict=True):
        # NOTE: the second request reads its prompt from the prefix cache: its logits may differ
        # from the first's in float rounding (the tokens may not)
        assert (got["token"], got["bytes"]) == (want.token, want.bytes)
        assert got["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert [t["token"] for t in got["top_logprobs"]] == [t.token for t in want.top_logprobs]
    # not asked for: null, as before
    plain = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    live.check()


def test_completion_logprobs_legacy_shape_streamed_and_not(live, oa):
    prompt = "The capital of France is"
    reply = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=2, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob  # greedy
    chunks = _sse(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10, "logprobs": 2,
                                            "ignore_eos": True})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    for key in ("tokens", "text_offset"):
        assert [x for part in parts for x in part[key]] == getattr(lp, key), key
    assert [x for part in parts for x in part["token_logprobs"]] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [list(top) for part in parts for top in part["top_logprobs"]] == [list(top) for top in lp.top_logprobs]
    # logprobs=0: the sampled tokens' log probabilities alone
    zero = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=0).choices[0].logprobs
    assert len(zero.token_logprobs) == 3 and zero.top_logprobs == [None] * 3
    # sampled at random, a token outside the most likely is among its alternatives too (once missing)
    hot = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=1, temperature=2.0, seed=3,
                                extra_body={"ignore_eos": True}).choices[0].logprobs
    assert all(top[token] == logprob for token, logprob, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs,
                                                                      strict=True))
    assert any(len(top) == 2 for top in hot.top_logprobs)
    live.check()


def test_a_batch_of_prompts_is_each_prompt_alone(live, oa):
    """OpenAI's and vLLM's batch (a list of texts, or of token-id lists): prompt i's choice j is
    index i * n + j, each as the prompt sent alone; usage counts each prompt once."""
    texts = ["The capital of France is", "One, two, three,", "The capital of France is"]
    # NOTE: the third prompt repeats the first: its reply alone is the first's (greedy), so it is
    # not asked for twice. 3 tokens tell the prompts' replies apart as well as 5 did.
    alone = [oa.completions.create(model=MODEL, prompt=p, max_tokens=3) for p in texts[:2]]
    alone.append(alone[0])
    batch = oa.completions.create(model=MODEL, prompt=texts, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [httpx.post(live.base + "/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"] for p in texts[:2]]
    # NOTE: greedy: a seeded draw is keyed by seed and position, but the logits it draws from
    # round with the step's rows on this CPU, so a near tie can fall either way in a batch
    body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "n": 2, "echo": True}
    sampled = httpx.post(live.base + "/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(texts[:2]):
        one = httpx.post(live.base + "/v1/completions", json={**body, "prompt": ids[i]}, timeout=120).json()
        assert [c["text"] for c in sampled["choices"][2 * i:2 * i + 2]] == [c["text"] for c in one["choices"]]
        assert all(c["text"].startswith(p) for c in one["choices"])  # echoed, as the prompt decodes
    assert sampled["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    # streamed: every choice's deltas add up to its text, and the usage frame counts the same
    chunks = _sse(live, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                for i in range(4)]
    assert streamed == [c["text"] for c in sampled["choices"]]
    assert chunks[-1]["usage"] == sampled["usage"]
    live.check()


def test_n_choices_seeded_and_reproducible(live, oa):
    messages = [{"role": "user", "content": "Write a word."}]
    # NOTE: 6 tokens already tell the three seeded choices apart (12 made each request twice as long)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, n=3, temperature=1.0, seed=5, logprobs=True)
    reply = oa.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) >= 2  # each choice samples with its own seed (seed + index)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    assert [c.message.content for c in oa.chat.completions.create(**kwargs).choices] == texts
    # the first choice is the request with n=1 and the same seed
    assert oa.chat.completions.create(**{**kwargs, "n": 1}).choices[0].message.content == texts[0]
    greedy = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    live.check()


def test_n_choices_streamed_interleave_by_index(live, oa):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 9,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = _sse(live, "/v1/completions", body)
    texts, reasons = ["", ""], [[], []]
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            reasons[choice["index"]].append(choice["finish_reason"])
    assert reasons == [["length"], ["length"]]
    assert events[-1]["usage"]["completion_tokens"] == 16 and events[-1]["usage"]["prompt_tokens"] > 0
    plain = oa.completions.create(**{k: v for k, v in body.items() if k not in ("stream_options", "ignore_eos")},
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in plain.choices] == texts
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


def test_tokenize_matches_the_completions_prompt_and_detokenize_inverts_it(live, oa):
    def post(path: str, body: dict) -> dict:
        r = httpx.post(f"{live.base}{path}", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    text = "Tokenize me, s'il vous plaît: 日本"
    got = post("/tokenize", {"model": MODEL, "prompt": text})
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 1024
    usage = oa.completions.create(model=MODEL, prompt=text, max_tokens=1).usage
    assert got["count"] == usage.prompt_tokens
    assert post("/detokenize", {"tokens": got["tokens"]}) == {"prompt": text}
    # a chat counts as a chat completion renders it (template, tools, generation prompt)
    messages = [{"role": "user", "content": "Show me the files."}]
    chat = post("/tokenize", {"messages": messages, "tools": TOOLS})
    reply = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    assert post("/tokenize", {"messages": messages})["count"] < chat["count"]  # the tools' schemas
    live.check()


def test_vllm_generation_extensions(live, oa):
    messages = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    short = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    # NOTE: max_tokens at the minimum: without min_tokens the same greedy reply stops at n, so
    # reaching n + 5 shows the stop held back (30 let it run on to 30 for nothing)
    held = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=n + 5,
                                      extra_body={"min_tokens": n + 5, "skip_special_tokens": True})
    assert held.usage.completion_tokens >= n + 5
    kept = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=30, stop=["."],
                                 extra_body={"include_stop_str_in_output": True})
    cut = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=30, stop=["."])
    assert kept.choices[0].text == cut.choices[0].text + "."
    # add_generation_prompt=false: the prompt ends where the chat does, as /tokenize counts it
    body = {"messages": messages, "add_generation_prompt": False}
    bare = httpx.post(f"{live.base}/tokenize", json=body, timeout=30).json()["count"]
    full = httpx.post(f"{live.base}/tokenize", json={"messages": messages}, timeout=30).json()["count"]
    assert bare < full
    reply = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"add_generation_prompt": False})
    assert reply.usage.prompt_tokens == bare
    live.check()
