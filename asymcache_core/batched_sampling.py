"""Random sampling of a batch of rows where their logits are: temperature, top-k, top-p, min-p.

The rows of a step that sample at random without logits processors or penalties are sampled
together on the logits' device, in a few batched ops and one draw (:func:`sample_rows`): no
copy of the vocabulary to the host, and on CUDA no synchronization, so async scheduling keeps
the next step's launch ahead of this one (the next step reads the tokens on the device).

Each row is drawn by the exponential race of :mod:`kernels.sampling`, keyed by its seed and
the index of the token it draws (:func:`kernels.sampling.row_keys`): a row's token depends only
on its own logits, settings, seed and position, never on the rest of the batch, and a token
recomputed after its KV was evicted is drawn again the same. On CUDA the race is one Triton
launch; elsewhere each row draws with ``torch.multinomial`` from a generator seeded by its
keys (cheaper than the hash on a CPU), with the same independence.

The masks follow vLLM's order: temperature, then top-k on the scaled logits, softmax, min-p
(relative to the row's most likely token), then top-p (the most likely token always stays).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asymcache_core.sampling_params import SamplingParams
from kernels.sampling import exponential_race_naive, exponential_race_triton, row_keys
from kernels.sampling import triton as _triton


class SampledRows(NamedTuple):
    """The tokens of :func:`sample_rows`, on the logits' device.

    Attributes:
        tokens: ``[N]`` int64; a failed row holds a valid id (its greedy fallback) so that a
            step reading it on the device stays in range.
        failed: ``[N]`` bool, rows with no finite logit at all (their requests fail).
    """

    tokens: torch.Tensor
    failed: torch.Tensor


class RowSettings(NamedTuple):
    """The sampling settings of the rows of one :func:`sample_rows` call, host side.

    Attributes:
        params: each row's parameters (none greedy).
        seeds: each row's seed in ``[0, 2**64)``.
        draws: each row's draw index (the index of the output token it samples).
    """

    params: list[SamplingParams]
    seeds: list[int]
    draws: list[int]


def _column(values: list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def masked_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows' probabilities after temperature, top-k, min-p and top-p: ``[N, V]`` float32,
    zero where masked (rows not renormalized: the race does not need it).

    Args:
        logits: ``[N, V]`` of the rows, any float dtype.
        params: each row's parameters (``temperature > 0``).
    """
    device, vocab = logits.device, logits.shape[-1]
    x = logits.float() / _column([p.temperature for p in params], device, torch.float32)[:, None]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    if any(top_k):
        kth = torch.topk(x, max(top_k), dim=-1).values
        kth = kth.gather(1, _column([max(k, 1) - 1 for k in top_k], device, torch.int64)[:, None])
        # NOTE: a row without top-k keeps everything (its threshold is -inf)
        kth = kth.masked_fill(_column([k == 0 for k in top_k], device, torch.bool)[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        floor = _column([p.min_p for p in params], device, torch.float32)[:, None]
        probs = probs.masked_fill(probs < floor * probs.amax(dim=-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        # NOTE: a row without top-p keeps every token: its bound is +inf, not 1.0 (the float32
        # cumulative sum of a whole row can pass 1.0 before its last tokens)
        bound = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device, torch.float32)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < bound[:, None]
        keep[:, 0] = True  # the most likely token always stays (a tiny top_p rounds to 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return probs


def race(probs: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """One token per row of ``probs`` by its keys: ``[N]`` int64 on ``probs``' device."""
    device = probs.device
    if device.type == "cuda" and _triton is not None:
        return exponential_race_triton(probs, _column(keys, device, torch.int64))
    if device.type != "cpu":
        return exponential_race_naive(probs, _column(keys, device, torch.int64))
    tokens = [
        # NOTE: the generator is seeded by this draw's keys, no state carried between draws; by
        # the second key alone, which depends on both halves of the seed (the CPU generator
        # keeps only the low 32 bits of a seed)
        int(torch.multinomial(row, 1, generator=torch.Generator().manual_seed(k1)))
        for row, (_, k1) in zip(probs, keys, strict=True)
    ]
    return torch.tensor(tokens, dtype=torch.int64)


def sample_rows(logits: torch.Tensor, rows: RowSettings) -> SampledRows:
    """Samples one token per row of ``logits`` at random.

    A row whose probabilities are not finite or sum to nothing (non-finite logits) takes the
    argmax of its finite logits instead; a row without any finite logit is marked failed.

    Args:
        logits: ``[N, V]`` of the rows (processed already, where processors ran).
        rows: their settings, seeds and draw indices.

    Returns:
        The tokens and failure marks, on ``logits``' device.
    """
    probs = masked_probs(logits, rows.params)
    sums = probs.sum(dim=-1)
    ok = torch.isfinite(probs).all(dim=-1) & (sums > 0.0)
    if probs.device.type == "cpu" and not bool(ok.all()):
        # NOTE: the CPU's multinomial rejects such rows; their tokens come from the fallback
        probs = torch.where(ok[:, None], probs, torch.ones_like(probs))
    drawn = race(probs, [row_keys(s, d) for s, d in zip(rows.seeds, rows.draws, strict=True)])
    finite = torch.nan_to_num(logits.float(), nan=float("-inf"))
    fallback = finite.argmax(dim=-1)
    tokens = torch.where(ok, drawn, fallback)
    failed = ~ok & ~torch.isfinite(finite).any(dim=-1)
    return SampledRows(tokens, failed)
