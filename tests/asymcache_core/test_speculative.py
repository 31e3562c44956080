"""Speculative decoding with n-gram drafts (:mod:`asymcache_core.speculative`): the config, the
proposer and the acceptance rule on their own, then SmolLM2 generating with and without drafts:
the same tokens (greedy and seeded random, alone and batched, under preemption), drafts kept,
fewer steps, no block leaked, the prefix cache still right, the stop conditions inside a run."""

from __future__ import annotations

import numpy as np
import pytest

from asymcache_core import EngineConfig, SamplingParams
from asymcache_core.speculative import (
    SpeculativeConfig,
    accepted_tokens,
    ngram_drafts,
)
from tests.conftest import make_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_the_config_is_vllms():
    assert SpeculativeConfig.parse(SPEC) == SpeculativeConfig(4, 2, 4)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(3, 5, 5)
    # one bound given: the other takes it (vLLM's SpeculativeConfig)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == (
        SpeculativeConfig(2, 3, 3))
    assert SpeculativeConfig.parse(None) is None
    bad = {
        "not json": "speculative_config: not valid JSON",
        '["ngram"]': "speculative_config: must be a JSON object",
        '{"method": "eagle", "num_speculative_tokens": 2}': "speculative_config.method: only 'ngram'",
        '{"method": "ngram"}': "speculative_config.num_speculative_tokens: required",
        '{"method": "ngram", "num_speculative_tokens": 0}': "speculative_config.num_speculative_tokens: must be",
        '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}': "speculative_config.model: not served",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}':
            "speculative_config.prompt_lookup_min: 4 is above",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
            SpeculativeConfig.parse(text)
    schedule = {**SPEC, "num_speculative_tokens_per_batch_size": [[9, 16, 2], [1, 4, 6], [5, 8, 3]]}
    config = SpeculativeConfig.parse(schedule)
    assert config.per_batch_size == ((1, 4, 6), (5, 8, 3), (9, 16, 2))
    # capped by num_speculative_tokens; past the last range its k carries on
    assert [config.drafts_at(b) for b in (1, 4, 5, 8, 9, 16, 17, 500)] == [4, 4, 3, 3, 2, 2, 2, 2]
    field = "speculative_config.num_speculative_tokens_per_batch_size"
    for schedule_value, message in (([], "must be a non-empty list"), ([[1, 4]], "each entry is"),
                                    ([[2, 4, 1]], "the first range must start at batch size 1"),
                                    ([[1, 4, 1], [4, 8, 2]], "the ranges overlap"), ([[1, 4, -1]], r"\[1, 4, -1\] needs 1 <= first")):
        with pytest.raises(ValueError, match=f"^{field}: {message}"):
            SpeculativeConfig.parse({**SPEC, "num_speculative_tokens_per_batch_size": schedule_value})
    with pytest.raises(ValueError, match="^speculative_config: not with async_scheduling"):
        EngineConfig(speculative_config=SPEC, async_scheduling=True)
    assert EngineConfig(speculative_config=SPEC).speculative_config == (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}')


