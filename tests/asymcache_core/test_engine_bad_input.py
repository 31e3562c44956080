"""Bad input to the engine is a ValueError naming the argument, and leaves the engine usable:
requests, prompts and batches, sampling parameters, the config, models and checkpoints, chats,
job calls, and pools past the machine's memory."""

from __future__ import annotations

import re

import pytest
import torch

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.loaders import load_model
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 49152]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [5] * 300}, "prompt"),
        ({"prompt": [5] * 10, "params": SamplingParams(max_tokens=5000)}, "num_kv_blocks"),
    ],
)
def test_bad_requests_raise_and_leave_engine_usable(smollm, chat_prompts, kwargs, field):
    engine = make_engine(smollm, num_kv_blocks=8, max_model_len=256)
    with pytest.raises(ValueError, match=field):
        engine.add_request(**kwargs)
    assert engine.generate([chat_prompts[0]], SamplingParams(max_tokens=3))[0].token_ids
    engine.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "bad"),
    [([1, 2, 2.0, 3], "2.0"), ([1, "7", 2], "'7'"), ([3, 4, 10**9], str(10**9)), ([5, -2, 6], "-2"), ([1, None], "None")],
)
def test_a_bad_prompt_id_is_named_in_the_error(prompt, bad):
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    with pytest.raises(ValueError, match=rf"^prompt: token id {re.escape(bad)} is outside the vocabulary"):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    engine.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": None}, "^prompt: a string or a list of token ids"),
        ({"prompt": b"ab"}, "^prompt: a string or a list of token ids"),
        ({"prompt": [True, False]}, "^prompt: token id True is outside"),
        ({"priority": "high"}, "^priority: a finite number"),
        ({"priority": None}, "^priority: a finite number"),
        ({"priority": float("nan")}, "^priority: a finite number"),
        ({"request_id": ["r"]}, "^request_id: a non-empty string"),
        ({"job_id": 5}, "^job_id: a non-empty string"),
        ({"job_id": ""}, "^job_id: a non-empty string"),
        ({"continues_job": 5}, "^continues_job: a non-empty string"),
        ({"is_last_step": "no"}, "^is_last_step: True or False"),
    ],
)
def test_add_request_arguments_of_the_wrong_type_are_value_errors(kwargs, message):
    """A priority that is no number once queued and broke every later step's sort (a
    TypeError for every request); the others slipped through or raised deep inside."""
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=message):
        engine.add_request(**{"prompt": [4, 5, 6], "params": SamplingParams(max_tokens=2), **kwargs})
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_engine_ids_skip_a_callers_id_they_would_repeat():
    """A caller's ``req-1`` and the engine's next id once collided: the second overwrote the
    first, which stayed running with its block and every later step raised a KeyError."""
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    ids = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="req-1"),
           engine.add_request([4, 5, 6], SamplingParams(max_tokens=2)),
           engine.add_request([7, 8, 9], SamplingParams(max_tokens=2))]
    assert len(set(ids)) == 3 and ids[0] == "req-1"
    finished = set()
    while engine.has_unfinished():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == set(ids)
    engine.check_integrity()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([[1, 2], [3, 4]], None, ["a"]), r"^job_ids: one job id \(or None\) per prompt"),
        (([[1, 2], None],), r"^prompts\[1\]: a string or a list of token ids"),
        ((None,), "^prompts: a prompt"),
        ((5,), "^prompts: a prompt"),
    ],
)
def test_generate_rejects_a_bad_batch_and_queues_none_of_it(args, message):
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    with pytest.raises(ValueError, match=message):
        engine.generate(*args)
    assert not engine.has_unfinished() and engine.step() == []
    engine.check_integrity()


