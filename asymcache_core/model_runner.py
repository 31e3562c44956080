"""Model runner: turns a scheduler plan into one packed forward pass and sampled tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch

from asymcache_core.loaders import LoadedModel
from asymcache_core.sampler import Sampler
from asymcache_core.scheduler import SchedulerOutput
from kernels.dispatch import AttentionBackend
from kernels.metadata import MSAMetadata, build_msa_metadata


class StepInputs(NamedTuple):
    """Host-side batch of one step.

    Attributes:
        input_ids: packed token ids.
        positions: their absolute positions.
        meta: MSA metadata (segments, block tables, slot mapping).
        logits_rows: packed row of each sampling request's last token.
        sample_index: index into ``SchedulerOutput.scheduled`` of each sampling row.
    """

    input_ids: list[int]
    positions: list[int]
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
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler(seed)
        cfg = loaded.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

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
        return StepInputs(input_ids, positions, meta, logits_rows, sample_index)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Runs the step; returns the sampled token of every request that reached its end."""
        inputs = self.prepare(plan)
        dev = self.device
        logits = self.model(
            torch.tensor(inputs.input_ids, dtype=torch.long).to(dev, non_blocking=True),
            torch.tensor(inputs.positions, dtype=torch.long).to(dev, non_blocking=True),
            self.kv_caches,
            inputs.meta,
            self.backend,
            torch.tensor(inputs.logits_rows, dtype=torch.long).to(dev, non_blocking=True),
        )
        if not inputs.sample_index:
            return {}
        requests = [plan.scheduled[i].request for i in inputs.sample_index]
        tokens = self.sampler.sample(
            logits,
            [r.request_id for r in requests],
            [r.params for r in requests],
            [r.output_token_ids for r in requests],
        )
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}