def test_drafts_follow_the_longest_earliest_match():
    tokens = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3])
    # "1 2 3" occurs at 0 and 5: the earliest wins, its next four tokens are the drafts
    assert ngram_drafts(tokens, 1, 3, 4) == [4, 5, 1, 2]
    assert ngram_drafts(tokens, 1, 3, 2) == [4, 5]
    # a longer match beats an earlier shorter one
    assert ngram_drafts(np.array([7, 3, 8, 1, 2, 3, 6, 1, 2, 3]), 1, 3, 2) == [6, 1]
    # too short a match, no match, or the context ends right after the match
    assert ngram_drafts(tokens, 4, 4, 4) == []
    assert ngram_drafts(np.array([1, 2, 3, 4]), 1, 2, 3) == []
    assert ngram_drafts(np.array([5, 5, 5]), 1, 1, 4) == [5, 5]  # an occurrence may overlap the suffix
    assert accepted_tokens([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]
    assert accepted_tokens([4, 5], [4, 5, 9]) == [4, 5, 9]
    assert accepted_tokens([4, 5], [1, 5, 9]) == [1]
    with pytest.raises(ValueError, match="^sampled: 2 tokens for 2 drafts"):
        accepted_tokens([4, 5], [4, 5])


def _prompt(smollm) -> list[int]:
    tok = smollm.tokenizer
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2
    text = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + code}],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(text)


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        engine.check_integrity()
    return [tokens[rid] for rid in ids]


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "library"])
def test_the_tokens_are_those_of_decoding_without_drafts(smollm, batch_invariant):
    prompt = _prompt(smollm)
    params = [SamplingParams(max_tokens=28, ignore_eos=True),
              SamplingParams(max_tokens=23, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)]
    prompts = [prompt, prompt[:-3], prompt[5:], prompt]
    if not batch_invariant:
        # NOTE: the library kernels promise greedy tokens only: the greedy row alone
        params, prompts = params[:1], prompts[:1]
    runs = {}
    for spec in (None, SPEC):
        engine = make_engine(smollm, num_kv_blocks=96, batch_invariant=batch_invariant, speculative_config=spec)
        runs[spec is not None] = _run(engine, prompts, params)
        if spec is not None:
            stats = engine.scheduler.speculation
            steps = len(engine.step_log)
        else:
            plain_steps = len(engine.step_log)
        assert engine.pool.num_free_blocks == engine.num_blocks  # nothing leaked
    assert [len(t) for t in runs[True]] == [28, 23, 18, 12][: len(params)]
    if batch_invariant:
        assert runs[True] == runs[False]  # bit-equal logits: the same tokens, random rows too
    else:
        assert runs[True][0] == runs[False][0]  # the library kernels: greedy tokens
    assert stats.num_accepted_tokens > 10 and stats.num_drafts > 0 and steps < plain_steps


def test_stops_inside_a_run_and_the_cache_after_it(smollm):
    prompt = _prompt(smollm)
    engine = make_engine(smollm, num_kv_blocks=96, batch_invariant=True, speculative_config=SPEC)
    plain = make_engine(smollm, num_kv_blocks=96, batch_invariant=True)
    free = _run(plain, [prompt], [SamplingParams(max_tokens=30, ignore_eos=True)])[0]
    # a stop token the run reaches: the reply ends on it, nothing after it kept
    stop = free[12]
    cut = _run(engine, [prompt], [SamplingParams(max_tokens=30, stop_token_ids=(stop,), ignore_eos=True)])[0]
    assert cut == free[: free.index(stop) + 1]
    for limit in (1, 9):
        assert _run(engine, [prompt], [SamplingParams(max_tokens=limit, ignore_eos=True)])[0] == free[:limit]
    # the drafts' blocks, once kept, are the prefix cache's: the next turn hits them
    first = _run(engine, [prompt], [SamplingParams(max_tokens=30, ignore_eos=True)])[0]
    rid = engine.add_request(prompt + first, SamplingParams(max_tokens=4, ignore_eos=True))
    request = engine.requests[rid]
    engine.step()
    bs = engine.config.block_size
    assert request.metrics.cached_tokens == (len(prompt) + len(first) - 1) // bs * bs
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_preempted_requests_with_drafts_keep_their_tokens(smollm):
    prompt = _prompt(smollm)
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, temperature=0.7, seed=1,
                                                                             ignore_eos=True)]
    prompts = [prompt, prompt[3:]]
    roomy = _run(make_engine(smollm, num_kv_blocks=96, batch_invariant=True), prompts, params)
    # two contexts of ~8 blocks each in a pool of 12: one is preempted and recomputed
    tight = make_engine(smollm, num_kv_blocks=12, batch_invariant=True, speculative_config=SPEC)
    assert _run(tight, prompts, params) == roomy
    assert tight.counters.num_preemptions > 0 and tight.scheduler.speculation.num_accepted_tokens > 0


