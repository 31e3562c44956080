"""Logits processors that only mask tokens, applied where the logits are.

Grammars (tool calls, JSON schemas), ``allowed_token_ids``, ``min_tokens`` and ``bad_words``
do not rewrite a row's logits: they keep some tokens and set the others to ``-inf``. Such a
processor says which ones with ``keep_words(output_token_ids, vocab)``: a packed mask of the
tokens it keeps (``[ceil(vocab / 32)]`` int32, bit ``i`` of word ``w`` = token ``32 w + i``,
xgrammar's layout), or ``None`` when it keeps every token this step. The sampler then builds
each such row's mask on the host, copies all of them in one small copy and applies them to the
logits on the device, and the rows sample there with the others, instead of copying whole
vocabulary rows to the host and sampling there (:class:`asymcache_core.sampler.Sampler`).

- :func:`masks_only`: whether every processor of a row can say so.
- :func:`keep_words`: a row's mask, the processors' masks combined (a token is kept when every
  processor keeps it: masking in turn, as the host path does).
- :func:`pack_keep`, :func:`keep_only`, :func:`all_words`, :func:`clear_tokens`: build masks;
  :func:`single_token`: the one token a mask keeps, if it keeps one (jump-forward).
- :func:`stacked_keep`: the masks of a batch's rows, as :func:`apply_keep` takes them.
- :func:`apply_keep`: masks ``[R, V]`` logits rows on their device.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch


def words_for(vocab: int) -> int:
    """The int32 words of a packed mask over ``vocab`` tokens."""
    return -(-vocab // 32)


def pack_keep(keep: np.ndarray) -> np.ndarray:
    """A bool ``[V]`` array packed into ``[ceil(V / 32)]`` int32 words."""
    padded = np.zeros(words_for(len(keep)) * 32, dtype=bool)
    padded[: len(keep)] = keep
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def keep_only(tokens: Iterable[int], vocab: int) -> np.ndarray:
    """The mask keeping ``tokens`` alone (ids outside ``[0, vocab)`` ignored)."""
    ids = np.fromiter((t for t in tokens), dtype=np.int64)
    keep = np.zeros(vocab, dtype=bool)
    keep[ids[(ids >= 0) & (ids < vocab)]] = True
    return pack_keep(keep)


def single_token(words: np.ndarray) -> int | None:
    """The one token a packed mask keeps (:mod:`asymcache_core.token_masks`), or ``None`` where
    it keeps several or none."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


@functools.lru_cache(maxsize=8)
def _all_words(vocab: int) -> np.ndarray:
    return pack_keep(np.ones(vocab, dtype=bool))


def all_words(vocab: int) -> np.ndarray:
    """The mask keeping all ``vocab`` tokens (the bits past the vocabulary clear), a fresh
    copy the caller may change."""
    return _all_words(vocab).copy()


def clear_tokens(words: np.ndarray, tokens: Iterable[int]) -> np.ndarray:
    """``words`` with the bits of ``tokens`` cleared, in place (ids outside the mask ignored).

    Returns:
        ``words``.
    """
    ids = np.fromiter((t for t in tokens), dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < len(words) * 32)]
    if len(ids):
        view = words.view(np.uint32)
        np.bitwise_and.at(view, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words


def masks_only(processors: Sequence[Any]) -> bool:
    """Whether every processor says which tokens it keeps (``keep_words``), so that the row
    can be masked where its logits are."""
    return bool(processors) and all(callable(getattr(p, "keep_words", None)) for p in processors)


def keep_words(processors: Sequence[Any], output_token_ids: list[int], vocab: int) -> np.ndarray | None:
    """The tokens a row's processors keep this step, combined (see the module's docstring).

    Args:
        processors: the row's logits processors, each with ``keep_words`` (:func:`masks_only`).
        output_token_ids: the row's generated tokens so far.
        vocab: the logits' vocabulary size.

    Returns:
        ``[ceil(vocab / 32)]`` int32, or ``None`` when they keep every token.
    """
    out: np.ndarray | None = None
    for processor in processors:
        words = processor.keep_words(output_token_ids, vocab)
        if words is None:
            continue
        if len(words) != words_for(vocab):
            raise ValueError(f"keep_words: {len(words)} words for a vocabulary of {vocab}")
        # NOTE: a processor's array is never written: the first is taken as it is
        out = words if out is None else np.bitwise_and(out, words)
    return out


def stacked_keep(masks: dict[int, np.ndarray | None], rows: Sequence[int]) -> tuple[list[int], np.ndarray] | None:
    """The masks of a batch's ``rows`` as :func:`apply_keep` takes them: the positions in
    ``rows`` of those with a mask in ``masks`` (row -> mask, ``None``: keeps every token) and
    their masks stacked; ``None`` when no row is masked."""
    masked = [k for k, row in enumerate(rows) if masks.get(row) is not None]
    if not masked:
        return None
    return masked, np.stack([masks[rows[k]] for k in masked])


def apply_keep(logits: torch.Tensor, rows: list[int], words: np.ndarray) -> torch.Tensor:
    """``logits`` with the tokens the masks drop set to ``-inf`` in ``rows``.

    Args:
        logits: ``[N, V]`` float (a copy the caller owns: rewritten in place).
        rows: the rows masked, one a mask.
        words: ``[len(rows), ceil(V / 32)]`` int32 masks, host side (copied in one copy).

    Returns:
        ``logits``.
    """
    device, vocab = logits.device, logits.shape[-1]
    words = np.ascontiguousarray(words, dtype=np.int32)
    if device.type == "cpu":
        # NOTE: numpy unpacks a byte a token at once; torch's shifts cost 5x that on a CPU
        bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
        drop = torch.from_numpy(bits == 0)
    else:
        # NOTE: the packed masks cross over (32x smaller than a byte a token) and unpack there,
        # from pinned memory: a copy from pageable memory may wait for the stream's work before
        # it (the step's forward pass, when the masks are built beside it)
        packed = torch.from_numpy(words).pin_memory().to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        drop = ((packed[:, :, None] >> shifts) & 1 == 0).reshape(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        return logits.masked_fill_(drop, float("-inf"))
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(drop, float("-inf")))
    return logits
