"""Incremental detokenization: each step decodes a few tokens, not the whole output again.

Decoding a request's full output on every step costs O(n) per step, O(n^2) per request: at
1,000 output tokens one decode takes ~0.18 ms on this CPU, ~12 ms a step for a batch of 64,
more than an H200 decode step. Each step here decodes a short window instead: the tokens since
the previous piece of text was read, with the ones before it as left context (a token's text can
depend on its neighbours: byte-level BPE pieces of one multi-byte character, or a tokenizer's
word-initial space handling). The new text is the window's text minus its context's; when the
window ends inside a UTF-8 sequence (its text ends in U+FFFD), the tokens wait for the next step.
A request that ends there (``max_tokens``, an abort) does not end its text with that U+FFFD: the
incomplete sequence is left out, as vLLM's detokenizer never emits one (its ``DecodeStream``
returns nothing for it); its tokens (and their log probabilities) stay. A U+FFFD the model wrote
from complete bytes stays where the tokenizer's bytes tell them apart (byte-level BPE).

Two implementations of that one rule:

* **Stream** (HF fast tokenizers: a Rust ``tokenizers.Tokenizer`` behind the wrapper, as the
  packaged SmolLM2's is): ``tokenizers``' :class:`~tokenizers.decoders.DecodeStream` keeps the
  window in Rust, one call a step with no Python-side decode wrapper.
* **Window** (everything else): two ``tokenizer.decode`` calls a step, context and window.

The state keeps ``prefix_offset``/``read_offset`` for both, so a finished or aborted request's
held-back tokens are flushed the same way whichever path streamed the rest.
"""

from __future__ import annotations

import codecs
import functools
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_INCOMPLETE = "\ufffd"


@dataclass
class DetokenizerState:
    """Where a request's incremental decode stands.

    Attributes:
        text: the text of ``token_ids[:read_offset]``.
        prefix_offset: first token of the left context of the next window.
        read_offset: tokens whose text is in ``text``.
        use_stream: True: decode with ``DecodeStream``; False: with ``tokenizer.decode``
            windows; None: chosen from the tokenizer on the first call (see
            :func:`stream_backend`).
        stream: the request's ``DecodeStream`` (stream path only).
        fed: tokens given to ``stream``.
    """

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    use_stream: bool | None = None
    stream: DecodeStream | None = None
    fed: int = 0


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character that stands for a byte -> the byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 on.
    (One shared dict: do not modify it.)
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def token_bytes(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> bytes | None:
    """The exact bytes ``token_ids`` decode from, where the tokenizer is byte-level BPE.

    Args:
        tokenizer: an HF tokenizer.
        token_ids: the tokens.
        skip_special_tokens: special tokens add nothing (as ``decode`` skips them).

    Returns:
        The bytes, or None when the tokenizer is not byte-level BPE (or a token is unknown).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = byte_level_alphabet()
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = bytearray()
    for token_id in token_ids:
        extra = added.get(token_id)
        if extra is not None:
            # NOTE: added tokens are stored as their text, not in the byte alphabet
            if not (skip_special_tokens and getattr(extra, "special", False)):
                out += str(getattr(extra, "content", extra)).encode("utf-8")
            continue
        piece = backend.id_to_token(token_id)
        if piece is None or not all(c in alphabet for c in piece):
            return None
        out.extend(alphabet[c] for c in piece)
    return bytes(out)


def without_incomplete_tail(tokenizer: Any, token_ids: list[int], text: str, skip_special_tokens: bool = True) -> str:
    """``text`` (the decoded ``token_ids``) less the U+FFFD of a UTF-8 sequence cut off at
    its end, for a finished output (vLLM never emits one).

    Args:
        tokenizer: the tokenizer that decoded ``text``.
        token_ids: the tokens ``text`` was decoded from (from a character boundary on).
        text: their text.
        skip_special_tokens: as ``text`` was decoded.

    Returns:
        The text without the trailing replacement character of an incomplete sequence. With
        byte-level BPE the bytes say whether the last U+FFFD stands for one (a U+FFFD the model
        wrote from its complete bytes ``EF BF BD``, or one for invalid bytes, stays); with
        other tokenizers every trailing U+FFFD goes, as vLLM's detokenizer holds them all back.
    """
    if not text.endswith(_INCOMPLETE):
        return text
    raw = token_bytes(tokenizer, token_ids, skip_special_tokens)
    if raw is None:
        return text.rstrip(_INCOMPLETE)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(raw, final=False)
    pending = decoder.getstate()[0]
    # NOTE: a cut-off sequence (a valid prefix, held by the incremental decoder) is one maximal
    # ill-formed subpart: the tokenizer's lossy decode replaced it with exactly one U+FFFD
    return text[:-1] if pending else text


def stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer that ``DecodeStream`` can decode ``tokenizer``'s text with.

    Args:
        tokenizer: an HF tokenizer, or anything with ``decode(ids, skip_special_tokens=...)``.

    Returns:
        The backend, or None when ``DecodeStream`` cannot give ``tokenizer.decode``'s text.
    """
    # NOTE: the window path stays for the tokenizers DecodeStream cannot serve: slow
    # (pure-Python, e.g. SentencePiece-only) tokenizers and other objects with just a
    # ``decode`` method have no Rust backend; and a wrapper with
    # ``clean_up_tokenization_spaces`` on rewrites the backend's text after decoding
    # (" ." -> "."), which a stream of the backend's text does not reproduce.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def detokenize_incrementally(
    tokenizer: Any,
    token_ids: list[int],
    state: DetokenizerState,
    *,
    final: bool = False,
    skip_special_tokens: bool = True,
) -> str:
    """Appends the text of ``token_ids[state.read_offset:]`` to ``state.text``.

    Args:
        tokenizer: an HF tokenizer, or anything with ``decode(ids, skip_special_tokens=...)``.
        token_ids: the request's output tokens so far (earlier ones unchanged since last call).
        state: the request's state, updated in place.
        final: the output is complete: flush tokens held back for an incomplete character.
        skip_special_tokens: passed to the decoder (keep it the same for one request).

    Returns:
        The text added (empty while the new tokens end inside a character).
    """
    if state.use_stream is None:
        # NOTE: a state that already holds text (made by hand, e.g. a benchmark's) keeps the
        # window path: a fresh DecodeStream cannot take over another path's window.
        state.use_stream = state.read_offset == 0 and stream_backend(tokenizer) is not None
    before = len(state.text)
    if state.use_stream:
        backend = stream_backend(tokenizer)
        try:
            if backend is not None:
                _stream_step(backend, token_ids, state, skip_special_tokens)
        except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception
            backend = None
        if backend is not None and (not final or state.read_offset == len(token_ids)):
            return state.text[before:]
        # NOTE: the window path takes over from the offsets of the last piece the stream
        # returned: to flush a finished request's held-back tokens (DecodeStream has no
        # flush), or when DecodeStream refuses to go on because a decoder rewrote text it had
        # already returned (its "invalid prefix" error). The stream is out of step after that.
        state.use_stream, state.stream = False, None
    _window_step(tokenizer, token_ids, state, final, skip_special_tokens)
    return state.text[before:]