def test_rejected_drafts_give_their_blocks_back(smollm):
    engine = make_engine(smollm, num_kv_blocks=32, speculative_config=SPEC)
    bs = engine.config.block_size
    rid = engine.add_request(list(range(300, 300 + 2 * bs - 2)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    request = engine.requests[rid]
    held = len(request.block_ids)
    # drafts no model would write, across the next block boundary: all rejected
    request.draft_token_ids = [0, 0, 0, 0]
    engine.step()
    assert engine.scheduler.speculation.num_accepted_tokens == 0 and len(request.output_token_ids) == 2
    assert request.num_computed_tokens == request.num_tokens - 1
    # the block the drafts spilled into is free again, and the table's row is marked from there
    assert len(request.block_ids) == held == -(-request.num_computed_tokens // bs)
    assert request.table_dirty_from <= held
    assert engine.pool.num_free_blocks == engine.num_blocks - held
    engine.check_integrity()


def test_the_drafts_are_counted_under_vllms_names(smollm):
    from agent_runtime.server.metrics import ServerMetrics
    from tests.agent_runtime.test_server_metrics import _samples

    engine = make_engine(smollm, num_kv_blocks=96, speculative_config=SPEC)
    _run(engine, [_prompt(smollm)], [SamplingParams(max_tokens=24, ignore_eos=True)])
    stats = engine.stats()
    spec = engine.scheduler.speculation
    assert stats.spec_decode_num_speculative_tokens == 4 and stats.spec_decode_num_drafts_total == spec.num_drafts > 0
    s = _samples(ServerMetrics("m").render(stats).decode())
    model = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:spec_decode_num_drafts_total", model)] == spec.num_drafts
    assert s[("vllm:spec_decode_num_draft_tokens_total", model)] == spec.num_draft_tokens
    assert s[("vllm:spec_decode_num_accepted_tokens_total", model)] == spec.num_accepted_tokens > 0
    assert s[("asymcache_spec_decode_num_accepted_tokens_total", ())] == spec.num_accepted_tokens
    # without a speculative config vLLM has no such series
    plain = _samples(ServerMetrics("m").render(make_engine(smollm, num_kv_blocks=8).stats()).decode())
    assert not any(name.startswith("vllm:spec_decode") for name, _ in plain)


@pytest.mark.gpu
def test_the_same_tokens_on_the_gpu():
    """The CUDA default (batch-invariant, piecewise graphs for the verifying steps) against the
    default engine without drafts (async scheduling, decode graphs): a tiny dummy model whose
    repeats get drafted."""
    import torch

    from asymcache_core import Engine
    from asymcache_core.loaders import load_model

    tiny = load_model("dummy:tiny", torch.device("cuda"), torch.bfloat16, seed=0)
    prompt = torch.randint(100, 400, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [SamplingParams(max_tokens=64, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0.8, seed=5, ignore_eos=True)]
    runs = {}
    for spec in (None, {**SPEC, "prompt_lookup_min": 1}):
        engine = Engine(model="dummy:tiny", device="cuda", loaded=tiny, num_kv_blocks=256, speculative_config=spec)
        runs[spec is not None] = [engine.generate([prompt], p)[0].token_ids for p in params]
        kept = engine.scheduler.speculation.num_accepted_tokens
    assert runs[True] == runs[False] and kept > 0


def test_a_stop_string_inside_a_kept_run_ends_the_reply_on_its_token(smollm):
    prompt = _prompt(smollm)
    outs = {}
    for spec in (None, SPEC):
        engine = make_engine(smollm, num_kv_blocks=96, batch_invariant=True, speculative_config=spec)
        free = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        # a stop string that ends inside the reply: the piece of text of tokens 14-16
        stop = smollm.tokenizer.decode(free.token_ids[14:17])
        outs[spec is not None] = [engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=s))[0]
                                  for s in ((stop,), ("no such text",))]
        generated = engine.counters.generated_tokens
    for (plain, drafted) in zip(outs[False], outs[True], strict=True):
        assert (drafted.token_ids, drafted.text, drafted.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert outs[True][0].finish_reason == "stop" and len(outs[True][0].token_ids) < 20
    assert generated == 24 + len(outs[True][0].token_ids) + 24  # the dropped tokens are not counted


def test_kept_drafts_carry_the_log_probabilities_of_their_rows(smollm):
    prompt = _prompt(smollm)
    outs = {}
    for spec in (None, SPEC):
        engine = make_engine(smollm, num_kv_blocks=96, batch_invariant=True, speculative_config=spec)
        outs[spec is not None] = engine.generate([prompt, prompt], [
            SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=20, logprobs=1, temperature=0.8, seed=2, ignore_eos=True,
                           stop=(smollm.tokenizer.decode([prompt[-30]]),)),
        ])
        kept = engine.scheduler.speculation.num_accepted_tokens
    assert kept > 0
    for plain, drafted in zip(outs[False], outs[True], strict=True):
        assert drafted.token_ids == plain.token_ids and len(drafted.logprobs) == len(drafted.token_ids)
        assert drafted.logprobs == plain.logprobs


def test_the_batch_size_schedule_sets_the_drafts(smollm):
    """vLLM's ``num_speculative_tokens_per_batch_size``: drafts when one request runs, none
    when two do (the k of the step's batch size)."""
    prompt = _prompt(smollm)
    spec = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 64, 0]]}
    engine = make_engine(smollm, num_kv_blocks=96, speculative_config=spec)
    _run(engine, [prompt, prompt[2:]], [SamplingParams(max_tokens=12, ignore_eos=True)] * 2)
    assert engine.scheduler.speculation.num_drafts == 0
    _run(engine, [prompt], [SamplingParams(max_tokens=12, ignore_eos=True)])
    assert engine.scheduler.speculation.num_drafts > 0


