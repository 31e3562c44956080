"""Prompt log probabilities (vLLM's ``prompt_logprobs``): their values against transformers'
SmolLM2, no prefix-cache hit over a position whose logits are still needed, chunked prefills,
preemption, a tight pool and async scheduling."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import Engine, EngineConfig, SamplingParams, logprobs
from asymcache_core.logprobs import MAX_LOGPROBS, TokenLogprob
from asymcache_core.request import Request
from kernels import cpu_linear
from tests.asymcache_core.test_logprobs import run_sessions
from tests.conftest import StepClock, make_engine

PROMPT = list(range(500, 540)) + [28, 253, 1233, 314, 1300, 30, 4020, 28, 253, 1233, 314] * 6


def _entry(token: int, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, 1, ())


def _same(a: tuple | None, b: tuple | None) -> None:
    # NOTE: float32 values of logits computed in other chunks (other reduction orders in
    # attention): equal to a few units in the sixth digit. A rank in the thousands can move by
    # one between such values (another token's logit within 1e-6 of it); the top ids and the
    # ranks among them may not.
    assert a is not None and b is not None and len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.token_id == y.token_id
        assert x.rank == y.rank if y.rank <= MAX_LOGPROBS else abs(x.rank - y.rank) <= 1
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "1"])
def test_prompt_logprobs_out_of_range_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=bad)


def test_simulated_backend_rejects_prompt_logprobs():
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        engine.add_request(list(range(10)), SamplingParams(prompt_logprobs=0))
    assert not engine.has_unfinished()


def test_request_keeps_only_the_part_that_continues_its_prompt_logprobs():
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), 0.0)
    assert request.prompt_logits_from == 0
    request.add_prompt_logprobs(2, [_entry(8, -1.0)])  # past the end: dropped
    assert request.prompt_logprobs == [None]
    request.add_prompt_logprobs(0, [_entry(6, -1.0), _entry(7, -2.0)])
    request.add_prompt_logprobs(1, [_entry(7, -2.0), _entry(8, -3.0)])  # recomputed position 1
    assert [e.token_id for e in request.prompt_logprobs[1:]] == [6, 7, 8]
    assert request.prompt_logits_from == 3
    request.add_prompt_logprobs(3, [_entry(9, -4.0)])
    assert request.prompt_logits_from is None and len(request.prompt_logprobs) == 5
    request.add_prompt_logprobs(3, [_entry(9, -9.0)])  # complete: nothing changes
    assert request.prompt_logprobs[-1].logprob == -4.0
    assert Request("s", [5, 6], SamplingParams(), 0.0).prompt_logits_from is None


def _one_form(monkeypatch, form: str) -> None:
    """Pins the CPU's linear op (:mod:`kernels.cpu_linear`) to ``form`` for every row count."""
    if form == "onednn" and not cpu_linear.onednn_available():
        pytest.skip("this torch build has no oneDNN linear op")
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: (form,) * len(cpu_linear.ROW_BUCKETS))


@pytest.mark.parametrize("form", ["library", "onednn"])
def test_prompt_logprobs_match_transformers(smollm, hf_smollm, monkeypatch, form):
    # NOTE: the library form is transformers' own product, so a rank equals the one counted in
    # its logits; oneDNN's sums in another order (its float32 rounding ~1.7x MKL's, measured
    # 2026-12-06): a rank then counts the tokens above it up to the ties within 1e-4 of it.
    _one_form(monkeypatch, form)
    engine = make_engine(smollm)
    plain, asked = engine.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=3)]
    )
    assert plain.prompt_logprobs is None and asked.token_ids == plain.token_ids
    entries = asked.prompt_logprobs
    assert isinstance(entries, tuple) and len(entries) == len(PROMPT) and entries[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for i, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == PROMPT[i]
        assert entry.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=2e-3)
        assert len(entry.top) == 3
        assert [t for t, _ in entry.top] == ref[i - 1].topk(3).indices.tolist()
        value = ref[i - 1, PROMPT[i]]
        if form == "library":
            assert entry.rank == int((ref[i - 1] > value).sum()) + 1
        else:
            assert int((ref[i - 1] > value + 1e-4).sum()) + 1 <= entry.rank <= int((ref[i - 1] > value - 1e-4).sum()) + 1
    # the repeated phrase is predictable the second time round: the model says so
    assert entries[-1].rank == 1


def test_a_one_token_prompt_has_one_null_entry(smollm):
    (out,) = make_engine(smollm).generate([[42]], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs == (None,)


def test_no_cache_hit_covers_a_position_whose_logits_are_needed(smollm):
    # NOTE: chunks of 32 tokens: the prompt's logits come from four steps, and the prompt is
    # cached before it is asked again, yet every position is computed for its log probabilities.
    reference = make_engine(smollm).generate([PROMPT], SamplingParams(max_tokens=3, prompt_logprobs=2))[0]
    engine = make_engine(smollm, max_num_batched_tokens=32)
    (warm,) = engine.generate([PROMPT], SamplingParams(max_tokens=3))
    (asked,) = engine.generate([PROMPT], SamplingParams(max_tokens=3, prompt_logprobs=2))
    (again,) = engine.generate([PROMPT], SamplingParams(max_tokens=3))
    assert asked.metrics.cached_tokens == 0 and again.metrics.cached_tokens > 0
    assert asked.token_ids == warm.token_ids == reference.token_ids
    _same(asked.prompt_logprobs, reference.prompt_logprobs)
    engine.check_integrity()


def test_streamed_outputs_carry_the_prompt_logprobs_once_complete(smollm):
    engine = make_engine(smollm, max_num_batched_tokens=32)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    assert outs and all(o.prompt_logprobs is not None for o in outs)
    assert all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)  # one shared tuple
    assert all(e.top == () for e in outs[0].prompt_logprobs[1:])


