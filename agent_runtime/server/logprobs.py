"""OpenAI's ``logprobs`` objects from the engine's :class:`~asymcache_core.logprobs.TokenLogprob`.

Chat completions carry ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; text
completions the legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. A token's
text is its id decoded alone (as vLLM reports it: a piece of a multi-byte character reads as
U+FFFD); ``bytes`` are its exact bytes where the tokenizer is byte-level BPE (GPT-2's byte
alphabet, SmolLM2's and Llama 3's), so a client can join pieces of one character again.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from agent_runtime.server.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from asymcache_core.detokenizer import byte_level_alphabet
from asymcache_core.logprobs import TokenLogprob


class TokenTexts:
    """Token id -> its text and bytes, decoded once per id.

    Holds a private copy of the tokenizer: the engine thread decodes with the original.

    Args:
        tokenizer: the engine's HF tokenizer (``decode``; ``convert_ids_to_tokens`` and a
            ``ByteLevel`` backend decoder for exact bytes), or None: a token reads as
            ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids`` form) with null bytes.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        """The token's text and its UTF-8 bytes.

        Args:
            token_id: a vocabulary id.

        Returns:
            ``(text, bytes)``.
        """
        hit = self._cache.get(token_id)
        if hit is None and self.tokenizer is None:
            return f"token_id:{token_id}", None
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = list(text.encode("utf-8"))
            if self._alphabet is not None:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and piece and all(c in self._alphabet for c in piece):
                    raw = [self._alphabet[c] for c in piece]
            hit = self._cache[token_id] = (text, raw)
        return hit


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """A chat choice's (or chunk's) ``logprobs`` for ``entries``.

    Args:
        entries: one per generated token.
        texts: the token decoder.

    Returns:
        ``{"content": [...]}``.
    """
    content = []
    for entry in entries:
        text, raw = texts(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt_text, alt_raw = texts(token_id)
            top.append(TopLogprob(token=alt_text, logprob=logprob, bytes=alt_raw))
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob | None], texts: TokenTexts, offset: int, num_top: int, first_token: int | None = None
) -> CompletionLogprobs:
    """A text completion's (or chunk's) ``logprobs`` for ``entries``.

    Args:
        entries: one per token: generated ones, or an echoed prompt's (None for its first
            token, whose log probability and alternatives read as null).
        texts: the token decoder.
        offset: ``text_offset`` of the first entry (the characters of the tokens before it).
        num_top: the request's ``logprobs``: each token's ``top_logprobs`` holds that many
            alternatives and the token taken (0: the token taken alone, as vLLM gives it).
        first_token: the id of an echoed prompt's first token (its entry is None).

    Returns:
        ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for entry in entries:
        if entry is None:
            text = texts(first_token)[0] if first_token is not None else ""
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset.append(offset)
            offset += len(text)
            continue
        text, _ = texts(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in entry.top[:num_top]:
            # NOTE: two ids may read as the same text (pieces of characters): the likelier stays
            top.setdefault(texts(token_id)[0], logprob)
        # NOTE: the token taken is always among them, as OpenAI's legacy API and vLLM give it
        # (up to logprobs + 1 entries): a sampled token outside the most likely was missing;
        # with ``logprobs: 0`` it is the only one (vLLM's ``{token: logprob}``, not null)
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def prompt_logprobs(entries: Sequence[TokenLogprob | None], texts: TokenTexts) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of a request.

    Args:
        entries: one per prompt token, the first None.
        texts: the token decoder.

    Returns:
        Per prompt token, null or ``{token id: {logprob, rank, decoded_token}}``: the prompt
        token's entry and its alternatives' (ranked 1..k), the prompt token's first.
    """
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        row = {str(entry.token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                  decoded_token=texts(entry.token_id)[0])}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            row.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank, decoded_token=texts(token_id)[0]))
        out.append(row)
    return out


__all__ = ["TokenTexts", "byte_level_alphabet", "chat_logprobs", "completion_logprobs", "prompt_logprobs"]
