"""Async scheduling (``EngineConfig.async_scheduling``) with the real SmolLM2: step N+1 is planned
and launched before step N's tokens are back, and every output is the one the synchronous loop
gives.

On the CPU the launch runs the forward pass at once, but the engine's bookkeeping is the GPU's:
pending tokens, inputs copied from the previous step's sampled tensor, planned tokens of requests
that have already ended dropped, steps that sample on the host waited for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.eviction import registered_policies
from asymcache_core.request import RequestOutput
from asymcache_core.token_masks import pack_keep
from tests.asymcache_core.test_step_faults import POISON, FaultyModel, assert_clean, run_all
from tests.conftest import StepClock, make_engine


class LaunchCounter:
    """Wraps ``runner.launch``: counts launches made while another step was still in flight."""

    def __init__(self, engine: Engine) -> None:
        self.launch = engine.runner.launch
        self.overlapped = 0
        self.launches = 0
        engine.runner.launch = self  # type: ignore[method-assign]

    def __call__(self, plan: Any, previous: Any) -> Any:
        self.launches += 1
        self.overlapped += previous is not None
        return self.launch(plan, previous)


def _preemptions_in_flight(engine: Engine) -> list[int]:
    """Wraps the scheduler's ``preempt``: the pending tokens of each request it preempts."""
    seen: list[int] = []
    preempt = engine.scheduler.preempt

    def spy(request: Any) -> None:
        seen.append(request.num_pending)
        preempt(request)

    engine.scheduler.preempt = spy  # type: ignore[method-assign]
    return seen


def _small_vocab_sessions(
    engine: Engine, sessions: int = 6, turns: int = 3, concurrent: int = 3, sampled: bool = False
) -> list[list[int]]:
    """The multi-session script of ``test_holes_and_policies`` in token ids below 500 (the
    tiny dummy model's vocabulary); ``sampled``: each session samples at random with its own
    seed (temperature, top-p) instead of greedily."""
    def user(s: int, t: int) -> list[int]:
        return [(60 + 23 * s + 7 * t + i) % 500 for i in range(20)]

    contexts = {s: list(range(10, 58)) + user(s, 0) for s in range(sessions)}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs: list[list[int]] = []
    for turn in range(turns):
        for first in range(0, sessions, concurrent):
            group = range(first, min(first + concurrent, sessions))
            ids = {
                s: engine.add_request(
                    contexts[s], dataclasses.replace(params, temperature=0.9, top_p=0.9, seed=s) if sampled else params,
                    job_id=f"s{s}", is_last_step=turn == turns - 1,
                )
                for s in group
            }
            done = run_all(engine)
            for s in group:
                outputs.append(done[ids[s]].token_ids)
                contexts[s] = contexts[s] + done[ids[s]].token_ids + user(s, turn + 1)
    return outputs


@pytest.fixture(scope="module")
def tiny_unbounded() -> list[list[int]]:
    """The small-vocabulary session script on a pool that never evicts, synchronously."""
    return _small_vocab_sessions(Engine(model="dummy:tiny", num_kv_blocks=2048, max_model_len=2048, max_num_seqs=8))


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["device", "host-tier"])
@pytest.mark.parametrize("policy", registered_policies())
def test_async_is_lossless_under_pressure(tiny_unbounded, expensive_reload_profile, policy, host_blocks):
    # multi-session turns on 12 blocks (a working set of ~33): evictions, holes, preemptions of
    # requests whose token is in flight, and host-tier copies (a profile where rebuilding is
    # costly, so blocks come back by copy) while a step is in flight; every token equals the
    # unbounded synchronous pool's. The tiny dummy model in float32 keeps this cheap enough for
    # every policy; the real model's run is the slow variant below.
    engine = Engine(
        model="dummy:tiny", num_kv_blocks=12, max_model_len=2048, max_num_seqs=8, eviction_policy=policy,
        num_host_kv_blocks=host_blocks, latency_profile=expensive_reload_profile, clock=StepClock(),
        async_scheduling=True,
    )
    preempted = _preemptions_in_flight(engine)
    assert _small_vocab_sessions(engine) == tiny_unbounded
    assert engine.stats().evictions_total > 0
    if host_blocks:
        assert engine.host_tier is not None and engine.host_tier.counters.reloaded > 0
    if policy == "vllm-apc":
        assert 1 in preempted  # a request preempted while its token was in flight
    assert_clean(engine)


