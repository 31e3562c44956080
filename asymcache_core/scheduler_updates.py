"""What the scheduler does after a step ran (a mixin of :class:`~asymcache_core.scheduler.Scheduler`):
append each request's sampled tokens (the run its drafts confirm, the tokens a grammar forces
after them), apply the token-level stop conditions (EOS, stop token ids, ``max_tokens``,
``max_model_len``) and free the requests that finished.

NOTE: separate from ``scheduler.py``, which plans the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asymcache_core.jump_forward import forced_tokens
from asymcache_core.request import Request, RequestStatus
from asymcache_core.scheduler_output import RequestUpdate, SchedulerOutput
from asymcache_core.speculative import NgramProposer, SpeculationStats, verified_run
from asymcache_core.stop_conditions import check_stop

if TYPE_CHECKING:
    from asymcache_core.job_admission import JobAdmission
    from asymcache_core.kv_cache_manager import KVCacheManager


class StepUpdates:
    """The step's outcome applied to the requests (a mixin: ``self`` is the scheduler)."""

    kv: KVCacheManager
    eos_token_ids: frozenset[int]
    max_model_len: int | None
    jump_forward: bool
    num_jump_forward_tokens: int
    proposer: NgramProposer | None
    speculation: SpeculationStats
    job_admission: JobAdmission | None
    running: list[Request]
    on_finish: Callable[[Request, float], None] | None
    _remove: Callable[[Request], None]

    def update_from_output(
        self, plan: SchedulerOutput, sampled: dict[str, int], now: float,
        draft_samples: dict[str, list[int]] | None = None,
    ) -> list[RequestUpdate]:
        """Appends the step's sampled tokens, stops the requests they end and frees those.

        Args:
            plan: the step's plan, as :meth:`schedule` returned it.
            sampled: ``request_id -> token`` for every planned request that samples.
            now: engine time at the end of the step (token and finish times).
            draft_samples: ``request_id -> tokens`` its rows sampled after each of its drafts
                (speculative decoding): the drafts they confirm are appended too.

        Returns:
            One update per sampled request, in batch order.
        """
        updates: list[RequestUpdate] = []
        for item in plan.scheduled:
            if not item.sample:
                continue
            request = item.request
            if request.skip_samples:
                # NOTE: a jump-forward already appended the token at the position this step
                # sampled (and took this step's pending token off then)
                request.skip_samples -= 1
                continue
            if request.num_pending:
                request.num_pending -= 1
            if request.finished:
                # NOTE: failed alone during the step (the engine finished it with its error),
                # or, with async scheduling, ended by the step before (its token is dropped)
                continue
            token = sampled[request.request_id]
            speculated = bool(request.draft_token_ids)
            run = [token]
            if speculated:
                run = verified_run(request, token, (draft_samples or {}).get(request.request_id), self.speculation)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            tokens: list[int] = []
            status = self._append(request, run, tokens, now)
            if speculated:
                # NOTE: the KV of the drafts the run did not keep (or that a stop cut) is dropped
                request.num_computed_tokens = request.num_tokens - 1
                self.kv.drop_tail(request)
            if status is None and self.jump_forward and (forced_run := forced_tokens(request, self.max_model_len)):
                if request.num_pending:
                    # NOTE: the step in flight (async scheduling) samples the position the
                    # first forced token takes: its token is dropped, and is no longer pending
                    request.num_pending -= 1
                    request.skip_samples += 1
                before = len(tokens)
                status = self._append(request, forced_run, tokens, now)
                self.num_jump_forward_tokens += len(tokens) - before
            stop_reason = tokens[-1] if status is RequestStatus.FINISHED_STOPPED else None
            if status is not None:
                self.finish_request(request, status, now, stop_reason)
            elif self.proposer is not None and not request.num_pending:
                self.proposer.draft(request, self.max_model_len, len(plan.scheduled))
            updates.append(RequestUpdate(request, tokens, status, stop_reason))
        return updates

    def _append(self, request: Request, run: list[int], tokens: list[int], now: float) -> RequestStatus | None:
        """Appends ``run`` to ``request``'s output (and to ``tokens``) up to the first token
        that ends it; returns the status that token ends it with (``None``: none does)."""
        for token in run:
            request.append_output(token)
            request.metrics.token_times.append(now)
            tokens.append(token)
            status = check_stop(request, token, self.eos_token_ids, self.max_model_len)
            if status is not None:
                return status
        return None

    def finish_request(
        self, request: Request, status: RequestStatus, now: float, stop_reason: int | str | None = None
    ) -> None:
        """Ends ``request`` with ``status`` (a finished one) at ``now`` and frees its blocks.

        A request that has already finished keeps its blocks freed and only takes the new
        status and stop reason (a stop string found in the text of its last token).

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not status.finished:
            raise ValueError(f"status: {status.value!r} is not a finished status")
        already = request.finished
        request.status = status
        request.stop_reason = stop_reason
        if already:
            return
        request.metrics.finish_time = now
        if self.job_admission is not None and request in self.running:
            self.job_admission.on_released(request, now)
        if self.on_finish is not None:
            self.on_finish(request, now)
        self._remove(request)


__all__ = ["StepUpdates"]
