"""Launch configurations of the library MSA kernel (:mod:`kernels.msa_triton`): tile sizes,
pipelining depth and the KV split, chosen on the host from a step's segments and the device's
shared memory and SM count (the batch-invariant mode's own configuration is
:func:`kernels.msa_plan.invariant_config`). No device sync, no Triton needed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.metadata import MSAMetadata


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


__all__ = ["MSAConfig", "choose_config"]
