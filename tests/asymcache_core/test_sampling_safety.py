"""A bad sampling request is rejected when it is built; a row that fails anyway fails alone."""

from __future__ import annotations

import math

import pytest
import torch

from asymcache_core import Engine, SamplingParams
from asymcache_core.batched_penalties import prompt_ids, with_penalties
from asymcache_core.sampler import FAILED, Sampler
from asymcache_core.sim_runner import SimulatedRunner, VirtualClock

VOCAB = 50


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e-300), ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
        ("temperature", "hot"), ("temperature", True), ("temperature", 1e9),
        ("top_p", 0.0), ("top_p", math.nan), ("top_p", 1.5), ("top_p", -math.inf),
        ("top_k", 1.5), ("top_k", -2), ("top_k", True),
        ("min_p", 1.5), ("min_p", math.nan),
        ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0), ("seed", True),
        ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2**40), ("max_tokens", 3.0),
        ("presence_penalty", 3.0), ("frequency_penalty", math.inf), ("repetition_penalty", 0.0),
        ("repetition_penalty", math.nan),
        ("logit_bias", {"abc": 1.0}), ("logit_bias", {"5": 200.0}), ("logit_bias", {"5": math.nan}),
        ("logit_bias", {-1: 1.0}), ("logit_bias", [1, 2]), ("logit_bias", {str(i): 1.0 for i in range(2000)}),
        ("stop", ("x" * 2000,)), ("stop", tuple("abcdefghijklmnopq")), ("stop", ("",)), ("stop", (3,)),
        ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(f"{field}")


def test_edge_values_that_the_sampler_takes_are_accepted():
    for kwargs in (
        {"temperature": 0.01}, {"temperature": 100.0}, {"top_p": 1e-300}, {"seed": 2**63 - 1},
        {"seed": -(2**63)}, {"top_k": 10**9}, {"min_p": 1.0}, {"logit_bias": {"3": -100, 4: 100}},
    ):
        SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"3": 1}).logit_bias == {3: 1.0}


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5


def test_greedy_without_rewrites_is_plain_argmax():
    logits = _logits(8)
    params = [SamplingParams()] * 8
    tokens = Sampler(0).sample(logits, [f"r{i}" for i in range(8)], params, [[] for _ in range(8)])
    assert tokens == logits.argmax(dim=-1).tolist()


class _Gate:
    """A processor that passes while its output is shorter than ``until`` and then forces 0."""

    def __init__(self, until: int) -> None:
        self.until, self.calls = until, 0

    def passes(self, output: list[int]) -> bool:
        return len(output) < self.until

    def __call__(self, output: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        masked = torch.full_like(logits, float("-inf"))
        masked[0] = 0.0
        return masked


def test_a_greedy_row_whose_processors_pass_takes_the_device_argmax():
    logits = _logits(3)
    gates = [_Gate(2), _Gate(2), _Gate(2), _Gate(2)]
    params = [SamplingParams(logits_processors=(gates[0],)),
              SamplingParams(logits_processors=(gates[1], lambda out, row: row)),  # one cannot tell: host
              SamplingParams(logits_processors=(gates[2],), presence_penalty=2.0),  # a penalty: on the device
              SamplingParams(logits_processors=(gates[3],), logit_bias={1: 50.0})]  # a bias: on the device
    outputs = [[7], [7], [7], [7]]
    tokens = Sampler(0).sample(torch.cat([logits, logits[:1]]), ["a", "b", "c", "d"], params, outputs)
    assert tokens[0] == int(logits[0].argmax()) and gates[0].calls == 0  # passed: never called
    assert gates[1].calls == 1 and gates[2].calls == 0
    assert tokens[2] == int((logits[2] - 2.0 * (torch.arange(VOCAB) == 7)).argmax())  # the output's 7 penalized
    assert tokens[3] == 1 and gates[3].calls == 0
    # once it no longer passes, its mask applies
    tokens = Sampler(0).sample(logits, ["a"], params[:1], [[7, 7]])
    assert tokens == [0] and gates[0].calls == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.01}, {"temperature": 100.0}, {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 0.7, "top_k": 10**9, "top_p": 1e-30, "min_p": 1.0}, {"temperature": 1.0, "seed": -5},
        {"temperature": 1.0, "seed": 2**63 - 1},
    ],
)
def test_extreme_accepted_values_sample_a_valid_token(kwargs):
    sampler = Sampler(0)
    logits = _logits(1)
    logits[0, 7] = 40.0  # one clear favourite
    token = sampler.sample(logits, ["r"], [SamplingParams(**kwargs)], [[]])[0]
    assert 0 <= token < VOCAB and not sampler.failures
    if kwargs.get("top_p", 1.0) < 1e-10 or kwargs.get("min_p") == 1.0:
        assert token == 7


def test_non_finite_logits_fall_back_to_greedy_over_the_finite_ones():
    logits = _logits(1)
    logits[0, :] = float("-inf")
    logits[0, 3] = float("nan")
    logits[0, 9] = 1.0
    sampler = Sampler(0)
    assert sampler.sample(logits, ["r"], [SamplingParams(temperature=1.0)], [[]]) == [9]


