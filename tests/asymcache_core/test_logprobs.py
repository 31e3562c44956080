"""Log probabilities of sampled tokens: the computation, the engine's bookkeeping across
preemption, eviction and async scheduling, and their values against transformers' SmolLM2."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.logprobs import FLOOR_LOGPROB, MAX_LOGPROBS, TokenLogprob, token_logprobs
from asymcache_core.request import RequestOutput
from asymcache_core.sampler import Sampler
from tests.conftest import StepClock, make_engine


def test_token_logprobs_match_log_softmax_rank_and_top():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    tokens = [int(logits[0].argmax()), 7, 49]
    entries = token_logprobs(logits, tokens, [4, 0, MAX_LOGPROBS])
    ref = torch.log_softmax(logits, dim=-1)
    for row, (entry, token, k) in enumerate(zip(entries, tokens, [4, 0, MAX_LOGPROBS], strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(ref[row, token]), abs=1e-6)
        assert entry.rank == int((ref[row] > ref[row, token]).sum()) + 1
        assert len(entry.top) == k
        assert [t for t, _ in entry.top] == ref[row].topk(k).indices.tolist()
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:], strict=False))
    assert entries[0].rank == 1 and entries[0].top[0] == (tokens[0], entries[0].logprob)


def test_token_logprobs_report_minus_inf_as_a_finite_floor():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    (entry,) = token_logprobs(logits, [1], [3])
    assert entry.logprob == FLOOR_LOGPROB and entry.rank == 3
    assert all(math.isfinite(lp) for _, lp in entry.top)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5, "2"])
def test_logprobs_out_of_range_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="^logprobs:"):
        SamplingParams(logprobs=bad)


def test_sampler_reports_raw_logprobs_for_rows_that_ask_only():
    # NOTE: the log probabilities are the model's: a penalty or temperature changes the pick,
    # not the reported distribution.
    sampler = Sampler(seed=0)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(logprobs=2, logit_bias={5: 100.0}),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=1.0, seed=3),
    ]
    tokens = sampler.sample(logits, ["a", "b", "c"], params, [[], [], []])
    assert tokens[0] == 5  # the bias picked it
    got = sampler.take_logprobs()
    assert set(got) == {"a", "c"} and sampler.take_logprobs() == {}
    ref = torch.log_softmax(logits, dim=-1)
    assert got["a"].logprob == pytest.approx(float(ref[0, 5]), abs=1e-6)
    assert got["a"].rank == int((ref[0] > ref[0, 5]).sum()) + 1
    assert got["c"].token_id == tokens[2] and got["c"].top == ()
    # a bias samples on the device too, and so do penalties; a logits processor needs the host
    assert Sampler.on_device(params[0]) and Sampler.on_device(SamplingParams(logprobs=2, repetition_penalty=1.2))
    assert not Sampler.on_device(SamplingParams(logprobs=0, logits_processors=(lambda out, row: row,)))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _check_aligned(out) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert [e.token_id for e in out.logprobs] == out.token_ids


def test_greedy_tokens_with_logprobs_match_without_and_transformers(smollm, hf_smollm):
    engine = make_engine(smollm)
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    with_lp = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3))
    assert [o.token_ids for o in with_lp] == [o.token_ids for o in plain]
    assert all(o.logprobs is None for o in plain)
    for out in with_lp:
        _check_aligned(out)
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm(ids).logits[0].float(), dim=-1)
        start = len(out.prompt_token_ids) - 1
        for i, entry in enumerate(out.logprobs):
            assert entry.rank == 1 and entry.top[0][0] == entry.token_id  # greedy: the likeliest
            assert entry.logprob == pytest.approx(float(ref[start + i, entry.token_id]), abs=2e-3)
            alt_id, alt_lp = entry.top[2]
            assert alt_lp == pytest.approx(float(ref[start + i, alt_id]), abs=2e-3)


def test_random_sampling_reports_the_sampled_tokens_rank(smollm):
    engine = make_engine(smollm)
    params = SamplingParams(max_tokens=24, temperature=2.0, seed=11, logprobs=1, ignore_eos=True)
    (out,) = engine.generate(PROMPTS[:1], params)
    _check_aligned(out)
    assert any(e.rank > 1 for e in out.logprobs)  # a hot temperature leaves the argmax
    for e in out.logprobs:
        assert (e.rank == 1) == (e.top[0][0] == e.token_id)
        assert e.logprob <= e.top[0][1]


TURN = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
SYSTEM = list(range(300, 348))


def run_sessions(
    engine: Engine, params_of: Callable[[int], SamplingParams] = lambda _: TURN, sessions: int = 3, turns: int = 3
) -> list[RequestOutput]:
    """Multi-turn sessions three at a time on one engine, each turn extending its context;
    the final output of every turn, in order (``params_of(session)``: its turns' parameters).

    NOTE: three sessions by default (one group): a pool smaller than the three contexts still
    evicts, rebuilds holes and preempts (the tests assert it), at half the steps of six."""
    contexts = {s: SYSTEM + [1000 + 97 * s + i for i in range(20)] for s in range(sessions)}
    outputs = []
    for turn in range(turns):
        for first in range(0, sessions, 3):
            ids = {s: engine.add_request(contexts[s], params_of(s), job_id=f"s{s}") for s in range(first, first + 3)}
            done = {}
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                engine.check_integrity()
            for s, rid in ids.items():
                outputs.append(done[rid])
                contexts[s] = contexts[s] + done[rid].token_ids + [2000 + 31 * s + 7 * turn + i for i in range(20)]
    return outputs


def _sessions(engine: Engine) -> list[tuple[list[int], list[TokenLogprob]]]:
    outputs = run_sessions(engine)
    for out in outputs:
        _check_aligned(out)
    return [(out.token_ids, out.logprobs) for out in outputs]


@pytest.fixture(scope="module")
def unbounded(smollm) -> tuple[list[tuple[list[int], list[TokenLogprob]]], float]:
    """An unbounded pool's sessions, and how far their log probabilities move when only the
    prompts' chunking changes (16-token steps): the float32 rounding of this CPU's BLAS, whose
    summation order follows a step's rows (1.3e-5 on an AMD EPYC with MKL; 0 to 1e-5 on the
    Xeons of 2026-12)."""
    reference = _sessions(make_engine(smollm, clock=StepClock()))
    chunked = _sessions(make_engine(smollm, clock=StepClock(), max_num_batched_tokens=16))
    spread = 0.0
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, chunked, strict=True):
        assert ids == ref_ids
        spread = max([spread] + [abs(a.logprob - b.logprob) for a, b in zip(ref_lp, lp, strict=True)])
    return reference, spread


@pytest.mark.parametrize(("overrides", "pressure"), [
    ({"eviction_policy": "asymcache"}, "engine_hole_tokens_total"),
    ({"eviction_policy": "lru", "async_scheduling": True}, "preemptions_total"),
], ids=["asymcache", "lru-async"])
def test_logprobs_are_lossless_under_eviction_and_preemption(smollm, unbounded, overrides, pressure):
    # NOTE: a 10-block pool against a ~20-block working set (three sessions): blocks are
    # evicted, holes rebuilt (asymcache: 48 hole tokens, measured) and requests preempted
    # (lru: 2), yet every token keeps the log probabilities of an unbounded pool, to the
    # rounding that rechunking the same prompts alone gives on this CPU (a hole is rebuilt in
    # steps of other shapes; a float32 GEMM's bits may follow the row count).
    reference, spread = unbounded
    rounding = max(1e-5, 2.0 * spread)
    assert rounding < 1e-4  # rounding, not a different computation
    engine = make_engine(smollm, clock=StepClock(), num_kv_blocks=10, **overrides)
    tight = _sessions(engine)
    stats = engine.stats()
    assert stats.evictions_total > 0 and getattr(stats, pressure) > 0
    assert engine.async_scheduling == overrides.get("async_scheduling", False)
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, tight, strict=True):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp, strict=True):
            assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=rounding)


def test_simulated_backend_rejects_logprobs():
    engine = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    with pytest.raises(ValueError, match="^logprobs:"):
        engine.add_request(list(range(10)), SamplingParams(logprobs=1))
    assert not engine.has_unfinished()


def test_async_greedy_rows_with_logprobs_stay_sampled_on_the_device(smollm):
    # NOTE: a greedy row's log probabilities are computed where its argmax is: the step stays
    # device-sampled, so the next step's launch does not wait for it (async scheduling).
    engine = make_engine(smollm, async_scheduling=True)
    launched = []
    launch = engine.runner.launch

    def spy(plan, previous):
        step = launch(plan, previous)
        launched.append(step)
        return step

    engine.runner.launch = spy
    (out,) = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    _check_aligned(out)
    sampled = [s for s in launched if s.sample_index]
    assert sampled and all(s.device_sampled and s.logprobs is not None for s in sampled)
    (sync,) = make_engine(smollm).generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    assert sync.token_ids == out.token_ids
    for a, b in zip(sync.logprobs, out.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.gpu
def test_logprobs_on_the_gpu_async_and_synchronous_agree() -> None:
    """On the GPU (CUDA graphs, async scheduling by default): greedy rows' log probabilities
    come from the device with the tokens (pinned copies), a sampled row's from the host path,
    and both engines report the same entries."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 130))]
    params = [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=k) for k in (0, 3, 20)]
    params.append(SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2, temperature=0.8, seed=4))
    results = []
    for mode in (False, True):
        engine = Engine(model="dummy:tiny", device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
                        max_model_len=2048, async_scheduling=mode)
        assert engine.async_scheduling is mode
        outs = engine.generate(prompts, params)
        for out, p in zip(outs, params, strict=True):
            _check_aligned(out)
            assert all(len(e.top) == p.logprobs for e in out.logprobs)
        results.append(outs)
    for sync, asynchronous in zip(*results, strict=True):
        assert sync.token_ids == asynchronous.token_ids
        for a, b in zip(sync.logprobs, asynchronous.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.rank == b.rank