def _sessions(engine: Engine) -> list[tuple[list[int], tuple | None]]:
    """Multi-turn sessions, every turn asking its prompt's log probabilities (but the first
    session's, which takes the cache as usual)."""
    def params_of(session: int) -> SamplingParams:
        return SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=None if session == 0 else 2)

    return [(out.token_ids, out.prompt_logprobs) for out in run_sessions(engine, params_of)]


@pytest.fixture(scope="module")
def unbounded_prompt_logprobs(smollm):
    """The sessions' tokens and prompt log probabilities on an unbounded pool (once a module),
    with the library's linear product (as the test below pins it)."""
    with pytest.MonkeyPatch.context() as patch:
        _one_form(patch, "library")
        return _sessions(make_engine(smollm, clock=StepClock()))


@pytest.mark.parametrize("overrides", [
    {"eviction_policy": "asymcache", "max_num_batched_tokens": 48, "num_kv_blocks": 13},
    {"eviction_policy": "lru", "async_scheduling": True, "max_num_batched_tokens": 40, "num_kv_blocks": 12},
], ids=["asymcache-chunked", "lru-async-chunked"])
def test_prompt_logprobs_are_lossless_under_eviction_and_preemption(smollm, unbounded_prompt_logprobs, overrides, monkeypatch):
    # NOTE: a 12- or 13-block pool against a ~20-block working set (three sessions), prompts in
    # chunks: blocks are evicted, requests preempted mid-prompt and computed again, yet every
    # prompt token gets one entry, the unbounded pool's. (Measured: 14 and 17 evictions, 2 and
    # 7 preemptions; asymcache's job admission preempts rarely, and on 13 blocks more than on 12.)
    # The CPU's linear op is pinned to the library's product (kernels/cpu_linear.py): with
    # oneDNN's, whose float32 rounding is ~1.7x MKL's, the same chunk-order differences reach
    # 2.5e-5 (measured 2026-12-06); the entries' bookkeeping checked here is the same either way.
    _one_form(monkeypatch, "library")
    reference = unbounded_prompt_logprobs
    engine = make_engine(smollm, clock=StepClock(), **overrides)
    tight = _sessions(engine)
    stats = engine.stats()
    assert stats.evictions_total > 0 and stats.preemptions_total > 0
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, tight, strict=True):
        assert ids == ref_ids
        if ref_lp is None:
            assert lp is None
        else:
            _same(lp, ref_lp)


@pytest.mark.gpu
def test_prompt_logprobs_on_the_gpu_async_chunked_and_not_agree() -> None:
    """On the GPU (CUDA graphs, piecewise graphs for small mixed steps, async scheduling by
    default): prompt rows come from the prefill steps, in one step or in chunks, and a cached
    prompt is computed again for them; every engine reports the same entries."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 300))]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in (0, 3, 20, 1)]
    results = []
    for mode, budget in ((False, 8192), (True, 8192), (True, 64)):
        engine = Engine(model="dummy:tiny", device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
                        max_model_len=2048, async_scheduling=mode, max_num_batched_tokens=budget)
        engine.generate(prompts, SamplingParams(max_tokens=2))  # the prompts cached first
        outs = engine.generate(prompts, params)
        for out, prompt, p in zip(outs, prompts, params, strict=True):
            assert out.metrics.cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
            assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
            assert all(len(e.top) == p.prompt_logprobs for e in out.prompt_logprobs[1:])
        engine.check_integrity()
        results.append(outs)
    for outs in results[1:]:
        for a, b in zip(results[0], outs, strict=True):
            assert a.token_ids == b.token_ids
            _same(a.prompt_logprobs, b.prompt_logprobs)


def test_prompt_rows_through_the_head_in_slices_give_the_same_entries(smollm, monkeypatch):
    # NOTE: the prompt rows' logits are computed a slice at a time; slices of 7 rows (a prompt
    # of 106 rows in 16 slices, the last one short) give the entries of a single slice. The
    # CPU's linear op is pinned to F.linear: where a timing probe picks another form for few
    # rows (kernels/cpu_linear.py), a 7-row slice's bits differ from a 106-row one's
    # by rounding (1.1e-5 in a log probability on an AMD EPYC), and the probe's pick follows
    # the machine's load, so the test would too
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("library",) * len(cpu_linear.ROW_BUCKETS))
    (whole,) = make_engine(smollm).generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=4))
    monkeypatch.setattr(logprobs, "PROMPT_LOGITS_SLICE", 7)
    (sliced,) = make_engine(smollm).generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=4))
    assert sliced.token_ids == whole.token_ids
    _same(sliced.prompt_logprobs, whole.prompt_logprobs)
