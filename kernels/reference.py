"""Torch implementations of MSA, the KV store and the layer's elementwise steps: the CPU path and
the test oracle.

Shapes: packed queries ``q`` are ``[T, HQ, D]``; caches are ``[num_blocks, block_size, HKV, D]``
per layer; the output is ``[T, HQ, D]``. ``HQ`` is a multiple of ``HKV`` (GQA).

Two twins with one signature:

- :func:`msa_naive` loops over segments and does the softmax by hand, in the dtype it is given
  (tests call it in float64): the oracle.
- :func:`msa_torch` is the fast torch path: every length-1 segment of the step (decodes) goes
  through one batched SDPA call over a padded gather, every longer segment through one SDPA call
  with an explicit causal mask offset by its position.
- :func:`kernels.msa_tiled.msa_tiled` (its own module) is the batch-invariant torch path: a
  query's output is the same bits alone, inside a prefill chunk of any length, or rebuilt as a
  hole.

The twins of :mod:`kernels.fused`: :func:`rope_store_torch` (rotary + KV store),
:func:`add_rms_norm_torch` and :func:`silu_mul_torch`, each the unfused sequence of torch ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.metadata import MSAMetadata


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [T, H, D]`` (neox half-split layout) in ``x``'s dtype, as HF does.

    Args:
        x: ``[T, H, D]``.
        cos: ``[T, 1, D]``, ``cat(cos, cos)`` of each token's position.
        sin: ``[T, 1, D]``, ``cat(-sin, sin)``: the sign of rotate-half is in its first half.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


#: A per-head RMSNorm of the query and key heads before the rotary embedding (Qwen3's
#: ``q_norm``/``k_norm``): ``(q_weight [D], k_weight [D], eps)``.
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


def qk_norm_torch(qk: torch.Tensor, num_q_heads: int, qk_norm: QKNorm) -> torch.Tensor:
    """``qk [T, HQ + HKV, D]`` with each query head normalised by ``q_weight`` and each key
    head by ``k_weight`` (an RMSNorm over ``D``, per head)."""
    q_weight, k_weight, eps = qk_norm
    head_dim = qk.shape[-1]
    q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
    return torch.cat((F.rms_norm(q, (head_dim,), q_weight.to(qk.dtype), eps),
                      F.rms_norm(k, (head_dim,), k_weight.to(qk.dtype), eps)), dim=1)


def rope_store_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """The unfused twin of :func:`rope_store_triton`; ``store_kv`` is the backend's KV store;
    ``qk_norm`` normalises each query and key head first (:func:`qk_norm_torch`).

    Returns:
        ``q [T, HQ, D]`` (a view of the rotated projection).
    """
    head_dim = cos.shape[-1]
    heads = num_q_heads + num_kv_heads
    qk = qkv[:, : heads * head_dim].reshape(-1, heads, head_dim)
    if qk_norm is not None:
        qk = qk_norm_torch(qk, num_q_heads, qk_norm)
    qk = rotate_torch(qk, cos, sin)
    q, k = qk.split([num_q_heads, num_kv_heads], dim=1)
    v = qkv[:, heads * head_dim :].reshape(-1, num_kv_heads, head_dim)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused twin of :func:`add_rms_norm_triton`: ``(rms_norm(residual + x), residual + x)``."""
    total = residual + x
    return F.rms_norm(total, (total.shape[-1],), weight.to(total.dtype), eps), total


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The unfused twin of :func:`silu_mul_triton`: ``silu(gate) * up`` of ``[..., 2I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    blocks = cache.index_select(0, block_row[:num_blocks].long())
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
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        # NOTE: queries in slices of at most ~2^27 scores, so that a 20k-token prefill of 64
        # heads stays a few GB in float64; each row's softmax is still computed whole.
        rows = max(1, (1 << 27) // max(q.shape[1] * ctx_len, 1))
        for lo in range(0, q_len, rows):
            hi = min(q_len, lo + rows)
            qs = q[q_start + lo : q_start + hi]  # [L, HQ, D]
            scores = torch.einsum("lhd,shd->hls", qs, k) * scale
            q_pos = torch.arange(pos_start + lo, pos_start + hi, device=q.device)[:, None]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_start + lo : q_start + hi] = torch.einsum("hls,shd->lhd", probs, v)
    return out


# Largest K (or V) gather, in elements, that one batched SDPA call of :func:`msa_torch` makes;
# a larger group of equal segments is cut into several calls.
_GATHER_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class TorchDecodeBatch:
    """The decodes of a step (length-1 segments), as one padded SDPA call.

    Attributes:
        rows: packed rows of the decodes (a slice when they are consecutive).
        tables: ``[B, NB]`` int64 block tables, ``NB`` blocks covering the longest context.
        mask: ``[B, S]`` bool, key ``j`` visible to decode ``b`` (``S``: the longest context).
        pad: ``[B, S - lo, 1, 1]`` bool, gathered slots past a context (zeroed: a pool slot
            may hold NaN, and ``0 * NaN`` survives a mask), or ``None`` when no context is
            shorter than ``S``.
        lo: the shortest context.
    """

    rows: slice | torch.Tensor
    tables: torch.Tensor
    mask: torch.Tensor
    pad: torch.Tensor | None
    lo: int


@dataclass(frozen=True)
class TorchSegmentGroup:
    """Segments of one length at one position (say, a batch of fresh prompts), as one SDPA call.

    Attributes:
        rows: packed rows of the group, segment after segment (a slice when consecutive).
        tables: ``[B, NB]`` int64 block tables covering ``pos_start + q_len`` keys.
        q_len: each segment's query tokens.
        pos_start: each segment's first position.
        mask: ``[q_len, pos_start + q_len]`` bool, the keys each query sees, for a group deep
            in its sequences (``None`` at position 0: SDPA's own causal mask).

    NOTE: SDPA's ``is_causal`` is top-left aligned; a segment deep in its sequence needs the
    mask aligned to its absolute position instead.
    """

    rows: slice | torch.Tensor
    tables: torch.Tensor
    q_len: int
    pos_start: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class TorchMSAPlan:
    """:func:`msa_torch`'s step plan (:func:`plan_msa_torch`), built once per step and shared
    by every layer: the index tensors and masks would otherwise be rebuilt per layer.

    Attributes:
        decodes: the step's decodes when there are several, else ``None``.
        groups: every other segment, grouped by ``(q_len, pos_start)``.
    """

    decodes: TorchDecodeBatch | None
    groups: tuple[TorchSegmentGroup, ...]


def _packed_rows(starts: list[int], length: int, device: torch.device) -> slice | torch.Tensor:
    """Rows ``start .. start + length`` of each start, in order: a slice when they follow each
    other, an index tensor otherwise."""
    if all(b == starts[0] + i * length for i, b in enumerate(starts)):
        return slice(starts[0], starts[0] + len(starts) * length)
    return torch.tensor([b + i for b in starts for i in range(length)], device=device)


def plan_msa_torch(meta: MSAMetadata, num_kv_heads: int, head_dim: int) -> TorchMSAPlan:
    """Plans a step of :func:`msa_torch` (host work and small tensors, no attention).

    Args:
        meta: the step's segments.
        num_kv_heads: KV heads (bounds a group's gather, :data:`_GATHER_ELEMENTS`).
        head_dim: the heads' width.
    """
    device = meta.block_tables.device
    block_size = meta.block_size
    decodes = [s for s in meta.host_segments if s[2] == 1]
    batch = None
    if len(decodes) > 1:
        ctx = [s[3] + 1 for s in decodes]
        max_ctx, lo = max(ctx), min(ctx)
        seqs = torch.tensor([s[0] for s in decodes], device=device)
        tables = meta.block_tables[seqs, : -(-max_ctx // block_size)].long()
        mask = torch.arange(max_ctx, device=device)[None, :] < torch.tensor(ctx, device=device)[:, None]
        pad = ~mask[:, lo:, None, None] if lo < max_ctx else None
        batch = TorchDecodeBatch(_packed_rows([s[1] for s in decodes], 1, device), tables, mask, pad, lo)
    others: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for seg in meta.host_segments:
        if batch is None or seg[2] != 1:
            others.setdefault((seg[2], seg[3]), []).append(seg)
    groups = []
    for (q_len, pos_start), segs in others.items():
        ctx_len = pos_start + q_len
        per_call = max(1, _GATHER_ELEMENTS // max(1, ctx_len * num_kv_heads * head_dim))
        for i in range(0, len(segs), per_call):
            part = segs[i : i + per_call]
            seqs = torch.tensor([s[0] for s in part], device=device)
            tables = meta.block_tables[seqs, : -(-ctx_len // block_size)].long()
            rows = _packed_rows([s[1] for s in part], q_len, device)
            mask = None
            if pos_start > 0:
                q_pos = torch.arange(pos_start, ctx_len, device=device)[:, None]
                mask = torch.arange(ctx_len, device=device)[None, :] <= q_pos
            groups.append(TorchSegmentGroup(rows, tables, q_len, pos_start, mask))
    return TorchMSAPlan(batch, tuple(groups))


def prepare_msa_torch(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int) -> MSAMetadata:
    """The torch backend's ``prepare``: ``meta`` with its :class:`TorchMSAPlan` attached."""
    return dataclasses.replace(meta, plan=plan_msa_torch(meta, num_kv_heads, head_dim))


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[B, NB * block_size, HKV, D]``: the blocks of each row of ``tables`` ``[B, NB]``.

    NOTE: ``index_select`` on the block axis, not ``cache[tables]``: on the CPU the advanced
    index ran 5x slower for a decode batch's gather (173 against 35 us, 16 x 12 blocks).
    """
    batch, num_blocks = tables.shape
    blocks = cache.index_select(0, tables.reshape(-1))
    return blocks.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def _gather_batch(cache: torch.Tensor, tables: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """``[B, HKV, ctx_len, D]``: the first ``ctx_len`` cached tokens of each table's sequence."""
    return _gather_blocks(cache, tables)[:, :ctx_len].transpose(1, 2)


def msa_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    scale: float,
) -> torch.Tensor:
    """Fast torch MSA (same contract as :func:`msa_naive`): the decodes in one SDPA call, the
    other segments in one call per ``(length, position)``, planned by :func:`plan_msa_torch`
    (``meta.plan`` when the backend's ``prepare`` set it)."""
    plan = meta.plan if isinstance(meta.plan, TorchMSAPlan) else plan_msa_torch(meta, k_cache.shape[2], k_cache.shape[3])
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    if plan.decodes is not None:
        _decode_batched(q, k_cache, v_cache, plan.decodes, scale, group, out)
    for grp in plan.groups:
        ctx_len = grp.pos_start + grp.q_len
        k = _gather_batch(k_cache, grp.tables, ctx_len)
        v = _gather_batch(v_cache, grp.tables, ctx_len)
        num = grp.tables.shape[0]
        qs = q[grp.rows].reshape(num, grp.q_len, *q.shape[1:]).transpose(1, 2)  # [B, HQ, L, D]
        o = F.scaled_dot_product_attention(
            qs, k.to(q.dtype), v.to(q.dtype), attn_mask=grp.mask,
            is_causal=grp.mask is None and grp.q_len > 1, scale=scale, enable_gqa=group > 1,
        )
        out[grp.rows] = o.transpose(1, 2).reshape(num * grp.q_len, *q.shape[1:])
    return out


def _decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: TorchDecodeBatch,
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    """All length-1 segments in one SDPA call over a padded gather of their contexts."""
    max_ctx = batch.mask.shape[1]
    k = _gather_blocks(k_cache, batch.tables)[:, :max_ctx]  # [B, S, HKV, D], a fresh gather
    v = _gather_blocks(v_cache, batch.tables)[:, :max_ctx]
    # Slots past a context hold whatever the pool left there (NaN included): a masked score
    # still multiplies its V by 0, and 0 * NaN = NaN, so zero them. Only columns past the
    # shortest context can be masked: zero just that tail, in place (decode hot path).
    if batch.pad is not None:
        k[:, batch.lo :].masked_fill_(batch.pad, 0)
        v[:, batch.lo :].masked_fill_(batch.pad, 0)
    k = k.transpose(1, 2)  # [B, HKV, S, D]
    v = v.transpose(1, 2)
    qs = q[batch.rows].unsqueeze(2)  # [B, HQ, 1, D]
    o = F.scaled_dot_product_attention(
        qs, k.to(q.dtype), v.to(q.dtype), attn_mask=batch.mask[:, None, None, :],
        scale=scale, enable_gqa=group > 1,
    )
    out[batch.rows] = o.squeeze(2)