@pytest.mark.slow
def test_async_is_lossless_under_pressure_with_the_real_model(tight_run, unbounded):
    run = tight_run("vllm-apc", async_scheduling=True)
    assert run.outputs == unbounded
    assert run.engine.stats().preemptions_total > 0
    run.engine.check_integrity()


def _mixed_requests(engine: Engine, prompts: list[list[int]], stop_token: int, stop_text: str) -> list[str]:
    """Requests that end every way while others run: on a stop token (so their next, already
    planned token is dropped), on a stop string, on length; greedy rows beside ones that sample
    on the host (a logits processor) or where the logits are (seeded random, penalties)."""
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=10, ignore_eos=True, logits_processors=(lambda out, row: row,)),
    ]
    return [engine.add_request(prompts[i % len(prompts)], p) for i, p in enumerate(params)]


def test_async_gives_the_synchronous_outputs_whatever_ends_a_request(smollm, chat_prompts):
    probe = make_engine(smollm, num_kv_blocks=128)
    greedy = probe.generate([chat_prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_token = greedy.token_ids[10]  # the greedy run emits it: the request stops there
    stop_text = probe.generate([chat_prompts[1]], SamplingParams(max_tokens=24, ignore_eos=True))[0].text[8:14]
    assert stop_text.strip()

    finals = {}
    counters = {}
    for mode in (False, True):
        engine = make_engine(smollm, num_kv_blocks=128, async_scheduling=mode)
        if mode:
            counters["launch"] = LaunchCounter(engine)
        ids = _mixed_requests(engine, chat_prompts, stop_token, stop_text)
        outs = run_all(engine)
        finals[mode] = [
            (outs[i].token_ids, outs[i].text, outs[i].finish_reason, outs[i].metrics.computed_tokens >= 1) for i in ids
        ]
        assert_clean(engine)
    assert finals[True] == finals[False]
    reasons = [reason for _, _, reason, _ in finals[True]]
    assert reasons[:3] == ["stop", "stop", "length"]
    assert len(finals[True][0][0]) < 24 and finals[True][0][0][-1] == stop_token
    # steps overlapped while no row sampled on the host; the ones with host sampling were waited for
    assert counters["launch"].overlapped > 0
    assert counters["launch"].overlapped < counters["launch"].launches


def test_async_overlaps_every_step_of_greedy_decoding(smollm, chat_prompts):
    engine = make_engine(smollm, num_kv_blocks=128, async_scheduling=True)
    counter = LaunchCounter(engine)
    sync = make_engine(smollm, num_kv_blocks=128)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(chat_prompts, params)] == [
        o.token_ids for o in sync.generate(chat_prompts, params)
    ]
    # one prefill step, then one decode step a token: each launched while the one before ran
    assert counter.launches == 8
    assert counter.overlapped == counter.launches - 1
    # the request that ends on length is never planned past its last token
    assert all(len(r.token_times) == 8 for r in (o.metrics for o in engine.generate(chat_prompts, params)))
    assert_clean(engine)


def test_async_overlaps_random_sampling_and_gives_the_synchronous_tokens(smollm, chat_prompts):
    """Rows sampled at random (temperature, top-k, top-p, min-p, seeded or not) and rows with
    penalties and a bias sample where the logits are (the token of the step in flight counted
    from the device): every step is launched while the one before runs, as with plain greedy
    rows, and the tokens are the synchronous engine's."""
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.2, top_k=20, min_p=0.05, frequency_penalty=1.5),
        SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.4, presence_penalty=0.7,
                       logit_bias={11: 2.0}),
    ]
    outs = {}
    for mode in (False, True):
        engine = make_engine(smollm, num_kv_blocks=128, async_scheduling=mode)
        counter = LaunchCounter(engine) if mode else None
        ids = [engine.add_request(p, s) for p, s in zip(chat_prompts, params, strict=False)]
        finals = run_all(engine)
        outs[mode] = [finals[i].token_ids for i in ids]
        assert_clean(engine)
    assert outs[True] == outs[False]
    assert counter is not None and counter.overlapped == counter.launches - 1


