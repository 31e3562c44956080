"""Prompt log probabilities over HTTP: ``echo`` on text completions (lm-evaluation-harness's
log-likelihood request: ``echo``, ``logprobs: 1``, ``max_tokens`` 0 or 1), vLLM's
``prompt_logprobs`` on completions (per choice, streamed in the first chunk) and on chat (in
the body), against the engine's own values."""

from __future__ import annotations

import httpx
import pytest

from asymcache_core import SamplingParams
from tests.agent_runtime.live_server import MODEL, sse
from tests.conftest import make_engine

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _post(live, path: str, body: dict) -> dict:
    r = httpx.post(f"{live.base}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(smollm):
    """The prompt's ids and log probabilities from an engine of its own (two alternatives)."""
    engine = make_engine(smollm)
    ids = engine.encode(PROMPT)
    (out,) = engine.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=2))
    return ids, out


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(live, reference, max_tokens):
    ids, ref = reference
    body = _post(live, "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": max_tokens,
                                           "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234})
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    generated = max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1 : len(ids)]
    assert got == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-4)
    # lm-eval's greedy check: each prompt token against the likeliest alternative
    for token_lp, top, entry in zip(got, lp["top_logprobs"][1 : len(ids)], ref.prompt_logprobs[1:], strict=True):
        # the likeliest token, and the prompt's own where it is another (vLLM's logprobs + 1)
        assert len(top) == (1 if entry.rank == 1 else 2) and max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-4)
        assert (token_lp >= max(top.values()) - 1e-4) == (entry.rank == 1)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert choice["text"].startswith(PROMPT)
    if max_tokens == 0:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0
    else:
        assert lp["tokens"][-1] in choice["text"][len(PROMPT):] or lp["tokens"][-1].strip() == ""
        assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["prompt_tokens"] == len(ids)
    live.check()


def test_echo_streamed_equals_the_body(live, reference):
    ids, _ = reference
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "echo": True, "ignore_eos": True,
               "temperature": 0}
    body = _post(live, "/v1/completions", request)
    chunks = sse(live, "/v1/completions", request)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in choices) == body["choices"][0]["text"]
    parts = [c["logprobs"] for c in choices if c["logprobs"]]
    streamed = [x for part in parts for x in part["token_logprobs"]]
    assert len(streamed) == len(ids) + 6 and streamed[0] is None
    assert streamed[1:] == pytest.approx(body["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert [x for part in parts for x in part["text_offset"]] == body["choices"][0]["logprobs"]["text_offset"]
    # echo without logprobs: the text alone
    plain = _post(live, "/v1/completions", {**request, "logprobs": None})["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == body["choices"][0]["text"]
    live.check()


def test_vllm_prompt_logprobs_on_completions_and_chat(live, reference):
    ids, ref = reference
    body = _post(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    (choice,) = body["choices"]
    assert choice["logprobs"] is None and choice["text"] and not choice["text"].startswith(PROMPT)
    rows = choice["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for row, token, entry in zip(rows[1:], ids[1:], ref.prompt_logprobs[1:], strict=True):
        assert 2 <= len(row) <= 3 and str(token) in row
        assert row[str(token)]["rank"] == entry.rank
        assert row[str(token)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert {v["rank"] for v in row.values()} >= {1, 2}  # the two likeliest, ranked
    chunks = sse(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    carried = [c["choices"][0].get("prompt_logprobs") for c in chunks if c["choices"]]
    assert carried[0] == rows and all(p is None for p in carried[1:])
    chat = _post(live, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
                                                "messages": [{"role": "user", "content": PROMPT}]})
    tokenized = _post(live, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]})
    assert len(chat["prompt_logprobs"]) == tokenized["count"] and chat["prompt_logprobs"][0] is None
    assert all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in _post(live, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": PROMPT}]})
    live.check()
