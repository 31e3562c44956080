"""Torch implementations of MSA and the KV store: the CPU path and the test oracle.

Shapes: packed queries ``q`` are ``[T, HQ, D]``; caches are ``[num_blocks, block_size, HKV, D]``
per layer; the output is ``[T, HQ, D]``. ``HQ`` is a multiple of ``HKV`` (GQA).

Two twins with one signature:

- :func:`msa_naive` loops over segments and does the softmax by hand, in the dtype it is given
  (tests call it in float64): the oracle.
- :func:`msa_torch` is the fast torch path: every length-1 segment of the step (decodes) goes
  through one batched SDPA call over a padded gather, every longer segment through one SDPA call
  with an explicit causal mask offset by its position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import MSAMetadata


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes this step's K/V ``[T, HKV, D]`` into their slots of the paged caches; a negative
    slot (padding) is skipped, as in the Triton store."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = v


def _gather_context(
    cache: torch.Tensor, block_row: torch.Tensor, ctx_len: int
) -> torch.Tensor:
    """Returns the first ``ctx_len`` cached tokens of one sequence as ``[ctx_len, HKV, D]``."""
    block_size = cache.shape[1]
    num_blocks = (ctx_len + block_size - 1) // block_size
    blocks = cache[block_row[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:ctx_len]


def msa_naive(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference MSA: one explicit softmax per segment, in ``q``'s dtype.

    Args:
        q: ``[T, HQ, D]`` packed queries.
        k_cache: ``[num_blocks, block_size, HKV, D]``.
        v_cache: same shape as ``k_cache``.
        meta: the step's segments.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``[T, HQ, D]``; rows of tokens that belong to no segment are zero.
    """
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for seq, q_start, q_len, pos_start in meta.host_segments:
        ctx_len = pos_start + q_len
        k = _gather_context(k_cache, meta.block_tables[seq], ctx_len).to(q.dtype)
        v = _gather_context(v_cache, meta.block_tables[seq], ctx_len).to(q.dtype)
        k = k.repeat_interleave(group, dim=1)  # [S, HQ, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q_start : q_start + q_len]  # [L, HQ, D]
        scores = torch.einsum("lhd,shd->hls", qs, k) * scale
        q_pos = torch.arange(pos_start, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start : q_start + q_len] = torch.einsum("hls,shd->lhd", probs, v)
    return out


def msa_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    scale: float,
) -> torch.Tensor:
    """Fast torch MSA (same contract as :func:`msa_naive`)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    decodes = [s for s in meta.host_segments if s[2] == 1]
    if len(decodes) > 1:
        _decode_batched(q, k_cache, v_cache, meta, decodes, scale, group, out)
    else:
        decodes = []
    for seg in meta.host_segments:
        if decodes and seg[2] == 1:
            continue
        seq, q_start, q_len, pos_start = seg
        ctx_len = pos_start + q_len
        k = _gather_context(k_cache, meta.block_tables[seq], ctx_len).transpose(0, 1)
        v = _gather_context(v_cache, meta.block_tables[seq], ctx_len).transpose(0, 1)
        qs = q[q_start : q_start + q_len].transpose(0, 1)  # [HQ, L, D]
        if pos_start == 0:
            mask = None
            causal = q_len > 1
        else:
            # NOTE: SDPA's is_causal is top-left aligned; a segment deep in its sequence needs
            # the mask aligned to its absolute position instead.
            q_pos = torch.arange(pos_start, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos
            causal = False
        o = F.scaled_dot_product_attention(
            qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=group > 1,
        )
        out[q_start : q_start + q_len] = o.transpose(0, 1)
    return out


def _decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    decodes: list[tuple[int, int, int, int]],
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    """All length-1 segments in one SDPA call over a padded gather of their contexts."""
    block_size = k_cache.shape[1]
    seqs = torch.tensor([s[0] for s in decodes], device=q.device)
    rows = torch.tensor([s[1] for s in decodes], device=q.device)
    ctx = torch.tensor([s[3] + 1 for s in decodes], device=q.device)
    max_ctx = int(max(s[3] + 1 for s in decodes))
    num_blocks = (max_ctx + block_size - 1) // block_size
    tables = meta.block_tables[seqs, :num_blocks].long()  # [B, NB]
    shape = (len(decodes), num_blocks * block_size, *k_cache.shape[2:])
    k = k_cache[tables].reshape(shape)[:, :max_ctx]  # [B, S, HKV, D], a fresh gather
    v = v_cache[tables].reshape(shape)[:, :max_ctx]
    mask = torch.arange(max_ctx, device=q.device)[None, :] < ctx[:, None]  # [B, S]
    # Slots past a context hold whatever the pool left there (NaN included): a masked score
    # still multiplies its V by 0, and 0 * NaN = NaN, so zero them. Only columns past the
    # shortest context can be masked: zero just that tail, in place (decode hot path).
    lo = int(min(s[3] + 1 for s in decodes))
    if lo < max_ctx:
        pad = ~mask[:, lo:, None, None]
        k[:, lo:].masked_fill_(pad, 0)
        v[:, lo:].masked_fill_(pad, 0)
    k = k.transpose(1, 2)  # [B, HKV, S, D]
    v = v.transpose(1, 2)
    qs = q[rows].unsqueeze(2)  # [B, HQ, 1, D]
    o = F.scaled_dot_product_attention(
        qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=group > 1,
    )
    out[rows] = o.squeeze(2)
