"""Model runner: turns a scheduler plan into one packed forward pass and sampled tokens."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from asymcache_core.block_tables import BlockTableRows
from asymcache_core.cuda_graphs import DecodeBatch, DecodeGraphs
from asymcache_core.host_tier import KVTransfers
from asymcache_core.kv_transfer import HostKVCache
from asymcache_core.launched_steps import LaunchPath
from asymcache_core.loaders import LoadedModel
from asymcache_core.logprobs import (
    LogprobTensors,
    PendingPromptLogprobs,
    TokenLogprob,
    sliced_logprob_tensors,
    token_logprobs,
)
from asymcache_core.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from asymcache_core.sampler import FAILED, Sampler
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.scheduler import SchedulerOutput
from kernels.dispatch import AttentionBackend
from kernels.metadata import build_msa_metadata, table_width


class StepInputs(NamedTuple):
    """Host-side batch of one step: plain lists, so that tensor-parallel ranks receive it as is.

    Attributes:
        input_ids: packed token ids.
        positions: their absolute positions.
        slots: their KV slots.
        segments: ``(sequence, packed start, length, first position)`` per segment.
        block_tables: each scheduled sequence's physical blocks.
        logits_rows: packed row of each sampling request's last token.
        sample_index: index into ``SchedulerOutput.scheduled`` of each sampling row.
        decode_only: one new token per sequence, every sequence sampled (the CUDA-graph case).
        block_table_array: ``block_tables`` padded to ``[sequences, width]`` int32 (width a
            multiple of 16), from the runner's persistent rows; ``None``: pad the lists.
        pending_inputs: ``(packed index, request id)`` of each input whose token a step still
            in flight samples (async scheduling): ``input_ids`` holds 0 there, and the runner
            copies the token in on the device.
        prompt_rows: packed rows whose logits the prompt log probabilities need (after
            ``logits_rows`` in the forward pass's logits).
        prompt_spans: ``(sequence, first position, count)`` of each run of ``prompt_rows``,
            in their order.
        prompt_targets: each prompt row's next prompt token (whose log probability it gives).
        prompt_num_top: alternatives each prompt row reports.
        draft_spans: ``(sequence, drafts)`` of each sampled sequence with drafts (speculative
            decoding), in order: its rows after each draft follow the sampled rows in
            ``logits_rows`` (their first token's row is the sequence's own sampled row).
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    segments: list[tuple[int, int, int, int]]
    block_tables: list[list[int]]
    logits_rows: list[int]
    sample_index: list[int]
    decode_only: bool
    block_table_array: np.ndarray | None = None
    pending_inputs: tuple[tuple[int, str], ...] = ()
    prompt_rows: tuple[int, ...] = ()
    prompt_spans: tuple[tuple[int, int, int], ...] = ()
    prompt_targets: tuple[int, ...] = ()
    prompt_num_top: tuple[int, ...] = ()
    draft_spans: tuple[tuple[int, int], ...] = ()

    @property
    def all_logits_rows(self) -> list[int]:
        """The rows the forward pass computes logits for: the sampled, then the prompt's."""
        return self.logits_rows + list(self.prompt_rows) if self.prompt_rows else self.logits_rows


class ForwardOutput(NamedTuple):
    """What a step's forward pass gives.

    Attributes:
        logits: ``[len(logits_rows), vocab]`` float32, the sampled rows' logits.
        prompt: the prompt rows' log probabilities (on the logits' device), ``None`` without
            prompt rows.
    """

    logits: torch.Tensor
    prompt: LogprobTensors | None = None


def pack_step(plan: SchedulerOutput, block_size: int, rows: BlockTableRows | None = None) -> StepInputs:
    """Packs the plan's segments into flat host lists.

    Args:
        plan: the step's plan.
        block_size: tokens per block.
        rows: the runner's persistent block table rows: the padded table is built from them
            (``StepInputs.block_table_array``); ``None``: only the lists.

    NOTE: block tables are the requests' own lists, not copies: the step consumes them before
    the scheduler changes them (a tensor-parallel runner pickles them at once).
    """
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    segments: list[tuple[int, int, int, int]] = []
    tables: list[list[int]] = []
    logits_rows: list[int] = []
    sample_index: list[int] = []
    pending: list[tuple[int, str]] = []
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[int, int, int]] = []
    prompt_targets: list[int] = []
    prompt_num_top: list[int] = []
    draft_rows: list[int] = []
    draft_spans: list[tuple[int, int]] = []
    for seq, item in enumerate(plan.scheduled):
        request = item.request
        table = request.block_ids
        tokens = request.all_token_ids
        drafts = request.draft_token_ids
        logits_from = request.prompt_logits_from
        for start, end in item.segments:
            if logits_from is not None:
                # NOTE: from the first position whose logits are not computed yet, up to the
                # prompt's last but one (the last one's logits sample the first output token)
                lo, hi = max(start, logits_from), min(end, request.num_prompt_tokens - 1)
                if lo < hi:
                    prompt_rows.extend(range(len(input_ids) + lo - start, len(input_ids) + hi - start))
                    prompt_spans.append((seq, lo, hi - lo))
                    prompt_targets.extend(request.prompt_token_ids[lo + 1 : hi + 1])
                    prompt_num_top.extend([request.params.prompt_logprobs or 0] * (hi - lo))
            segments.append((seq, len(input_ids), end - start, start))
            input_ids.extend(tokens[start:end])
            if drafts and end > len(tokens):
                # NOTE: the positions past the context are the drafts' (never in flight too:
                # drafts need synchronous steps)
                input_ids.extend(drafts[max(0, start - len(tokens)) : end - len(tokens)])
            elif end > len(tokens):
                # NOTE: only a request's last position can be in flight: a step computes the
                # token its previous step sampled, never two ahead.
                assert end == len(tokens) + 1 and start <= len(tokens), "two tokens ahead of the context"
                pending.append((len(input_ids), request.request_id))
                input_ids.append(0)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        tables.append(table)
        if item.sample:
            # NOTE: with drafts, the sampled row is the context's last token's; the rows after
            # the drafts come after every sampled row
            first = len(input_ids) - 1 - len(drafts)
            logits_rows.append(first)
            sample_index.append(seq)
            if drafts:
                draft_rows.extend(range(first + 1, first + 1 + len(drafts)))
                draft_spans.append((seq, len(drafts)))
    array = None
    if rows is not None and tables:
        array = rows.build([item.request for item in plan.scheduled], table_width(tables))
    return StepInputs(
        input_ids, positions, slots, segments, tables, logits_rows + draft_rows, sample_index, plan.is_decode_only,
        array, tuple(pending), tuple(prompt_rows), tuple(prompt_spans), tuple(prompt_targets), tuple(prompt_num_top),
        tuple(draft_spans),
    )


