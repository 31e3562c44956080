"""A finished output never ends in the U+FFFD of a character cut off mid-bytes (vLLM's
detokenizer never emits an incomplete UTF-8 sequence), on both detokenizer paths and through the
engine, while a U+FFFD the model wrote from complete bytes stays and token ids stay whole."""

from __future__ import annotations

from typing import Any

import pytest

from asymcache_core.detokenizer import DetokenizerState, detokenize_incrementally, token_bytes
from asymcache_core.sampling_params import SamplingParams
from tests.conftest import make_engine

# use_stream=None: chosen from the tokenizer (DecodeStream for SmolLM2); False: the window path.
PATHS = [pytest.param(None, id="stream"), pytest.param(False, id="window")]
FFFD = "\ufffd"


def _finish(tokenizer: Any, ids: list[int], use_stream: bool | None) -> tuple[str, list[str]]:
    """Feeds ``ids`` token by token, the last call final; returns the text and each step's."""
    state = DetokenizerState(use_stream=use_stream)
    seen = []
    for n in range(1, len(ids) + 1):
        detokenize_incrementally(tokenizer, ids[:n], state, final=n == len(ids))
        seen.append(state.text)
    return state.text, seen


@pytest.mark.parametrize("use_stream", PATHS)
def test_cut_off_character_is_dropped_at_the_end(smollm, use_stream: bool | None) -> None:
    tok = smollm.tokenizer
    for text in ("pizza 🍕🍕", "日本の首都は東京", "😀 😃"):
        ids = tok.encode(text, add_special_tokens=False)
        raw = text.encode("utf-8")
        assert token_bytes(tok, ids) == raw
        cuts = 0
        for n in range(1, len(ids) + 1):
            whole = tok.decode(ids[:n])
            got, _ = _finish(tok, ids[:n], use_stream)
            prefix = token_bytes(tok, ids[:n])
            assert prefix is not None and raw.startswith(prefix)
            # the longest prefix of the bytes that is complete characters
            complete = prefix.decode("utf-8", "ignore")
            assert got == complete, (text, n, whole)
            cuts += whole.endswith(FFFD)
        assert cuts > 0  # some prefixes did end inside a character


@pytest.mark.parametrize("use_stream", PATHS)
def test_a_replacement_character_from_complete_bytes_stays(smollm, use_stream: bool | None) -> None:
    tok = smollm.tokenizer
    ids = tok.encode("bad \ufffd", add_special_tokens=False)
    assert token_bytes(tok, ids) == "bad \ufffd".encode()
    got, seen = _finish(tok, ids, use_stream)
    assert got == "bad \ufffd"
    # two cut-off characters: the first, interrupted, reads U+FFFD; only the last is dropped
    emoji = tok.encode("🚀", add_special_tokens=False)
    assert len(emoji) > 1
    twice = emoji[:-1] + emoji[:-1]
    assert tok.decode(twice).endswith(FFFD + FFFD)
    got, _ = _finish(tok, twice, use_stream)
    assert got == tok.decode(twice)[:-1] and got.endswith(FFFD)


class _NotByteLevel:
    """A tokenizer with only ``decode`` (the window path, no bytes to tell U+FFFDs apart)."""

    PIECES = {1: "a", 2: "b", 3: FFFD}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids)


def test_without_bytes_every_trailing_replacement_character_goes() -> None:
    tok = _NotByteLevel()
    assert token_bytes(tok, [1, 2]) is None
    assert _finish(tok, [1, 3, 2], None)[0] == f"a{FFFD}b"
    assert _finish(tok, [1, 2, 3, 3], None)[0] == "ab"


def test_engine_output_cut_mid_character(smollm) -> None:
    """Through the engine, for ``max_tokens`` cutting an emoji: the text ends at the last whole
    character, the token ids and log probabilities are all there."""
    tok = smollm.tokenizer
    engine = make_engine(smollm)
    prompt = "I love pizza 🍕🍕🍕 and sushi 🍣"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    full = engine.generate(prompt, params)[0]
    cut_at = [n for n in range(1, len(full.token_ids) + 1) if tok.decode(full.token_ids[:n]).endswith(FFFD)]
    assert cut_at, tok.decode(full.token_ids)  # greedy SmolLM2 writes emoji here
    for n in cut_at[:3]:
        out = engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))[0]
        assert out.finish_reason == "length" and out.token_ids == full.token_ids[:n]
        assert out.logprobs is not None and len(out.logprobs) == n
        raw = token_bytes(tok, out.token_ids)
        assert raw is not None
        assert out.text == raw.decode("utf-8", "ignore") and not out.text.endswith(FFFD)
    engine.check_integrity()