class FollowsTheLastToken:
    """A grammar-like mask: after token ``t`` only ``t + 1 .. t + 40`` may follow, so a mask
    built before the previous token is known keeps the wrong tokens. Past ``stop_after``
    tokens it keeps ``stop`` alone (the request then stops on it), and it raises if it is
    asked for a mask after that (a row whose request has ended); ``fail_at``: it raises when
    asked for that token's mask. Records the lengths it was called with."""

    def __init__(self, start: int, stop: int, stop_after: int, fail_at: int | None = None) -> None:
        self.start, self.stop, self.stop_after, self.fail_at = start, stop, stop_after, fail_at
        self.calls: list[int] = []

    def keep(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        n = len(output_token_ids)
        self.calls.append(n)
        if n == self.fail_at:
            raise RuntimeError("grammar broke")
        assert n <= self.stop_after, "asked for a mask after the request stopped"
        keep = np.zeros(vocab, dtype=bool)
        if n == self.stop_after:
            keep[self.stop] = True
        else:
            last = output_token_ids[-1] if output_token_ids else self.start
            keep[last + 1 : last + 41] = True
        return keep

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        return pack_keep(self.keep(output_token_ids, vocab))

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(self.keep(output_token_ids, logits.shape[-1]))
        return logits.masked_fill(~keep, float("-inf"))


def _masked_params() -> list[SamplingParams]:
    """Rows whose processors only mask: a grammar-like processor that stops its request on a
    stop token (its next, already planned row is dropped unmasked), one that raises at its
    fourth token, ``allowed_token_ids`` at random, ``min_tokens`` with EOS, ``bad_words``; and a
    plain greedy row beside them."""
    return [
        SamplingParams(max_tokens=12, logits_processors=(FollowsTheLastToken(400, 7, stop_after=5),),
                       stop_token_ids=[7]),
        SamplingParams(max_tokens=12, ignore_eos=True, logits_processors=(FollowsTheLastToken(900, 7, 20, fail_at=3),)),
        SamplingParams(max_tokens=10, temperature=0.9, seed=5, allowed_token_ids=list(range(1000, 1400))),
        SamplingParams(max_tokens=10, min_tokens=7),
        SamplingParams(max_tokens=10, ignore_eos=True, bad_words=["the", " Paris"]),
        SamplingParams(max_tokens=10, ignore_eos=True),
    ]


def test_async_overlaps_rows_their_processors_mask_and_gives_the_synchronous_tokens(smollm, chat_prompts):
    """Rows masked by their processors (grammars, allowed ids, min_tokens, bad words) keep async
    scheduling's overlap: each step is launched while the one before runs, and its masks are
    built once that one's tokens are back, while its own forward pass runs. The tokens are the
    synchronous engine's, each mask is built once a token and after every token before it, a
    row whose request stopped is not masked, and a processor that raises fails its request
    alone. ``masks_in_flight = False`` (the ablation) waits for each step instead."""
    finals: dict[str, list] = {}
    counters: dict[str, LaunchCounter] = {}
    calls: dict[str, list[list[int]]] = {}
    for mode in ("sync", "async", "ablation"):
        engine = make_engine(smollm, num_kv_blocks=128, async_scheduling=mode != "sync")
        if mode != "sync":
            counters[mode] = LaunchCounter(engine)
        if mode == "ablation":
            engine.runner.masks_in_flight = False
        params = _masked_params()
        ids = [engine.add_request(chat_prompts[i % len(chat_prompts)], p) for i, p in enumerate(params)]
        outs = run_all(engine)
        finals[mode] = [(outs[i].token_ids, outs[i].finish_reason, outs[i].error) for i in ids]
        calls[mode] = [p.logits_processors[0].calls for p in params[:2]]
        assert_clean(engine)
    assert finals["async"] == finals["sync"] == finals["ablation"]
    stopped, broke = finals["async"][0], finals["async"][1]
    assert stopped[0][-1] == 7 and len(stopped[0]) == 6 and stopped[1] == "stop"
    assert all(400 < t <= 440 for t in stopped[0][:1])
    assert broke[1] == "abort" and "grammar broke" in broke[2] and len(broke[0]) == 3
    assert len(finals["async"][3][0]) >= 7
    # one mask a token, each after the token before it
    assert calls["async"] == calls["sync"] == [list(range(6)), list(range(4))]
    assert counters["async"].overlapped == counters["async"].launches - 1
    assert counters["ablation"].overlapped < counters["async"].overlapped


def test_aborting_a_request_in_flight_frees_it_and_the_others_go_on(smollm, chat_prompts):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = [make_engine(smollm).generate([p], params)[0].token_ids for p in chat_prompts]
    engine = make_engine(smollm, num_kv_blocks=128, async_scheduling=True)
    ids = [engine.add_request(p, params) for p in chat_prompts]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    in_flight = {item.request.request_id for item in engine._in_flight.plan.scheduled}
    assert ids[1] in in_flight
    assert engine.abort(ids[1])
    finals = run_all(engine)
    assert finals[ids[1]].finish_reason == "abort"
    assert len(finals[ids[1]].token_ids) < 10
    assert [finals[ids[0]].token_ids, finals[ids[2]].token_ids] == [reference[0], reference[2]]
    assert_clean(engine)


def test_a_fault_in_a_launched_step_fails_only_its_culprit(smollm, chat_prompts):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = [make_engine(smollm).generate([p], params)[0].token_ids for p in chat_prompts]
    engine = make_engine(smollm, num_kv_blocks=24, async_scheduling=True)
    model = FaultyModel(engine.runner.model)
    engine.runner.model = model
    good = [engine.add_request(p, params) for p in chat_prompts]
    first = run_all(engine)
    assert [first[i].token_ids for i in good] == reference
    # a transient fault in a step launched while another was in flight, then a culprit
    good = [engine.add_request(p, params) for p in chat_prompts]
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    model.fail_next = 1
    bad = engine.add_request([*chat_prompts[1][:5], POISON, 7, 8], params)
    finals = run_all(engine)
    assert model.faults >= 2
    assert finals[bad].finish_reason == "abort" and "injected forward-pass fault" in finals[bad].error
    assert [finals[i].token_ids for i in good] == reference
    assert_clean(engine)


def test_a_fault_when_collecting_reruns_both_steps(smollm, chat_prompts):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = [make_engine(smollm).generate([p], params)[0].token_ids for p in chat_prompts]
    engine = make_engine(smollm, num_kv_blocks=64, async_scheduling=True)
    collect = engine.runner.collect
    failed = []

    def flaky_collect(step):
        if not failed and step.plan.is_decode_only:
            failed.append(step)
            raise RuntimeError("injected fault while collecting")
        return collect(step)

    engine.runner.collect = flaky_collect  # type: ignore[method-assign]
    ids = [engine.add_request(p, params) for p in chat_prompts]
    finals = run_all(engine)
    assert failed
    assert [finals[i].token_ids for i in ids] == reference
    assert_clean(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"async_scheduling": "yes"}, "async_scheduling"),
        ({"async_scheduling": 1}, "async_scheduling"),
        ({"async_scheduling": True, "tensor_parallel_size": 2}, "async_scheduling"),
    ],
)
def test_bad_async_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_the_default_is_off_on_the_cpu_and_in_the_simulator(smollm):
    assert make_engine(smollm).async_scheduling is False
    simulated = Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16))
    assert simulated.async_scheduling is False and simulated.scheduler.async_output is False


