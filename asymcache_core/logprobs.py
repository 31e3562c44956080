"""Log probabilities of sampled tokens (OpenAI's ``logprobs`` / ``top_logprobs``, vLLM's
``SamplingParams.logprobs``).

They are the model's own distribution: ``log_softmax`` of the raw logits, before logit bias,
penalties, logits processors, temperature, top-k/top-p or min-p (vLLM's default
``raw_logprobs``), so a token's log probability does not depend on how it was sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

#: Most alternatives a request may ask for per token (vLLM's default ``max_logprobs``; OpenAI's
#: ``top_logprobs`` limit).
MAX_LOGPROBS = 20
#: What a log probability of ``-inf`` or NaN is reported as (JSON has neither; vLLM's value).
FLOOR_LOGPROB = -9999.0


class TokenLogprob(NamedTuple):
    """The log probability of one sampled token and of its most likely alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its log probability.
        rank: its rank in the distribution (1: the most likely; ties share the better rank).
        top: the ``k`` most likely tokens as ``(token id, log probability)``, most likely first
            (``k`` is the request's ``logprobs``; empty for 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


class LogprobTensors(NamedTuple):
    """:func:`logprob_tensors` of some rows: what :func:`to_entries` reads, on one device.

    Attributes:
        chosen: ``[N]`` float32, the sampled tokens' log probabilities.
        rank: ``[N]`` int64, their ranks.
        top_values: ``[N, k]`` float32, the ``k`` largest log probabilities, descending.
        top_ids: ``[N, k]`` int64, their tokens.
    """

    chosen: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to(self, device: torch.device, pin: bool = False) -> LogprobTensors:
        """A copy on ``device`` (without blocking, into pinned memory, when ``pin``)."""
        if not pin:
            return LogprobTensors(*(t.to(device) for t in self))
        out = []
        for t in self:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        return LogprobTensors(*out)


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobTensors:
    """Log probabilities of ``tokens`` and the ``k`` likeliest tokens of each row, where the
    logits are (nothing waits for the device: async scheduling queues this after its step).

    Args:
        logits: ``[N, vocab]`` raw logits (any float dtype).
        tokens: ``[N]`` int64, the sampled token of each row, on the logits' device.
        k: alternatives per row (the largest any row asks for; at most the vocabulary).

    Returns:
        The tensors, on the logits' device.
    """
    # NOTE: log p = logit - logsumexp: one reduction over the vocabulary, the rank and the top
    # k read from the logits themselves; no [N, vocab] table of log probabilities is written.
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = x.gather(1, tokens[:, None])
    rank = (x > picked).sum(dim=1) + 1
    top = torch.topk(x, min(k, x.shape[1]), dim=1)

    def finite(values: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(values - lse, nan=FLOOR_LOGPROB, neginf=FLOOR_LOGPROB, posinf=FLOOR_LOGPROB)

    return LogprobTensors(finite(picked)[:, 0], rank, finite(top.values), top.indices)


def to_entries(tensors: LogprobTensors, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of each row from its tensors (on the host).

    Args:
        tensors: :func:`logprob_tensors` of the rows, on the host.
        tokens: each row's sampled token.
        num_top: how many alternatives each row reports.

    Returns:
        One entry per row.
    """
    chosen, rank = tensors.chosen.tolist(), tensors.rank.tolist()
    values, ids = tensors.top_values.tolist(), tensors.top_ids.tolist()
    return [
        TokenLogprob(token, chosen[i], rank[i], tuple(zip(ids[i][: num_top[i]], values[i][: num_top[i]], strict=True)))
        for i, token in enumerate(tokens)
    ]


#: Prompt rows whose logits are computed at once: a step's prompt log probabilities go through
#: the vocabulary head in slices of this many rows, so that an 8,192-token chunk of a 128k
#: vocabulary needs 0.5 GB of float32 logits at a time, not 4 GB.
PROMPT_LOGITS_SLICE = 1024


def sliced_logprob_tensors(
    head: Callable[[slice], torch.Tensor], num_rows: int, tokens: torch.Tensor, k: int
) -> LogprobTensors:
    """:func:`logprob_tensors` of many rows, :data:`PROMPT_LOGITS_SLICE` at a time.

    Args:
        head: the ``[rows, vocab]`` logits of a slice of the rows (the vocabulary head).
        num_rows: the rows.
        tokens: ``[num_rows]`` int64, each row's token, on the logits' device.
        k: alternatives per row.

    Returns:
        The rows' tensors, in order.
    """
    width = PROMPT_LOGITS_SLICE
    parts = [logprob_tensors(head(slice(lo, lo + width)), tokens[lo : lo + width], k) for lo in range(0, num_rows, width)]
    return LogprobTensors(*(torch.cat(column) for column in zip(*parts, strict=True)))


class PendingPromptLogprobs(NamedTuple):
    """Prompt log probabilities of a step's prompt rows, on their way to the host.

    Attributes:
        spans: ``(request id, first position, count)`` of each run of rows.
        targets: each row's next prompt token (whose log probability it gives).
        num_top: alternatives each row reports.
        tensors: their :class:`~asymcache_core.logprobs.LogprobTensors` (host copies in flight
            on CUDA; read after the step's ``ready`` event).
    """

    spans: list[tuple[str, int, int]]
    targets: list[int]
    num_top: list[int]
    tensors: LogprobTensors

    def entries(self) -> dict[str, list[tuple[int, list[TokenLogprob]]]]:
        """Request id -> ``(first position, entries)`` of each of its runs (on the host)."""
        rows = to_entries(self.tensors, self.targets, self.num_top)
        out: dict[str, list[tuple[int, list[TokenLogprob]]]] = {}
        at = 0
        for rid, start, count in self.spans:
            out.setdefault(rid, []).append((start, rows[at : at + count]))
            at += count
        return out



def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of each row's sampled token.

    Args:
        logits: ``[N, vocab]`` raw logits (any float dtype, any device).
        tokens: the sampled token of each row.
        num_top: how many alternatives each row reports (0..:data:`MAX_LOGPROBS`).

    Returns:
        One entry per row.
    """
    if not tokens:
        return []
    # NOTE: one log_softmax and one top-k for all rows where the logits are, then one copy of
    # the few values needed to the host (never the [N, vocab] table).
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    tensors = logprob_tensors(logits, ids, max(num_top))
    return to_entries(tensors.to(torch.device("cpu")), tokens, num_top)


__all__ = [
    "FLOOR_LOGPROB", "MAX_LOGPROBS", "PROMPT_LOGITS_SLICE", "LogprobTensors", "PendingPromptLogprobs", "TokenLogprob",
    "logprob_tensors", "sliced_logprob_tensors", "to_entries", "token_logprobs",
]
