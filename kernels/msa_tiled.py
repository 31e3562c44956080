"""The batch-invariant torch MSA: a query's output is the same bits alone, inside a prefill chunk
of any length, batched with other decodes, or rebuilt as a hole (the CPU's batch-invariant
mode; the same contract as :func:`kernels.reference.msa_naive`, its oracle).

How a row's bits are fixed:

- keys are cut into tiles of :data:`TILE_KEYS` at absolute positions; a row's scores are one dot
  over ``D`` each, and its weights ``exp(s - m)`` with ``m`` its exact maximum (a max has no
  order), ``exp`` taken in calls of at most :data:`_SERIAL_ELEMENTS` (:func:`_exp_serial`);
- each tile's ``P @ V`` is a GEMM of a fixed key width, and the tiles are summed in order, so the
  tiles past a row's position (its own segment's, or those a batch pads to) add exact zeros;
- rows are a segment's ``L * G`` query heads of one KV head, padded to a multiple of
  :data:`_ROW_PAD` (CPU BLAS takes another kernel for fewer rows).

A step is planned once (:func:`plan_msa_tiled`, the backend's ``prepare``): every longer segment
is a call of its own, the one-token segments (decodes) are batched by their padded widths
(:func:`_decode_batches`), and each call's gathers, masks and rows are built there, not again in
every layer.

Shapes: packed queries ``q [T, HQ, D]``; caches ``[num_blocks, block_size, HKV, D]``; output
``[T, HQ, D]``. Prefixes: ``S`` segments of a call, ``R`` padded rows, ``W`` padded keys, ``n``
tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata
from kernels.reference import _gather_blocks

# Keys per tile, and the largest elementwise call (the CPU's TensorIterator splits calls above
# 32,768 elements across threads, and a split point can land inside a SIMD vector, whose
# elements then take the scalar path: other bits for ``exp``).
TILE_KEYS = 64
_SERIAL_ELEMENTS = 32768
_ROW_PAD = 8
# Keys (segments x padded width) of one batch of decodes: a batch's gathered keys and values
# then take ~1.5 MB (SmolLM2's 3 KV heads of 64), within a core's share of the caches. Measured
# (AMD EPYC, one thread): 16 decodes of 150 keys batched take 0.5-0.7x the time of one at a
# time, 16 of 1,000 in one batch 1.6-2x.
DECODE_BATCH_KEYS = 4096


@dataclass(frozen=True)
class TiledCall:
    """``S`` segments of one length attended in one :func:`_tiled_attend` call.

    Attributes:
        rows: the packed query rows, segment after segment (a slice when consecutive).
        q_len: tokens of each segment (1 for a batch of decodes).
        tables: ``[S, NB]`` int64 block tables, ``NB`` blocks covering the widest context.
        width: ``W``, the widest context rounded up to whole tiles.
        hidden: ``[S, 1, n, R, 64]`` bool, key hidden from row (past its position).
        v_past: ``[S, 1, W - lo, 1]`` bool, value slots past a segment's context (zeroed: a pool
            slot may hold NaN, and ``0 * NaN`` survives a zero weight), ``None`` when there are
            none; ``lo`` the shortest context.
        lo: the shortest context of the call.
    """

    rows: slice | torch.Tensor
    q_len: int
    tables: torch.Tensor
    width: int
    hidden: torch.Tensor
    v_past: torch.Tensor | None
    lo: int


@dataclass(frozen=True)
class TiledPlan:
    """A step's calls (:func:`plan_msa_tiled`)."""

    calls: tuple[TiledCall, ...]