def _stream_step(
    backend: Tokenizer, token_ids: list[int], state: DetokenizerState, skip_special_tokens: bool
) -> None:
    """The stream path: feeds the tokens ``state.stream`` has not seen.

    Args:
        backend: the Rust tokenizer.
        token_ids: the request's output tokens so far.
        state: updated in place (``text`` and the offsets each time a piece comes out).
        skip_special_tokens: for a new stream.

    Raises:
        Exception: DecodeStream's invalid-prefix error.
    """
    if state.stream is None:
        state.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    # NOTE: one token per step() call, as DecodeStream has taken since it exists; the engine
    # feeds one token a step anyway. Each piece it returns moves the window the same way the
    # window path does (context = the previous window's new tokens), mirrored in the offsets.
    for pos in range(state.fed, len(token_ids)):
        piece = state.stream.step(backend, token_ids[pos])
        state.fed = pos + 1
        if piece is not None:
            state.text += piece
            state.prefix_offset, state.read_offset = state.read_offset, state.fed


def _window_step(
    tokenizer: Any, token_ids: list[int], state: DetokenizerState, final: bool, skip_special_tokens: bool
) -> None:
    """The window path: decodes context and window with ``tokenizer.decode``.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        token_ids: the request's output tokens so far.
        state: updated in place.
        final: flush held-back tokens.
        skip_special_tokens: passed to ``decode``.
    """
    if state.read_offset >= len(token_ids):
        return
    context = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens)
    window = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if not final and (len(window) <= len(context) or window.endswith(_INCOMPLETE)):
        return
    if final:
        window = without_incomplete_tail(tokenizer, token_ids[state.prefix_offset :], window, skip_special_tokens)
    state.text += window[len(context) :]
    state.prefix_offset = state.read_offset
    state.read_offset = len(token_ids)
