"""What a request asks of generation on the live server: logprobs (chat and the legacy
completions shape), a batch of prompts, n choices, tokenize/detokenize, and vLLM's generation
extensions."""

from __future__ import annotations

import httpx
import pytest

from tests.agent_runtime.live_server import MODEL, TOOLS, sse


def test_chat_logprobs_through_openai_client_streamed_and_not(live, oa):
    messages = [{"role": "user", "content": "Name three colours in French, with accents: é, è."}]
    # NOTE: the reply's first tokens are accented letters, some split over two tokens (a lead
    # byte, then a continuation byte): 8 tokens hold them; 24 repeated them at three times the cost
    reply = oa.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, logprobs=True, top_logprobs=3, temperature=0,
        extra_body={"ignore_eos": True},
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
    chunks = sse(live, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                 "logprobs": True, "top_logprobs": 3, "ignore_eos": True,
                                                 "temperature": 0})
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
    reply = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob  # greedy
    chunks = sse(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10, "logprobs": 2,
                                            "ignore_eos": True, "temperature": 0})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    for key in ("tokens", "text_offset"):
        assert [x for part in parts for x in part[key]] == getattr(lp, key), key
    assert [x for part in parts for x in part["token_logprobs"]] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [list(top) for part in parts for top in part["top_logprobs"]] == [list(top) for top in lp.top_logprobs]
    # logprobs=0: each token's top_logprobs is the sampled token alone (vLLM's), not null
    zero = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=0).choices[0].logprobs
    assert len(zero.token_logprobs) == 3
    assert zero.top_logprobs == [{t: lp} for t, lp in zip(zero.tokens, zero.token_logprobs, strict=True)]
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
    alone = [oa.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0) for p in texts[:2]]
    alone.append(alone[0])
    batch = oa.completions.create(model=MODEL, prompt=texts, max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [httpx.post(live.base + "/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"] for p in texts[:2]]
    # NOTE: greedy: a seeded draw is keyed by seed and position, but the logits it draws from
    # round with the step's rows on this CPU, so a near tie can fall either way in a batch
    body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "n": 2, "echo": True, "temperature": 0}
    sampled = httpx.post(live.base + "/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(texts[:2]):
        one = httpx.post(live.base + "/v1/completions", json={**body, "prompt": ids[i]}, timeout=120).json()
        assert [c["text"] for c in sampled["choices"][2 * i:2 * i + 2]] == [c["text"] for c in one["choices"]]
        assert all(c["text"].startswith(p) for c in one["choices"])  # echoed, as the prompt decodes
    assert sampled["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    # streamed: every choice's deltas add up to its text, and the usage frame counts the same
    chunks = sse(live, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
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
    greedy = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    live.check()


def test_n_choices_streamed_interleave_by_index(live, oa):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 9,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = sse(live, "/v1/completions", body)
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
    short = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    # NOTE: max_tokens at the minimum: without min_tokens the same greedy reply stops at n, so
    # reaching n + 5 shows the stop held back (30 let it run on to 30 for nothing)
    held = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=n + 5, temperature=0,
                                      extra_body={"min_tokens": n + 5, "skip_special_tokens": True})
    assert held.usage.completion_tokens >= n + 5
    kept = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=30, stop=["."], temperature=0,
                                 extra_body={"include_stop_str_in_output": True})
    cut = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=30, stop=["."],
                                temperature=0)
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