def test_two_ranks_verify_the_drafts_as_one_decodes():
    """Tensor parallelism (two CPU ranks, gloo): the drafts reach every rank with the step's
    inputs, and the tokens are those of one rank without drafts."""
    from asymcache_core import Engine

    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6, 7]
    outs = {}
    for ranks, spec in ((1, None), (2, {**SPEC, "prompt_lookup_min": 1})):
        engine = Engine(model="dummy:tiny", num_kv_blocks=64, tensor_parallel_size=ranks, speculative_config=spec,
                        batch_invariant=True)
        try:
            outs[ranks] = [o.token_ids for o in engine.generate([prompt, prompt[3:]],
                                                                 SamplingParams(max_tokens=24, ignore_eos=True))]
            kept = engine.scheduler.speculation.num_accepted_tokens
        finally:
            engine.close()
    assert outs[2] == outs[1] and kept > 0


def test_constrained_replies_speculate_through_their_grammar(smollm):
    """A forced tool call and a JSON reply (xgrammar processors, jump-forward on): each draft's
    row is masked by the grammar as its position's decode would be; the replies are those of
    an engine without drafts."""
    import asyncio

    from agent_runtime.runtime import AgentRuntime
    from tests.agent_runtime.live_server import TOOLS

    ask = [{"role": "user", "content": "Read the file src/app/main.py and then src/app/util.py, please."}]
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    replies = {}
    for spec in (None, {**SPEC, "prompt_lookup_min": 1}):
        runtime = AgentRuntime(make_engine(smollm, max_model_len=1024, batch_invariant=True, speculative_config=spec))
        try:
            called = asyncio.run(runtime.chat(ask, max_tokens=40, tools=TOOLS, tool_choice="required"))
            answer = asyncio.run(runtime.chat(ask, max_tokens=30, response_format={
                "type": "json_schema", "json_schema": {"name": "f", "schema": schema}}))
            replies[spec is not None] = (called.token_ids, answer.token_ids)
            kept = runtime.engine.scheduler.speculation.num_accepted_tokens
        finally:
            runtime.close_sync()
            runtime.engine.close()
    assert replies[True] == replies[False] and kept > 0
