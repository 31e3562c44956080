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
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata
from kernels.msa_grid_order import HEADS_FIRST_ROWS, heads_first_pays


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class MSAConfig:
    """Tile sizes and launch parameters of one MSA launch.

    Attributes:
        block_m: query tokens per q-tile (rows are ``block_m * next_pow2(G)``).
        block_n: keys per KV tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loop.
        num_splits: KV splits (1: no split-K, the kernel writes the output directly).
        split_path: compile the kernel's split path even at one split (its tiles then write
            their output directly and no merge runs): see :data:`_WIDE_KV_ROWS`.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    split_path: bool = False


# NOTE: cached: the planner asks once a step, and the device's properties never change.
@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Hopper's opt-in shared memory per block (bytes); the CPU interpreter plans as for an H200.
_DEFAULT_SMEM = 232448
# Bytes of shared memory Triton uses beside the operand buffers (barriers, layout scratch).
_SMEM_SLACK = 8192


@functools.cache
def _smem_limit(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or _DEFAULT_SMEM)
    return _DEFAULT_SMEM


def _smem_bytes(rows: int, block_n: int, num_stages: int, head_dim: int, elem_bytes: int) -> int:
    """Shared memory of one program: the q tile plus ``num_stages`` buffers of K and V tiles.

    NOTE: a conservative model of what Triton 3.6 allocates for this kernel on Hopper: float32
    programs of 256 rows, 64 keys and head_dim 128 asked for 262,400 bytes at 3 stages and
    263,168 at 2 (the q tile, 131,072, plus four 32,768-byte K/V buffers, plus barriers).
    """
    return elem_bytes * head_dim * (rows + 2 * max(num_stages, 2) * block_n)


def _fit_tile(
    rows: int, block_n: int, num_stages: int, head_dim: int, elem_bytes: int, limit: int
) -> tuple[int, int, int] | None:
    """Shrinks pipelining depth, then the KV tile, until a program of ``rows`` fits ``limit``
    bytes of shared memory; ``None`` when even 2 stages of 16-key tiles do not fit."""
    while _smem_bytes(rows, block_n, num_stages, head_dim, elem_bytes) + _SMEM_SLACK > limit:
        if num_stages > 2:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            return None
    return rows, block_n, num_stages


def _tile_shape(
    rows: int, head_dim: int = 128, elem_bytes: int = 2, smem_limit: int = _DEFAULT_SMEM
) -> tuple[int, int, int, int]:
    """``(rows, block_n, num_warps, num_stages)`` for programs of up to ``rows`` query rows.

    ``rows`` comes back halved (down to 16) until the tile fits ``smem_limit``: float32 and wide
    heads need less pipelining, smaller KV tiles or fewer rows than bf16 at head_dim 128.
    """
    # Measured on the H200: decode-like tiles are bandwidth-bound and prefer
    # few warps; long segments prefer 256-row tiles on 8 warps.
    while True:
        block_n, num_stages = 64, 3
        fitted = _fit_tile(rows, block_n, num_stages, head_dim, elem_bytes, smem_limit)
        if fitted is not None or rows <= 16:
            break
        rows //= 2
    if fitted is None:
        raise ValueError(f"msa_triton: no tile of head_dim {head_dim} fits {smem_limit} bytes of shared memory")
    rows, block_n, num_stages = fitted
    num_warps = 2 if rows <= 16 else 4 if rows <= 64 else 8
    return rows, block_n, num_warps, num_stages


def _short_tile_splits(programs: int, max_ctx: int, num_sms: int) -> int:
    """KV splits of a launch of short tiles (decodes, one-block holes): they are
    bandwidth-bound and their merge is cheap, so ~3 programs per SM, in chunks of >= 512 keys."""
    if programs >= 3 * num_sms or max_ctx <= 1024:
        return 1
    return min(-(-3 * num_sms // programs), -(-max_ctx // 512))


def choose_config(
    meta: MSAMetadata,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> MSAConfig:
    """Picks tile sizes and the KV split from host metadata only (no device sync).

    Rows per program are ``block_m * next_pow2(G)``: 16 for decode-only steps (the smallest
    tensor-core tile), up to 256 once segments are long, fewer where the tile would not fit
    the device's shared memory in ``dtype``. KV tiles are 64 keys, or 128 for 256-row prefill
    tiles whose queries see >= 8k keys on average (:data:`_WIDE_KV_MIN_KEYS`; such launches
    run the kernel's split path). Split-K turns on when the programs (q-tiles times KV heads) cannot fill the
    GPU and contexts are long: ~3 programs per SM for short tiles (up to 64 rows), two waves
    for prefill tiles.
    """
    return _config_for(meta.host_segments, num_q_heads, num_kv_heads, head_dim, device, dtype)


def _config_for(
    segments: tuple[tuple[int, int, int, int], ...] | list[tuple[int, int, int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> MSAConfig:
    """:func:`choose_config` for a launch over ``segments`` ``(seq, q_start, q_len, pos_start)``."""
    max_q_len = max((seg[2] for seg in segments), default=0)
    max_ctx = max((seg[3] + seg[2] for seg in segments), default=0)
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    min_m = max(1, 16 // g_pad)
    max_m = max(min_m, min(128, 256 // g_pad))
    block_m = min(max(_next_pow2(max(max_q_len, 1)), min_m), max_m)
    rows, block_n, num_warps, num_stages = _tile_shape(
        block_m * g_pad, head_dim, _elem_bytes(dtype), _smem_limit(device)
    )
    block_m = max(1, rows // g_pad)
    num_tiles = sum(-(-seg[2] // block_m) for seg in segments)
    programs = max(num_tiles * num_kv_heads, 1)
    num_sms = _num_sms(device)
    num_splits = 1
    if rows <= 64:
        num_splits = _short_tile_splits(programs, max_ctx, num_sms)
    elif programs < 2 * num_sms:
        # compute-bound tiles (one 8-warp program per SM): split only long contexts, into
        # chunks of >= 4k keys, to fill two waves (measured: the merge costs more below that)
        num_splits = max(1, min(-(-2 * num_sms // programs), max_ctx // 4096))
    if rows == _WIDE_KV_ROWS and _mean_keys(segments) >= _WIDE_KV_MIN_KEYS:
        wide = (rows, _WIDE_KV_BLOCK_N, 2)
        if _fit_tile(*wide, head_dim, _elem_bytes(dtype), _smem_limit(device)) == wide:
            return MSAConfig(
                block_m, _WIDE_KV_BLOCK_N, num_warps, 2, max(num_splits, _WIDE_KV_MIN_SPLITS), split_path=True
            )
    return MSAConfig(block_m, block_n, num_warps, num_stages, max(num_splits, 1))


# Prefill tiles of this many rows walk KV tiles of _WIDE_KV_BLOCK_N keys (two stages deep)
# when the launch's queries see at least _WIDE_KV_MIN_KEYS keys on average.
# NOTE: measured on the H200 (Triton 3.6, bf16, 32 q / 8 KV heads, head_dim 128,
# scripts/gpu_msa_tiles.py): from 8k keys a query on average the planner's launches with the
# 128-key tile were 4-12% faster than with 64-key tiles on each of 14 layouts (9 of them held
# out from the choice of the rule); below it, the wide tile loses (a fresh 8k prompt -7%, four
# fresh 2k prompts -29%): its masked diagonal tiles and its one fewer stage of copies in flight
# outweigh the turns saved.
# It runs on the kernel's split path (``MSAConfig.split_path``), at one split where the launch
# balances without more: the same tile compiled without the split path ran 1.45x slower,
# whatever the layout (its KV loop spills: 117 local loads and stores a turn against 36 split,
# compiled for sm_90). At one split on that path it beat two splits by 0-2.5% on every layout
# once uneven launches went KV head first (:data:`kernels.msa_grid_order.HEADS_FIRST_MIN_GAIN`; before that, two
# splits evened their tail). Only the 256-row tile was measured.
_WIDE_KV_ROWS = 256
_WIDE_KV_BLOCK_N = 128
_WIDE_KV_MIN_KEYS = 8192
# KV splits the wide tile runs at least (benchmarks set 2: the rule as session 33 left it).
_WIDE_KV_MIN_SPLITS = 1


def _mean_keys(segments: tuple[tuple[int, int, int, int], ...] | list[tuple[int, int, int, int]]) -> float:
    """Mean keys a query of ``segments`` attends to (its position + 1)."""
    tokens = sum(seg[2] for seg in segments)
    keys = sum(seg[2] * (seg[3] + (seg[2] + 1) / 2) for seg in segments)
    return keys / max(tokens, 1)


def _elem_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


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
        keys_per_sm = sum(r[3] + r[2] for r in rows) * num_kv_heads / _num_sms(device)
        balanced = -(-max(min_chunk, int(keys_per_sm)) // cfg.block_n) * cfg.block_n
        if balanced < chunk:
            chunk, num_splits = balanced, -(-max_ctx // balanced)
    heads_first = order_by_head and heads_first_pays([r[3] + r[2] for r in rows], num_kv_heads, chunk, _num_sms(device))
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
    num_sms = _num_sms(device)
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
    splits = _short_tile_splits(programs, max_context, _num_sms(tiles.device))
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
    "MSAConfig",
    "MSAPlan",
    "MSAStepPlan",
    "choose_config",
    "decode_graph_chunk",
    "decode_graph_plan",
    "invariant_config",
    "plan_msa",
]