def test_a_rejected_batch_leaves_no_request_and_no_output_behind():
    # generate() queues nothing of a batch with a bad prompt: the prompts before it are
    # aborted without an output of their own (the caller gets the ValueError instead)
    from asymcache_core import Engine, EngineConfig

    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[1, 2, 3], []], SamplingParams(max_tokens=2))
    assert engine.step() == [] and not engine.has_unfinished()
    engine.check_integrity()
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2 and engine.step() == []


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # once TypeErrors and OverflowErrors from deep inside, or accepted and failing at a step
    for kwargs, field in (({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids"),
                          ({"bad_words": 5}, "bad_words"), ({"allowed_token_ids": 5}, "allowed_token_ids"),
                          ({"logits_processors": 5}, "logits_processors"),
                          ({"logits_processors": [5]}, "logits_processors"),
                          ({"temperature": 10**400}, "temperature"), ({"top_p": 10**400}, "top_p"),
                          ({"logit_bias": {"1": 10**400}}, r"logit_bias\[1\]")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            SamplingParams(**kwargs)
    # None is no items, as vLLM takes it; one string is one stop string
    none = SamplingParams(stop=None, stop_token_ids=None, bad_words=None, logits_processors=None)
    assert none.stop == () and none.stop_token_ids == () and none.bad_words == () and none.logits_processors == ()
    assert SamplingParams(stop="xe").stop == ("xe",)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eviction_policy": "nope"}, "eviction_policy"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_model_len": -5}, "max_model_len"),
        ({"chunking": "fixed:x"}, "chunking"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"priority": "random"}, "priority"),
        ({"attention_backend": "cudnn"}, "attention_backend"),
        # once TypeErrors or AttributeErrors from inside, or taken as they were
        ({"kv_memory_fraction": "0.5"}, "kv_memory_fraction"),
        ({"tpot_slo_ms": None}, "tpot_slo_ms"),
        ({"tpot_slo_ms": float("inf")}, "tpot_slo_ms"),
        ({"chunking": 5}, "chunking"),
        ({"chunking": "fixed: 8"}, "chunking"),
        ({"dtype": ["x"]}, "dtype"),
        ({"hole_reuse": "yes"}, "hole_reuse"),
        ({"latency_profile": 5}, "latency_profile"),
        ({"seed": True}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"device_memory_gib": True}, "device_memory_gib"),
        ({"device": "cpu:1"}, "device"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        EngineConfig(**kwargs)


def test_a_pool_past_the_machines_memory_is_refused_and_positions_past_the_models_are_not_built(monkeypatch):
    """``num_kv_blocks=10**12`` once allocated until the kernel killed the process; a
    ``max_model_len`` past the model's limit was clamped by the engine but sized the rotary
    table first (a 32 GB allocation at 10**9)."""
    import asymcache_core.memory_budget as memory_budget

    with monkeypatch.context() as patched:  # a machine of 1 MiB: no real allocation is risked
        patched.setattr(memory_budget.os, "sysconf", lambda name: {"SC_PHYS_PAGES": 256, "SC_PAGE_SIZE": 4096}[name])
        with pytest.raises(ValueError, match="^num_kv_blocks: a KV pool of .* GiB does not fit the 0.0 GiB"):
            Engine("dummy:tiny", num_kv_blocks=1024)
    engine = Engine("dummy:tiny", num_kv_blocks=8)
    limit = engine.model_config.max_position_embeddings
    # NOTE: vLLM's rule: a limit past the model's is refused, not kept in engine.config while
    # the engine runs the model's (a shared model is checked the same)
    for loaded in (None, engine.loaded):
        with pytest.raises(ValueError, match=f"^max_model_len: 1000000000 is past dummy:tiny's limit of {limit} "):
            Engine("dummy:tiny", num_kv_blocks=8, max_model_len=10**9, loaded=loaded)
    assert Engine("dummy:tiny", num_kv_blocks=8, max_model_len=limit).config.max_model_len == limit
    loaded = load_model("dummy:tiny", torch.device("cpu"), torch.float32, 0, max_len=10**9)
    rotary = [b for n, b in loaded.model.named_buffers() if "cos" in n or "sin" in n]
    assert rotary and all(b.shape[0] <= limit for b in rotary)


def test_the_simulated_engine_refuses_a_max_model_len_past_the_models_as_the_real_one_does():
    # dummy:llama-3.1-8b's config: 131072 positions (its weights are never loaded here)
    with pytest.raises(ValueError, match="^max_model_len: 131073 is past dummy:llama-3.1-8b's limit of 131072 "):
        Engine.simulated(model="dummy:llama-3.1-8b", num_kv_blocks=16, max_model_len=131073)
    with pytest.raises(ValueError, match="^max_model_len: 1000000000 is past dummy:tiny's limit of "):
        Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, max_model_len=10**9))
    at_limit = Engine.simulated(model="dummy:llama-3.1-8b", num_kv_blocks=16, max_model_len=131072)
    assert at_limit.max_model_len == at_limit.config.max_model_len == 131072
    assert Engine.simulated(model="dummy:llama-3.1-8b", num_kv_blocks=16).max_model_len == 131072


def test_unknown_model_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="model"):
        Engine(model="no-such-model")
    with pytest.raises(ValueError, match="model"):
        Engine(model="dummy:no-such-config")
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(ValueError, match="architectures"):
        Engine(model=f"dummy:{cfg}")


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Engine(model=str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="model"):
        Engine(model=str(bad))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        (__import__("pathlib").Path(__file__).parents[2] / "asymcache_core/configs/tiny.json").read_text()
    )
    with pytest.raises(ValueError, match="safetensors"):
        Engine(model=str(folder))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="safetensors"):
        Engine(model=str(folder))



