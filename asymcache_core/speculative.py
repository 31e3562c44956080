"""Speculative decoding with n-gram drafts (vLLM's ``--speculative-config '{"method": "ngram"}'``).

An agent's replies copy a lot of their context: a file they edit, a path they list, the JSON of
a tool's output. After each sampled token, :func:`ngram_drafts` looks the context's last few
tokens up earlier in it (prompt lookup) and proposes the tokens that followed them there. The
next step computes the request's last token and its drafts together, one segment, and samples
a token after each of them (:class:`SpeculativeConfig.num_speculative_tokens` + 1 logits
rows); :func:`accepted_tokens` keeps the drafts up to the first one the model would not have
sampled, and that one's correction. A step then yields 1 to k + 1 tokens for one forward pass.

The tokens are those of decoding without drafts, random sampling included: each row samples
as the decode of its position would (the same seed and draw index: the sampler's Gumbel-max
race, :mod:`asymcache_core.batched_sampling`; the same penalties over the same earlier
output), so a draft is kept exactly when that decode would have sampled it. Bit-equal logits
make the tokens equal: the batch-invariant mode guarantees a position's logits do not depend
on how its step is cut; the library kernels agree to rounding (greedy ties aside).

A draft's row goes through the request's logits processors (a grammar sees the output with the
drafts before the row), and its log probabilities are the row's. A stop string is looked for
token by token along a kept run, so the request ends on the same token as without drafts. The KV of
rejected drafts is dropped: the frontier moves back and the blocks past it are freed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from asymcache_core.request import Request

#: vLLM's defaults: both lookup bounds 5 when neither is given (``SpeculativeConfig``).
DEFAULT_LOOKUP = 5
_KEYS = frozenset({
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "num_speculative_tokens_per_batch_size",
})
_SCHEDULE = "speculative_config.num_speculative_tokens_per_batch_size"


def _positive(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{key}: must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate (vLLM's ``SpeculativeConfig`` for the ``ngram`` method).

    Attributes:
        num_speculative_tokens: drafts proposed after each sampled token, at most.
        prompt_lookup_min: the shortest context suffix looked up.
        prompt_lookup_max: the longest one (the longest that matches wins).
        per_batch_size: vLLM's ``num_speculative_tokens_per_batch_size``, inclusive
            ``(first, last, k)`` batch-size ranges, sorted (empty: ``k`` at every size):
            :meth:`drafts_at`.
    """

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    per_batch_size: tuple[tuple[int, int, int], ...] = ()

    def drafts_at(self, batch_size: int) -> int:
        """The drafts a request may get after a step of ``batch_size`` sequences: the range's
        ``k`` (a gap between ranges, or the sizes past the last, carry the ``k`` before them,
        as vLLM's ``build_dynamic_sd_schedule_lookup`` does), at most
        ``num_speculative_tokens``."""
        k = self.num_speculative_tokens
        for first, _, ranged in self.per_batch_size:
            if first > batch_size:
                break
            k = min(self.num_speculative_tokens, ranged)
        return k

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config of vLLM's ``--speculative-config`` (a JSON object or its text).

        Raises:
            ValueError: naming ``speculative_config`` or its key.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: not served (the ngram method takes "
                             f"{', '.join(sorted(_KEYS))})")
        if value.get("method") not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config.method: only 'ngram' is served, got {value.get('method')!r}")
        k = _positive(value, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        low, high = _positive(value, "prompt_lookup_min"), _positive(value, "prompt_lookup_max")
        low, high = low or high or DEFAULT_LOOKUP, high or low or DEFAULT_LOOKUP
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min: {low} is above prompt_lookup_max {high}")
        schedule = value.get("num_speculative_tokens_per_batch_size")
        return cls(k, low, high, _batch_schedule(schedule) if schedule is not None else ())


def _batch_schedule(value: Any) -> tuple[tuple[int, int, int], ...]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` checked as its
    ``validate_and_normalize_dynamic_sd_schedule`` checks it: a non-empty list of ``(first,
    last, k)``, positive ranges, ``k >= 0``, sorted without overlap, the first from 1.

    Raises:
        ValueError: naming the field.
    """
    if not isinstance(value, list) or not value:
        raise ValueError(f"{_SCHEDULE}: must be a non-empty list of [first, last, k] entries")
    entries = []
    for entry in value:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) for x in entry)):
            raise ValueError(f"{_SCHEDULE}: each entry is [first, last, k] integers, got {entry!r}")
        first, last, k = entry
        if first <= 0 or last < first or k < 0:
            raise ValueError(f"{_SCHEDULE}: {list(entry)} needs 1 <= first <= last and k >= 0")
        entries.append((first, last, k))
    entries.sort()
    if entries[0][0] != 1:
        raise ValueError(f"{_SCHEDULE}: the first range must start at batch size 1")
    if any(b[0] <= a[1] for a, b in zip(entries, entries[1:], strict=False)):
        raise ValueError(f"{_SCHEDULE}: the ranges overlap")
    return tuple(entries)


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens that followed the longest earlier occurrence of the context's suffix.

    As vLLM's ``_find_longest_matched_ngram_and_propose_tokens``: the longest suffix of
    ``tokens`` of ``min_n`` to ``max_n`` tokens that occurs earlier (the earliest occurrence
    among the longest; an occurrence may overlap the suffix), and up to ``k`` tokens after it
    (fewer where the context ends first).

    Args:
        tokens: the request's context (prompt and output), ``[N]`` integers.
        min_n: the shortest suffix matched.
        max_n: the longest.
        k: drafts at most.

    Returns:
        The drafts (none when no suffix of ``min_n`` tokens or more occurs earlier).
    """
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return []
    # NOTE: vectorised, not vLLM's KMP pass in Python: a comparison of every earlier window
    # with the suffix (``n * N`` compares in C) is ~100x faster than a Python loop over N
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + min(k, total - start)].tolist()
    return []


class NgramProposer:
    """Proposes each request's drafts from its context, kept as an array between steps (only
    the tokens appended since the last proposal are copied).

    Args:
        config: the speculation settings.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._contexts: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request_id: str, tokens: Sequence[int], limit: int) -> list[int]:
        """Drafts to follow ``tokens``, at most ``min(limit, num_speculative_tokens)``."""
        k = min(limit, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        buffer, known = self._contexts.get(request_id, (np.empty(0, dtype=np.int64), 0))
        total = len(tokens)
        if total > len(buffer):
            grown = np.empty(max(total, 2 * len(buffer), 64), dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        known = min(known, total)
        buffer[known:total] = tokens[known:total]
        self._contexts[request_id] = (buffer, total)
        return ngram_drafts(buffer[:total], self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)

    def draft(self, request: Request, max_model_len: int | None, batch_size: int = 1) -> None:
        """Gives ``request`` the drafts its limits leave room for (its next step appends at
        most one token more than it has drafts), after a step of ``batch_size`` sequences
        (:meth:`SpeculativeConfig.drafts_at`)."""
        room = min(request.params.max_tokens - len(request.output_token_ids) - 1, self.config.drafts_at(batch_size))
        if max_model_len is not None:
            room = min(room, max_model_len - request.num_tokens - 1)
        request.draft_token_ids = self.propose(request.request_id, request.all_token_ids, room)

    def forget(self, request_id: str) -> None:
        """Drops a request's context (it finished, or its output was recomputed)."""
        self._contexts.pop(request_id, None)


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified step yields.

    Args:
        drafts: the ``k`` drafts the step computed.
        sampled: the ``k + 1`` tokens its rows sampled: after the request's last token, then
            after each draft.

    Returns:
        The drafts up to the first one that differs from what its row sampled, then that
        row's token (all ``k`` drafts and the last row's token when every one matches).
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"sampled: {len(sampled)} tokens for {len(drafts)} drafts (one more expected)")
    kept = 0
    while kept < len(drafts) and drafts[kept] == sampled[kept]:
        kept += 1
    return [*drafts[:kept], sampled[kept]]


def verified_run(request: Request, token: int, after_drafts: Sequence[int] | None, stats: SpeculationStats) -> list[int]:
    """The tokens a step with drafts yields for ``request``: ``token`` (sampled after its last
    token) and, where the drafts' rows sampled (``after_drafts``), the run they confirm
    (:func:`accepted_tokens`); the drafts are cleared and counted in ``stats``."""
    drafts = request.draft_token_ids
    request.draft_token_ids = []
    if after_drafts is None or len(after_drafts) != len(drafts):
        return [token]  # NOTE: the draft rows failed to sample: the first token alone
    run = accepted_tokens(drafts, [token, *after_drafts])
    stats.num_drafts += 1
    stats.num_draft_tokens += len(drafts)
    stats.num_accepted_tokens += len(run) - 1
    return run


@dataclass
class SpeculationStats:
    """Counters of the drafts (vLLM's ``vllm:spec_decode_*`` metrics).

    Attributes:
        num_drafts: verified steps of a request with drafts.
        num_draft_tokens: drafts computed.
        num_accepted_tokens: drafts kept.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


__all__ = ["NgramProposer", "SpeculationStats", "SpeculativeConfig", "accepted_tokens", "ngram_drafts", "verified_run"]
