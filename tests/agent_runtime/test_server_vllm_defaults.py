"""The server's defaults as vLLM 0.32's: sampling fields a request leaves out take the model's
generation config (else temperature 1), ``--override-generation-config`` over it; a chat without
``max_tokens`` may run to the end of the context (a text completion stops at 16); ``model`` may
be left out; several served names; integral floats for integer fields; no upper bound on
``repetition_penalty``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import ServeOptions, create_app
from agent_runtime.server.generation_defaults import (
    check_generation_config,
    model_generation_config,
    sampling_defaults,
)
from agent_runtime.server.requests import ChatCompletionRequest
from asymcache_core import SamplingParams
from tests.conftest import make_engine

USER = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def runtime(smollm):
    rt = AgentRuntime(make_engine(smollm, max_model_len=256, num_kv_blocks=64))
    yield rt
    rt.close_sync()


def _client(runtime, name="m", **kwargs) -> TestClient:
    return TestClient(create_app(runtime, name, **kwargs))


def _texts(body: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


# -- sampling defaults ------------------------------------------------------------------------


def test_omitted_temperature_samples_as_vllm_does(runtime):
    """Without a generation config, vLLM samples at temperature 1: n choices of one request
    differ (greedy ones would all be the same text)."""
    with _client(runtime) as client:
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Once upon a"})):
            r = client.post(path, json={"model": "m", **body, "n": 4, "max_tokens": 12, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert len(set(_texts(r.json()))) > 1, r.text
            greedy = client.post(path, json={"model": "m", **body, "n": 4, "max_tokens": 12, "ignore_eos": True,
                                             "temperature": 0}).json()
            assert len(set(_texts(greedy))) == 1


def test_override_generation_config_sets_the_defaults(runtime):
    with _client(runtime, override_generation_config='{"temperature": 0}') as client:
        for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Once upon a"})):
            r = client.post(path, json={"model": "m", **body, "n": 4, "max_tokens": 12, "ignore_eos": True})
            assert len(set(_texts(r.json()))) == 1, r.text
            # the request's own value wins over the server's default
            sampled = client.post(path, json={"model": "m", **body, "n": 4, "max_tokens": 12, "ignore_eos": True,
                                              "temperature": 1.0}).json()
            assert len(set(_texts(sampled))) > 1
        msg = client.post("/v1/messages", json={"model": "m", "messages": USER, "max_tokens": 12})
        again = client.post("/v1/messages", json={"model": "m", "messages": USER, "max_tokens": 12})
        assert msg.status_code == 200 and msg.json()["content"] == again.json()["content"], msg.text
        resp = [client.post("/v1/responses", json={"model": "m", "input": "Write a poem", "max_output_tokens": 12,
                                                   "store": False}).json()["output"] for _ in range(2)]
        assert resp[0][0]["content"] == resp[1][0]["content"]


def test_request_sampling_fields_take_the_server_defaults():
    req = ChatCompletionRequest.model_validate({"messages": USER, "top_k": 5})
    p = req.sampling_params(8, {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1})
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.7, 0.9, 5, 1.1, 0.0)
    p = req.sampling_params(8)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 5)


def test_model_generation_config_is_read_as_vllm_reads_it(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64, "eos_token_id": 2,
        "repetition_penalty": 1.0,
    }))
    # NOTE: top_k 50 and repetition_penalty 1 were transformers 4's defaults, which its to_diff_dict
    # dropped; vLLM 0.32 reads the file with transformers 5 (no defaults): they are kept
    assert model_generation_config(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50,
                                                      "repetition_penalty": 1.0, "max_new_tokens": 64}
    assert sampling_defaults(str(tmp_path), {"temperature": 0.0}) == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "max_tokens": 64}
    assert model_generation_config("smollm2-135m") == {} and model_generation_config(str(tmp_path / "none")) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_generation_config(str(tmp_path)) == {}


@pytest.mark.parametrize("text,needle", [
    ("{temperature: 0}", "not valid JSON"),
    ("[0]", "must be a JSON object"),
    ('{"temprature": 0}', "unknown key 'temprature'"),
    ('{"temperature": -1}', "temperature"),
    ('{"temperature": "hot"}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"max_new_tokens": 0}', "max_new_tokens"),
    ('{"top_k": 1.5}', "top_k"),
])
def test_bad_override_generation_config_names_the_option(text, needle):
    with pytest.raises(ValueError, match="override_generation_config") as e:
        check_generation_config(text)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="override_generation_config"):
        ServeOptions(override_generation_config=text)


def test_python_api_stays_greedy():
    assert SamplingParams().temperature == 0.0


# -- max_tokens defaults ----------------------------------------------------------------------


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(runtime, smollm):
    # NOTE: a short context of its own: the reply runs to its end
    short = AgentRuntime(make_engine(smollm, max_model_len=80, num_kv_blocks=8))
    try:
        with _client(short) as client:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "ignore_eos": True})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 80 and usage["completion_tokens"] > 16
            assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        short.close_sync()
    with _client(runtime) as client:
        # a text completion's default stays 16 (vLLM's CompletionRequest.max_tokens)
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Once", "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 16
    with _client(runtime, default_max_tokens=5) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5


def test_generation_config_max_new_tokens_is_a_chats_default(runtime):
    with _client(runtime, override_generation_config={"max_new_tokens": 7}) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 7


def test_rest_of_the_context_ends_where_a_smaller_pool_does(smollm):
    """A pool smaller than max_model_len (vLLM would refuse to start): the default stops where
    the pool ends instead of the request being refused."""
    rt = AgentRuntime(make_engine(smollm, max_model_len=512, num_kv_blocks=8))
    try:
        pool = rt.engine.num_blocks * rt.engine.block_size
        assert pool < 512
        with _client(rt) as client:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "ignore_eos": True})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == pool
            # a stated limit past the pool is still refused
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 400})
            assert r.status_code == 400, r.text
    finally:
        rt.close_sync()


# -- model names ------------------------------------------------------------------------------


def test_model_left_out_or_null_is_the_served_model(runtime):
    with _client(runtime) as client:
        for extra in ({}, {"model": None}):
            r = client.post("/v1/chat/completions", json={**extra, "messages": USER, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "m", r.text
            r = client.post("/v1/completions", json={**extra, "prompt": "a", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "m", r.text
        r = client.post("/v1/chat/completions", json={"model": "other", "messages": USER, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # Anthropic's Messages route requires it, as Anthropic's and vLLM's do
        for extra in ({}, {"model": None}):
            r = client.post("/v1/messages", json={**extra, "messages": USER, "max_tokens": 2})
            assert r.status_code == 400 and "model" in r.json()["error"]["message"], r.text


def test_several_served_names(runtime):
    with _client(runtime, ("first", "second")) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]
        assert client.get("/v1/models/second").json()["id"] == "second"
        assert client.get("/v1/models/third").status_code == 404
        for name in ("first", "second"):
            r = client.post("/v1/chat/completions", json={"model": name, "messages": USER, "max_tokens": 2})
            # NOTE: vLLM reports its first served name whichever one the request used
            assert r.status_code == 200 and r.json()["model"] == "first", r.text
        assert client.post("/v1/completions", json={"model": "third", "prompt": "a"}).status_code == 404
    assert ServeOptions(served_model_name=["a", "b"]).served_model_name == ("a", "b")
    with pytest.raises(ValueError, match="served_model_name"):
        ServeOptions(served_model_name=["a", ""])


# -- vLLM's lax ints and ranges ---------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"max_tokens": 2.0}, {"n": 1.0}, {"seed": 42.0}, {"top_k": 40.0},
                                   {"repetition_penalty": 2.5}, {"repetition_penalty": 1e6}])
def test_vllm_accepts_integral_floats_and_large_repetition_penalties(runtime, extra):
    with _client(runtime) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0,
                                                 **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("extra,param", [({"max_tokens": 2.5}, "max_tokens"), ({"n": 1.5}, "n"),
                                         ({"seed": 4.2}, "seed"), ({"repetition_penalty": 0}, "repetition_penalty")])
def test_non_integral_floats_stay_a_400(runtime, extra, param):
    with _client(runtime) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_largest_repetition_penalty_leaves_no_nan_in_the_sampler():
    """vLLM bounds repetition_penalty below only; here float32's largest value is the top, so
    the sampler's float32 penalty stays finite: a seen zero logit stays 0 (an infinite penalty
    would make it NaN), a seen positive one nears 0, a seen negative one goes to -inf."""
    import torch

    from asymcache_core.batched_penalties import prompt_ids, with_penalties
    from asymcache_core.sampler import Sampler
    from asymcache_core.sampling_params import MAX_REPETITION_PENALTY

    vocab = 64
    row = torch.zeros(vocab)
    row[1], row[2], row[3] = 5.0, -5.0, 4.0
    params = SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY)
    out = with_penalties(row[None], [params], [[1, 0]], [prompt_ids([2], vocab, row.device)])[0]
    assert not torch.isnan(out).any()
    assert out[0] == 0.0 and 0.0 <= out[1] < 1e-30 and out[2] == -math.inf and out[3] == 4.0
    # the greedy pick moves off the penalised favourite to the best unseen token
    assert Sampler(0).sample(row[None].clone(), ["r"], [params], [[1]]) == [3]
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e39)
