"""Random sampling of a batch of rows where their logits are: temperature, top-k, top-p, min-p.

The rows of a step that sample at random without logits processors are sampled together on
the logits' device (their bias and penalties applied there first:
:mod:`asymcache_core.batched_penalties`), in a few batched ops and one draw (:func:`sample_rows`): no
copy of the vocabulary to the host, and on CUDA no synchronization, so async scheduling keeps
the next step's launch ahead of this one (the next step reads the tokens on the device).

Each row is drawn by the Gumbel-max race of :mod:`kernels.sampling`, keyed by its seed and
the index of the token it draws (:func:`kernels.sampling.row_keys`): a row's token depends only
on its own logits, settings, seed and position, never on the rest of the batch, and a token
recomputed after its KV was evicted is drawn again the same. On CUDA the race is one Triton
launch that reads the logits once (no softmax); on a CPU each row finds one uniform from its
keys in its cumulative distribution (:func:`inverse_cdf_draw`, cheaper than hashing every token
there), with the same independence.

The masks are one number a row, the least scaled logit kept (:func:`row_cuts`): top-k on the
logits divided by the temperature, min-p relative to the most likely token, then top-p over
the distribution what is left renormalizes to (the most likely token always stays). Rows with
temperature alone need no mask at all. Top-p sorts only what a top-k kept; without a top-k, on
CUDA a search finds each row's cut (:mod:`kernels.top_p`, no sort of the vocabulary), on a CPU
the most likely 256 tokens are looked at first.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from asymcache_core.batched_penalties import to_device
from asymcache_core.sampling_params import SamplingParams
from kernels.sampling import gumbel_argmax_triton, gumbel_scores_naive, row_keys_array
from kernels.sampling import triton as _triton
from kernels.top_p import cut_of_sorted, scaled_logits, top_p_cut_naive, top_p_cut_triton


class SampledRows(NamedTuple):
    """The tokens of :func:`sample_rows`, on the logits' device.

    Attributes:
        tokens: ``[N]`` int64; a failed row holds a valid id so that a step reading it on the
            device stays in range.
        failed: ``[N]`` bool, rows with nothing to draw (no logit above ``-inf``, NaNs aside;
            their requests fail); ``None`` where no row can fail (all greedy).
    """

    tokens: torch.Tensor
    failed: torch.Tensor | None


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


def _no_cut(params: list[SamplingParams]) -> bool:
    return all(p.top_k <= 0 and p.min_p <= 0.0 and p.top_p >= 1.0 for p in params)


#: rows from which top-p without a top-k searches for its cut on CUDA (:mod:`kernels.top_p`,
#: one program a row) instead of sorting the vocabulary (its twin: the same cut, so a row's
#: token does not depend on how many share its step). NOTE: below it the sort's few launches
#: cost a decode step less than one program reading a whole row on one SM (H100, dummy
#: Llama-3.1-8B, top-p 0.95 alone, step / greedy: sort against search 1.031 / 1.070 at one
#: row, 1.062 / 1.070 at 4, 1.069 / 1.058 at 16; ``scripts/gpu_sampling_step.py
#: --search-min-rows``, BENCHMARKS.md "Random sampling on the device")
SEARCH_MIN_ROWS = 4


def row_cuts(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's temperature and cut: the least logit divided by the temperature that its
    top-k, min-p and top-p keep (``-inf``: all of them).

    Args:
        logits: ``[N, V]`` of the rows, any float dtype.
        params: each row's parameters (``temperature > 0``).

    Returns:
        ``temperature [N]`` and ``cut [N]``, float32 on ``logits``' device.
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = to_device([p.temperature for p in params], device, torch.float32)
    cut = torch.full((len(params),), float("-inf"), device=device)
    if _no_cut(params):
        return temperature, cut
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    searched = device.type == "cuda" and _triton is not None
    scaled = None
    if any(top_k) or any(p.min_p > 0.0 for p in params) or device.type == "cpu":
        scaled = scaled_logits(logits, temperature)
    top_values = None
    if any(top_k):
        top_values = torch.topk(scaled, max(top_k), dim=-1).values
        kth = top_values.gather(1, to_device([max(k, 1) - 1 for k in top_k], device, torch.int64)[:, None]).squeeze(1)
        cut = torch.where(to_device([k > 0 for k in top_k], device, torch.bool), kth, cut)
    if any(p.min_p > 0.0 for p in params):
        # NOTE: p >= min_p * p_max is x / T >= max(x / T) + log(min_p)
        floor = to_device([math.log(p.min_p) if p.min_p > 0.0 else float("-inf") for p in params], device, torch.float32)
        cut = torch.maximum(cut, scaled.amax(dim=-1) + floor)
    if any(p.top_p < 1.0 for p in params):
        top_p = [p.top_p for p in params]
        if top_values is not None and all(k > 0 for k, p in zip(top_k, top_p, strict=True) if p < 1.0):
            # NOTE: every top-p row has a top-k, so what is left lies among the most likely
            # tokens top-k sorted already (exact but for ties at the k-th logit): no more sort
            masked = torch.where(top_values >= cut[:, None], top_values, float("-inf"))
            cut_p = cut_of_sorted(masked, torch.logsumexp(masked, dim=-1, keepdim=True), to_device(top_p, device, torch.float32))
        elif searched and len(params) >= SEARCH_MIN_ROWS:
            # NOTE: knowing how many of the most likely tokens a row needs would wait for the
            # device, and sorting the vocabulary is most of a sampled step: a search instead
            cut_p = top_p_cut_triton(
                logits, temperature, cut, to_device(top_p, device, torch.float32),
                has_cut=any(top_k) or any(p.min_p > 0.0 for p in params),
            )
        elif device.type == "cpu":
            cut_p = _top_p_cut_cpu(scaled, cut, top_p)
        else:
            # NOTE: another device, or CUDA without Triton: the whole sort
            cut_p = top_p_cut_naive(logits, temperature, cut, to_device(top_p, device, torch.float32))
        cut = torch.maximum(cut, cut_p)
    return temperature, cut


def _top_p_cut_cpu(scaled: torch.Tensor, cut: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The cut of each row's top-p over what ``cut`` keeps, on a CPU: its most likely tokens
    until their probability reaches ``top_p`` (the token that reaches it included); ``-inf`` for
    a row without top-p.

    NOTE: the sort of the whole vocabulary is most of a CPU step's sampling: the most likely
    256 (then 8x more) are enough for a row whose cut falls among them.
    """
    vocab = scaled.shape[-1]
    masked = torch.where(scaled >= cut[:, None], scaled, float("-inf"))
    norm = torch.logsumexp(masked, dim=-1, keepdim=True)
    bound = torch.tensor(top_p, dtype=torch.float32)
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    width = min(vocab, 256)
    while True:
        top = masked.topk(width, dim=-1).values if width < vocab else masked.sort(dim=-1, descending=True).values
        reached = torch.exp(top[rows] - norm[rows]).sum(dim=-1)
        if width == vocab or bool((reached >= bound[rows]).all()):
            return cut_of_sorted(top, norm, bound)
        width = min(vocab, width * 8)