def test_the_simulator_refuses_async_scheduling():
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine.simulated(EngineConfig(model="dummy:tiny", num_kv_blocks=16, async_scheduling=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_async_on_the_gpu_gives_the_synchronous_tokens(dtype: str) -> None:
    """On the GPU, with CUDA graphs (decode) and piecewise graphs (mixed steps): async steps read
    their pending inputs from the previous step's sampled tensor on the device, and give the
    synchronous engine's greedy tokens; requests arrive while others decode and end on length
    at different steps."""
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 130, 260, 33))]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 3, 20, 7, 16, 9)]
    outputs = []
    for mode in (False, True):
        engine = Engine(
            model="dummy:tiny", device="cuda", dtype=dtype, num_kv_blocks=256, max_num_seqs=8,
            max_model_len=2048, **({} if mode else {"async_scheduling": False}),
        )
        assert engine.async_scheduling is mode  # the default on one CUDA device
        assert engine.runner.decode_graphs is not None
        counter = LaunchCounter(engine) if mode else None
        ids = [engine.add_request(p, s) for p, s in zip(prompts[:3], params[:3], strict=True)]
        finals: dict[str, RequestOutput] = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            steps += 1
            if steps == 4:  # later arrivals join running decodes
                ids += [engine.add_request(p, s) for p, s in zip(prompts[3:], params[3:], strict=True)]
        outputs.append([finals[i].token_ids for i in ids])
        assert_clean(engine)
        if counter is not None:
            assert counter.overlapped >= counter.launches - 2
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[1]] == [12, 3, 20, 7, 16, 9]


