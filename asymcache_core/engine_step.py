"""The phases of one engine step that :meth:`Engine._step <asymcache_core.engine.Engine._step>`
and :class:`~asymcache_core.async_steps.AsyncSteps` sequence: plan it, execute it (a fault fails
only its culprits), and complete it (failed requests ended, tokens appended, outputs, the
scheduler's finish hook, the step log). A mixin of :class:`~asymcache_core.engine.Engine`.

NOTE: separate from ``engine.py``, which keeps the engine's construction, its request calls and
the loop that orders these phases (synchronous or launched ahead: ``async_steps.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asymcache_core.engine_outputs import (
    attach_logprobs,
    attach_prompt_logprobs,
    detokenize_step,
    request_output,
)
from asymcache_core.engine_stats import EngineCounters, StepStats
from asymcache_core.errors import EngineDeadError
from asymcache_core.request import Request, RequestOutput, RequestStatus
from asymcache_core.scheduler_output import RequestUpdate, SchedulerOutput
from asymcache_core.step_faults import StepResult, execute_isolating_faults

if TYPE_CHECKING:
    from asymcache_core.block_pool import BlockPool
    from asymcache_core.continuum.backends import PinManager
    from asymcache_core.continuum.controller import ContinuumController
    from asymcache_core.host_tier import HostTier
    from asymcache_core.host_tier_driver import HostTierDriver
    from asymcache_core.job_stats import JobStats
    from asymcache_core.kv_cache_manager import KVCacheManager
    from asymcache_core.latency_model import LatencyFeedback, LatencyModel
    from asymcache_core.scheduler import Scheduler
    from asymcache_core.serving_stats import ServingStats


class StepPhases:
    """Plan, execute and complete of one step (a mixin: ``self`` is the engine).

    Invariant: a request leaves :attr:`requests` only through :meth:`_on_finish`, which the
    scheduler calls before it frees the request's blocks.
    """

    pins: PinManager
    host_driver: HostTierDriver | None
    host_tier: HostTier | None
    step_log: deque[StepStats]
    scheduler: Scheduler
    runner: Any
    kv: KVCacheManager
    pool: BlockPool
    block_size: int
    dead: EngineDeadError | None
    requests: dict[str, Request]
    counters: EngineCounters
    serving_stats: ServingStats
    tokenizer: Any
    job_stats: JobStats
    continuum: ContinuumController
    latency: LatencyModel
    latency_feedback: LatencyFeedback
    _last_end: float
    _logged_recomputed: int
    _sweep_jobs: Callable[[float], None]
    _remember_conversation: Callable[[Request], None]

    def _plan(self, start: float) -> SchedulerOutput:
        """Expires pins, prefetches from the host tier, plans the step and issues its copies."""
        self.pins.expire(start)
        self._sweep_jobs(start)
        if self.host_driver is not None:
            self.host_driver.prefetch(start, self.step_log[-1].duration_s if self.step_log else 0.0)
        plan = self.scheduler.schedule()
        if plan.transfers is not None and self.host_driver is not None:
            self.host_driver.transfer(plan.transfers)
        return plan

    def _complete(self, result: StepResult, end: float) -> list[RequestOutput]:
        """Ends a step that ran: fails its faulted requests, appends its tokens, and returns
        its outputs."""
        ran, sampled, faults = result
        outputs = []
        for request, error in faults:
            self._fail_request(request, error, end)
            outputs.append(request_output(request, []))
        take_failures = getattr(self.runner, "take_failures", None)
        for rid, error in (take_failures() if take_failures is not None else {}).items():
            request = self.requests.get(rid)
            if request is not None:
                self._fail_request(request, error, end)
                outputs.append(request_output(request, []))
        take_prompt_logprobs = getattr(self.runner, "take_prompt_logprobs", None)
        if take_prompt_logprobs is not None:
            # NOTE: before the updates: a request they finish leaves ``self.requests``
            attach_prompt_logprobs(self.requests, take_prompt_logprobs())
        take_draft_samples = getattr(self.runner, "take_draft_samples", None)
        drafts = take_draft_samples() if take_draft_samples is not None else None
        updates = self.scheduler.update_from_output(ran, sampled, end, drafts)
        take_logprobs = getattr(self.runner, "take_logprobs", None)
        take_draft_logprobs = getattr(self.runner, "take_draft_logprobs", None)
        attach_logprobs(updates, take_logprobs() if take_logprobs is not None else {},
                        take_draft_logprobs() if take_draft_logprobs is not None else None)
        self._last_end = end
        return outputs + [self._process_output(update, end) for update in updates]

    def _execute(self, plan: SchedulerOutput) -> StepResult:
        """Runs the step; a fault of the forward pass fails only the requests that cause it
        (:func:`~asymcache_core.step_faults.execute_isolating_faults`). A dead engine (a
        tensor-parallel rank gone) is recorded, and every later step raises."""
        try:
            return execute_isolating_faults(
                plan, self.runner, self.kv, self.pool, self.scheduler, self.block_size
            )
        except EngineDeadError as exc:
            self.dead = exc  # no request is the culprit: the engine is gone
            raise

    def _fail_request(self, request: Request, error: str, now: float) -> None:
        """Ends one request that failed on its own (its blocks are freed; the batch goes on)."""
        request.error = error
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED, now)

    def _process_output(self, update: RequestUpdate, now: float) -> RequestOutput:
        """Turns one scheduler update into the request's output: text, stop strings."""
        request = update.request
        new_ids = update.new_token_ids
        if self.tokenizer is not None:
            # NOTE: a request the scheduler finished was counted under its reason then; its
            # last token's text may settle another (a stop string, a detokenizer failure)
            counted = self.serving_stats.finish_reason(request) if request.finished else None
            try:
                dropped = detokenize_step(self.tokenizer, request, self.scheduler, now, len(new_ids))
                # NOTE: a run of kept drafts past a stop string ends on the stop's token
                new_ids = new_ids[: len(new_ids) - dropped]
            except Exception as exc:  # noqa: BLE001 - the request fails, not the step
                self._fail_request(
                    request, f"detokenizing failed: {type(exc).__name__}: {exc}", now
                )
            if counted is not None:
                self.serving_stats.on_reason_settled(request, counted)
        self.counters.generated_tokens += len(new_ids)
        return request_output(request, new_ids)

    def _on_finish(self, request: Request, now: float) -> None:
        """The scheduler's finish hook: runs before the request's blocks are freed."""
        self._remember_conversation(request)
        if request.job_id is not None:
            blocks = self.pool.blocks
            held = [
                (b, h)
                for b in self.kv.held_blocks(request)
                if (h := blocks[b].block_hash) is not None
            ]
            self.pins.remember(request.job_id, held)  # type: ignore[arg-type]
            self.job_stats.on_finish(request.job_id, now, request.is_last_step, request.num_tokens)
            if request.is_last_step:
                self.pins.forget(request.job_id)
        runner_sampler = getattr(self.runner, "sampler", None)
        if runner_sampler is not None:
            runner_sampler.forget(request.request_id)
        self.counters.add_finished(request.metrics)
        self.serving_stats.on_finish(request)
        self.continuum.on_request_finished(request)
        del self.requests[request.request_id]

    def _log_step(self, plan: SchedulerOutput, start: float, end: float, schedule_s: float) -> None:
        """Records the step that ran ``plan`` and feeds its duration to the latency feedback."""
        predicted = self.latency.step_latency(
            plan.num_tokens, plan.attn_pairs, plan.is_decode_only, plan.decode_kv_tokens
        )
        self.latency_feedback.observe(predicted, end - start, plan.is_decode_only)
        recomputed = 0
        if self.host_tier is not None:
            recomputed = self.host_tier.counters.recompute_chosen - self._logged_recomputed
            self._logged_recomputed = self.host_tier.counters.recompute_chosen
        self.serving_stats.on_step(plan.num_tokens)
        self.step_log.append(
            StepStats.of_plan(
                plan, start, end, schedule_s, predicted, self.pool.num_in_use, recomputed
            )
        )
