"""The logits processors a request's own fields imply (vLLM's ``min_tokens``,
``allowed_token_ids``, ``bad_words``): each only masks tokens, so its row is masked and sampled
where the logits are (:mod:`asymcache_core.token_masks`); :func:`with_engine_processors` adds
them to a request's parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from asymcache_core.sampling_params import SamplingParams
from asymcache_core.token_masks import all_words, clear_tokens, keep_only


class MinTokensMask:
    """A logits processor that bans the tokens that would end a request (EOS, its stop token
    ids) until it has generated ``min_tokens`` (vLLM's ``min_tokens``).

    Args:
        min_tokens: tokens to generate first.
        banned: the ids that end the request.
    """

    def __init__(self, min_tokens: int, banned: frozenset[int]) -> None:
        self.min_tokens = min_tokens
        self.banned = torch.tensor(sorted(banned), dtype=torch.long)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) < self.min_tokens and self.banned.numel():
            banned = self.banned[self.banned < logits.numel()]
            logits[banned] = float("-inf")
        return logits

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray | None:
        """The tokens kept this step, packed (:mod:`asymcache_core.token_masks`)."""
        if len(output_token_ids) < self.min_tokens and self.banned.numel():
            return clear_tokens(all_words(vocab), self.banned.tolist())
        return None


class AllowedTokensMask:
    """A logits processor that leaves only ``allowed`` ids samplable (vLLM's
    ``allowed_token_ids``).

    Args:
        allowed: the ids that may be sampled (within the vocabulary).
    """

    def __init__(self, allowed: tuple[int, ...]) -> None:
        self.allowed = torch.tensor(sorted(set(allowed)), dtype=torch.long)
        self._words: dict[int, np.ndarray] = {}

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = self.allowed[self.allowed < logits.numel()]
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        """The tokens kept, packed (built once a vocabulary size)."""
        words = self._words.get(vocab)
        if words is None:
            words = self._words[vocab] = keep_only(self.allowed.tolist(), vocab)
        return words


class BadWordsMask:
    """A logits processor that never lets a bad word's token sequence complete (vLLM's
    ``bad_words``): each sequence's last token is banned where the output ends with the rest
    of it (a one-token word: always).

    Args:
        sequences: the words' token sequences (:func:`bad_word_sequences`).
    """

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def _banned(self, output_token_ids: list[int]) -> list[int]:
        return [
            seq[-1] for seq in self.sequences
            if len(seq) - 1 <= len(output_token_ids) and (len(seq) == 1 or output_token_ids[1 - len(seq):] == seq[:-1])
        ]

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in self._banned(output_token_ids):
            if token < logits.numel():
                logits[token] = float("-inf")
        return logits

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray | None:
        """The tokens kept this step, packed (:mod:`asymcache_core.token_masks`)."""
        banned = self._banned(output_token_ids)
        return clear_tokens(all_words(vocab), banned) if banned else None


def bad_word_sequences(tokenizer: Any, words: tuple[str, ...]) -> list[list[int]]:
    """The token sequences of ``words`` as vLLM bans them: each word as written (its leading
    spaces removed) and with one leading space, the latter only where the space makes a token
    sequence of the same length that starts with another token (a word token of its own).

    Args:
        tokenizer: the model's tokenizer (``encode``).
        words: the bad words.

    Returns:
        The sequences, none empty.
    """
    out: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def with_engine_processors(
    params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any | None = None
) -> SamplingParams:
    """``params`` with the logits processors its own fields imply: a :class:`MinTokensMask`
    when it sets ``min_tokens``, an :class:`AllowedTokensMask` with ``allowed_token_ids``, a
    :class:`BadWordsMask` with ``bad_words`` (unchanged otherwise).

    NOTE: the ids that would end the request are banned until ``min_tokens``, so they never
    reach the scheduler's stop check; the processors only mask, so their rows are masked and
    sampled where the logits are (:mod:`asymcache_core.token_masks`).

    Args:
        params: the request's parameters.
        eos_token_ids: the model's end-of-sequence ids (banned unless ``ignore_eos``).
        tokenizer: the model's tokenizer (``bad_words`` needs one).

    Returns:
        The parameters to run.

    Raises:
        ValueError: ``bad_words`` without a tokenizer.
    """
    added: list[Any] = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer to encode them")
        added.append(BadWordsMask(bad_word_sequences(tokenizer, params.bad_words)))
    if params.allowed_token_ids is not None:
        added.append(AllowedTokensMask(params.allowed_token_ids))
    if params.min_tokens:
        banned = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        added.append(MinTokensMask(params.min_tokens, banned))
    if not added:
        return params
    return dataclasses.replace(params, logits_processors=(*params.logits_processors, *added))


__all__ = ["AllowedTokensMask", "BadWordsMask", "MinTokensMask", "bad_word_sequences", "with_engine_processors"]
