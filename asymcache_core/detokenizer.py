"""Incremental detokenization: each step decodes a few tokens, not the whole output again.

Decoding a request's full output on every step costs O(n) per step, O(n^2) per request: at
1,000 output tokens one decode takes ~0.18 ms on this CPU, ~12 ms a step for a batch of 64,
more than an H200 decode step. Each step here decodes a short window instead: the tokens since
the previous piece of text was read, with the ones before it as left context (a token's text can
depend on its neighbours: byte-level BPE pieces of one multi-byte character, or a tokenizer's
word-initial space handling). The new text is the window's text minus its context's; when the
window ends inside a UTF-8 sequence (its text ends in U+FFFD), the tokens wait for the next step.

Two implementations of that one rule:

* **Stream** (HF fast tokenizers: a Rust ``tokenizers.Tokenizer`` behind the wrapper, as the
  packaged SmolLM2's is): ``tokenizers``' :class:`~tokenizers.decoders.DecodeStream` keeps the
  window in Rust, one call a step with no Python-side decode wrapper.
* **Window** (everything else): two ``tokenizer.decode`` calls a step, context and window.

The state keeps ``prefix_offset``/``read_offset`` for both, so a finished or aborted request's
held-back tokens are flushed the same way whichever path streamed the rest.
"""

from __future__ import annotations

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
    state.text += window[len(context) :]
    state.prefix_offset = state.read_offset
    state.read_offset = len(token_ids)