def inverse_cdf_draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The CPU's draw: one uniform per row from its keys (``[N, 2]`` int64), found in the row's
    cumulative sum: ``[N]`` int64.

    NOTE: one number a row where the race hashes every token: ~20x cheaper on a CPU, and as
    independent of the batch (a row's token is a function of its keys and probabilities).
    """
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1:]
    # NOTE: the uniform's bits come from the second key, which depends on the whole seed
    u = (((keys[:, 1:] >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)).to(probs.device)
    # NOTE: the target stays below the row's total, so the first entry past it exists; a
    # zero-probability token never starts a step of the cumulative sum, so it is never found
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def sample_rows(logits: torch.Tensor, rows: RowSettings) -> SampledRows:
    """Samples one token per row of ``logits`` at random, among the tokens its cut keeps.

    NaN logits are never drawn; a row with a ``+inf`` logit takes it; a row with nothing left
    (no logit above ``-inf``) is marked failed.

    Args:
        logits: ``[N, V]`` of the rows (processed already, where processors ran).
        rows: their settings, seeds and draw indices.

    Returns:
        The tokens and failure marks, on ``logits``' device.
    """
    device = logits.device
    temperature, cut = row_cuts(logits, rows.params)
    keys = torch.from_numpy(row_keys_array(rows.seeds, rows.draws))
    if device.type != "cpu":
        key_tensor = keys.to(device, non_blocking=True)
        if device.type == "cuda" and _triton is not None:
            tokens, best = gumbel_argmax_triton(logits, temperature, cut, key_tensor)
        else:
            best, tokens = gumbel_scores_naive(logits, temperature, cut, key_tensor).max(dim=-1)
        return SampledRows(tokens, best == float("-inf"))
    scaled = logits.float() / temperature[:, None]
    kept = torch.where(scaled >= cut[:, None], scaled, float("-inf"))
    probs = torch.softmax(kept, dim=-1)
    sums = probs.sum(dim=-1)
    ok = torch.isfinite(sums) & (sums > 0.0)
    tokens = inverse_cdf_draw(torch.where(ok[:, None], probs, 1.0), keys)
    if bool(ok.all()):
        return SampledRows(tokens, torch.zeros_like(ok))
    # NOTE: a +inf logit makes the softmax NaN: the first such token is drawn
    best, fallback = kept.max(dim=-1)
    return SampledRows(torch.where(ok, tokens, fallback), ~ok & (best == float("-inf")))
