"""CUDA graphs for decode-only steps.

An eager decode step of an 8B model issues ~1,000 kernel launches for ~10 ms of GPU work, so the
host, not the GPU, sets its pace. A decode-only step has a fixed shape for a given batch size,
so it can be captured once per batch size and replayed: one launch for the whole forward pass.

What a replay may change lives in static device buffers the runner refills before each replay:
token ids, positions, KV slots, block tables, the MSA tile table (one tile per sequence, see
:func:`kernels.msa_plan.decode_graph_plan`) and the keys per KV split, sized for the batch's
longest context rather than ``max_model_len``. Batches are padded up to the next captured size;
padding rows store nothing (slot ``-1``), attend to nothing (``n_q = 0``; their padding tiles
write their attention output's zeros) and their logits are dropped. Steps with prefill or hole
tokens run eagerly.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kernels.dispatch import AttentionBackend
from kernels.metadata import MSAMetadata, pad_block_tables

if TYPE_CHECKING:
    from kernels.msa_plan import MSAPlan

# Captured batch sizes: every size up to 8, then steps of 8 (vLLM captures a similar ladder).
_SMALL_SIZES = (1, 2, 4, 8)
_STEP = 8


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture for at most ``max_batch`` sequences, ascending."""
    sizes = [s for s in _SMALL_SIZES if s < max_batch]
    sizes += list(range(_STEP * 2, max_batch, _STEP))
    return sorted({*sizes, max_batch})


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: object | None = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with Python's cyclic garbage collector held off.

    NOTE: an engine is freed only by the cyclic collector (its scheduler holds its hooks), and
    freeing one destroys its CUDA graphs. A collection that runs inside another engine's
    capture (on any allocation) destroys a graph while the stream captures, which invalidates
    the capture (seen on the H200: "operation not permitted when stream is capturing").
    ``torch.cuda.graph`` collects once before capturing; nothing collects during it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


class DecodeBatch(NamedTuple):
    """Host inputs of a decode-only step, one row per sequence.

    Attributes:
        input_ids: the last token of each sequence.
        positions: its absolute position (context length - 1).
        slots: flat KV slot of that token.
        block_tables: each sequence's physical blocks.
        block_table_array: the same tables padded to ``[sequences, >= longest]`` int32 (the
            runner's persistent rows), or ``None``.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    block_table_array: np.ndarray | None = None


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class DecodeGraphs:
    """One captured decode forward per batch size, sharing one memory pool and one set of
    static input buffers.

    Args:
        model: the causal LM (``forward(ids, positions, kv_caches, meta, backend, rows)``).
        kv_caches: the per-layer paged caches the graphs read and write.
        backend: the attention backend; must be ``triton`` (its MSA takes a device tile table).
        block_size: tokens per KV block.
        max_model_len: longest context a replay may see (sizes the KV split and block tables).
        max_batch: largest batch to capture; larger decode steps run eagerly.
        device: a CUDA device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        device: torch.device,
    ) -> None:
        if backend.name != "triton" or device.type != "cuda":
            raise ValueError("enforce_eager: CUDA graphs need the triton attention backend on CUDA")
        from kernels.msa_plan import decode_graph_chunk, decode_graph_plan

        # NOTE: kept on the instance so that scripts/gpu_decode_graphs.py can time replays with
        # the captured chunk beside the per-replay one.
        self._graph_chunk = decode_graph_chunk

        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.max_batch = max_batch
        cfg = model.config
        max_blocks = -(-max_model_len // block_size)
        # rows: input ids, positions, slots (int64); tiles and block tables (int32)
        self.token_rows = torch.zeros((3, max_batch), dtype=torch.long, device=device)
        # padding tile of row i: (i, i, 0, 0) (kernels.msa_plan.decode_graph_plan)
        rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.pad_tiles = torch.stack((rows, rows, rows * 0, rows * 0), dim=1)
        self.tiles = self.pad_tiles.clone()
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(max_batch, dtype=torch.long, device=device)
        # keys per KV split, set before each replay for the batch's longest context
        self.chunk = torch.zeros(1, dtype=torch.int32, device=device)
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, _Captured] = {}
        self.plans: dict[int, MSAPlan] = {}
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        pool = None
        self.token_rows[2] = -1  # every row starts as padding: no KV store, empty tile
        with torch.inference_mode():
            # NOTE: largest first, so the smaller graphs fit in the memory pool it leaves.
            for size in reversed(self.sizes):
                plan = decode_graph_plan(
                    self.tiles[:size], cfg.num_attention_heads, cfg.num_key_value_heads, max_model_len,
                    chunk_buffer=self.chunk, head_dim=cfg.head_dim, dtype=kv_caches[0][0].dtype,
                    invariant=backend.batch_invariant,
                )
                self.plans[size] = plan
                meta = MSAMetadata(
                    block_tables=self.block_tables[:size], seg_seq=empty, seg_q_start=empty,
                    seg_q_len=empty, seg_pos_start=empty, slot_mapping=self.token_rows[2, :size],
                    block_size=block_size, max_q_len=1, max_ctx_len=max_model_len,
                    host_segments=(), plan=plan,
                )
                args = (
                    self.token_rows[0, :size], self.token_rows[1, :size], kv_caches, meta, backend,
                    self.logits_rows[:size],
                )
                model(*args)  # warm-up: compiles the Triton kernels outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, pool):
                    logits = model(*args)
                pool = graph.pool()
                self.graphs[size] = _Captured(graph, logits)
        torch.cuda.synchronize(device)

    def run(self, batch: DecodeBatch, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Replays the smallest graph that fits ``batch``.

        Args:
            batch: the decode step.
            fill: ``(rows, tokens)`` on the device: input ids written after the batch's (the
                tokens a step still in flight samples, async scheduling).

        Returns:
            ``[len(batch.input_ids), vocab]`` float32 logits (a view of the graph's output, valid
            until the next replay), or ``None`` when the batch is larger than any graph.
        """
        num = len(batch.input_ids)
        size = next((s for s in self.sizes if s >= num), None)
        if size is None:
            return None
        width = max(len(t) for t in batch.block_tables)
        if batch.block_table_array is not None:
            # NOTE: a contiguous copy of exactly the columns the lists fill: one memcpy to the
            # device of the bytes it needs, whatever width the rows were padded to
            tables = torch.from_numpy(np.ascontiguousarray(batch.block_table_array[:, :width]))
        else:
            tables = pad_block_tables(batch.block_tables, width)
        tiles = torch.tensor([(i, i, 1, p) for i, p in enumerate(batch.positions)], dtype=torch.int32)
        pad = size - num
        token_rows = torch.tensor(
            [
                batch.input_ids + [0] * pad,
                batch.positions + [0] * pad,
                batch.slots + [-1] * pad,
            ],
            dtype=torch.long,
        )
        self.token_rows[:, :size].copy_(token_rows, non_blocking=True)
        if fill is not None:
            self.token_rows[0].index_copy_(0, *fill)
        self.tiles[:num].copy_(tiles, non_blocking=True)
        if pad:
            self.tiles[num:size].copy_(self.pad_tiles[num:size])
        self.block_tables[:num, :width].copy_(tables, non_blocking=True)
        plan = self.plans[size]
        if plan.chunk_buffer is not None:  # the batch-invariant plan's chunk is fixed
            self.chunk.fill_(self._graph_chunk(plan, max(batch.positions) + 1))
        captured = self.graphs[size]
        captured.graph.replay()
        return captured.logits[:num]
