"""Per-step metadata of a Multi-Segment Attention launch.

A *segment* is a run of consecutive query tokens of one sequence, at absolute positions
``[pos_start, pos_start + q_len)``. A step packs the segments of many sequences into one query
tensor ``[T, H, D]``; a sequence may own several segments (evicted holes refilled in the middle
of its history, its new suffix, a decode token). Query at absolute position ``p`` attends to the
keys at positions ``<= p`` of its own sequence; the cache already holds this step's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class MSAMetadata:
    """Everything an MSA launch needs besides Q and the caches.

    Attributes:
        block_tables: ``[num_seqs, max_blocks]`` int32, physical block of each logical block
            (entries past a sequence's context are unused and may hold anything >= 0).
        seg_seq: ``[num_segs]`` int32, row of ``block_tables`` that each segment belongs to.
        seg_q_start: ``[num_segs]`` int32, offset of the segment's first token in packed Q.
        seg_q_len: ``[num_segs]`` int32, number of query tokens of the segment.
        seg_pos_start: ``[num_segs]`` int32, absolute position of the segment's first token.
        slot_mapping: ``[T]`` int64, flat slot (``block * block_size + offset``) where each
            packed token's new K/V is stored.
        block_size: tokens per KV block.
        max_q_len: largest ``seg_q_len`` (host int, so launches need no device sync).
        max_ctx_len: largest ``seg_pos_start + seg_q_len``.
        host_segments: the same segments as host tuples ``(seq, q_start, q_len, pos_start)``,
            for the torch paths that loop on the host.
        plan: a backend's launch plan, prepared once per step and shared by every layer
            (``AttentionBackend.prepare``; the Triton backend's ``MSAPlan``); ``None`` lets the
            backend plan on each call.
    """

    block_tables: torch.Tensor
    seg_seq: torch.Tensor
    seg_q_start: torch.Tensor
    seg_q_len: torch.Tensor
    seg_pos_start: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    max_q_len: int
    max_ctx_len: int
    host_segments: tuple[tuple[int, int, int, int], ...]
    plan: Any = None

    @property
    def num_segments(self) -> int:
        return len(self.host_segments)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def pad_block_tables(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """The ragged block tables as one zero-padded ``[len(block_tables), width]`` int32 CPU tensor.

    Args:
        block_tables: one list of physical block ids per sequence, each at most ``width`` long.
        width: the row length.

    NOTE: filled row by row through numpy. A long-context batch's tables hold tens of thousands
    of ids, rebuilt every step: ``torch.tensor`` of the padded nested lists took ~3x as long
    (``python scripts/bench_block_tables.py``: 32 tables of 1,875 blocks 7.3 against 2.6 ms on
    this project's CPU).
    """
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, ids in zip(table, block_tables, strict=True):
        row[: len(ids)] = ids
    return torch.from_numpy(table)


def table_width(block_tables: list[list[int]]) -> int:
    """The padded table's row length: the longest table rounded up to a multiple of 16 (at least 16).

    NOTE: the width is the table's row stride. Triton compiles one kernel variant per
    divisibility of an integer argument, so a width that is sometimes a multiple of 16 and
    sometimes not would compile every MSA configuration twice, the second time in the middle of
    a run (about a second each on a GPU).
    """
    longest = max((len(t) for t in block_tables), default=1) or 1
    return -(-longest // 16) * 16


def build_msa_metadata(
    block_tables: list[list[int]],
    segments: list[tuple[int, int, int, int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    table_array: np.ndarray | None = None,
) -> MSAMetadata:
    """Builds :class:`MSAMetadata` from host lists.

    Args:
        block_tables: one list of physical block ids per sequence (ragged; padded here).
        segments: ``(seq, q_start, q_len, pos_start)`` per segment, in packed-Q order.
        slot_mapping: one flat slot per packed query token.
        block_size: tokens per block.
        device: where the tensors live.
        table_array: ``block_tables`` already padded to ``[len(block_tables), table_width]``
            int32 (a persistent table's rows); ``None``: padded here.

    Returns:
        The metadata, tensors on ``device``.
    """
    if table_array is not None:
        assert table_array.shape == (len(block_tables), table_width(block_tables)), table_array.shape
        tables = torch.from_numpy(table_array)
    else:
        tables = pad_block_tables(block_tables or [[]], table_width(block_tables))  # one row at least
    seg = list(zip(*segments, strict=True)) if segments else [(), (), (), ()]

    def as_tensor(values: object, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return MSAMetadata(
        block_tables=tables.to(device, non_blocking=True),
        seg_seq=as_tensor(list(seg[0]), torch.int32),
        seg_q_start=as_tensor(list(seg[1]), torch.int32),
        seg_q_len=as_tensor(list(seg[2]), torch.int32),
        seg_pos_start=as_tensor(list(seg[3]), torch.int32),
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        block_size=block_size,
        max_q_len=max((s[2] for s in segments), default=0),
        max_ctx_len=max((s[3] + s[2] for s in segments), default=0),
        host_segments=tuple(tuple(s) for s in segments),  # type: ignore[misc]
    )
