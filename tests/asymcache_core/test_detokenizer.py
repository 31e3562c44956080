"""Incremental detokenization gives the full decode's text, token by token, with the packaged
SmolLM2 tokenizer (byte-level BPE: multi-byte characters span tokens), on both paths: tokenizers'
DecodeStream (the default for it) and the ``tokenizer.decode`` window."""

from __future__ import annotations

import codecs
import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from asymcache_core.detokenizer import (
    DetokenizerState,
    byte_level_alphabet,
    detokenize_incrementally,
    stream_backend,
)
from asymcache_core.sampling_params import SamplingParams
from tests.conftest import make_engine

# use_stream=None: chosen from the tokenizer (DecodeStream for SmolLM2); False: the window path.
PATHS = [pytest.param(None, id="stream"), pytest.param(False, id="window")]

TEXTS = [
    "The capital of France is Paris.\n\n  Indented line\twith a tab.",
    "Ünïcödé: naïve café, 中文字符, 日本語のテキスト, 한국어 and emoji 🚀🔥👍🏽 mixed in.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code <|im_end|> after",
]


def _feed(
    tokenizer: Any, ids: list[int], use_stream: bool | None = None
) -> tuple[DetokenizerState, list[str]]:
    state = DetokenizerState(use_stream=use_stream)
    seen = []
    for n in range(1, len(ids) + 1):
        detokenize_incrementally(tokenizer, ids[:n], state, final=n == len(ids))
        seen.append(state.text)
    return state, seen


def test_smollm2_streams_with_decode_stream(smollm) -> None:
    tok = smollm.tokenizer
    assert stream_backend(tok) is tok.backend_tokenizer
    state = DetokenizerState()
    detokenize_incrementally(tok, tok.encode("Hi", add_special_tokens=False), state)
    assert state.use_stream is True and state.stream is not None


@pytest.mark.parametrize("use_stream", PATHS)
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_is_the_full_decode(smollm, text: str, use_stream: bool | None) -> None:
    tok = smollm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    state, seen = _feed(tok, ids, use_stream)
    assert state.text == tok.decode(ids, skip_special_tokens=True)
    for n, partial in enumerate(seen, start=1):
        # every intermediate text is a prefix of the final one (streaming never takes back)
        assert state.text.startswith(partial)
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(partial)
        # held back only while the decode ends inside a character
        assert partial == full or full.endswith("\ufffd")


@pytest.fixture(scope="module")
def partial_byte_ids(smollm) -> list[int]:
    """SmolLM2 tokens that hold part of a multi-byte character (their own text has U+FFFD)."""
    backend = smollm.tokenizer.backend_tokenizer
    ids = [i for i in range(backend.get_vocab_size()) if "\ufffd" in backend.decode([i])]
    assert len(ids) > 100
    return ids


@pytest.mark.parametrize("use_stream", PATHS)
def test_random_token_streams_end_as_the_full_decode(
    smollm, partial_byte_ids: list[int], use_stream: bool | None
) -> None:
    """Random ids, half of them pieces of multi-byte characters, some special tokens: the
    streamed text is the full decode, never takes text back, and holds back only while the
    decode ends inside a character."""
    tok = smollm.tokenizer
    rng = random.Random(5)
    vocab = smollm.config.vocab_size
    specials = list(tok.all_special_ids)
    held_back = 0
    for _ in range(60):
        ids = [
            rng.choice(partial_byte_ids) if r < 0.5 else rng.choice(specials) if r < 0.55 else rng.randrange(vocab)
            for r in (rng.random() for _ in range(rng.randint(1, 40)))
        ]
        state, seen = _feed(tok, ids, use_stream)
        # the full decode, less the U+FFFD of a character cut off at the end (vLLM emits none)
        whole = tok.decode(ids, skip_special_tokens=True)
        alphabet = byte_level_alphabet()
        raw = bytes(alphabet[c] for t in ids if t not in specials for c in tok.convert_ids_to_tokens(t))
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.decode(raw, final=False)
        assert state.text == (whole[:-1] if utf8.getstate()[0] else whole)
        for n, partial in enumerate(seen[:-1], start=1):
            full = tok.decode(ids[:n], skip_special_tokens=True)
            assert full.startswith(partial)
            assert partial == full or full.endswith("\ufffd")
            held_back += partial != full
    assert held_back > 50  # the streams did stop inside characters


@pytest.mark.parametrize("use_stream", PATHS)
def test_final_flush_drops_an_unfinished_character(smollm, use_stream: bool | None) -> None:
    tok = smollm.tokenizer
    ids = tok.encode("ok 🚀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte-level piece is missing
    assert tok.decode(cut).endswith("\ufffd")
    state = DetokenizerState(use_stream=use_stream)
    for n in range(1, len(cut) + 1):
        detokenize_incrementally(tok, cut[:n], state)
    assert state.text == "ok"
    # the blank before the emoji is released; the emoji's cut-off bytes are not (vLLM's rule)
    assert detokenize_incrementally(tok, cut, state, final=True) == " "
    assert state.text == "ok "


def _tiny_tokenizer(decoder: decoders.Decoder, **kwargs: Any) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["[UNK]", "a", "b", "c", ".", "'s"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


class _RightToLeft:
    """A decoder that writes tokens right to left: later tokens change earlier text."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return list(reversed(tokens))


def test_decode_stream_refusal_continues_on_the_window_path() -> None:
    tok = _tiny_tokenizer(decoders.WordPiece())
    # NOTE: set after wrapping: the wrapper deep-copies its backend, and a Python decoder
    # cannot be copied.
    tok.backend_tokenizer.decoder = decoders.Decoder.custom(_RightToLeft())
    assert tok.decode([1, 2]) == "ba"
    ids = [1, 2, 3, 1]
    streamed = DetokenizerState()
    windowed = DetokenizerState(use_stream=False)
    for n in range(1, len(ids) + 1):
        detokenize_incrementally(tok, ids[:n], streamed, final=n == len(ids))
        detokenize_incrementally(tok, ids[:n], windowed, final=n == len(ids))
        if n == 1:
            assert streamed.use_stream is True
    # DecodeStream raised its invalid-prefix error at the second token; the request went on.
    assert streamed.use_stream is False
    assert streamed.text == windowed.text
    assert streamed.text.startswith("a") and len(streamed.text) == len(ids)


def test_window_path_for_tokenizers_decode_stream_cannot_serve() -> None:
    cleaned = _tiny_tokenizer(decoders.WordPiece(cleanup=True), clean_up_tokenization_spaces=True)
    plain = _tiny_tokenizer(decoders.WordPiece(cleanup=True), clean_up_tokenization_spaces=False)
    assert stream_backend(plain) is plain.backend_tokenizer
    assert stream_backend(cleaned) is None
    assert stream_backend(object()) is None  # no Rust backend
    ids = [1, 4, 2, 5, 3]
    for tok in (cleaned, plain):
        state, seen = _feed(tok, ids)
        assert state.use_stream is (tok is plain)
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
