"""Dummy models' tokenizers: SmolLM2's BPE in Llama-3 / Qwen2 shape, built offline and cached,
and a small dummy model with Llama 3's vocabulary serving chats and forced tool calls."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import asymcache_core.loaders as loaders
import asymcache_core.loaders.dummy_tokenizer as dummy_tokenizer_module
from asymcache_core import Engine, SamplingParams
from asymcache_core.detokenizer import DetokenizerState, detokenize_incrementally
from asymcache_core.loaders import load_model, packaged_smollm2_path, resolve_hf_config
from asymcache_core.loaders.dummy_tokenizer import BASE_VOCAB, load_dummy_tokenizer
from asymcache_core.models import ModelConfig
from asymcache_core.parallel import TensorParallelGroup, plan_tensor_shards

CPU = torch.device("cpu")
TEXT = "Hello world, héllo 日本語 🙂 <tool_call> {\"a\": 1}\n\tend"
LLAMA3_NAMED = {
    128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128002: "<|reserved_special_token_0|>",
    128003: "<|reserved_special_token_1|>", 128004: "<|finetune_right_pad_id|>",
    128005: "<|reserved_special_token_2|>", 128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
    128008: "<|eom_id|>", 128009: "<|eot_id|>", 128010: "<|python_tag|>",
    128011: "<|reserved_special_token_3|>", 128255: "<|reserved_special_token_247|>",
}
QWEN2_NAMED = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151664: "<|file_sep|>",
}
TOOLS = [{
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read one file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["notes.txt", "todo.md"]}},
            "required": ["path"],
        },
    },
}]


def _config(name: str) -> dict[str, Any]:
    return resolve_hf_config(f"dummy:{name}")[0]


def _tokenizer(name: str) -> Any:
    tokenizer, _ = loaders._dummy_tokenizer(_config(name))
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def base() -> Any:
    try:
        path = packaged_smollm2_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    return loaders._gguf_meta(path)[1]


@pytest.fixture(scope="module")
def llama3(base: Any) -> Any:
    return _tokenizer("llama-3.1-8b")


@pytest.fixture(scope="module")
def qwen2(base: Any) -> Any:
    return _tokenizer("qwen2.5-7b")


def test_llama3_tokenizer_has_llama3_specials_at_llama3_ids(llama3: Any, base: Any) -> None:
    cfg = _config("llama-3.1-8b")
    for token_id, text in LLAMA3_NAMED.items():
        assert llama3.convert_tokens_to_ids(text) == token_id
        assert llama3.decode([token_id]) == text
    specials = {i: t.content for i, t in llama3.added_tokens_decoder.items() if t.special}
    assert sorted(specials) == list(range(128000, 128256))
    assert llama3.bos_token_id == cfg["bos_token_id"] == 128000
    assert llama3.eos_token_id == 128009 and llama3.eos_token_id in cfg["eos_token_id"]
    assert llama3.pad_token_id is None
    # the BPE keeps SmolLM2's ids; SmolLM2's own specials are plain text now
    ids = llama3.encode(TEXT, add_special_tokens=False)
    assert ids == base.encode(TEXT, add_special_tokens=False) and max(ids) < BASE_VOCAB
    assert llama3.decode(ids) == TEXT
    assert llama3.encode("<|im_start|>", add_special_tokens=False) != [1]
    assert llama3("hi").input_ids[0] == 128000  # encoding with specials prepends bos, as Llama 3's does
    # special text spelled by the caller is read as the special token, as a real tokenizer does
    assert llama3.encode("a<|eot_id|>", add_special_tokens=False)[-1] == 128009


def test_llama3_chat_template_renders_header_and_eot_turns(llama3: Any) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    text = llama3.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = llama3.encode(text, add_special_tokens=False)
    assert ids[0] == 128000 and ids.count(128006) == 5 and ids.count(128009) == 4 and ids[-2] == 128007
    assert llama3.decode(ids) == text


def test_qwen2_tokenizer_has_chatml_specials_at_qwen_ids(qwen2: Any, base: Any) -> None:
    cfg = _config("qwen2.5-7b")
    for token_id, text in QWEN2_NAMED.items():
        assert qwen2.convert_tokens_to_ids(text) == token_id
    assert qwen2.bos_token_id == cfg["bos_token_id"] == 151643
    assert qwen2.eos_token_id == cfg["eos_token_id"] == 151645
    assert qwen2.pad_token_id == 151643
    # Qwen's tool-call tags are added tokens that stay text when specials are skipped
    ids = qwen2.encode("x<tool_call>y</tool_call>", add_special_tokens=False)
    assert 151657 in ids and 151658 in ids
    assert qwen2.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call>"
    assert qwen2.decode(qwen2.encode(TEXT, add_special_tokens=False)) == TEXT
    assert qwen2("hi").input_ids == base.encode("hi", add_special_tokens=False)  # ChatML adds no bos
    text = qwen2.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name,textless", [
    ("llama-3.1-8b", [0, 16, BASE_VOCAB, 100000, 127999]),
    ("qwen2.5-7b", [0, 16, BASE_VOCAB, 151642, 151665, 152063]),
])
def test_decoding_any_id_of_the_vocabulary_never_raises(name: str, textless: list[int], llama3: Any, qwen2: Any) -> None:
    tokenizer = llama3 if name.startswith("llama") else qwen2
    vocab = _config(name)["vocab_size"]
    rng = random.Random(0)
    ids = [rng.randrange(vocab) for _ in range(3000)] + textless + [vocab - 1]
    assert isinstance(tokenizer.decode(ids), str)
    assert isinstance(tokenizer.decode(ids, skip_special_tokens=True), str)
    # SmolLM2's dropped specials, the gap below the family's specials, the padded rows past them
    assert tokenizer.decode(textless) == ""
    for use_stream in (None, False):
        state = DetokenizerState(use_stream=use_stream)
        for end in range(1, 400):
            detokenize_incrementally(tokenizer, ids[:end], state)
        detokenize_incrementally(tokenizer, ids[:400], state, final=True)
        assert state.text == tokenizer.decode(ids[:400], skip_special_tokens=True)


def test_a_cached_build_is_reused_and_a_new_source_or_builder_rebuilds(
    tmp_path: Path, base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config("llama-3.1-8b")
    # a stand-in for the SmolLM2 file: its fingerprint keys the cache entry
    source = tmp_path / "smollm2.gguf"
    source.write_bytes(b"v1")
    real_build = dummy_tokenizer_module.build_tokenizer
    builds: list[Any] = []

    def counting_build(*args: Any) -> Any:
        # NOTE: rebuilds hand back the first build (what is built is checked above; here only
        # whether a build happens)
        builds.append(builds[0] if builds else real_build(*args))
        return builds[-1]

    monkeypatch.setattr(dummy_tokenizer_module, "build_tokenizer", counting_build)
    first, what = load_dummy_tokenizer(cfg, source, lambda: base, tmp_path / "cache")
    again, _ = load_dummy_tokenizer(cfg, source, lambda: pytest.fail("the base was read again"), tmp_path / "cache")
    assert len(builds) == 1 and "Llama-3" in what
    assert again is not first and again.encode(TEXT) == first.encode(TEXT)
    assert again.chat_template == first.chat_template and again.eos_token_id == 128009
    entries = list((tmp_path / "cache" / "dummy-tokenizer").iterdir())
    assert len(entries) == 1
    source.write_bytes(b"v2, another size")
    os.utime(source, ns=(1, 1))
    load_dummy_tokenizer(cfg, source, lambda: base, tmp_path / "cache")
    assert len(builds) == 2
    assert list((tmp_path / "cache" / "dummy-tokenizer").iterdir()) != entries  # the stale entry went
    monkeypatch.setattr(dummy_tokenizer_module, "BUILD_VERSION", dummy_tokenizer_module.BUILD_VERSION + 1)
    load_dummy_tokenizer(cfg, source, lambda: base, tmp_path / "cache")
    assert len(builds) == 3


def test_small_or_unknown_vocabularies_keep_no_tokenizer_and_say_why() -> None:
    engine = Engine(model="dummy:tiny-qwen2", num_kv_blocks=16)
    assert engine.tokenizer is None and engine.loaded is not None
    with pytest.raises(ValueError, match="^prompt: this model has no tokenizer .*512 tokens .*smaller than the SmolLM2"):
        engine.add_request("text")
    mistral = {**_config("llama-3.1-8b"), "bos_token_id": 1}
    tokenizer, why = loaders._dummy_tokenizer(mistral)
    assert tokenizer is None and "no tokenizer family fits" in why


def test_dummy_smollm2_gets_smollm2s_own_tokenizer(base: Any) -> None:
    tokenizer, what = loaders._dummy_tokenizer(_config("smollm2-135m"))
    assert tokenizer.get_vocab() == base.get_vocab() and "SmolLM2's" in what
    assert tokenizer.chat_template == base.chat_template and (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def _small_llama3(tmp_path: Path) -> str:
    """A two-layer dummy model with Llama 3.1's vocabulary, special ids and rope."""
    cfg = {**_config("llama-3.1-8b"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return f"dummy:{path}"


def test_only_rank_0_of_a_split_dummy_model_gets_the_tokenizer(tmp_path: Path, llama3: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the weights do not matter here; drawing them for a split model builds the whole
    # one on the meta device, whose first use imports torch's reference ops (seconds)
    monkeypatch.setattr(loaders, "_init_dummy", lambda *_: None)
    spec = _small_llama3(tmp_path)
    shards = plan_tensor_shards(ModelConfig.from_hf(resolve_hf_config(spec)[0]), 2)
    first = load_model(spec, CPU, torch.float32, 0, 256, TensorParallelGroup(shards[0], None))
    assert first.tokenizer is not None and first.tokenizer.eos_token_id == 128009
    monkeypatch.setattr(loaders, "_dummy_tokenizer", lambda cfg: pytest.fail("a worker built the tokenizer"))
    second = load_model(spec, CPU, torch.float32, 0, 256, TensorParallelGroup(shards[1], None))
    assert second.tokenizer is None


def test_a_small_llama3_dummy_model_serves_chats_and_forced_tool_calls(tmp_path: Path, llama3: Any) -> None:
    pytest.importorskip("xgrammar")
    from fastapi.testclient import TestClient

    from agent_runtime import AgentRuntime, create_app

    spec = _small_llama3(tmp_path)
    engine = Engine(model=spec, num_kv_blocks=128, max_model_len=1024, seed=3)
    assert engine.tokenizer is not None and {128001, 128008, 128009} <= engine.eos_token_ids
    out = engine.generate(["Hello there"], SamplingParams(max_tokens=24, ignore_eos=True, seed=1))[0]
    assert len(out.token_ids) == 24 and out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)

    runtime = AgentRuntime(engine, policy="asymcache")
    user = [{"role": "user", "content": "Read the notes."}]

    async def forced() -> list[Any]:
        turns = []
        for choice in ("required", {"type": "function", "function": {"name": "read_file"}}):
            turns.append(await runtime.chat(user, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=5))
        return turns

    for turn in asyncio.run(forced()):
        (call,) = turn.parsed.tool_calls
        assert call.name == "read_file" and call.arguments["path"] in ("notes.txt", "todo.md")
        assert turn.finish_reason == "tool_calls"
    with TestClient(create_app(runtime, "dummy")) as client:
        body = {"model": "dummy", "messages": user, "max_tokens": 32, "temperature": 1.0, "seed": 2,
                "ignore_eos": True}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        assert reply.json()["usage"]["completion_tokens"] == 32
        forced_reply = client.post("/v1/chat/completions", json={
            "model": "dummy", "messages": user, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0,
        })
        assert forced_reply.status_code == 200, forced_reply.text
        (call,) = forced_reply.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "read_file"
        assert json.loads(call["function"]["arguments"])["path"] in ("notes.txt", "todo.md")
        # vLLM's add_special_tokens: a text completion starts with Llama's <|begin_of_text|> by
        # default, as /tokenize's prompt does; a chat has the one its template writes
        plain = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        for extra, want in (({}, [128000, *plain]), ({"add_special_tokens": False}, plain)):
            done = client.post("/v1/completions", json={"model": "dummy", "prompt": "Hello there", "max_tokens": 2,
                                                        "return_token_ids": True, **extra})
            assert done.status_code == 200, done.text
            assert done.json()["choices"][0]["prompt_token_ids"] == want
            assert client.post("/tokenize", json={"prompt": "Hello there", **extra}).json()["tokens"] == want
        chat_ids = client.post("/tokenize", json={"messages": user}).json()["tokens"]
        assert chat_ids[0] == 128000 and chat_ids.count(128000) == 1
    runtime.close_sync()
