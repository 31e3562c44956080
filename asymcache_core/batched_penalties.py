"""Logit bias and the repetition, presence and frequency penalties of a batch of rows, where
their logits are.

:func:`with_penalties` rewrites a batch of rows at once: the bias is added, then the repetition
penalty applies to every token of the prompt and the output, then the presence and frequency
penalties to the output's counts (vLLM's order). Rows sampled on the host (with logits
processors that rewrite them) go through the same function there. The histories come from the host (each
request's token lists) and, under async scheduling, from the device: the token the step in
flight samples for a row is not on the host yet when the next step is launched, and is counted
from the device tensor it lands in (``pending``). No synchronization.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from asymcache_core.request import Request
from asymcache_core.sampling_params import SamplingParams


def to_device(values: list, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list as a tensor on ``device``, copied without waiting."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def rewrites(params: SamplingParams) -> bool:
    """Whether :func:`with_penalties` changes a row with ``params``."""
    return bool(params.logit_bias) or bool(params.presence_penalty or params.frequency_penalty) or (
        params.repetition_penalty != 1.0
    )


def in_flight_tokens(requests: list[Request], tokens: torch.Tensor | None, rows: dict[str, int]) -> torch.Tensor | None:
    """``[R]`` int64 on the device: each request's token sampled by the step in flight (its
    ``tokens``, request id -> row in ``rows``), not on the host yet (``-1``: none); ``None``
    when no request has one.

    NOTE: a request planned into the step being launched while the one before is in flight
    counts two pending tokens: that step's and its own.
    """
    if tokens is None:
        return None
    index = [rows.get(r.request_id, -1) if r.num_pending >= 2 else -1 for r in requests]
    if all(i < 0 for i in index):
        return None
    at = to_device(index, tokens.device, torch.int64)
    return torch.where(at >= 0, tokens[at.clamp(min=0)], -1)


def _marks(
    rows: list[int],
    outputs: list[list[int]],
    prompts: list[torch.Tensor] | None,
    vocab: int,
    device: torch.device,
    pending: torch.Tensor | None,
) -> torch.Tensor:
    """``[len(rows), V]`` float32: for each of ``rows``, the count of each token of its output
    (a host list), of its prompt (``prompts[k]``, ids on the device) and of its pending token
    (``pending[row]``, ``-1``: none).

    NOTE: every ``(row, token)`` pair is one index into the flattened counts, and all of them
    go in by one ``scatter_add_`` of ones (the counts are small integers: exact in any order).
    A two-dimensional ``index_put_(accumulate=True)`` sorts its indices on CUDA, and
    ``repeat_interleave`` of the prompts' owners is a cumulative sum there: several small
    kernels each, which a step with penalties paid on the device. The owners' offsets are
    known on the host (the prompts' sizes), so they cross with the outputs' indices in one copy.
    """
    num = len(rows)
    out = torch.zeros(num * vocab, dtype=torch.float32, device=device)
    parts = [np.asarray(tokens, dtype=np.int64) for tokens in outputs]
    owners = np.repeat(np.arange(num, dtype=np.int64) * vocab, [len(t) for t in parts])
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    keep = (tokens >= 0) & (tokens < vocab)
    host = owners[keep] + tokens[keep]
    num_output = len(host)
    if prompts is not None and any(t.numel() for t in prompts):
        # the prompts' ids are on the device already: their rows' offsets go with the outputs'
        offsets = np.repeat(np.arange(num, dtype=np.int64) * vocab, [t.numel() for t in prompts])
        host = np.concatenate((host, offsets))
    if len(host):
        flat = torch.from_numpy(host).to(device, non_blocking=True)
        if len(host) > num_output:
            flat = torch.cat((flat[:num_output], flat[num_output:] + torch.cat(prompts)))  # type: ignore[arg-type]
        out.scatter_add_(0, flat, torch.ones(len(host), dtype=torch.float32, device=device))
    if pending is not None:
        token = pending[to_device(rows, device, torch.int64)]
        valid = (token >= 0) & (token < vocab)
        flat = torch.arange(num, device=device) * vocab + token.clamp(0, vocab - 1)
        out.scatter_add_(0, flat, valid.to(torch.float32))
    return out.view(num, vocab)


def prompt_ids(prompt: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """A prompt's distinct ids within the vocabulary, on ``device`` (what the repetition
    penalty covers; built once a request, not once a step)."""
    ids = np.unique(np.asarray(prompt, dtype=np.int64))
    return torch.from_numpy(ids[(ids >= 0) & (ids < vocab)]).to(device)


def with_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None,
    prompts: list[torch.Tensor | None] | None,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows' logits with their bias and penalties applied.

    Args:
        logits: ``[N, V]``.
        params: each row's parameters.
        outputs: each row's generated tokens on the host (``None``: none yet).
        prompts: each row's distinct prompt ids on the device (:func:`prompt_ids`; the
            repetition penalty covers them; ``None``: unknown), needed for rows with one.
        pending: ``[N]`` int64 on ``logits``' device, each row's token sampled but not on the
            host yet (``-1``: none).

    Returns:
        A new float32 tensor, or ``logits`` itself when no row has a bias or a penalty (so that
        log probabilities still read the model's logits).
    """
    if not any(rewrites(p) for p in params):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    x = logits.float().clone()
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab]
    if bias:
        index = to_device([[i, t] for i, t, _ in bias], device, torch.int64)
        x.index_put_((index[:, 0], index[:, 1]), to_device([b for _, _, b in bias], device, torch.float32), accumulate=True)
    history = outputs if outputs is not None else [[] for _ in params]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        rep_prompts = None
        if prompts is not None:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            rep_prompts = [prompts[i] if prompts[i] is not None else empty for i in rep]
        seen = _marks(rep, [history[i] for i in rep], rep_prompts, vocab, device, pending) > 0
        penalty = to_device([params[i].repetition_penalty for i in rep], device, torch.float32)[:, None]
        x = _rewrite_rows(x, rep, lambda vals: torch.where(seen, torch.where(vals > 0, vals / penalty, vals * penalty), vals))
    counted = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if counted:
        counts = _marks(counted, [history[i] for i in counted], None, vocab, device, pending)
        frequency = to_device([params[i].frequency_penalty for i in counted], device, torch.float32)[:, None]
        presence = to_device([params[i].presence_penalty for i in counted], device, torch.float32)[:, None]
        x = _rewrite_rows(x, counted, lambda vals: vals - (frequency * counts + presence * (counts > 0).to(torch.float32)))
    return x


def _rewrite_rows(x: torch.Tensor, rows: list[int], rewrite: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` with ``rows`` rewritten (``x[rows] = rewrite(x[rows])``, in place), or
    ``rewrite(x)`` when ``rows`` are all of them (no gather and scatter back: two kernels and a
    copy fewer a step)."""
    if rows == list(range(x.shape[0])):
        return rewrite(x)
    index = to_device(rows, x.device, torch.int64)
    return x.index_copy_(0, index, rewrite(x.index_select(0, index)))
