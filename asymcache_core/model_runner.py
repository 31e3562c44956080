"""Model runner: turns a scheduler plan into one packed forward pass and sampled tokens."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from asymcache_core.batched_penalties import in_flight_tokens
from asymcache_core.batched_penalties import rewrites as penalties_rewrite
from asymcache_core.block_tables import BlockTableRows
from asymcache_core.cuda_graphs import DecodeBatch, DecodeGraphs
from asymcache_core.host_tier import KVTransfers
from asymcache_core.kv_transfer import HostKVCache
from asymcache_core.loaders import LoadedModel
from asymcache_core.logprobs import (
    LogprobTensors,
    PendingPromptLogprobs,
    TokenLogprob,
    logprob_tensors,
    sliced_logprob_tensors,
    to_entries,
)
from asymcache_core.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from asymcache_core.sampler import FAILED, Sampler
from asymcache_core.scheduler import SchedulerOutput
from asymcache_core.token_masks import keep_words, masks_only
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


class PendingLogprobs(NamedTuple):
    """Log probabilities of a launched step's device-sampled rows, on their way to the host.

    Attributes:
        rows: the rows (indices into the step's ``tokens``) that ask for them.
        num_top: alternatives each of those rows reports.
        tensors: their :class:`~asymcache_core.logprobs.LogprobTensors` (host copies in flight
            on CUDA; read after the step's ``ready`` event).
    """

    rows: list[int]
    num_top: list[int]
    tensors: LogprobTensors


class LaunchedStep(NamedTuple):
    """A step whose forward pass (and, where it can, its sampling) is queued on the device.

    Attributes:
        plan: what it runs.
        sample_index: index into ``plan.scheduled`` of each sampling row.
        rows: request id -> its row in ``tokens`` / ``logits``.
        tokens: ``[R]`` int64 on the device, the sampled tokens, when every row samples there
            (greedy or at random without processors or penalties: the next step's pending
            inputs are copied from it); ``None``: the rows sample on the host from ``logits``
            when collected.
        host_tokens: ``tokens`` copied to the host without blocking (pinned on CUDA).
        ready: recorded after that copy, or after the forward pass when the rows sample on the
            host (``None`` off CUDA); with timing.
        logits: ``[R, vocab]`` float32 for host sampling (``None`` with ``tokens``). It may be
            a view of a CUDA graph's output: collect before the next launch.
        started: recorded, with timing, when the launch began (``None`` off CUDA): with
            ``ready`` it places the step on the device's timeline
            (:class:`~asymcache_core.step_timeline.DeviceTimeline`).
        logprobs: the log probabilities of device-sampled rows that ask for them, copied to
            the host with ``host_tokens`` (``None``: no row asks).
        prompt_logprobs: the step's prompt log probabilities (``None``: no prompt row).
        failed: ``[R]`` bool, the random rows without a finite logit, copied to the host with
            ``host_tokens`` (``None``: every row is greedy).
        awaiting_masks: its rows' processors only mask (:func:`~asymcache_core.token_masks.masks_only`):
            the forward pass is queued, and the rows sample on the device once the step
            before is collected (:meth:`ModelRunner.sample_masked`), their masks built from
            its tokens meanwhile; ``logits`` holds them until then.
        mask_failed: requests whose processor raised building their mask: their tokens are
            left out when collected (the engine fails them alone).
    """

    plan: SchedulerOutput
    sample_index: list[int]
    rows: dict[str, int]
    tokens: torch.Tensor | None
    host_tokens: torch.Tensor | None
    ready: torch.cuda.Event | None
    logits: torch.Tensor | None
    started: torch.cuda.Event | None = None
    logprobs: PendingLogprobs | None = None
    prompt_logprobs: PendingPromptLogprobs | None = None
    failed: torch.Tensor | None = None
    awaiting_masks: bool = False
    mask_failed: frozenset[str] = frozenset()

    @property
    def device_sampled(self) -> bool:
        """Its tokens exist on the device before it is collected."""
        return self.tokens is not None or not self.sample_index


def _timing_event(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded now on ``device``'s current stream (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


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
    for seq, item in enumerate(plan.scheduled):
        request = item.request
        table = request.block_ids
        tokens = request.all_token_ids
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
            if end > len(tokens):
                # NOTE: only a request's last position can be in flight: a step computes the
                # token its previous step sampled, never two ahead.
                assert end == len(tokens) + 1 and start <= len(tokens), "two tokens ahead of the context"
                pending.append((len(input_ids), request.request_id))
                input_ids.append(0)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        tables.append(table)
        if item.sample:
            logits_rows.append(len(input_ids) - 1)
            sample_index.append(seq)
    array = None
    if rows is not None and tables:
        array = rows.build([item.request for item in plan.scheduled], table_width(tables))
    return StepInputs(
        input_ids, positions, slots, segments, tables, logits_rows, sample_index, plan.is_decode_only, array,
        tuple(pending), tuple(prompt_rows), tuple(prompt_spans), tuple(prompt_targets), tuple(prompt_num_top),
    )


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
        #: rows whose processors only mask sample in async scheduling's pipeline, their masks
        #: built while the step runs (:meth:`sample_masked`); ``False`` (an ablation) waits for
        #: the step before and samples them on :meth:`collect`, as rows with other processors
        self.masks_in_flight = True
        #: each scheduled request's block table between steps (:mod:`asymcache_core.block_tables`)
        self.block_table_rows = BlockTableRows()
        #: request id -> ``(first position, entries)`` of the prompt log probabilities computed
        #: since :meth:`take_prompt_logprobs` was last called
        self.prompt_logprobs: dict[str, list[tuple[int, list[TokenLogprob]]]] = {}
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

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Runs the step; returns the sampled token of every request that reached its end."""
        inputs = pack_step(plan, self.block_size, self.block_table_rows)
        if inputs.pending_inputs:
            raise ValueError("execute: the plan has tokens still in flight; use launch()")
        return self.finish_forward(plan, inputs, self.forward(inputs))

    def finish_forward(self, plan: SchedulerOutput, inputs: StepInputs, out: ForwardOutput) -> dict[str, int]:
        """Records the prompt log probabilities of a synchronous step and samples its rows
        (:meth:`execute`'s end, shared with the tensor-parallel runner)."""
        prompt = self._pending_prompt_logprobs(plan, inputs, out)
        if prompt is not None:
            self._record_prompt_logprobs(prompt)
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
    def launch(self, plan: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queues the step on the device without waiting for it (async scheduling).

        Args:
            plan: the step; its inputs still in flight are sampled by ``previous``.
            previous: the step launched before it, not collected yet (``None``: none).

        Returns:
            The launched step, for :meth:`collect`. Its rows sample on the device at once when
            none has a logits processor; when every processor only masks, they wait for
            :meth:`sample_masked` (``awaiting_masks``), called once ``previous`` is collected;
            otherwise the logits are kept for the host.
        """
        started = _timing_event(self.device)
        inputs = pack_step(plan, self.block_size, self.block_table_rows)
        fill = None
        if inputs.pending_inputs:
            if previous is None or previous.tokens is None:
                raise ValueError("launch: inputs in flight need the previous step's tokens on the device")
            dst = torch.tensor([i for i, _ in inputs.pending_inputs], dtype=torch.long).to(self.device, non_blocking=True)
            src = torch.tensor([previous.rows[rid] for _, rid in inputs.pending_inputs], dtype=torch.long)
            fill = (dst, previous.tokens[src.to(self.device, non_blocking=True)])
        out = self.forward(inputs, fill)
        prompt = self._pending_prompt_logprobs(plan, inputs, out)
        logits = out.logits
        requests = [plan.scheduled[i].request for i in inputs.sample_index]
        rows = {r.request_id: row for row, r in enumerate(requests)}
        if requests and all(self.sampler.on_device(r.params) for r in requests):
            return self._sample_launched(
                plan, inputs.sample_index, rows, logits, started, prompt, previous.tokens if previous else None,
                previous.rows if previous else None,
            )
        masked = self.masks_in_flight and bool(requests) and all(
            self.sampler.on_device(r.params) or masks_only(r.params.logits_processors) for r in requests
        )
        # NOTE: rows sampled on the host record ``ready`` after the forward pass; masked rows
        # record it once they are sampled (sample_masked)
        ready = None if masked else _timing_event(self.device)
        return LaunchedStep(
            plan, inputs.sample_index, rows, None, None, ready, logits if requests else None,
            started, prompt_logprobs=prompt, awaiting_masks=masked,
        )

    @torch.inference_mode()
    def sample_masked(self, step: LaunchedStep) -> LaunchedStep:
        """Queues the sampling of a launched step whose rows wait for their masks
        (``awaiting_masks``), once the step before it is collected: each row's processors see
        every token before the one it samples. Returns the step as :meth:`launch` returns one
        that samples on the device.

        NOTE: the masks are built while the step's forward pass runs on the device, so that a
        grammar costs its host time beside the step instead of between steps (vLLM's
        structured outputs overlap their bitmasks the same way). A row whose request has ended
        since its launch (its token will be dropped) is not masked.
        """
        assert step.awaiting_masks and step.logits is not None
        requests = [step.plan.scheduled[i].request for i in step.sample_index]
        vocab = step.logits.shape[-1]
        masked: list[int] = []
        words: list[np.ndarray] = []
        failed: set[str] = set()
        for row, request in enumerate(requests):
            processors = request.params.logits_processors
            if not processors or request.finished:
                continue
            try:
                mask = keep_words(processors, request.output_token_ids, vocab)
            except Exception as exc:  # noqa: BLE001 - the row's request fails, not the batch
                self.sampler.record_failure(request.request_id, exc)
                failed.add(request.request_id)
                continue
            if mask is not None:
                masked.append(row)
                words.append(mask)
        keep = (masked, np.stack(words)) if masked else None
        sampled = self._sample_launched(
            step.plan, step.sample_index, step.rows, step.logits, step.started, step.prompt_logprobs, keep=keep
        )
        return sampled._replace(mask_failed=frozenset(failed))

    def _sample_launched(
        self,
        plan: SchedulerOutput,
        sample_index: list[int],
        rows: dict[str, int],
        logits: torch.Tensor,
        started: torch.cuda.Event | None,
        prompt: PendingPromptLogprobs | None,
        previous_tokens: torch.Tensor | None = None,
        previous_rows: dict[str, int] | None = None,
        keep: tuple[list[int], np.ndarray] | None = None,
    ) -> LaunchedStep:
        """Queues the sampling of a launched step's rows on the device, their tokens' copy to
        the host and their log probabilities.

        Args:
            previous_tokens / previous_rows: the step in flight before it (its tokens, not on
                the host yet, count for the penalties), or ``None``.
            keep: rows masked by their processors and their packed masks.
        """
        requests = [plan.scheduled[i].request for i in sample_index]
        penalized = any(penalties_rewrite(r.params) for r in requests)
        drawn = self.sampler.sample_on_device(
            logits, list(rows), [r.params for r in requests], [r.draw_index for r in requests],
            [r.output_token_ids for r in requests] if penalized else None,
            [r.prompt_token_ids for r in requests] if penalized else None,
            in_flight_tokens(requests, previous_tokens, previous_rows)
            if penalized and previous_tokens is not None and previous_rows is not None else None,
            keep=keep,
        )
        tokens, failed = drawn
        want = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        pending = None
        if want:
            num_top = [requests[row].params.logprobs or 0 for row in want]
            index = torch.tensor(want, dtype=torch.long).to(self.device, non_blocking=True)
            tensors = logprob_tensors(logits[index], tokens[index], max(num_top))
            # NOTE: queued behind the step like its tokens; collect() reads them after ``ready``
            pending = PendingLogprobs(want, num_top, tensors.to(torch.device("cpu"), pin=self.device.type == "cuda"))
        if self.device.type != "cuda":
            return LaunchedStep(plan, sample_index, rows, tokens, tokens, None, None, None, pending, prompt, failed)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        host_failed = None
        if failed is not None:
            host_failed = torch.empty(failed.shape, dtype=failed.dtype, pin_memory=True)
            host_failed.copy_(failed, non_blocking=True)
        return LaunchedStep(
            plan, sample_index, rows, tokens, host, _timing_event(self.device), None, started, pending, prompt,
            host_failed,
        )

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> dict[str, int]:
        """Waits for a launched step; returns its sampled tokens (as :meth:`execute`)."""
        if step.ready is not None:
            # NOTE: every step is waited for, one that samples nothing (a prompt's middle
            # chunk) too: its end event places it on the device's timeline
            step.ready.synchronize()
        if step.prompt_logprobs is not None:
            self._record_prompt_logprobs(step.prompt_logprobs)
        if step.logits is not None:
            return self._sample(step.plan, step.sample_index, step.logits)
        if step.host_tokens is None:
            return {}
        tokens = step.host_tokens.tolist()
        if step.logprobs is not None:
            ids = list(step.rows)
            rows = step.logprobs.rows
            entries = to_entries(step.logprobs.tensors, [tokens[row] for row in rows], step.logprobs.num_top)
            self.sampler.logprobs.update((ids[row], entry) for row, entry in zip(rows, entries, strict=True))
        if step.failed is not None:
            # NOTE: a failed row's token is left out; the engine fails its request alone
            drawn = self.sampler.take_drawn(tokens, step.failed.tolist(), list(step.rows))
        else:
            drawn = dict(zip(step.rows, tokens, strict=True))
        for request_id in step.mask_failed:
            drawn.pop(request_id, None)
        return drawn

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
            [r.draw_index for r in requests],
        )
        # NOTE: a row whose sampling failed is left out; the engine fails its request alone.
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True) if t != FAILED}

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
