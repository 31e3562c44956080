"""Incremental detokenization gives the full decode's text, token by token, with the packaged
SmolLM2 tokenizer (byte-level BPE: multi-byte characters span tokens)."""

from __future__ import annotations

import random

import pytest

from asymcache_core.detokenizer import DetokenizerState, detokenize_incrementally
from asymcache_core.sampling_params import SamplingParams
from tests.conftest import make_engine

TEXTS = [
    "The capital of France is Paris.\n\n  Indented line\twith a tab.",
    "Ünïcödé: naïve café, 中文字符, 日本語のテキスト, 한국어 and emoji 🚀🔥👍🏽 mixed in.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code <|im_end|> after",
]


def _feed(tokenizer, ids: list[int]) -> tuple[DetokenizerState, list[str]]:  # type: ignore[no-untyped-def]
    state = DetokenizerState()
    seen = []
    for n in range(1, len(ids) + 1):
        detokenize_incrementally(tokenizer, ids[:n], state, final=n == len(ids))
        seen.append(state.text)
    return state, seen


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_is_the_full_decode(smollm, text: str) -> None:
    tok = smollm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    state, seen = _feed(tok, ids)
    assert state.text == tok.decode(ids, skip_special_tokens=True)
    for n, partial in enumerate(seen, start=1):
        # every intermediate text is a prefix of the final one (streaming never takes back)
        assert state.text.startswith(partial)
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(partial)
        # held back only while the decode ends inside a character
        assert partial == full or full.endswith("\ufffd")


def test_random_token_streams_end_as_the_full_decode(smollm) -> None:
    tok = smollm.tokenizer
    rng = random.Random(5)
    vocab = smollm.config.vocab_size
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        state, seen = _feed(tok, ids)
        assert state.text == tok.decode(ids, skip_special_tokens=True)
        assert all(state.text.startswith(s) for s in seen)


def test_engine_streams_prefix_consistent_text(smollm, chat_prompts) -> None:
    """Each step's text extends the previous one, and the final text is the full decode."""
    engine = make_engine(smollm)
    rid = engine.add_request(chat_prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    texts: list[str] = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                texts.append(out.text)
                final = out
    assert final is not None and final.finished
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert final.text == smollm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_stop_string_across_tokens_cuts_at_its_first_occurrence(smollm, chat_prompts) -> None:
    tok = smollm.tokenizer
    engine = make_engine(smollm)
    full = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    text = tok.decode(full.token_ids, skip_special_tokens=True)
    stop = text[10:17]  # seven characters, likely spanning token boundaries
    cut = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]


def test_aborted_request_text_is_the_full_decode(smollm, chat_prompts) -> None:
    engine = make_engine(smollm)
    rid = engine.add_request(chat_prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):
        engine.step()
    assert engine.abort(rid)
    out = next(o for o in engine.step() if o.request_id == rid)
    assert out.finished and out.finish_reason == "abort"
    assert out.text == smollm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
