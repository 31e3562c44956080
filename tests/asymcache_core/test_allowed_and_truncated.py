"""vLLM's ``allowed_token_ids`` and ``truncate_prompt_tokens`` on the engine with the real
SmolLM2: the mask, the greedy pick among the allowed ids, the prompt's kept end."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import SamplingParams
from asymcache_core.sampler import AllowedTokensMask, BadWordsMask, bad_word_sequences
from tests.conftest import make_engine

PROMPT = list(range(300, 348))


@pytest.mark.parametrize("bad", [(), [-1], [1.5], "abc", [True]])
def test_bad_allowed_token_ids_are_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="^allowed_token_ids:"):
        SamplingParams(allowed_token_ids=bad)


@pytest.mark.parametrize("bad", [0, -2, 1.0, True])
def test_bad_truncate_prompt_tokens_are_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="^truncate_prompt_tokens:"):
        SamplingParams(truncate_prompt_tokens=bad)


def test_allowed_tokens_mask_keeps_only_the_allowed_logits():
    logits = torch.arange(10, dtype=torch.float32)
    out = AllowedTokensMask((2, 5, 5, 99))(  # a duplicate and an id past the vocabulary
        [], logits.clone()
    )
    assert out[2] == 2.0 and out[5] == 5.0 and torch.isinf(out[[0, 1, 3, 4, 6, 7, 8, 9]]).all()


def test_greedy_picks_the_likeliest_allowed_token(smollm):
    engine = make_engine(smollm)
    (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=20))
    top = [t for t, _ in plain.logprobs[0].top]
    allowed = (top[7], top[3], 4000)  # the 4th likeliest is the best of these
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=1, allowed_token_ids=allowed, logprobs=0))
    assert out.token_ids == [top[3]] and out.logprobs[0].rank == 4  # log probabilities stay raw
    (hot,) = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=2.0, seed=1, ignore_eos=True,
                                                      allowed_token_ids=allowed))
    assert set(hot.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="^allowed_token_ids:"):
        engine.add_request(PROMPT, SamplingParams(allowed_token_ids=(10**7,)))
    engine.check_integrity()


def test_truncate_prompt_tokens_runs_the_prompts_end(smollm):
    engine = make_engine(smollm, max_model_len=64)
    (cut,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, truncate_prompt_tokens=12))
    (tail,) = engine.generate([PROMPT[-12:]], SamplingParams(max_tokens=4))
    assert cut.prompt_token_ids == PROMPT[-12:] and cut.token_ids == tail.token_ids
    # -1: the last max_model_len - 1 tokens, so a prompt too long for the model still runs
    long = list(range(300, 400))
    with pytest.raises(ValueError, match="^prompt:"):
        engine.add_request(long, SamplingParams(max_tokens=1))
    (fit,) = engine.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert fit.prompt_token_ids == long[-63:] and len(fit.token_ids) == 1


def test_bad_words_mask_bans_the_last_token_where_the_rest_matches():
    mask = BadWordsMask([[7], [3, 4, 5]])
    logits = torch.zeros(10)
    out = mask([1, 3, 4], logits.clone())
    assert torch.isinf(out[7]) and torch.isinf(out[5]) and torch.isfinite(out[[0, 1, 2, 3, 4, 6, 8, 9]]).all()
    out = mask([3, 4, 1], logits.clone())
    assert torch.isinf(out[7]) and torch.isfinite(out[5])


def test_bad_words_are_never_generated(smollm):
    engine = make_engine(smollm)
    prompt = "The capital of France is"
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert "Paris" in free.text
    (clean,) = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, bad_words=("Paris",)))
    assert "Paris" not in clean.text
    seqs = bad_word_sequences(engine.tokenizer, ("Paris",))
    for seq in seqs:
        assert all(clean.token_ids[i : i + len(seq)] != seq for i in range(len(clean.token_ids)))
    # up to the word, the same greedy path
    first = min(i for seq in seqs for i in range(len(free.token_ids)) if free.token_ids[i : i + len(seq)] == seq)
    assert clean.token_ids[:first] == free.token_ids[:first]
    with pytest.raises(ValueError, match="^bad_words:"):
        SamplingParams(bad_words=("ok", "  "))
    engine.check_integrity()


def _mask_all(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A processor that rewrites the row (so it runs on the host) and leaves nothing."""
    return torch.full_like(logits, float("-inf"))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("constraint", ["allowed-vs-min-tokens", "processor"])
def test_constraints_that_allow_no_token_fail_their_request_alone(smollm, async_scheduling, temperature, constraint):
    """Greedy picked token 0 from a row masked whole (argmax of -inf everywhere), against every
    constraint the request stated: such a row fails its request with NOTHING_ALLOWED, at
    random as greedy, and the request beside it runs as it runs alone."""
    from asymcache_core.sampler import NOTHING_ALLOWED

    engine = make_engine(smollm, num_kv_blocks=64, async_scheduling=async_scheduling)
    eos = smollm.tokenizer.eos_token_id
    common = {"max_tokens": 6, "temperature": temperature, "seed": 3}
    if constraint == "processor":
        bad = SamplingParams(**common, logits_processors=(_mask_all,))
    else:  # the one allowed token ends the request, which min_tokens forbids
        bad = SamplingParams(**common, allowed_token_ids=(eos,), min_tokens=3)
    good = SamplingParams(**common, ignore_eos=True)
    (alone,) = engine.generate([PROMPT[::-1]], good)
    ids = [engine.add_request(PROMPT, bad), engine.add_request(PROMPT[::-1], good)]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert 0 not in out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    failed, ran = finals[ids[0]], finals[ids[1]]
    assert failed.error == NOTHING_ALLOWED and failed.token_ids == []
    assert ran.error is None and ran.token_ids == alone.token_ids
    engine.check_integrity()
