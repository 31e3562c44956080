"""Model runner: turns a scheduler plan into one packed forward pass and sampled tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch

from asymcache_core.cuda_graphs import DecodeGraphs, decode_batch
from asymcache_core.host_tier import KVTransfers
from asymcache_core.kv_transfer import HostKVCache
from asymcache_core.loaders import LoadedModel
from asymcache_core.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from asymcache_core.sampler import FAILED, Sampler
from asymcache_core.scheduler import SchedulerOutput
from kernels.dispatch import AttentionBackend
from kernels.metadata import MSAMetadata, build_msa_metadata


class StepInputs(NamedTuple):
    """Host-side batch of one step.

    Attributes:
        input_ids: packed token ids.
        positions: their absolute positions.
        slots: their KV slots.
        meta: MSA metadata (segments, block tables, slot mapping).
        logits_rows: packed row of each sampling request's last token.
        sample_index: index into ``SchedulerOutput.scheduled`` of each sampling row.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    meta: MSAMetadata
    logits_rows: list[int]
    sample_index: list[int]


class ModelRunner:
    """Owns the model, its paged KV caches and the sampler.

    Args:
        loaded: the loaded model.
        num_blocks: KV pool size.
        block_size: tokens per block.
        device: where everything runs.
        dtype: cache dtype (the model's).
        backend: attention backend.
        seed: sampler seed.
        max_model_len: longest context (sizes the CUDA graphs' buffers).
        max_num_seqs: most sequences in one step (the largest CUDA graph).
        cuda_graphs: capture decode-only steps as CUDA graphs (CUDA with the Triton backend).
        mixed_graph_tokens: with ``cuda_graphs``, also capture other steps of up to this many
            tokens piecewise (:class:`~asymcache_core.piecewise_graphs.PiecewiseGraphs`); 0: no.
        num_host_blocks: slots of the host KV tier (:class:`~asymcache_core.kv_transfer.HostKVCache`); 0: none.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
        seed: int,
        max_model_len: int = 0,
        max_num_seqs: int = 0,
        cuda_graphs: bool = False,
        mixed_graph_tokens: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler(seed)
        cfg = loaded.config
        # NOTE: one tensor [L, 2, num_blocks, block_size, H_kv, D] whose per-layer K and V views
        # are each contiguous: the host tier gathers a block of every layer in one kernel.
        self.kv_cache = torch.zeros(
            (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
            dtype=dtype, device=device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.host_cache = HostKVCache(self.kv_cache, num_host_blocks) if num_host_blocks > 0 else None
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, backend, block_size, max_model_len, max_num_seqs, device
            )
        self.mixed_graphs: PiecewiseGraphs | None = None
        if cuda_graphs and mixed_graph_tokens > 0:
            self.mixed_graphs = PiecewiseGraphs(
                self.model, self.kv_caches, backend, piecewise_sizes(mixed_graph_tokens), device
            )

    # -- the host tier's copies ---------------------------------------------------------------
    def transfer_kv(self, transfers: KVTransfers) -> None:
        """Issues a step's block copies between the host tier and the device caches."""
        assert self.host_cache is not None, "a plan with block copies needs the host tier"
        self.host_cache.issue(transfers)

    def transfer_complete(self, ticket: int) -> bool:
        return self.host_cache is None or self.host_cache.is_complete(ticket)

    def wait_transfers(self, ticket: int | None = None) -> None:
        """Blocks until the reloads of ``ticket`` (``None``: every copy) have landed."""
        if self.host_cache is None:
            return
        if ticket is None:
            self.host_cache.wait_all()
        else:
            self.host_cache.wait(ticket)

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        """Packs the plan's segments into flat host lists and the MSA metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[tuple[int, int, int, int]] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample_index: list[int] = []
        for seq, item in enumerate(plan.scheduled):
            request = item.request
            table = request.block_ids
            tokens = request.all_token_ids
            for start, end in item.segments:
                segments.append((seq, len(input_ids), end - start, start))
                input_ids.extend(tokens[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(list(table))
            if item.sample:
                logits_rows.append(len(input_ids) - 1)
                sample_index.append(seq)
        meta = build_msa_metadata(tables, segments, slots, bs, self.device)
        cfg = self.loaded.config
        # NOTE: once per step, not once per layer: the backend's launch plan (the Triton tile
        # table and its copy to the device) is shared by all layers.
        meta = self.backend.prepare(meta, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        return StepInputs(input_ids, positions, slots, meta, logits_rows, sample_index)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Runs the step; returns the sampled token of every request that reached its end."""
        if self.decode_graphs is not None:
            batch = decode_batch(plan, self.block_size)
            logits = self.decode_graphs.run(batch) if batch is not None else None
            if logits is not None:
                return self._sample(plan, list(range(len(plan.scheduled))), logits)
        inputs = self.prepare(plan)
        dev = self.device
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long).to(dev, non_blocking=True)
        logits = None
        if self.mixed_graphs is not None:
            logits = self.mixed_graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.meta, rows)
        if logits is None:
            logits = self.model(
                torch.tensor(inputs.input_ids, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(inputs.positions, dtype=torch.long).to(dev, non_blocking=True),
                self.kv_caches,
                inputs.meta,
                self.backend,
                rows,
            )
        return self._sample(plan, inputs.sample_index, logits)

    def _sample(self, plan: SchedulerOutput, sample_index: list[int], logits: torch.Tensor) -> dict[str, int]:
        """Samples one token per row of ``logits`` for ``plan.scheduled[sample_index[row]]``."""
        if not sample_index:
            return {}
        requests = [plan.scheduled[i].request for i in sample_index]
        tokens = self.sampler.sample(
            logits,
            [r.request_id for r in requests],
            [r.params for r in requests],
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
        )
        # NOTE: a row whose sampling failed is left out; the engine fails its request alone.
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True) if t != FAILED}

    def take_failures(self) -> dict[str, str]:
        """Requests whose sampling failed since the last call: id -> error text."""
        return self.sampler.take_failures()
