"""Jump-forward decoding (``EngineConfig.jump_forward``): the tokens a request's one processor
allows alone next are appended at once and computed in the next step together; the outputs
are those of sampling them one decode step each, under every cache state and policy."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import EngineConfig, SamplingParams
from asymcache_core.jump_forward import PositionForcing
from tests.conftest import StepClock, make_engine

PROMPTS = [list(range(300 + 7 * i, 340 + 9 * i)) for i in range(4)]


class ForcedEvery(PositionForcing):
    """Forces output position ``i`` to token ``base + i`` where ``i % period`` is in ``forced``
    (a grammar's fixed text between choices); every other position is free."""

    def __init__(self, base: int = 1000, period: int = 5, forced: tuple[int, ...] = (1, 2, 3)) -> None:
        self.base, self.period, self.forced = base, period, forced

    def forced_at(self, position: int) -> int | None:
        return self.base + position if position % self.period in self.forced else None


class Plain(ForcedEvery):
    """The same masks, without ``forced_tokens``: sampled one step each."""

    forced_tokens = None  # type: ignore[assignment]


def _run(engine, params: list[SamplingParams]) -> list[tuple[list[int], str | None]]:
    outs = engine.generate(PROMPTS[: len(params)], params)
    engine.check_integrity()
    return [(o.token_ids, o.finish_reason) for o in outs]


def _params(processor: type = ForcedEvery, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=14, ignore_eos=True, logits_processors=(processor(),), **extra)
            for _ in PROMPTS]


@pytest.fixture(scope="module")
def stepwise(smollm) -> tuple[list[tuple[list[int], str | None]], int]:
    """The greedy outputs of :func:`_params` with jump-forward off, and that engine's steps
    (the reference of several tests: computed once)."""
    off = make_engine(smollm, jump_forward=False)
    outputs = _run(off, _params())
    assert off.stats().engine_jump_forward_tokens_total == 0
    return outputs, len(off.step_log)


def test_forced_tokens_come_at_once_and_the_outputs_are_those_sampled_step_by_step(smollm, stepwise):
    reference, stepwise_steps = stepwise
    on = make_engine(smollm)
    got = _run(on, _params())
    assert got == reference
    # positions 1-3, 6-8 and 11-13 are forced: 9 of 14 tokens per request, none sampled
    assert on.stats().engine_jump_forward_tokens_total == 9 * len(PROMPTS)
    assert len(on.step_log) < stepwise_steps
    assert all(ids[1:4] == [1001, 1002, 1003] for ids, _ in got)
    # a processor that cannot say what it forces is sampled a step a token, the same tokens
    plain = make_engine(smollm)
    assert _run(plain, _params(Plain)) == reference and plain.stats().engine_jump_forward_tokens_total == 0


def test_jump_forward_is_lossless_under_eviction_preemption_and_random_sampling(smollm):
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=11 + i, logits_processors=(ForcedEvery(),))
              for i in range(len(PROMPTS))]
    reference = _run(make_engine(smollm, jump_forward=False, clock=StepClock()), params)
    fresh = [SamplingParams(max_tokens=14, temperature=0.8, seed=11 + i, logits_processors=(ForcedEvery(),))
             for i in range(len(PROMPTS))]
    tight = make_engine(smollm, num_kv_blocks=8, max_num_batched_tokens=32, eviction_policy="asymcache",
                        clock=StepClock())
    assert _run(tight, fresh) == reference
    stats = tight.stats()
    assert stats.engine_jump_forward_tokens_total > 0 and stats.preemptions_total > 0


@pytest.mark.parametrize(("extra", "why"), [
    ({"logprobs": 1}, "the forced tokens would need log probabilities"),
    ({"allowed_token_ids": list(range(900, 1100))}, "a second processor"),
])
def test_rows_jump_forward_cannot_report_sample_every_token(smollm, stepwise, extra, why):
    # NOTE: log probabilities and a stop string never met leave the tokens those of the
    # shared reference; a second mask changes them, so that row gets its own
    reference = (stepwise[0] if "allowed_token_ids" not in extra
                 else _run(make_engine(smollm, jump_forward=False), _params(**extra)))
    engine = make_engine(smollm)
    assert _run(engine, _params(**extra)) == reference, why
    assert engine.stats().engine_jump_forward_tokens_total == 0, why


def test_a_stop_string_inside_a_jump_ends_the_reply_on_its_token(smollm):
    # NOTE: the text of forced token 1002 as a stop string: the jump appends 1001-1003, the
    # reply ends on 1002 as it does a step a token
    stop = smollm.tokenizer.decode([1002])
    reference = _run(make_engine(smollm, jump_forward=False), _params(stop=[stop]))
    engine = make_engine(smollm)
    got = _run(engine, _params(stop=[stop]))
    assert got == reference and all(ids[-1] == 1002 and reason == "stop" for ids, reason in got)
    assert engine.stats().engine_jump_forward_tokens_total > 0 and engine.stats().engine_generated_tokens_total == sum(
        len(ids) for ids, _ in got)
    engine.check_integrity()


def test_a_jump_stops_at_max_tokens_and_at_a_stop_token(smollm):
    engine = make_engine(smollm)
    (ids, reason), = _run(engine, [SamplingParams(max_tokens=3, ignore_eos=True, logits_processors=(ForcedEvery(),))])
    assert len(ids) == 3 and ids[1:] == [1001, 1002] and reason == "length"
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=[1002],
                                                       logits_processors=(ForcedEvery(),)))[0]
    assert out.token_ids[1:] == [1001, 1002] and out.finish_reason == "stop" and out.stop_reason == 1002
    engine.check_integrity()


def test_async_scheduling_jumps_and_gives_the_same_tokens(smollm, stepwise):
    # NOTE: the step in flight when a jump is appended samples the position the first forced
    # token took: that sample is dropped; random rows draw by position, so none moves
    greedy = stepwise[0]
    engine = make_engine(smollm, async_scheduling=True)
    assert _run(engine, _params()) == greedy
    assert engine.stats().engine_jump_forward_tokens_total == 9 * len(PROMPTS)
    sampled = [SamplingParams(max_tokens=14, temperature=0.8, seed=3 + i, logits_processors=(ForcedEvery(),))
               for i in range(len(PROMPTS))]
    reference = _run(make_engine(smollm, jump_forward=False), sampled)
    fresh = [SamplingParams(max_tokens=14, temperature=0.8, seed=3 + i, logits_processors=(ForcedEvery(),))
             for i in range(len(PROMPTS))]
    assert _run(make_engine(smollm, async_scheduling=True), fresh) == reference


def test_the_default_is_on_for_the_cpu_and_a_bad_value_names_the_field():
    assert EngineConfig(model="dummy:tiny").jump_forward is True
    assert EngineConfig(model="dummy:tiny", jump_forward=False).jump_forward is False
    with pytest.raises(ValueError, match="^jump_forward:"):
        EngineConfig(model="dummy:tiny", jump_forward="yes")


@pytest.mark.gpu
def test_the_default_is_on_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert EngineConfig(model="dummy:tiny", device="cuda").jump_forward is True