def _exp_serial(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a contiguous tensor whose size is a multiple of :data:`TILE_KEYS`, in calls of
    at most :data:`_SERIAL_ELEMENTS` elements, in place: every element goes through the same
    SIMD path."""
    flat = x.view(-1)
    for i in range(0, flat.numel(), _SERIAL_ELEMENTS):
        torch.exp(flat[i : i + _SERIAL_ELEMENTS], out=flat[i : i + _SERIAL_ELEMENTS])
    return x


def _decode_batches(
    decodes: list[tuple[int, int, int, int]], max_keys: int = DECODE_BATCH_KEYS
) -> list[list[tuple[int, int, int, int]]]:
    """One-token segments in batches: in order of their positions, a batch closing where its
    padded width doubles or its keys (segments x width) pass ``max_keys``, so that padding at
    most doubles a batch's work and its gathered keys stay in the caches."""
    batches: list[list[tuple[int, int, int, int]]] = []
    for seg in sorted(decodes, key=lambda seg: seg[3]):
        width = -(-(seg[3] + 1) // TILE_KEYS) * TILE_KEYS
        if batches:
            first = -(-(batches[-1][0][3] + 1) // TILE_KEYS) * TILE_KEYS
            if width < 2 * first and (len(batches[-1]) + 1) * width <= max_keys:
                batches[-1].append(seg)
                continue
        batches.append([seg])
    return batches


def _plan_call(
    segments: list[tuple[int, int, int, int]], block_tables: torch.Tensor, block_size: int, group: int
) -> TiledCall:
    """The call of ``segments`` (all of one length), its rows, gathers and masks."""
    q_len = segments[0][2]
    device = block_tables.device
    ctx = [pos + q_len for _, _, _, pos in segments]
    width = -(-max(ctx) // TILE_KEYS) * TILE_KEYS
    num_blocks = min(-(-width // block_size), block_tables.shape[1])
    tables = block_tables[[seq for seq, _, _, _ in segments], :num_blocks].long().clamp_min(0)
    starts = [q_start for _, q_start, _, _ in segments]
    if all(b - a == q_len for a, b in zip(starts, starts[1:], strict=False)):
        rows: slice | torch.Tensor = slice(starts[0], starts[0] + q_len * len(starts))
    else:
        rows = (torch.tensor(starts)[:, None] + torch.arange(q_len)[None, :]).reshape(-1).to(device)
    padded_rows = -(-(q_len * group) // _ROW_PAD) * _ROW_PAD
    positions = torch.tensor([pos for _, _, _, pos in segments], device=device)
    q_pos = torch.arange(padded_rows, device=device)[None, :] // group + positions[:, None]  # [S, R]
    k_pos = torch.arange(width, device=device).reshape(1, width // TILE_KEYS, 1, TILE_KEYS)
    hidden = (k_pos > q_pos[:, None, :, None])[:, None]  # [S, 1, n, R, 64]
    lo = min(ctx)
    v_past = None
    if lo < width:
        past = torch.arange(lo, width, device=device)[None, :] >= torch.tensor(ctx, device=device)[:, None]
        v_past = past[:, None, :, None]
    return TiledCall(rows, q_len, tables, width, hidden, v_past, lo)


def plan_msa_tiled(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int) -> TiledPlan:
    """A step's :class:`TiledPlan`: a call per segment longer than one token, the decodes in
    :func:`_decode_batches`."""
    group = num_q_heads // num_kv_heads
    block_size = meta.block_size
    decodes = [seg for seg in meta.host_segments if seg[2] == 1]
    calls = [_plan_call(batch, meta.block_tables, block_size, group) for batch in _decode_batches(decodes)]
    calls += [_plan_call([seg], meta.block_tables, block_size, group) for seg in meta.host_segments if seg[2] > 1]
    return TiledPlan(tuple(calls))


def prepare_msa_tiled(meta: MSAMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int) -> MSAMetadata:
    """The batch-invariant torch backend's ``prepare``: ``meta`` with its :class:`TiledPlan`."""
    return dataclasses.replace(meta, plan=plan_msa_tiled(meta, num_q_heads, num_kv_heads))


def _head_major(gathered: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``[S, G, HKV, D]`` gathered keys or values as ``[S, HKV, width, D]`` in ``dtype`` (one
    copy), zeros from ``G`` on."""
    num, length, num_kv_heads, head_dim = gathered.shape
    out = gathered.new_empty((num, num_kv_heads, width, head_dim), dtype=dtype)
    out[:, :, : min(length, width)] = gathered[:, :width].transpose(1, 2)
    if width > length:
        out[:, :, length:] = 0.0
    return out


def _tiled_attend(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """The tiled attention of ``S`` segments at once.

    Args:
        qs: ``[S, HKV, R, D]`` query rows (row ``token * G + g``, zero rows past ``L * G``).
        k, v: ``[S, HKV, W, D]``, ``W`` a multiple of :data:`TILE_KEYS`; values zero past
            each segment's context (a hidden key's weight is an exact 0, and ``0 * NaN`` is not).
        hidden: ``[S, 1, n, R, 64]``, key hidden from row.
        scale: the softmax scale.

    Returns:
        ``[S, HKV, R, D]``.
    """
    num, num_kv_heads, width, head_dim = k.shape
    n_tiles = width // TILE_KEYS
    # NOTE: a tile's keys are one matrix with a row stride of D (the product reads it
    # transposed, no copy); every score is one dot over D, whatever the tile's neighbours.
    k_tiles = k.view(num, num_kv_heads, n_tiles, TILE_KEYS, head_dim).transpose(-1, -2)  # [S, HKV, n, D, 64]
    v_tiles = v.view(num, num_kv_heads, n_tiles, TILE_KEYS, head_dim)  # [S, HKV, n, 64, D]
    scores = torch.matmul(qs.unsqueeze(2), k_tiles).mul_(scale)  # [S, HKV, n, R, 64]
    scores.masked_fill_(hidden, float("-inf"))
    row_max = scores.amax(dim=(2, 4), keepdim=True)  # exact: a max has no order
    probs = _exp_serial(scores.sub_(row_max))
    tile_pv = torch.matmul(probs, v_tiles)  # [S, HKV, n, R, D]
    tile_sum = probs.sum(-1)  # [S, HKV, n, R]
    # the tiles summed in order, into the first tile's own storage (read no more)
    acc, total = tile_pv[:, :, 0], tile_sum[:, :, 0]
    for i in range(1, n_tiles):
        acc += tile_pv[:, :, i]
        total += tile_sum[:, :, i]
    return acc / total[..., None]


def msa_tiled(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: MSAMetadata,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant torch MSA (the module's docstring says how), over the step's
    :class:`TiledPlan` (``meta.plan``, else planned here).

    Args:
        q: ``[T, HQ, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, HKV, D]``.
        meta: the step's segments.
        scale: the softmax scale.

    Returns:
        ``[T, HQ, D]`` (zeros for rows of no segment).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    plan = meta.plan if isinstance(meta.plan, TiledPlan) else plan_msa_tiled(meta, num_q_heads, num_kv_heads)
    out = torch.zeros_like(q)
    for call in plan.calls:
        num = call.tables.shape[0]
        k, v = (_head_major(_gather_blocks(cache, call.tables), call.width, q.dtype) for cache in (k_cache, v_cache))
        if call.v_past is not None:
            v[:, :, call.lo :].masked_fill_(call.v_past, 0.0)
        rows = call.q_len * group
        # [S * L, HQ, D] -> [S, HKV, L * G, D], row token * G + g, zero rows to R
        qs = q.new_zeros((num, num_kv_heads, call.hidden.shape[3], head_dim))
        qs[:, :, :rows] = (
            q[call.rows].view(num, call.q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
            .reshape(num, num_kv_heads, rows, head_dim)
        )
        o = _tiled_attend(qs, k, v, call.hidden, scale)[:, :, :rows]
        out[call.rows] = (
            o.reshape(num, num_kv_heads, call.q_len, group, head_dim).permute(0, 2, 1, 3, 4)
            .reshape(num * call.q_len, num_q_heads, head_dim)
        )
    return out


__all__ = ["TILE_KEYS", "TiledCall", "TiledPlan", "msa_tiled", "plan_msa_tiled", "prepare_msa_tiled"]