@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([], {}, "^messages: a conversation"),
        ("hello", {}, "^messages: a conversation"),
        ([{"content": "no role"}], {}, r"^messages\[0\]\.role: must be one of"),
        ([[{"role": "user", "content": "a"}], []], {}, r"^messages\[1\]: must be a non-empty list of messages"),
        ([{"role": "user", "content": "a"}], {"continue_final_message": True}, "^continue_final_message: "),
        ([{"role": "user", "content": "a"}], {"chat_template": "{{ raise_exception('no system turns') }}"},
         r"^chat_template: the template failed on this chat: no system turns"),
        ([{"role": "user", "content": "a"}], {"chat_template_kwargs": ["x"]}, "^chat_template_kwargs: "),
        # checked as the server checks them (once rendered as they were)
        ([{"role": "alien", "content": "a"}], {}, r"^messages\[0\]\.role: "),
        ([{"role": "user", "content": 5}], {}, r"^messages\[0\]\.content: "),
        ([{"role": "user"}], {}, r"^messages\[0\]\.content: a user message needs content"),
        ([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}, {"role": "alien", "content": "c"}]],
         {}, r"^messages\[1\]\[1\]\.role: "),
        ([{"role": "user", "content": "a"}], {"add_generation_prompt": "x"}, "^add_generation_prompt: True or False"),
        ([{"role": "user", "content": "a"}], {"tools": [5]}, "^tools: a list of OpenAI tool schemas"),
        # a template's own arithmetic and recursion errors (once ZeroDivisionError, RecursionError)
        ([{"role": "user", "content": "a"}], {"chat_template": "{{ 1 / 0 }}"},
         r"^chat_template: the template failed on this chat: division by zero"),
        ([{"role": "user", "content": "a"}], {"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"},
         r"^chat_template: the template failed on this chat"),
        ([{"role": "user", "content": "a"}], {"chat_template": "{% for i in range(10**9) %}{% endfor %}"},
         r"^chat_template: the template failed on this chat"),
    ],
)
def test_chat_rejects_bad_conversations_naming_the_argument(smollm, messages, kwargs, message):
    engine = make_engine(smollm, num_kv_blocks=16)
    with pytest.raises(ValueError, match=message):
        engine.chat(messages, GREEDY, **kwargs)
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_chat_needs_a_tokenizer():
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="^messages: this model has no tokenizer"):
        engine.chat([{"role": "user", "content": "hi"}])


def test_job_calls_reject_bad_ids_and_seconds():
    """A NaN or infinite TTL pinned blocks that never expired; other bad values raised
    TypeErrors from deep inside or were taken silently."""
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=32, block_size=4))
    engine.generate([list(range(3, 40))], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["j"])
    for call, message in ((lambda: engine.pin_job("j", float("nan")), "^ttl_s: a finite number"),
                          (lambda: engine.pin_job("j", float("inf")), "^ttl_s: a finite number"),
                          (lambda: engine.pin_job("j", "1"), "^ttl_s: a finite number"),
                          (lambda: engine.pin_job("j", -1.0), "^ttl_s: must be >= 0"),
                          (lambda: engine.pin_job([], 1.0), "^job_id: a non-empty string"),
                          (lambda: engine.end_job([]), "^job_id: a non-empty string"),
                          (lambda: engine.hint_job("j", expected_gap_s="x"), "^expected_gap_s: a finite number"),
                          (lambda: engine.hint_job("j", expected_gap_s=-1), "^expected_gap_s: must be >= 0"),
                          (lambda: engine.hint_job("j", finished="yes"), "^finished: "),
                          (lambda: engine.idle_until(float("nan")), "^when: a finite number")):
        with pytest.raises(ValueError, match=message):
            call()
    assert engine.stats().pinned_blocks == 0
    assert engine.pin_job("j", 1.0) > 0
    engine.idle_until(engine.clock() + 2.0)
    assert engine.stats().pinned_blocks == 0
    engine.check_integrity()


def test_block_tables_past_the_machines_memory_are_refused_before_they_are_built():
    """A simulated pool of 10**14 blocks once built a Python object a block until the kernel
    killed the process (16 GB in); a host tier of 1e30 GB raised an empty MemoryError."""
    with pytest.raises(ValueError, match="^num_kv_blocks: 99,999,999,999,999 blocks need .* GiB of tables alone"):
        Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=99_999_999_999_999))
    with pytest.raises(ValueError, match="^cpu_offload_gb: .* blocks need"):
        Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, cpu_offload_gb=1e30))
    with pytest.raises(ValueError, match="^num_host_kv_blocks: .* blocks need"):
        Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, num_host_kv_blocks=10**14))
