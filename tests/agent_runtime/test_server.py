"""The OpenAI-compatible server live on 127.0.0.1 (uvicorn in a thread) over the real SmolLM2:
the official openai client, raw httpx (SSE), our client, tool calls, and the HTTP bench backend
(errors, auth and disconnects: ``test_server_errors.py``; logprobs, n choices and the generation
extensions: ``test_server_generation.py``)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_runtime.client import AsymCacheAPIError, AsymCacheClient
from tests.agent_runtime.live_server import MODEL, TOOLS, sse


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
    label = (("engine", "0"), ("model_name", MODEL))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:iteration_tokens_total_count"):
        assert (name, label) in samples, name
    # the deprecated aliases keep their earlier labels
    for name in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds_count"):
        assert (name, (("model_name", MODEL),)) in samples, name
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
                "cache_salt": "return-token-ids", "temperature": 0, **extra}
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
        chunks = sse(live, "/v1/chat/completions", body)
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
        reply = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra)
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
        events = sse(live, path, {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "n": 2, **body,
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
        bare = sse(live, path, {"model": MODEL, "max_tokens": 2, **body,
                                 "stream_options": {"continuous_usage_stats": True}})
        assert all(e.get("usage") is None for e in bare)
    live.check()


def test_tool_loop_through_openai_client(live, oa):
    messages = [{"role": "user", "content": "What is the secret word in notes.txt?"}]
    first = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        # NOTE: greedy, so that the reply is the same on every run (the server samples at
        # temperature 1 by default, as vLLM's does): a sampled reply may hold text that the
        # history renders otherwise, and fewer of the second turn's tokens would hit
        max_tokens=40, temperature=0, extra_body={"job_id": "job-http"},
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
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
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
        parallel_tool_calls=False, temperature=0,
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
        tool_choice="required", max_tokens=40, parallel_tool_calls=False, temperature=0).choices[0].message.tool_calls
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
            "temperature": 0, "return_token_ids": True, "job_id": "cjob", "tool_name": "sleep"}
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
        same = client.completion(list(range(300, 340)), max_tokens=4, ignore_eos=True, temperature=0)
        assert same["choices"][0]["text"] == text
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the same 40 ids again
        chunks = list(client.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0))
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert reply["choices"][0]["message"]["content"] == streamed.strip()
        with pytest.raises(AsymCacheAPIError) as info:
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=0)
        assert info.value.status == 400 and info.value.param == "max_tokens"
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

