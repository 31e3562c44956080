"""Launch plans of the MSA kernels (:mod:`kernels.msa_triton`): tile sizes, tile tables, KV splits.

All host side, no device sync, no Triton needed:

- The segments of the step are cut into *q-tiles* of ``BLOCK_M`` tokens. A small int32 tile
  table ``[num_tiles, 4]`` (sequence row, first packed row, valid tokens, absolute position of
  the first token) is built from ``meta.host_segments`` and copied to the device; heavy tiles
  (longest causal context) come first, so the tail of the launch is short. The GPU starts
  programs along the grid's first axis: the tile, or for prefill launches whose tiles sit at
  many depths the KV head, so that every head of the deepest tile starts first
  (:func:`kernels.msa_grid_order.heads_first_pays`).
- One program handles one q-tile and one KV head, with the ``G = HQ // HKV`` query heads of that
  group stacked as rows (``BLOCK_M * G_PAD`` rows), so each K/V tile is loaded once per group.
  Keys are walked in ``BLOCK_N`` tiles up to the tile's causal end only: tiles wholly before the
  first query position run unmasked, the few on the diagonal run masked. Online softmax
  (flash attention) with fp32 accumulators, in base 2.
- When the tiles times KV heads cannot fill the GPU (long-context decode), the KV range is split
  into chunks over a third grid axis (split-K / flash decoding); each split writes a partial
  output and its log-sum-exp, and a second small kernel merges them.
- Short segments (decodes, one-block holes) and long ones (prefill chunks) are two tile
  classes, each launched with its own tile size and split (:class:`MSAStepPlan`): in a shared
  launch a decode row would take a prefill-sized tile and walk its context in one program.

Each launch's configuration (tile sizes, pipelining, KV split) comes from
:mod:`kernels.msa_config`, the batch-invariant mode's from :func:`invariant_config` here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels import msa_config
from kernels.metadata import MSAMetadata
from kernels.msa_config import (
    MSAConfig,
    _config_for,
    _elem_bytes,
    _fit_tile,
    _next_pow2,
    _short_tile_splits,
    _smem_limit,
    _tile_shape,
)
from kernels.msa_grid_order import HEADS_FIRST_ROWS, heads_first_pays

# Keys per chunk of the batch-invariant mode's fixed KV split (a multiple of every KV tile):
# short enough that a decode at a 2k context still spreads over 4 programs per KV head.
INVARIANT_CHUNK = 512
# Largest float32 split-partial buffer (bytes) the batch-invariant mode spreads over programs;
# past it, each program merges its chunks itself (same bits, fewer programs).
_INVARIANT_PARTIAL_BYTES = 256 << 20
# Programs per SM below which the batch-invariant mode spreads a launch's chunks over more
# programs, and the programs per SM it then aims for. NOTE: measured on the H200
# (scripts/gpu_bi_msa.py, bf16, Llama-3.1-8B heads): with one program per SM or more the
# in-program walk is fastest (batch 32 at 2k keys: 1.08x the default launch's time, 1.43x
# spread over 3 programs per SM); below it, spreading wide pays (4 decodes at 32k keys: 1.63x
# at 12 per SM, 2.16x at 1).
_INVARIANT_SPLIT_BELOW = 1
_INVARIANT_PROGRAMS_PER_SM = 12
# Query rows per program of the batch-invariant mode: decode-sized and prefill-sized tiles.
# NOTE: prefill tiles of 128 rows, not the default mode's 256: the invariant walk holds two
# float32 accumulators (the chunk's and the merged one), and at 256 rows they spill (H200:
# 1.30x the default's time at a causal 8k prefill, 1.25x at 128 rows; 1.27x and 1.12x on a
# 16k context of 4 segments).
_INVARIANT_ROWS = (64, 128)


@functools.lru_cache(maxsize=64)
def invariant_config(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    rows: int = _INVARIANT_ROWS[0],
) -> MSAConfig:
    """A launch configuration of the batch-invariant mode for a model's attention shape.

    What sets a query row's bits is kept the same for every launch of every step: the KV tile
    (``block_n``, the one that fits the largest tile in shared memory) and the chunks of
    :data:`INVARIANT_CHUNK` keys merged in order (``num_splits`` is set per launch by
    :func:`plan_msa`). The rows per program, warps and pipelining depth may follow the
    segments (``rows`` of 64 or 256): a row's dot products and softmax do not depend on them
    (the GPU tests check the bits of a row alone and inside prefill tiles).
    """
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    elem, limit = _elem_bytes(dtype), _smem_limit(device)
    _, block_n, _, _ = _tile_shape(max(_INVARIANT_ROWS[-1], g_pad), head_dim, elem, limit)
    rows = max(rows, g_pad)
    fitted = _fit_tile(rows, block_n, 3, head_dim, elem, limit)
    while fitted is None or fitted[1] != block_n:
        rows //= 2
        fitted = _fit_tile(rows, block_n, 3, head_dim, elem, limit)
    rows, _, num_stages = fitted
    num_warps = 2 if rows <= 16 else 4 if rows <= 64 else 8
    return MSAConfig(max(1, rows // g_pad), block_n, num_warps, num_stages, 1)


@dataclass(frozen=True)
class MSAPlan:
    """One MSA launch, prepared on the host once per step and shared by every layer.

    Attributes:
        config: tile sizes and launch parameters.
        tiles: ``[num_tiles, 4]`` int32 device table ``(seq, row0, n_q, pos0)``; a tile with
            ``n_q = 0`` is padding: it writes nothing, or with ``pad_rows`` zeros to row
            ``row0``.
        num_tiles: grid size along the tile axis.
        chunk: keys per KV split (a multiple of ``config.block_n``).
        num_splits: KV splits (grid axis 2); 1 writes the output directly.
        covered_rows: packed rows that some tile writes; when fewer than ``T``, the output is
            zeroed first (a graph plan's batch: its padding tiles write their rows).
        chunk_buffer: a graph plan's ``[1]`` int32 device buffer of the keys per split, which
            the kernels read at run time (``chunk`` is then only its largest value); ``None``:
            ``chunk`` is passed as is.
        invariant: the batch-invariant mode: ``chunk`` is :data:`INVARIANT_CHUNK` whatever the
            step, and the chunks of a context are merged in order, by the split merge when
            ``num_splits > 1`` (partials indexed by packed row and chunk; a program walks every
            ``num_splits``-th chunk) or inside each program otherwise.
        num_chunks: with ``invariant`` and a split, the most chunks a tile's context spans
            (the partial slots); 0 otherwise.
        merge_counts: with ``invariant`` and a split, ``[num_tiles * num_kv_heads]`` int32
            device counters, zero between launches: the last program of a (tile, KV head) to
            finish folds its chunk states in the walk's launch (no merge kernel; the same
            bits, the fold being the merge kernel's). ``None``: the merge kernel runs.
        pad_rows: padding tiles (``n_q = 0``) write zeros to their row ``row0`` (graph plans:
            every row of the batch has a tile, so the output needs no zero fill).
        heads_first: the grid's first axis is the KV head, not the tile: the GPU then starts
            the programs in the table's order (heaviest tiles first) across heads.
    """

    config: MSAConfig
    tiles: torch.Tensor
    num_tiles: int
    chunk: int
    num_splits: int
    covered_rows: int
    chunk_buffer: torch.Tensor | None = None
    invariant: bool = False
    num_chunks: int = 0
    merge_counts: torch.Tensor | None = None
    pad_rows: bool = False
    heads_first: bool = False

    @property
    def partial_slots(self) -> int:
        """Split partials per row: one per chunk (batch-invariant split) or per split."""
        return max(self.num_chunks, self.num_splits)

    @property
    def launches(self) -> tuple[MSAPlan, ...]:
        """A single launch, so that any plan can be run as :class:`MSAStepPlan` is."""
        return (self,)


@dataclass(frozen=True)
class MSAStepPlan:
    """A step's MSA: one launch per tile class, all writing disjoint rows of one output.

    Decode rows and one-block holes (short segments) get their own launch, with small tiles
    and the KV split of a decode; the prefill segments get big tiles. In one shared launch a
    short segment would take a big tile (its rows mostly masked) and walk its whole context in
    one program per KV head: measured on the H200, one decode at 8k keys adds ~9 ms to a
    mixed step that way.

    Attributes:
        launches: the launches, heaviest class first.
    """

    launches: tuple[MSAPlan, ...]

    @property
    def num_tiles(self) -> int:
        return sum(launch.num_tiles for launch in self.launches)

    @property
    def covered_rows(self) -> int:
        """Packed rows that some launch writes."""
        return sum(launch.covered_rows for launch in self.launches)


def _split_chunk(max_ctx: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(chunk, num_splits)``: ``num_splits`` chunks of whole KV tiles covering ``max_ctx``."""
    chunk = -(-max(max_ctx, 1) // max(num_splits, 1))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-max(max_ctx, 1) // chunk)


def _plan_launch(
    segments: list[tuple[int, int, int, int]],
    cfg: MSAConfig,
    device: torch.device,
    num_kv_heads: int = 0,
    min_chunk: int = 4096,
    order_by_head: bool = False,
) -> MSAPlan:
    """One launch over ``segments`` with ``cfg``: its tile table, heaviest tiles first.

    With ``num_kv_heads`` (automatic configs), no program walks more keys than its share of
    the launch: when one tile's causal context exceeds the keys per SM of the whole launch (a
    deep hole next to a prefill chunk at the start of its history), the KV split grows until
    that tile's chunks fit, in chunks of at least ``min_chunk`` keys. Tiles within one chunk
    still write their output directly (see ``_msa_fwd_kernel``). With ``order_by_head`` too
    (prefill tiles, one program per SM), the grid goes KV head first where
    :func:`kernels.msa_grid_order.heads_first_pays`.
    """
    rows: list[tuple[int, int, int, int]] = []
    for seq, q_start, q_len, pos_start in segments:
        for off in range(0, q_len, cfg.block_m):
            rows.append((seq, q_start + off, min(cfg.block_m, q_len - off), pos_start + off))
    rows.sort(key=lambda r: -(r[3] + r[2]))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device, non_blocking=True)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    chunk, num_splits = _split_chunk(max_ctx, cfg.num_splits, cfg.block_n)
    if num_kv_heads and rows:
        keys_per_sm = sum(r[3] + r[2] for r in rows) * num_kv_heads / msa_config._num_sms(device)
        balanced = -(-max(min_chunk, int(keys_per_sm)) // cfg.block_n) * cfg.block_n
        if balanced < chunk:
            chunk, num_splits = balanced, -(-max_ctx // balanced)
    heads_first = order_by_head and heads_first_pays([r[3] + r[2] for r in rows], num_kv_heads, chunk, msa_config._num_sms(device))
    return MSAPlan(cfg, table, len(rows), chunk, num_splits, sum(seg[2] for seg in segments), heads_first=heads_first)


def plan_msa(
    meta: MSAMetadata,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    config: MSAConfig | None = None,
    short_q_len: int = 16,
    min_split_keys: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    invariant: bool = False,
) -> MSAStepPlan:
    """Builds the step's launches: configs, and tile tables copied to ``device`` (no sync).

    Segments of at most ``short_q_len`` tokens (decodes, one-block holes) form their own launch
    when longer segments share the step (see :class:`MSAStepPlan`). Within a launch, a tile
    whose context is far deeper than the rest is split into chunks of at least
    ``min_split_keys`` keys (the H200 measurement: split-K on prefill tiles pays from ~4k keys
    a chunk). A forced ``config`` (benchmarks, tests) makes one launch of everything.
    ``dtype`` (of ``q``) bounds the tiles by the device's shared memory. ``invariant`` plans
    the batch-invariant mode: :func:`invariant_config` for every launch, the fixed chunk.
    """
    segments = list(meta.host_segments)
    if config is not None:
        return MSAStepPlan((_plan_launch(segments, config, device),))
    long = [seg for seg in segments if seg[2] > short_q_len]
    short = [seg for seg in segments if seg[2] <= short_q_len]
    classes = [c for c in (long, short) if c] or [segments]
    if invariant:
        num_tokens = sum(seg[2] for seg in segments)
        return MSAStepPlan(
            tuple(
                _plan_invariant_launch(
                    c,
                    invariant_config(
                        num_q_heads, num_kv_heads, head_dim, device, dtype,
                        _INVARIANT_ROWS[-1] if c is long else _INVARIANT_ROWS[0],
                    ),
                    device, num_q_heads, num_kv_heads, head_dim, num_tokens,
                )
                for c in classes
            )
        )
    configs = [_config_for(c, num_q_heads, num_kv_heads, head_dim, device, dtype) for c in classes]
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    launches = tuple(
        _plan_launch(c, cfg, device, num_kv_heads, min_split_keys, order_by_head=cfg.block_m * g_pad >= HEADS_FIRST_ROWS)
        for c, cfg in zip(classes, configs, strict=True)
    )
    return MSAStepPlan(launches)


def _invariant_splits(
    programs: int, max_ctx: int, num_rows: int, num_q_heads: int, head_dim: int, device: torch.device
) -> tuple[int, int]:
    """``(grid splits, chunks)`` of a batch-invariant launch: the fixed chunks spread over
    programs (each walking every ``splits``-th chunk of its tile, up to
    :data:`_INVARIANT_PROGRAMS_PER_SM` programs per SM) when the launch has fewer than
    :data:`_INVARIANT_SPLIT_BELOW` programs per SM and its partials stay small; ``(1, 0)``
    (in-program merge) otherwise. Either way the bits are the same: this only trades programs
    for partial traffic."""
    chunks = -(-max(max_ctx, 1) // INVARIANT_CHUNK)
    num_sms = msa_config._num_sms(device)
    target = _INVARIANT_PROGRAMS_PER_SM * num_sms
    if chunks <= 1 or programs >= _INVARIANT_SPLIT_BELOW * num_sms:
        return 1, 0
    if chunks * num_rows * num_q_heads * head_dim * 4 > _INVARIANT_PARTIAL_BYTES:
        return 1, 0
    return min(chunks, -(-target // programs)), chunks


def _plan_invariant_launch(
    segments: list[tuple[int, int, int, int]],
    cfg: MSAConfig,
    device: torch.device,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
) -> MSAPlan:
    """One batch-invariant launch over ``segments``: ``cfg``'s tiles, the fixed chunk."""
    plan = _plan_launch(segments, cfg, device)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    splits, chunks = _invariant_splits(
        plan.num_tiles * num_kv_heads, max_ctx, num_tokens, num_q_heads, head_dim, device
    )
    return dataclasses.replace(
        plan, chunk=INVARIANT_CHUNK, num_splits=splits, invariant=True, num_chunks=chunks,
        merge_counts=_merge_counts(plan.num_tiles * num_kv_heads, splits, device),
    )


def _merge_counts(programs: int, splits: int, device: torch.device) -> torch.Tensor | None:
    """Zeroed counters of a batch-invariant split's fused merge (:class:`MSAPlan`); ``None``
    without a split. Shared by every layer's launch: each launch leaves them at zero."""
    return torch.zeros(programs, dtype=torch.int32, device=device) if splits > 1 else None


def decode_graph_plan(
    tiles: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    max_context: int,
    chunk_buffer: torch.Tensor | None = None,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    invariant: bool = False,
) -> MSAPlan:
    """A fixed launch for a CUDA-graph decode batch of ``tiles.shape[0]`` sequences.

    The launch may not depend on the step (a graph replays it as captured), so the tile table
    is a static buffer the caller refills before each replay (one ``(i, i, 1, ctx - 1)`` row per
    sequence, ``(i, i, 0, 0)`` for padding row ``i``, which the launch fills with zeros: the
    output needs no zero fill), and the grid's KV splits are sized for ``max_context``:
    splits past a sequence's context do no work, and the merge reads only the splits a tile's
    context reaches. With ``chunk_buffer`` the keys per split are read at run time: the caller
    sets them with :func:`decode_graph_chunk` for the batch it replays, so the splits cover the
    batch's longest context rather than ``max_context``. With ``invariant`` the launch is the
    batch-invariant mode's (fixed chunk; ``chunk_buffer`` is left alone and not read).

    Args:
        tiles: ``[batch, 4]`` int32 device buffer.
        num_q_heads: query heads.
        num_kv_heads: KV heads.
        max_context: longest context a replay may see (the engine's ``max_model_len``).
        chunk_buffer: optional ``[1]`` int32 device buffer of the keys per split.
        head_dim: the heads' width (bounds the tile by shared memory).
        dtype: the queries' dtype.
        invariant: plan the batch-invariant mode.
    """
    batch = int(tiles.shape[0])
    programs = max(batch * num_kv_heads, 1)
    if invariant:
        cfg = invariant_config(num_q_heads, num_kv_heads, head_dim, tiles.device, dtype)
        splits, chunks = _invariant_splits(programs, max_context, batch, num_q_heads, head_dim, tiles.device)
        return MSAPlan(
            cfg, tiles, batch, INVARIANT_CHUNK, splits, batch, None, True, chunks,
            _merge_counts(programs, splits, tiles.device), pad_rows=True,
        )
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    block_m = max(1, 16 // g_pad)
    rows, block_n, num_warps, num_stages = _tile_shape(
        block_m * g_pad, head_dim, _elem_bytes(dtype), _smem_limit(tiles.device)
    )
    block_m = max(1, rows // g_pad)
    splits = _short_tile_splits(programs, max_context, msa_config._num_sms(tiles.device))
    chunk, num_splits = _split_chunk(max_context, splits, block_n)
    cfg = MSAConfig(block_m, block_n, num_warps, num_stages, num_splits)
    if chunk_buffer is not None:
        chunk_buffer.fill_(chunk)
    return MSAPlan(cfg, tiles, batch, chunk, num_splits, batch, chunk_buffer, pad_rows=True)


def decode_graph_chunk(plan: MSAPlan, max_ctx: int) -> int:
    """Keys per split for a replay of a :func:`decode_graph_plan` launch whose longest context
    is ``max_ctx``: the plan's splits spread over that context, in whole KV tiles.

    NOTE: a graph sized for a 128k-token ``max_model_len`` at batch 8 has chunks of ~19k keys;
    on 10-20k-token contexts that left one program per (sequence, KV head) walking the whole
    context alone (measured on the H200). The grid stays as captured: only the chunk
    shrinks, and ``cdiv(max_ctx, chunk) <= num_splits`` still holds.
    """
    if plan.invariant:
        return plan.chunk
    chunk, _ = _split_chunk(max_ctx, plan.num_splits, plan.config.block_n)
    return min(plan.chunk, chunk)


__all__ = [
    "INVARIANT_CHUNK",
    "MSAPlan",
    "MSAStepPlan",
    "decode_graph_chunk",
    "decode_graph_plan",
    "invariant_config",
    "plan_msa",
]
