"""Engine behaviour with the real SmolLM2: batching, chunking, prefix sharing, preemption, errors."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.engine_outputs import stop_prefix_length
from asymcache_core.loaders import load_model
from tests.conftest import make_engine

# NOTE: 6 tokens: past the prompt, every step of a test costs about the same on the CPU
# whatever its batch (the weights' reads), so a test's time is its decode steps. The preemption
# test's answers are 12 tokens long (LONG): with 6, no request grows into another block.
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def long_reference(smollm, chat_prompts):
    """Each prompt alone, unchunked, roomy pool, :data:`LONG` answers."""
    engine = make_engine(smollm, num_kv_blocks=256)
    return [engine.generate([p], LONG)[0].token_ids for p in chat_prompts]


@pytest.fixture(scope="module")
def reference(long_reference):
    """The :data:`GREEDY` answers of each prompt alone: the first tokens of the long ones
    (greedy tokens do not depend on how many follow)."""
    return [tokens[: GREEDY.max_tokens] for tokens in long_reference]


def test_batch_matches_each_prompt_alone(smollm, chat_prompts, reference):
    engine = make_engine(smollm)
    prompts = [chat_prompts[0][:9], *chat_prompts]  # mixed lengths, including a short one
    alone = make_engine(smollm).generate([prompts[0]], GREEDY)[0].token_ids
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [alone, *reference]
    engine.check_integrity()


def test_chunked_prefill_matches_unchunked(smollm, chat_prompts, reference):
    engine = make_engine(smollm, chunking="fixed:16")
    outs = engine.generate(chat_prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert max(s.num_tokens for s in engine.step_log) <= 16
    # a prompt of 30+ tokens under a 16-token budget must have been split over several steps
    assert sum(1 for s in engine.step_log if s.num_tokens == 16) >= 3
    engine.check_integrity()


def test_shared_prefix_reports_cached_tokens(smollm, chat_prompts, reference):
    engine = make_engine(smollm)
    first = engine.generate([chat_prompts[2]], GREEDY)[0]
    second = engine.generate([chat_prompts[2]], GREEDY)[0]
    assert first.metrics.cached_tokens == 0
    bs = engine.block_size
    assert second.metrics.cached_tokens == (len(chat_prompts[2]) - 1) // bs * bs > 0
    assert second.token_ids == first.token_ids == reference[2]
    # the system prompt is shared across different questions too
    third = engine.generate([chat_prompts[0]], GREEDY)[0]
    assert third.metrics.cached_tokens >= bs
    assert third.token_ids == reference[0]
    engine.check_integrity()


def test_a_cache_salt_is_a_namespace_of_the_prefix_cache(smollm, chat_prompts, reference):
    """vLLM's ``cache_salt``: blocks are found only by requests of the same salt (the unsalted
    ones are a namespace of their own), and the tokens are those of an unsalted run."""
    from dataclasses import replace

    from asymcache_core.kv_cache_manager import salted_root

    engine = make_engine(smollm)
    bs, prompt = engine.block_size, chat_prompts[2]
    full = (len(prompt) - 1) // bs * bs

    def cached(salt: str | None) -> int:
        # NOTE: two tokens of the reference: the first reads the cached (or computed) prompt,
        # the second the KV written after it; six runs of six tokens would be 36 steps
        out = engine.generate([prompt], replace(GREEDY, max_tokens=2, cache_salt=salt))[0]
        assert out.token_ids == reference[2][:2]
        return out.metrics.cached_tokens

    assert [cached("tenant-a"), cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-b"),
            cached(None)] == [0, full, 0, 0, full, full]
    engine.check_integrity()
    # the namespaces' roots are digests: the same in every process (the host tier's and KV
    # events' readers compare hashes across processes), distinct per salt
    assert salted_root("tenant-a") == salted_root("tenant-a") != salted_root("tenant-b") != salted_root(None)
    for bad in ("", "x" * 1025, 5):
        with pytest.raises(ValueError, match="^cache_salt: "):
            SamplingParams(cache_salt=bad)


def test_preemption_under_tiny_pool_finishes_everything(smollm, chat_prompts, long_reference):
    longest = max(len(p) for p in chat_prompts) + LONG.max_tokens
    blocks = -(-longest // 16) + 1  # room for one request and a bit
    engine = make_engine(smollm, num_kv_blocks=blocks)
    outs = engine.generate(chat_prompts, LONG)
    assert [o.token_ids for o in outs] == long_reference
    # the pressure the test is for: two requests ran together and one lost its blocks
    assert engine.stats().preemptions_total > 0 and max(s.num_seqs for s in engine.step_log) == 2
    engine.check_integrity()
    assert engine.stats().kv_blocks_in_use == 0


def test_streaming_outputs_carry_new_tokens(smollm, chat_prompts, reference):
    engine = make_engine(smollm)
    rid = engine.add_request(chat_prompts[0], GREEDY)
    streamed: list[int] = []
    finished = None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            streamed.extend(out.new_token_ids)
            if out.finished:
                finished = out
    assert finished is not None and finished.finish_reason == "length"
    assert streamed == finished.token_ids == reference[0]
    m = finished.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert m.ttft is not None and m.ttft >= 0 and m.tpot is not None


def test_text_stop_strings_and_eos(smollm, chat_prompts):
    engine = make_engine(smollm)
    out = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=30))[0]
    assert out.text.startswith("The capital of France is Paris")
    assert out.finish_reason == "stop"  # SmolLM2 ends with <|im_end|>
    cut = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=30, stop=("France",)))[0]
    assert cut.text == "The capital of "
    assert cut.finish_reason == "stop"


@pytest.mark.parametrize("stop", ["of France", "capital of Fr", "France is Paris!"])
def test_a_stream_never_shows_part_of_a_stop_string(smollm, chat_prompts, stop):
    """Streamed texts once ended in the first characters of a stop string ("...capital of")
    that the final text then cut away: what a stream shows only grows, and is the final text's
    start (a stop string that never completes, the last case, is held back only while it might)."""
    engine = make_engine(smollm)
    params = SamplingParams(max_tokens=30, stop=(stop, "zzz-never"))
    rid = engine.add_request(chat_prompts[0], params)
    texts = []
    while engine.has_unfinished():
        texts += [out.text for out in engine.step() if out.request_id == rid]
    final = texts[-1]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert stop not in final
    (alone,) = engine.generate([chat_prompts[0]], params)
    assert alone.text == final


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab", max_size=12), st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3))
def test_the_held_back_end_of_a_text_is_the_longest_start_of_a_stop_string(text, stops):
    held = stop_prefix_length(text, stops)
    assert held == max((n for s in stops for n in range(len(s)) if text.endswith(s[:n]) and n <= len(text)), default=0)
    # whatever comes next, a stop string found later begins at or after what was shown
    for more in ("a", "b", "ab", "ba", "bb"):
        longer = text + more
        found = [longer.find(s) for s in stops if s in longer and s not in text]
        assert all(i >= len(text) - held for i in found)


def test_random_sampling_is_seeded(smollm, chat_prompts):
    engine = make_engine(smollm)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = engine.generate([chat_prompts[1]], params)[0].token_ids
    b = engine.generate([chat_prompts[1], chat_prompts[0]], [params, GREEDY])[0].token_ids
    assert a == b


def test_abort_frees_blocks(smollm, chat_prompts):
    engine = make_engine(smollm)
    rid = engine.add_request(chat_prompts[1], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().kv_blocks_in_use > 0
    assert engine.abort(rid)
    outs = engine.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert not engine.abort(rid)


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


def test_dummy_model_runs_without_tokenizer():
    engine = Engine(model="dummy:tiny", num_kv_blocks=32)
    out = engine.generate([[3, 4, 5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == ""
    # a 512-token vocabulary is too small for the SmolLM2 BPE a dummy model's tokenizer is built on
    with pytest.raises(ValueError, match="no tokenizer .*smaller than the SmolLM2 BPE"):
        engine.add_request("text needs a tokenizer")


def test_job_turn_size_is_the_new_tokens_of_each_turn(smollm, chat_prompts):
    """AsymCache prices a rebuild by the size of the job's next step: a turn's new tokens,
    not its whole prompt."""
    engine = make_engine(smollm)
    first = chat_prompts[0]
    out = engine.generate([first], SamplingParams(max_tokens=3, ignore_eos=True), job_ids=["s"])[0]
    follow_up = first + out.token_ids + chat_prompts[1][:10]
    engine.generate([follow_up], SamplingParams(max_tokens=2, ignore_eos=True), job_ids=["s"])
    assert engine.job_stats.jobs["s"].new_tokens == [len(first), 10]
    assert engine.job_stats.expected_next_tokens("s") == (len(first) + 10) // 2
    # a prompt that does not extend the last context counts whole
    engine.generate([chat_prompts[2][:7]], SamplingParams(max_tokens=1), job_ids=["s"])
    assert engine.job_stats.jobs["s"].new_tokens[-1] == 7


def test_stats_snapshot_tracks_pool_and_counters() -> None:
    from asymcache_core import EngineStats

    engine = Engine(model="dummy:tiny", num_kv_blocks=64, block_size=16, device="cpu", dtype="float32")
    before = engine.stats()
    assert isinstance(before, EngineStats)
    assert before.kv_blocks_total == 64 and before.kv_blocks_in_use == 0 and before.requests_total == 0
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=3), job_id="j")
    waiting = engine.stats()
    assert waiting.requests_waiting == 1 and waiting.requests_running == 0
    engine.step()
    running = engine.stats()
    assert running.requests_running == 1 and running.kv_blocks_in_use >= 3
    while engine.has_unfinished():
        engine.step()
    done = engine.stats()
    assert done.requests_running == 0 and done.engine_prompt_tokens_total == 39
    assert done.engine_generated_tokens_total == 3 and done.kv_blocks_peak_in_use >= 3
    assert set(done.as_dict()) >= {"evictions_total", "pinned_blocks", "engine_computed_tokens_total"}


def test_simulated_engine_moves_only_its_virtual_clock():
    from dataclasses import replace

    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=32)
    assert engine.clock() == 0.0 and engine.attention_backend == "simulated" and engine.tokenizer is None
    prompt = list(range(3, 40))  # 2 full blocks of 16
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = engine.generate([prompt], params, job_ids=["s"])[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    steps = engine.step_log
    assert engine.clock() == pytest.approx(sum(s.duration_s for s in steps)) and steps[0].duration_s > 0
    assert all(s.duration_s == pytest.approx(s.predicted_s) for s in steps)  # the device is the model
    # idle time: the clock jumps forward, never back, and pins due by then expire
    assert engine.pin_job("s", ttl_s=1.0) == 2 and engine.stats().pinned_blocks == 2
    now = engine.clock()
    engine.idle_until(now + 0.5)
    assert engine.clock() == now + 0.5 and engine.stats().pinned_blocks == 2
    engine.idle_until(now)
    assert engine.clock() == now + 0.5
    engine.idle_until(now + 2.0)
    stats = engine.stats()
    assert engine.clock() == now + 2.0 and stats.pinned_blocks == 0 and stats.pins_expired_total == 1
    # the prefix cache reset drops the cached blocks: the same prompt then hits nothing
    assert engine.reset_prefix_cache() == (2, 0) and engine.stats().evictions_total == 2
    assert engine.generate([prompt], params)[0].metrics.cached_tokens == 0
    engine.check_integrity()
    # a device slower than the engine's model: steps take longer than the model predicts
    slow = replace(engine.latency, floor_s=engine.latency.floor_s + 0.01)
    mispredicted = Engine.simulated(model="dummy:tiny", num_kv_blocks=32, device_latency=slow)
    mispredicted.generate([prompt], params)
    assert all(s.duration_s == pytest.approx(s.predicted_s + 0.01) for s in mispredicted.step_log)
    # a live loop's host time between steps: after each step's outputs, outside its duration
    gapped = Engine.simulated(model="dummy:tiny", num_kv_blocks=32, device_latency=replace(slow, host_gap_s=0.002))
    gapped.generate([prompt], params)
    log = list(gapped.step_log)
    assert all(s.duration_s == pytest.approx(s.predicted_s + 0.01) for s in log)
    assert all(b.start == pytest.approx(a.start + a.duration_s + 0.002) for a, b in zip(log, log[1:], strict=False))
    assert gapped.clock() == pytest.approx(sum(s.duration_s for s in log) + 0.002 * len(log))


def test_idle_until_leaves_a_real_clock_alone_and_expires_pins():
    now = [0.0]
    engine = Engine(model="dummy:tiny", num_kv_blocks=32, clock=lambda: now[0])
    engine.generate([list(range(3, 40))], SamplingParams(max_tokens=1, ignore_eos=True), job_ids=["s"])
    assert engine.pin_job("s", ttl_s=1.0) == 2
    engine.idle_until(100.0)  # not the engine's to move: returns at once
    assert now[0] == 0.0 and engine.stats().pinned_blocks == 2
    now[0] = 1.5  # the caller waited
    engine.idle_until(100.0)
    assert engine.stats().pinned_blocks == 0 and engine.stats().pins_expired_total == 1


def test_chat_renders_conversations_as_vllms_llm_chat(smollm):
    engine = make_engine(smollm, num_kv_blocks=64)
    tok = smollm.tokenizer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    started = [*question, {"role": "assistant", "content": "Paris is"}]
    outs = engine.chat([question, started], SamplingParams(max_tokens=3, ignore_eos=True),
                       add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(outs[1].prompt_token_ids).endswith("Paris is")  # no end-of-turn after it
    (alone,) = engine.chat(question, GREEDY)
    rendered = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    (reference,) = engine.generate([rendered], GREEDY)
    assert alone.prompt_token_ids == reference.prompt_token_ids and alone.token_ids == reference.token_ids
    # without the generation prompt the question's rendering stops before the assistant's header
    head = outs[0].prompt_token_ids
    assert len(head) < len(reference.prompt_token_ids) and reference.prompt_token_ids[: len(head)] == head
    engine.check_integrity()


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