@pytest.mark.gpu
def test_masked_rows_on_the_gpu_keep_the_overlap_and_the_synchronous_tokens() -> None:
    """On the GPU (CUDA graphs, bf16, batch-invariant): rows whose processors only mask sample
    in the pipeline, their masks built while their step's forward pass runs, with the
    synchronous engine's tokens; a row whose grammar-like mask stops it, and one whose
    processor raises, end as they do synchronously."""
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((5, 40, 77, 130, 33))]
    outputs = []
    for mode in (False, True):
        engine = Engine(
            model="dummy:tiny", device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8,
            max_model_len=2048, async_scheduling=mode,
        )
        counter = LaunchCounter(engine) if mode else None
        params = [
            SamplingParams(max_tokens=12, logits_processors=(FollowsTheLastToken(100, 7, stop_after=5),),
                           stop_token_ids=[7]),
            SamplingParams(max_tokens=12, ignore_eos=True, logits_processors=(FollowsTheLastToken(200, 7, 20, fail_at=3),)),
            SamplingParams(max_tokens=10, temperature=0.9, seed=5, allowed_token_ids=list(range(300, 420))),
            SamplingParams(max_tokens=10, min_tokens=7),
            SamplingParams(max_tokens=10, ignore_eos=True),
        ]
        ids = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        finals = run_all(engine)
        outputs.append([(finals[i].token_ids, finals[i].finish_reason) for i in ids])
        assert params[0].logits_processors[0].calls == list(range(6))
        assert_clean(engine)
        if counter is not None:
            assert counter.overlapped >= counter.launches - 2
    assert outputs[0] == outputs[1]
    assert outputs[1][0][0][-1] == 7 and outputs[1][1][1] == "abort"


@pytest.mark.gpu
def test_seeded_random_sampling_on_the_gpu_is_lossless_and_overlapped() -> None:
    """On the GPU in bf16 (batch-invariant), async scheduling by default: sessions sampling at
    random with their own seeds draw on the device (every launch overlaps the step before),
    and a 12-block pool that evicts and preempts gives the unbounded synchronous engine's
    sampled tokens."""
    common = dict(model="dummy:tiny", device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=8)
    reference = _small_vocab_sessions(Engine(num_kv_blocks=2048, async_scheduling=False, **common), sampled=True)
    assert reference != _small_vocab_sessions(Engine(num_kv_blocks=2048, async_scheduling=False, **common))
    engine = Engine(num_kv_blocks=12, eviction_policy="asymcache", **common)
    counter = LaunchCounter(engine)
    assert _small_vocab_sessions(engine, sampled=True) == reference
    assert engine.stats().evictions_total > 0
    assert counter.overlapped > counter.launches // 2
    assert_clean(engine)


@pytest.mark.gpu
def test_async_with_evictions_and_a_host_tier_on_the_gpu_is_lossless(expensive_reload_profile: str) -> None:
    """On the GPU in bf16 (batch-invariant), async scheduling by default: a 12-block pool that
    evicts and preempts, with and without a host tier whose copies run on their own streams
    beside the launched steps, gives the unbounded synchronous engine's tokens (a profile where
    rebuilding is costly, so evicted blocks come back by copy)."""
    common = dict(model="dummy:tiny", device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=8)
    reference = _small_vocab_sessions(Engine(num_kv_blocks=2048, async_scheduling=False, **common))
    for host_blocks in (0, 64):
        engine = Engine(
            num_kv_blocks=12, eviction_policy="asymcache", num_host_kv_blocks=host_blocks,
            latency_profile=expensive_reload_profile, **common,
        )
        assert engine.async_scheduling
        assert _small_vocab_sessions(engine) == reference
        assert engine.stats().evictions_total > 0
        if host_blocks:
            assert engine.host_tier is not None and engine.host_tier.counters.reloaded > 0
        assert_clean(engine)