class ModelRunner(LaunchPath):
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
        max_num_batched_tokens: most tokens in one step: the row counts up to which the
            batch-invariant linear op checks where the library's GEMM gives its bits
            (:meth:`~kernels.gemm_calibration.BatchInvariantLinear.calibrate`); 0: the
            longest context.
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
        max_num_batched_tokens: int = 0,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.sampler = Sampler(seed)
        cfg = loaded.config
        # NOTE: the heads this rank holds (all of them without tensor parallelism).
        attn = self.model.layers[0].self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        # NOTE: one tensor [L, 2, num_blocks, block_size, H_kv, D] whose per-layer K and V views
        # are each contiguous: the host tier gathers a block of every layer in one kernel.
        self.kv_cache = torch.zeros(
            (cfg.num_hidden_layers, 2, num_blocks, block_size, self.num_kv_heads, cfg.head_dim),
            dtype=dtype, device=device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.host_cache = HostKVCache(self.kv_cache, num_host_blocks) if num_host_blocks > 0 else None
        calibrate = getattr(backend.dense.linear, "calibrate", None)
        if calibrate is not None:
            # NOTE: before any graph capture: the checks run GEMMs and read their results.
            from asymcache_core.loaders.cache import cache_dir

            rows = self.model.linear_row_bounds(max_num_batched_tokens or max_model_len, max(1, max_num_seqs))
            calibrate(rows, dtype, cache_dir() / "batch-invariant-gemm.json")
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, backend, block_size, max_model_len, max_num_seqs, device
            )
        #: each scheduled request's block table between steps (:mod:`asymcache_core.block_tables`)
        self.block_table_rows = BlockTableRows()
        #: request id -> ``(first position, entries)`` of the prompt log probabilities computed
        #: since :meth:`take_prompt_logprobs` was last called
        self.prompt_logprobs: dict[str, list[tuple[int, list[TokenLogprob]]]] = {}
        #: request id -> the tokens sampled after its drafts (:meth:`take_draft_samples`)
        self.draft_samples: dict[str, list[int]] = {}
        self.draft_logprobs: dict[str, list[TokenLogprob]] = {}
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

    def pack(self, plan: SchedulerOutput) -> StepInputs:
        """The plan packed (:func:`pack_step`, looked up at each call: scripts time it)."""
        return pack_step(plan, self.block_size, self.block_table_rows)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Runs the step; returns the sampled token of every request that reached its end."""
        inputs = self.pack(plan)
        if inputs.pending_inputs:
            raise ValueError("execute: the plan has tokens still in flight; use launch()")
        return self.finish_forward(plan, inputs, self.forward(inputs))

    def finish_forward(self, plan: SchedulerOutput, inputs: StepInputs, out: ForwardOutput) -> dict[str, int]:
        """Records the prompt log probabilities of a synchronous step and samples its rows
        (:meth:`execute`'s end, shared with the tensor-parallel runner)."""
        prompt = self._pending_prompt_logprobs(plan, inputs, out)
        if prompt is not None:
            self._record_prompt_logprobs(prompt)
        if inputs.draft_spans:
            return self._sample(plan, inputs.sample_index, out.logits, draft_spans=inputs.draft_spans)
        return self._sample(plan, inputs.sample_index, out.logits)

    def _pending_prompt_logprobs(
        self, plan: SchedulerOutput, inputs: StepInputs, out: ForwardOutput
    ) -> PendingPromptLogprobs | None:
        """The prompt rows' log probabilities, copied to the host without blocking (``None``:
        the step has no prompt row)."""
        if out.prompt is None:
            return None
        spans = [(plan.scheduled[seq].request.request_id, start, count) for seq, start, count in inputs.prompt_spans]
        return PendingPromptLogprobs(
            spans, list(inputs.prompt_targets), list(inputs.prompt_num_top),
            out.prompt.to(torch.device("cpu"), pin=self.device.type == "cuda"),
        )

    def _prompt_tensors(self, h: torch.Tensor, residual: torch.Tensor, inputs: StepInputs) -> LogprobTensors:
        """The prompt rows' log probabilities from their final hidden state, the vocabulary head
        a slice of rows at a time (:func:`~asymcache_core.logprobs.sliced_logprob_tensors`)."""
        targets = torch.tensor(inputs.prompt_targets, dtype=torch.long).to(self.device, non_blocking=True)

        def head(rows: slice) -> torch.Tensor:
            return self.model.compute_logits(h[rows], residual[rows], None, self.backend.dense)

        return sliced_logprob_tensors(head, h.shape[0], targets, max(inputs.prompt_num_top))

    def _record_prompt_logprobs(self, pending: PendingPromptLogprobs) -> None:
        for rid, parts in pending.entries().items():
            self.prompt_logprobs.setdefault(rid, []).extend(parts)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardOutput:
        """The step's forward pass: the sampled rows' logits and the prompt rows' log
        probabilities.

        Decode-only steps replay a CUDA graph where one is captured; other steps run the
        piecewise graphs, else eagerly. With prompt rows, the pass stops before the vocabulary
        head and the rows go through it in slices (:meth:`_prompt_tensors`).

        Args:
            inputs: the packed step.
            fill: ``(packed indices, tokens)`` on the device, written into the input ids
                before the forward pass (the inputs still in flight).
        """
        if self.decode_graphs is not None and inputs.decode_only:
            assert not inputs.prompt_rows, "a decode-only step computes no prompt position"
            batch = DecodeBatch(
                inputs.input_ids, inputs.positions, inputs.slots, inputs.block_tables, inputs.block_table_array
            )
            logits = self.decode_graphs.run(batch, fill)
            if logits is not None:
                return ForwardOutput(logits)
        meta = build_msa_metadata(
            inputs.block_tables, inputs.segments, inputs.slots, self.block_size, self.device, inputs.block_table_array
        )
        # NOTE: once per step, not once per layer: the backend's launch plan (the Triton tile
        # table and its copy to the device) is shared by all layers.
        meta = self.backend.prepare(meta, self.num_q_heads, self.num_kv_heads, self.loaded.config.head_dim)
        dev = self.device
        hidden = bool(inputs.prompt_rows)
        rows = torch.tensor(inputs.all_logits_rows, dtype=torch.long).to(dev, non_blocking=True)
        out = None
        if self.mixed_graphs is not None:
            out = self.mixed_graphs.run(inputs.input_ids, inputs.positions, inputs.slots, meta, rows, fill, hidden)
        if out is None:
            input_ids = torch.tensor(inputs.input_ids, dtype=torch.long).to(dev, non_blocking=True)
            if fill is not None:
                input_ids.index_copy_(0, *fill)
            args = (
                input_ids, torch.tensor(inputs.positions, dtype=torch.long).to(dev, non_blocking=True),
                self.kv_caches, meta, self.backend, rows,
            )
            out = self.model.final_hidden(*args) if hidden else self.model(*args)
        if not hidden:
            return ForwardOutput(out)
        h, residual = out
        n = len(inputs.logits_rows)
        logits = self.model.compute_logits(h[:n], residual[:n], None, self.backend.dense)
        return ForwardOutput(logits, self._prompt_tensors(h[n:], residual[n:], inputs))

    def _sample(
        self, plan: SchedulerOutput, sample_index: list[int], logits: torch.Tensor,
        draft_spans: tuple[tuple[int, int], ...] = (),
    ) -> dict[str, int]:
        """Samples one token per row of ``logits`` for ``plan.scheduled[sample_index[row]]``
        (its first ``len(sample_index)`` rows; the rows after drafts follow:
        :meth:`_sample_drafts`)."""
        if not sample_index:
            return {}
        requests = [plan.scheduled[i].request for i in sample_index]
        tokens = self.sampler.sample(
            logits[: len(sample_index)] if draft_spans else logits,
            [r.request_id for r in requests],
            [r.params for r in requests],
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.draw_index for r in requests],
        )
        if draft_spans:
            # NOTE: after the sampled rows: a stateful processor (a grammar) then sees each
            # request's output grow, its own row's and then each draft's
            self._sample_drafts(plan, draft_spans, logits[len(sample_index):])
        # NOTE: a row whose sampling failed is left out; the engine fails its request alone.
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True) if t != FAILED}

    def _sample_drafts(self, plan: SchedulerOutput, spans: tuple[tuple[int, int], ...], logits: torch.Tensor) -> None:
        """Samples the rows after each draft as the decodes of their positions would: the
        request's parameters, its output with the drafts before the row, the draw index of the
        output token the row samples (:mod:`asymcache_core.speculative`). Kept for
        :meth:`take_draft_samples`."""
        ids: list[str] = []
        params: list[SamplingParams] = []
        outputs: list[list[int]] = []
        prompts: list[list[int]] = []
        draws: list[int] = []
        for seq, count in spans:
            request = plan.scheduled[seq].request
            row_params = request.params
            if row_params.logprobs is not None:
                # NOTE: the rows' log probabilities are taken below, by row: the sampler keys
                # its own by request, which the rows share
                row_params = dataclasses.replace(row_params, logprobs=None)
            for i in range(count):
                ids.append(request.request_id)
                params.append(row_params)
                outputs.append([*request.output_token_ids, *request.draft_token_ids[: i + 1]])
                prompts.append(request.prompt_token_ids)
                draws.append(request.draw_index + 1 + i)
        failures = dict(self.sampler.failures)
        tokens = self.sampler.sample(logits, ids, params, outputs, prompts, draws)
        # NOTE: a draft row that failed leaves its request without samples after its drafts:
        # the scheduler keeps the first token alone (its own row decides whether it fails)
        self.sampler.failures = failures
        asks = [plan.scheduled[seq].request.params.logprobs for seq, count in spans for _ in range(count)]
        want = [i for i, n in enumerate(asks) if n is not None and tokens[i] != FAILED]
        entries = dict(zip(want, token_logprobs(logits[want], [tokens[i] for i in want],
                                                [asks[i] or 0 for i in want]), strict=True)) if want else {}
        row = 0
        for seq, count in spans:
            got = tokens[row : row + count]
            if FAILED not in got:
                rid = plan.scheduled[seq].request.request_id
                self.draft_samples[rid] = got
                if row in entries:
                    self.draft_logprobs[rid] = [entries[row + j] for j in range(count)]
            row += count

    def take_draft_samples(self) -> dict[str, list[int]]:
        """The tokens sampled after each sequence's drafts since the last call."""
        taken, self.draft_samples = self.draft_samples, {}
        return taken

    def take_draft_logprobs(self) -> dict[str, list[TokenLogprob]]:
        """The log probabilities of those tokens, for requests that ask for them."""
        taken, self.draft_logprobs = self.draft_logprobs, {}
        return taken

    def take_failures(self) -> dict[str, str]:
        """Requests whose sampling failed since the last call: id -> error text."""
        return self.sampler.take_failures()

    def take_logprobs(self) -> dict[str, TokenLogprob]:
        """The log probabilities sampled since the last call: request id -> its token's entry."""
        return self.sampler.take_logprobs()

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, list[TokenLogprob]]]]:
        """The prompt log probabilities computed since the last call: request id ->
        ``(first position, entries)`` of each run (entry ``k`` is the log probability of prompt
        token ``first position + k + 1``)."""
        out, self.prompt_logprobs = self.prompt_logprobs, {}
        return out
