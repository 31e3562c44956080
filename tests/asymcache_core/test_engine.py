"""Engine behaviour with the real SmolLM2: batching, chunking, prefix sharing, preemption, stops, chat
(bad input: ``test_engine_bad_input.py``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core import Engine, SamplingParams
from asymcache_core.engine_outputs import stop_prefix_length
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
