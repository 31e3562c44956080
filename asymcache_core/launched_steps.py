"""The model runner's half of async scheduling: launch a step on the device, then collect it.

:class:`LaunchPath` is mixed into :class:`~asymcache_core.model_runner.ModelRunner`:
:meth:`LaunchPath.launch` queues a step's forward pass (and, where its rows can, their sampling)
without waiting, reading the inputs still in flight from the step before on the device;
:meth:`LaunchPath.sample_masked` queues the sampling of rows whose processors only mask, once
the step before is collected; :meth:`LaunchPath.collect` waits for a step and returns its
tokens. Its methods use the runner's device, sampler, packing and forward pass (``pack``,
``forward``, ``_pending_prompt_logprobs``, ``_record_prompt_logprobs``, ``_sample``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from asymcache_core.batched_penalties import in_flight_tokens
from asymcache_core.batched_penalties import rewrites as penalties_rewrite
from asymcache_core.logprobs import (
    LogprobTensors,
    PendingPromptLogprobs,
    logprob_tensors,
    to_entries,
)
from asymcache_core.scheduler import SchedulerOutput
from asymcache_core.token_masks import masks_only, stacked_keep

if TYPE_CHECKING:
    from asymcache_core.sampler import Sampler


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


def timing_event(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded now on ``device``'s current stream (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class LaunchPath:
    """Launch, masked sampling and collection of async steps (a mixin of the model runner).

    Invariant: a launched step's tokens exist on the device (``tokens``) before the next step
    is launched, unless its rows sample on the host (then the engine collects it first).
    """

    device: torch.device
    sampler: Sampler
    #: rows whose processors only mask sample in async scheduling's pipeline, their masks
    #: built while the step runs (:meth:`sample_masked`); ``False`` (an ablation) waits for
    #: the step before and samples them on :meth:`collect`, as rows with other processors
    masks_in_flight: bool = True

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
        started = timing_event(self.device)
        inputs = self.pack(plan)
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
            return self._sample_launched(plan, inputs.sample_index, rows, logits, started, prompt, previous)
        masked = self.masks_in_flight and bool(requests) and all(
            self.sampler.on_device(r.params) or masks_only(r.params.logits_processors) for r in requests
        )
        # NOTE: rows sampled on the host record ``ready`` after the forward pass; masked rows
        # record it once they are sampled (sample_masked)
        ready = None if masked else timing_event(self.device)
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
        ids = list(step.rows)
        masks, failed = self.sampler.row_masks(
            step.logits.shape[-1], ids, [r.params for r in requests], [r.output_token_ids for r in requests],
            [r.finished for r in requests],
        )
        sampled = self._sample_launched(
            step.plan, step.sample_index, step.rows, step.logits, step.started, step.prompt_logprobs,
            keep=stacked_keep(masks, range(len(requests))),
        )
        return sampled._replace(mask_failed=frozenset(ids[i] for i in failed))

    def _sample_launched(
        self,
        plan: SchedulerOutput,
        sample_index: list[int],
        rows: dict[str, int],
        logits: torch.Tensor,
        started: torch.cuda.Event | None,
        prompt: PendingPromptLogprobs | None,
        previous: LaunchedStep | None = None,
        keep: tuple[list[int], np.ndarray] | None = None,
    ) -> LaunchedStep:
        """Queues the sampling of a launched step's rows on the device, their tokens' copy to
        the host and their log probabilities.

        Args:
            previous: the step in flight before it (its tokens, not on the host yet, count for
                the penalties), or ``None``.
            keep: rows masked by their processors and their packed masks.
        """
        requests = [plan.scheduled[i].request for i in sample_index]
        penalized = any(penalties_rewrite(r.params) for r in requests)
        drawn = self.sampler.sample_on_device(
            logits, list(rows), [r.params for r in requests], [r.draw_index for r in requests],
            [r.output_token_ids for r in requests] if penalized else None,
            [r.prompt_token_ids for r in requests] if penalized else None,
            in_flight_tokens(requests, previous.tokens, previous.rows) if penalized and previous is not None else None,
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
            plan, sample_index, rows, tokens, host, timing_event(self.device), None, started, pending, prompt,
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
