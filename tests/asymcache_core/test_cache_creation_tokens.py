"""``RequestMetrics.cache_creation_tokens``: the prompt tokens a request wrote to the prefix
cache (vLLM's ``PrefillStats.num_cache_creation_tokens``): its prompt's full blocks that it
computed and registered before its first token, beside ``cached_tokens`` (its hits)."""

from __future__ import annotations

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.request import RequestMetrics

BS = 4
PROMPT = list(range(100, 142))  # ten full blocks of 4 tokens and two tokens more
ONE = SamplingParams(max_tokens=2, ignore_eos=True)


def _engine(**overrides: object) -> Engine:
    return Engine.simulated(EngineConfig(model="dummy:tiny", block_size=BS, **{"num_kv_blocks": 32, **overrides}))


def _run(engine: Engine, prompt: list[int]) -> RequestMetrics:
    metrics = engine.generate([prompt], ONE)[0].metrics
    engine.check_integrity()
    return metrics


def test_a_first_run_writes_its_full_blocks_and_a_second_reads_them_and_writes_the_new_tail():
    engine = _engine()
    first = _run(engine, PROMPT)
    assert (first.cached_tokens, first.cache_creation_tokens) == (0, 40)  # the partial block is no write
    again = _run(engine, PROMPT)
    assert (again.cached_tokens, again.cache_creation_tokens) == (40, 0)
    # nine new tokens: the two-token tail becomes a full block and one more follows
    longer = _run(engine, PROMPT + list(range(200, 209)))
    assert (longer.cached_tokens, longer.cache_creation_tokens) == (40, 8)
    # NOTE: a prompt of whole blocks that is all cached computes its last block again (the last
    # token needs logits), but the hash is cached already: no write (vLLM counts that copy)
    whole = _run(engine, PROMPT[:40])
    assert (whole.cached_tokens, whole.cache_creation_tokens) == (36, 0)


def test_blocks_evicted_since_are_written_again():
    engine = _engine(num_kv_blocks=16)
    assert _run(engine, PROMPT).cache_creation_tokens == 40
    other = _run(engine, list(range(300, 360)))  # fifteen blocks and its output: the pool's all
    assert (other.cached_tokens, other.cache_creation_tokens) == (0, 60)
    back = _run(engine, PROMPT)
    assert (back.cached_tokens, back.cache_creation_tokens) == (0, 40)


def test_a_chunked_prefill_counts_every_chunk_and_the_count_is_fixed_at_the_first_token():
    engine = _engine(max_num_batched_tokens=8)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    request = engine.requests[rid]
    seen = []
    while rid in engine.requests:
        engine.step()
        seen.append(request.metrics.cache_creation_tokens)
    # two blocks a step while the prompt runs, then 40 however many output blocks fill up
    assert seen[:5] == [8, 16, 24, 32, 40] and set(seen[5:]) == {40}
    assert len(request.output_token_ids) == 12  # its output filled blocks that are not the prompt's


def test_a_prefill_redone_after_a_preemption_counts_no_block_twice():
    """vLLM fixes the count at the first output and caps it at the prompt's full blocks less
    its hits: the blocks a preempted request writes again (here evicted meanwhile) add nothing."""
    for steps_before, chunk in ((1, 64), (2, 8)):  # after its first token / mid-prefill (16 of 42)
        engine = _engine(max_num_batched_tokens=chunk)
        rid = engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        request = engine.requests[rid]
        for _ in range(steps_before):
            engine.step()
        assert bool(request.output_token_ids) == (chunk == 64)
        engine.scheduler.preempt(request)
        assert engine.reset_prefix_cache().device_blocks >= request.metrics.cache_creation_tokens // BS > 0
        while rid in engine.requests:
            engine.step()
        engine.check_integrity()
        assert request.metrics.num_preemptions == 1 and request.metrics.computed_tokens > len(PROMPT)
        assert (request.metrics.cached_tokens, request.metrics.cache_creation_tokens) == (0, 40)
