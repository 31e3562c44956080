"""vLLM's ``min_tokens`` and ``include_stop_str_in_output`` with the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from asymcache_core import SamplingParams
from asymcache_core.sampler import MinTokensMask
from tests.conftest import make_engine

QUESTION = "What is 2+2? Answer with one number."


def _chat(engine, question: str = QUESTION) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_min_tokens_holds_eos_back_until_then(smollm):
    engine = make_engine(smollm)
    prompt = _chat(engine)
    (short,) = engine.generate([prompt], SamplingParams(max_tokens=40))
    assert short.finish_reason == "stop" and short.token_ids[-1] in engine.eos_token_ids
    n = len(short.token_ids)
    (held,) = engine.generate([prompt], SamplingParams(max_tokens=40, min_tokens=n + 4))
    assert len(held.token_ids) >= n + 4
    assert not set(held.token_ids[: n + 4]) & engine.eos_token_ids
    assert held.token_ids[: n - 1] == short.token_ids[:-1]  # the same greedy path up to the EOS
    # a stop token id is held back the same way; with ignore_eos only the stop ids are banned
    stop_id = short.token_ids[1]
    (ids,) = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=(stop_id,)))
    assert stop_id not in ids.token_ids[:6]
    engine.check_integrity()


def test_min_tokens_holds_stop_strings_back_until_then(smollm):
    engine = make_engine(smollm)
    prompt = "The capital of France is"
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=30, stop=["."]))
    assert cut.finish_reason == "stop" and cut.text == " Paris"
    (late,) = engine.generate([prompt], SamplingParams(max_tokens=30, stop=["."], min_tokens=len(cut.token_ids) + 3))
    assert late.text.startswith(" Paris.") and len(late.token_ids) > len(cut.token_ids)


def test_include_stop_str_in_output_keeps_the_stop_string(smollm):
    engine = make_engine(smollm)
    prompt = "The capital of France is"
    cut, kept = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=30, stop=["."]), SamplingParams(max_tokens=30, stop=["."], include_stop_str_in_output=True)],
    )
    assert cut.token_ids == kept.token_ids and cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + "."


def test_min_tokens_mask_bans_only_while_short():
    mask = MinTokensMask(3, frozenset({2, 7, 10**6}))
    logits = torch.zeros(8)
    out = mask([1, 1], logits.clone())
    assert out[2] == float("-inf") and out[7] == float("-inf") and out[0] == 0
    assert torch.equal(mask([1, 1, 1], logits.clone()), logits)


@pytest.mark.parametrize("kwargs", [{"min_tokens": -1}, {"min_tokens": 17, "max_tokens": 16}, {"min_tokens": 1.5},
                                    {"include_stop_str_in_output": 1}])
def test_bad_values_name_the_field(kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_skip_special_tokens_false_keeps_them_but_not_the_eos_that_ended_it(smollm):
    engine = make_engine(smollm)
    prompt = _chat(engine)
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=40))
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in engine.eos_token_ids
    (kept,) = engine.generate([prompt], SamplingParams(max_tokens=40, skip_special_tokens=False))
    assert kept.token_ids == plain.token_ids and kept.text == plain.text  # the ending EOS stays out
    (ended,) = engine.generate([prompt], SamplingParams(max_tokens=40, skip_special_tokens=False,
                                                        include_stop_str_in_output=True))
    eos_text = engine.tokenizer.decode(plain.token_ids[-1:], skip_special_tokens=False)
    assert eos_text and ended.text == plain.text + eos_text
    # past the EOS (ignored), the special tokens the model writes are in the text
    (long,) = engine.generate([prompt], SamplingParams(max_tokens=len(plain.token_ids) + 8, ignore_eos=True,
                                                       skip_special_tokens=False))
    assert long.text == engine.tokenizer.decode(long.token_ids, skip_special_tokens=False)
    assert eos_text in long.text
    with pytest.raises(ValueError, match="^skip_special_tokens:"):
        SamplingParams(skip_special_tokens="no")


def test_a_stop_token_id_is_left_out_of_the_text_as_vllm_does(smollm):
    engine = make_engine(smollm)
    prompt = "The capital of France is"
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    stop_id = free.token_ids[3]
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,)))
    cut = free.token_ids.index(stop_id)
    assert stopped.token_ids == free.token_ids[: cut + 1] and stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(free.token_ids[:cut], skip_special_tokens=True)
    (kept,) = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,),
                                                       include_stop_str_in_output=True))
    assert kept.text == engine.tokenizer.decode(free.token_ids[: cut + 1], skip_special_tokens=True)


def test_stop_reason_names_the_stop_string_or_id_as_vllm_does(smollm):
    engine = make_engine(smollm)
    prompt = "The capital of France is"
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    stop_id = free.token_ids[3]
    by_string, by_id, by_length, by_eos = engine.generate(
        [prompt, prompt, prompt, _chat(engine)],
        [SamplingParams(max_tokens=30, stop=["!", "."]), SamplingParams(max_tokens=8, ignore_eos=True,
                                                                         stop_token_ids=(stop_id,)),
         SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=40)],
    )
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", ".")
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert (by_length.finish_reason, by_length.stop_reason) == ("length", None)
    assert by_eos.finish_reason == "stop" and by_eos.token_ids[-1] in engine.eos_token_ids
    assert by_eos.stop_reason is None  # an EOS is no stop reason (vLLM's None)