def test_a_raising_row_fails_alone():
    def boom(output, row):
        raise RuntimeError("processor bug")

    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(logits_processors=(boom,)), SamplingParams(temperature=1.0, seed=1)]
    sampler = Sampler(0)
    tokens = sampler.sample(logits, ["a", "b", "c"], params, [[], [], []])
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == FAILED and 0 <= tokens[2] < VOCAB
    failures = sampler.take_failures()
    assert list(failures) == ["b"] and "processor bug" in failures["b"]
    assert sampler.take_failures() == {}


def test_logit_bias_and_penalties():
    row = torch.zeros(VOCAB)
    row[1], row[2] = 5.0, -5.0
    # a +100 bias forces a token under greedy
    assert Sampler(0).sample(row[None].clone(), ["r"], [SamplingParams(logit_bias={"30": 100})], [[]]) == [30]
    out = with_penalties(row[None], [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)], [[1, 1, 4]], None)[0]
    assert out[1] == pytest.approx(5.0 - 1.0 - 1.0) and out[4] == pytest.approx(-1.5) and out[0] == 0.0
    rep = with_penalties(row[None], [SamplingParams(repetition_penalty=2.0)], [[1]], [prompt_ids([2], VOCAB, row.device)])[0]
    assert rep[1] == pytest.approx(2.5) and rep[2] == pytest.approx(-10.0) and rep[0] == 0.0
    assert torch.equal(row[1:3], torch.tensor([5.0, -5.0]))  # the input row is left alone
    # a repeated favourite loses the greedy pick to the runner-up under a presence penalty
    row2 = torch.zeros(VOCAB)
    row2[1], row2[6] = 3.0, 2.5
    picked = Sampler(0).sample(row2[None], ["r"], [SamplingParams(presence_penalty=1.0)], [[1]])
    assert picked == [6]


class _SamplingSimRunner(SimulatedRunner):
    """The simulator's step cost, with tokens from the real sampler over random logits."""

    def __init__(self, engine: Engine, clock: VirtualClock) -> None:
        super().__init__(engine.latency, clock, engine.model_config.vocab_size)
        self.sampler = Sampler(0)
        self.logits_seed = 0

    def execute(self, plan):
        self.clock.advance(self.step_cost(plan))
        items = [item for item in plan.scheduled if item.sample]
        if not items:
            return {}
        self.logits_seed += 1
        logits = torch.randn(len(items), self.vocab_size, generator=torch.Generator().manual_seed(self.logits_seed))
        reqs = [item.request for item in items]
        tokens = self.sampler.sample(
            logits, [r.request_id for r in reqs], [r.params for r in reqs], [r.output_token_ids for r in reqs]
        )
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True) if t != FAILED}

    def take_failures(self) -> dict[str, str]:
        return self.sampler.take_failures()


def _sampling_engine(**overrides) -> Engine:
    clock = VirtualClock()
    return Engine(
        model="dummy:tiny", clock=clock, runner_factory=lambda e: _SamplingSimRunner(e, clock),
        num_kv_blocks=64, **overrides,
    )


def test_a_request_whose_sampling_raises_fails_alone_in_the_engine():
    calls = {"n": 0}

    def flaky(output, row):
        calls["n"] += 1
        if len(output) == 2:
            raise RuntimeError("grammar exploded")
        return row

    engine = _sampling_engine()
    good = [engine.add_request(list(range(10, 30 + i)), SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    bad = engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=6, ignore_eos=True, logits_processors=(flaky,)))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    assert set(finals) == {*good, bad}
    assert all(finals[r].error is None and len(finals[r].token_ids) == 6 for r in good)
    assert finals[bad].finish_reason == "abort" and "grammar exploded" in finals[bad].error
    assert len(finals[bad].token_ids) == 2
    assert engine.pool.num_in_use == 0 or all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.requests


def test_a_request_whose_detokenizing_raises_fails_alone():
    class Tok:
        eos_token_id = None

        def decode(self, ids, **kwargs):
            if 466 in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
            return "".join(f"<{i}>" for i in ids)

        def convert_ids_to_tokens(self, ids):
            return [f"<{i}>" for i in ids]

    engine = _sampling_engine()
    engine.tokenizer = Tok()
    ok = engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=4, ignore_eos=True))
    bad = engine.add_request(list(range(30, 40)), SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={466: 100}))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[ok].error is None and len(finals[ok].token_ids) == 4
    assert finals[bad].finish_reason == "abort" and "detokenizing failed" in finals[bad].error
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    engine.check_integrity()


def test_log_probabilities_stay_raw_under_a_processor_that_rewrites_in_place():
    # the log probabilities come from the logits the model gave (vLLM's raw_logprobs), whatever
    # a processor does to its row (on the CPU the row is the caller's)
    logits = _logits(3)
    before = logits.clone()

    def only_zero(_out: list[int], row: torch.Tensor) -> torch.Tensor:
        row.fill_(float("-inf"))
        row[0] = 0.0
        return row

    sampler = Sampler(0)
    params = [SamplingParams(logits_processors=(only_zero,), logprobs=0), SamplingParams(),
              SamplingParams(logits_processors=(only_zero,))]
    tokens = sampler.sample(logits, ["a", "b", "c"], params, [[], [], []])
    assert tokens == [0, int(before[1].argmax()), 0]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[1], before[1])
    assert sampler.take_logprobs()["a"].logprob == pytest.approx(float(torch.log_softmax(before[0], -1)[0]))
