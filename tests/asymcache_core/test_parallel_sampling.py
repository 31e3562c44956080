"""``SamplingParams.n`` in the Python API: ``Engine.generate`` / ``Engine.chat`` sample n
sequences of a prompt (vLLM's parallel sampling), each its own request, reported together in
``GenerationOutput.outputs``; the real SmolLM2 on the CPU."""

from __future__ import annotations

import math

import pytest

from asymcache_core import CompletionOutput, SamplingParams
from asymcache_core.sampling_params import MAX_CHOICES, SEED_MAX, SEED_MIN, choice_params
from tests.conftest import make_engine

RANDOM = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
PROMPT = "The three most useful shell commands are"


@pytest.fixture(scope="module")
def engine(smollm):
    """One default engine for the tests that leave it idle (every request finished or refused)."""
    return make_engine(smollm)


@pytest.mark.parametrize("n", [0, -1, MAX_CHOICES + 1, True, 2.0, "2"])
def test_bad_n_is_named(n: object) -> None:
    with pytest.raises(ValueError, match=r"^n: must be an integer in \[1, 1024\]"):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_choice_params_follow_vllms_seed_rule() -> None:
    params = SamplingParams(n=3, seed=5, temperature=0.5)
    choices = choice_params(params)
    assert [c.seed for c in choices] == [5, 6, 7]
    assert all(c.n == 1 and c.temperature == 0.5 for c in choices)
    # int64 wraps around, as the HTTP server's choices do
    assert [c.seed for c in choice_params(SamplingParams(n=3, seed=SEED_MAX))] == [SEED_MAX, SEED_MIN, SEED_MIN + 1]
    unseeded = choice_params(SamplingParams(n=2))
    assert [c.seed for c in unseeded] == [None, None] and all(c.n == 1 for c in unseeded)
    assert choice_params(SamplingParams(seed=3), 2)[1].seed == 4


def test_add_request_takes_one_sequence(engine) -> None:
    with pytest.raises(ValueError, match=r"^n: add_request queues one sequence"):
        engine.add_request(PROMPT, SamplingParams(n=2))
    assert not engine.has_unfinished() and not engine.requests
    engine.check_integrity()


def test_choices_are_the_seeded_requests_run_alone(smollm) -> None:
    """Choice i of a seeded prompt is what seed + i gives as a request of its own (the
    batch-invariant mode makes each row's logits independent of what shares the step)."""
    engine = make_engine(smollm, batch_invariant=True)
    [out] = engine.generate(PROMPT, SamplingParams(**{**_fields(RANDOM), "n": 3, "logprobs": 0}))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.request_id for c in out.outputs}) == 3 and out.request_id == out.outputs[0].request_id
    alone = [
        engine.generate(PROMPT, SamplingParams(**{**_fields(RANDOM), "seed": 7 + i, "logprobs": 0}))[0]
        for i in range(3)
    ]
    for choice, single in zip(out.outputs, alone, strict=True):
        assert isinstance(choice, CompletionOutput)
        assert choice.token_ids == single.token_ids and choice.text == single.text
        assert choice.finish_reason == "length" and len(choice.token_ids) == 8
        assert choice.cumulative_logprob == pytest.approx(math.fsum(lp.logprob for lp in single.logprobs))
    # different seeds sample different sequences (8 tokens at temperature 1)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # the flat fields are choice 0's
    assert (out.token_ids, out.text, out.finish_reason) == (
        out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason
    )
    assert out.prompt_token_ids == smollm.tokenizer.encode(PROMPT, add_special_tokens=False)
    engine.check_integrity()


def test_mixed_choices_per_prompt_and_greedy(engine) -> None:
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate(
        [PROMPT, "Paris is the capital of"],
        [SamplingParams(max_tokens=6, ignore_eos=True, n=2), greedy],
    )
    assert [len(o.outputs) for o in outs] == [2, 1]
    # greedy choices are the greedy sequence
    [single] = engine.generate(PROMPT, greedy)
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids == single.token_ids
    assert single.outputs[0].cumulative_logprob is None  # no logprobs asked for
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_chat_runs_n_choices(engine) -> None:
    [out] = engine.chat([{"role": "user", "content": "Name a colour."}], SamplingParams(max_tokens=4, n=2, seed=1,
                                                                                       temperature=0.8))
    assert len(out.outputs) == 2 and all(c.token_ids for c in out.outputs)


def test_choices_of_a_job_turn_are_refused_and_nothing_is_queued(engine) -> None:
    with pytest.raises(ValueError, match=r"^job_ids\[1\]: a job's turn has one choice"):
        engine.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(n=2)], job_ids=[None, "job-1"])
    assert not engine.requests


def test_a_rejected_prompt_queues_no_choice(smollm) -> None:
    engine = make_engine(smollm, max_model_len=64)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: "):
        engine.generate([PROMPT, "word " * 200], SamplingParams(n=3))
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.pool.num_in_use == 0


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in ("max_tokens", "temperature", "seed", "ignore_eos")}


@pytest.mark.gpu
def test_choices_on_the_gpu_are_the_seeded_requests_run_alone() -> None:
    """On the GPU in bf16 (batch-invariant by default there, CUDA graphs, async scheduling,
    sampling on the device): choice i of a seeded prompt is what seed + i samples alone."""
    import torch

    from asymcache_core import Engine

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = Engine(model="dummy:smollm2-135m", device="cuda", dtype="bfloat16", num_kv_blocks=512, max_num_seqs=16,
                    max_model_len=2048)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=1)
    prompt = list(range(100, 700))
    [out] = engine.generate(prompt, SamplingParams(**{**_fields(params), "top_p": 0.95, "logprobs": 1, "n": 4}))
    alone = [engine.generate(prompt, SamplingParams(**{**_fields(params), "top_p": 0.95, "logprobs": 1,
                                                         "seed": 11 + i}))[0] for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for choice, single in zip(out.outputs, alone, strict=True):
        assert choice.cumulative_logprob == pytest.approx(math.fsum(lp.logprob for lp in single.logprobs), abs=1e-3)
    engine.check_integrity()
