"""Phase-less scheduler (vLLM V1 style) with hole-aware segments.

There are no prefill or decode phases: every request catches its computed tokens up to its
total. Each step has a token budget; running requests go first (decodes cost one token each),
then waiting requests are admitted in priority order. A request's scheduled tokens form one or
more *segments*: runs of positions between cache hits (holes), then its new suffix. When blocks
run out, the lowest-priority running request is preempted by recompute.

The order is by arrival (vLLM's), or, with ``least_work_first``, by the tokens each request
still has to compute once its cache hits are counted (shortest remaining prefill first). With a
``least_work_patience`` P, admission is by ``arrival + P x (estimated seconds of the request's
own work)`` instead: a long prefill lets later, smaller requests go first only for P times its
own prefill time, so a stream of short turns cannot starve it.

After the step ran, :meth:`Scheduler.update_from_output` appends the sampled tokens, applies
the token-level stop conditions (EOS, stop token ids, ``max_tokens``, ``max_model_len``) and
frees the requests that finished; it returns one :class:`RequestUpdate` per sampled request.
Stop strings need text, so the engine checks them while it detokenizes and ends such a request
with :meth:`Scheduler.finish_request` (as vLLM's output processor does).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Collection

from asymcache_core.job_admission import JobAdmission
from asymcache_core.kv_cache_manager import CacheHit, KVCacheManager
from asymcache_core.request import HOLE, Request, RequestStatus
from asymcache_core.scheduler_output import ScheduledRequest, SchedulerOutput
from asymcache_core.scheduler_updates import StepUpdates
from asymcache_core.speculative import (
    NgramProposer,
    SpeculationStats,
    SpeculativeConfig,
)
from asymcache_core.stop_conditions import ends_on_length
from asymcache_core.waiting_hits import WaitingHits

PriorityKey = Callable[[Request], tuple]
BudgetFn = Callable[[list[Request], list[Request]], int]
AdmitHook = Callable[[Request], None]
FinishHook = Callable[[Request, float], None]


def fcfs_key(request: Request) -> tuple:
    """vLLM's default: by arrival."""
    return (request.priority, request.metrics.arrival_time)



class Scheduler(StepUpdates):
    """Plans steps over the waiting and running queues.

    Args:
        kv: the cache manager.
        block_size: tokens per block.
        max_num_seqs: running requests at most.
        budget_fn: token budget of the next step given the running requests.
        priority_key: admission/preemption order (smaller first).
        admission_key: another order for the waiting queue only (``None``: ``priority_key``):
            running requests then keep ``priority_key``'s order for the budget and the choice of
            victims.
        reclaim: frees pinned blocks under memory pressure (returns False when it cannot);
            tried before any preemption and before an admission gives up.
        on_admit: called when a waiting request is admitted (after its cache hits are held,
            before its fresh blocks are taken).
        on_finish: called with ``(request, now)`` when a request finishes, before its blocks
            are freed (they are still in its table).
        eos_token_ids: tokens that stop a request unless its params ignore EOS.
        max_model_len: a request whose context reaches it stops (``length``).
        clock: the engine's clock; a request's ``first_scheduled_time`` is the time at the start
            of the first :meth:`schedule` that plans any of its tokens.
        align_chunks: end budget-cut chunks on block boundaries (adaptive chunking), so a
            chunk never leaves a half-computed block for the next step.
        admit_full_prompt: while other requests run, admit a waiting one only when the blocks
            its whole prompt lacks fit (see ``EngineConfig.admit_full_prompt``).
        least_work_first: order requests by :meth:`remaining_work` (after their explicit
            ``priority``, before ``priority_key``): decodes first, then the prefills with the
            fewest tokens left to compute (see ``EngineConfig.least_work_first``).
        least_work_patience: with ``least_work_first``, admit waiting requests by
            ``arrival + least_work_patience * work_seconds(work, num_tokens)`` (their
            explicit ``priority`` first); ``None``: by work alone. Running requests keep the
            work order, so decodes still come first in every step.
        work_seconds: estimated seconds of ``work`` tokens ending at position ``num_tokens``
            (:meth:`LatencyModel.prefill_latency`); needed with ``least_work_patience``.
        job_admission: job-level admission; a waiting request it holds back is passed over
            (later ones may go first), unlike one that lacks room, which stops admission.
        async_output: plan each step before the previous one's tokens are back (async
            scheduling): a request that samples in a step counts that token as pending
            (:attr:`Request.num_pending`), the next step plans past it, and
            :meth:`update_from_output` drops the token of a request that had already ended.
        jump_forward: after a sampled token, append at once the tokens a request's constraint
            forces (:func:`~asymcache_core.jump_forward.forced_tokens`): the next step computes
            them together, as the rest of a prompt, instead of one decode step each.
        speculative: propose n-gram drafts after each sampled token, verified by the next step
            (:mod:`asymcache_core.speculative`; synchronous steps only); None: none.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        block_size: int,
        max_num_seqs: int,
        budget_fn: BudgetFn,
        priority_key: PriorityKey = fcfs_key,
        admission_key: PriorityKey | None = None,
        reclaim: Callable[[], bool] | None = None,
        on_admit: AdmitHook | None = None,
        on_finish: FinishHook | None = None,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        align_chunks: bool = False,
        admit_full_prompt: bool = False,
        least_work_first: bool = False,
        least_work_patience: float | None = None,
        work_seconds: Callable[[int, int], float] | None = None,
        job_admission: JobAdmission | None = None,
        async_output: bool = False,
        jump_forward: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        if least_work_patience is not None and (not least_work_first or work_seconds is None):
            raise ValueError("least_work_patience: needs least_work_first and a work_seconds estimate")
        if speculative is not None and async_output:
            raise ValueError("speculative_config: not with async scheduling (a draft follows the token before it)")
        self.proposer = NgramProposer(speculative) if speculative is not None else None
        self.speculation = SpeculationStats()
        self.align_chunks = align_chunks
        self.least_work_first = least_work_first
        self.least_work_patience = least_work_patience
        self.work_seconds = work_seconds
        self.admit_full_prompt = admit_full_prompt
        self.reclaim = reclaim
        self.on_admit = on_admit
        self.on_finish = on_finish
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.kv = kv
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.budget_fn = budget_fn
        self.priority_key = priority_key
        self.admission_key = admission_key or priority_key
        self.job_admission = job_admission
        self.async_output = async_output
        self.jump_forward = jump_forward
        #: tokens appended by jump-forward, not sampled (a counter for the stats)
        self.num_jump_forward_tokens = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._order = itertools.count()
        self._seq: dict[str, int] = {}
        #: each waiting request's cache hit, kept from the pools' changes (least work only: the
        #: order's key needs it on every step that can admit)
        self.waiting_hits: WaitingHits | None = WaitingHits(kv) if least_work_first else None

    # -- queues ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._seq[request.request_id] = next(self._order)
        self.waiting.append(request)
        if self.waiting_hits is not None:
            self.waiting_hits.join(request)

    def _key(self, request: Request) -> tuple:
        if self.least_work_first:
            work = self.remaining_work(request)
            return (request.priority, work, *self.priority_key(request), self._seq[request.request_id])
        return (*self.priority_key(request), self._seq[request.request_id])

    def _admission_key(self, request: Request) -> tuple:
        """Order of the waiting queue: :meth:`_key` with ``admission_key``, or the
        patience-bounded deadline."""
        order = self.admission_key(request)
        if self.least_work_patience is None or self.work_seconds is None:
            if self.least_work_first:
                return (request.priority, self.remaining_work(request), *order, self._seq[request.request_id])
            return (*order, self._seq[request.request_id])
        # NOTE: arrival + P x own work time is a deadline that does not move while the request
        # waits (only its cache hits can change it): short work still overtakes long work that
        # arrived a little earlier, but no later arrival passes a request that has waited P
        # times its own prefill time. Pure least work starved long cold prompts for 16-22 s
        # on the GPU long-chat grid (a third of the mean TTFT came from three requests).
        work = self.remaining_work(request)
        deadline = request.metrics.arrival_time + self.least_work_patience * self.work_seconds(work, request.num_tokens)
        return (request.priority, deadline, *order, self._seq[request.request_id])

    def remaining_work(self, request: Request) -> int:
        """Tokens ``request`` still has to compute to reach its next sample, cache hits excluded.

        A running request's hits are the cached blocks past its frontier (its holes and suffix
        are the work); a waiting request's are what a lookup finds now, the hits admission would
        take (a prefix only when hole reuse is off). A decode's work is 1.

        NOTE: a waiting request's hits come from :attr:`waiting_hits`, kept from the changes of
        its own blocks on both tiers: a full lookup walks the whole context (about 0.5 ms for a
        64k-token context on a 2-core CPU), and ran for every waiting request on every step that
        could admit, the largest host cost of a step at 128 SWE agents (BENCHMARKS.md, "The
        engine's host work per step at scale"). The lookup still answers for a request the
        tracker does not keep (not in the waiting queue, or a chain with a hash collision).
        """
        if request.status is RequestStatus.RUNNING:
            bs = self.block_size
            table = request.block_ids
            start = request.num_computed_tokens
            # NOTE: only whole blocks at or past the frontier count: the block the frontier is
            # in was allocated for the positions computed so far, not found in the cache.
            hits = sum(table[i] != HOLE for i in range(-(-start // bs), len(table))) * bs
            return max(1, request.num_planned_tokens - start - hits)
        hit = None if self.waiting_hits is None else self.waiting_hits.hit_tokens(request)
        if hit is None:
            hit = self.kv.lookup(request).hit_tokens
        return max(1, request.num_tokens - hit)

    def _remove(self, request: Request) -> None:
        """Drops a request from whichever queue holds it and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self._seq.pop(request.request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        if self.waiting_hits is not None:
            self.waiting_hits.leave(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning --------------------------------------------------------------------------
    def _skip_cached(self, request: Request, pos: int) -> int:
        """Moves ``pos`` past cache hits that start at it."""
        bs = self.block_size
        table = request.block_ids
        while pos % bs == 0 and pos // bs < len(table) and table[pos // bs] != HOLE:
            pos += bs
        return pos

    def plan_segments(self, request: Request, max_tokens: int) -> list[tuple[int, int]]:
        """Up to ``max_tokens`` positions from the frontier, skipping cached blocks."""
        bs = self.block_size
        table = request.block_ids
        total = request.num_planned_tokens
        segments: list[tuple[int, int]] = []
        pos = self._skip_cached(request, request.num_computed_tokens)
        left = max_tokens
        while left > 0 and pos < total:
            next_hit = total
            for idx in range(pos // bs + 1, len(table)):
                if table[idx] != HOLE:
                    next_hit = idx * bs
                    break
            end = min(pos + left, next_hit, total)
            if self.align_chunks and end == pos + left and end < min(next_hit, total) and end % bs:
                # NOTE: the budget ends inside a block: stop at that block's start instead, so
                # the next chunk begins on a boundary (nothing, if that leaves no whole block).
                if end - end % bs > pos:
                    segments.append((pos, end - end % bs))
                break
            segments.append((pos, end))
            left -= end - pos
            pos = self._skip_cached(request, end)
        return segments

    def schedule(self) -> SchedulerOutput:
        """Plans one step."""
        now = self.clock()
        self.running.sort(key=self._key)
        budget = self.budget_fn(self.running, self.waiting)
        left = budget
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and left > 0:
            request = self.running[i]
            if not self.kv.ready(request):
                i += 1  # its blocks are still being copied in from the host tier
                continue
            if request.num_pending and ends_on_length(request, self.max_model_len):
                i += 1  # the token in flight ends it: a step past it would be thrown away
                continue
            if len(request.draft_token_ids) >= left:
                # NOTE: the drafts the budget leaves room for, after the request's last token
                del request.draft_token_ids[max(0, left - 1):]
            segments = self.plan_segments(request, left)
            if not segments:
                i += 1
                continue
            while self.kv.try_allocate(request, segments) is None:
                if self.reclaim is not None and self.reclaim():
                    continue
                victim = self._pick_victim(i)
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # the request itself was preempted; running[i] is now the next one
            self._commit(request, segments, scheduled, now)
            left -= scheduled[-1].num_tokens
            i += 1

        if not preempted:
            left = self._admit_waiting(left, scheduled, now)
        return SchedulerOutput(scheduled, preempted, budget, budget - left, self.kv.take_transfers())

    def _admit_waiting(self, left: int, scheduled: list[ScheduledRequest], now: float) -> int:
        if left <= 0 or len(self.running) >= self.max_num_seqs:
            # NOTE: nothing can be admitted: skip the sort, whose keys read each waiting
            # request's hits under ``least_work_first`` (most steps of a loaded engine).
            return left
        if len(self.waiting) > 1:
            self.waiting.sort(key=self._admission_key)
        idx = 0
        gate = self.job_admission
        while idx < len(self.waiting) and left > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[idx]
            if request.num_pending:
                # NOTE: preempted while its last step was in flight: it recomputes once that
                # step's token is part of its context.
                idx += 1
                continue
            if gate is not None and request.job_id is not None:
                # NOTE: the gate finds a new job's shared prefix by its block hashes
                self.kv.ensure_hashes(request)
            if gate is not None and not gate.admits(request, now, engine_idle=not self.running):
                # NOTE: its job waits between turns for older jobs to finish; the ones behind
                # it (older jobs' turns, requests without a job) may still fit.
                idx += 1
                continue
            # NOTE: the whole prompt must fit only while others run (see ``admit_full_prompt``);
            # an idle engine admits a request on its first chunk.
            allocation = self.kv.try_admit(
                request,
                functools.partial(self.plan_segments, max_tokens=left),
                reserve_prompt=self.admit_full_prompt and bool(self.running),
                reclaim=self.reclaim,
                on_hold=self.on_admit,
            )
            if allocation is None:
                break
            assert allocation.hit is not None
            self.waiting.pop(idx)
            if self.waiting_hits is not None:
                self.waiting_hits.leave(request)
            if gate is not None:
                gate.on_admitted(request, now, cached_prefix_tokens=allocation.hit.leading_tokens)
            self._on_admitted(request, allocation.hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if allocation.deferred:
                # NOTE: it holds its blocks, and computes in a later step, once the copies into
                # them are complete; the budget goes to the others meanwhile.
                continue
            self._commit(request, allocation.segments, scheduled, now)
            left -= scheduled[-1].num_tokens
        return left

    def _on_admitted(self, request: Request, hit: CacheHit) -> None:
        metrics = request.metrics
        metrics.reload_tokens += len(hit.reloads) * self.block_size
        if not request.admitted_once:
            request.admitted_once = True
            metrics.cached_tokens = hit.hit_tokens
            metrics.hole_tokens += hit.hole_tokens
            metrics.suffix_recomputed_tokens += hit.skipped_hit_tokens

    def _commit(
        self,
        request: Request,
        segments: list[tuple[int, int]],
        scheduled: list[ScheduledRequest],
        now: float,
    ) -> None:
        """Moves the frontier past ``segments`` (their blocks are allocated) and registers the
        blocks that become full."""
        end = segments[-1][1]
        request.num_computed_tokens = self._skip_cached(request, end)
        self.kv.commit(request)
        sample = end == request.num_planned_tokens
        if sample and self.async_output:
            # NOTE: its token comes back after the next step is planned (async scheduling)
            request.num_pending += 1
        scheduled.append(ScheduledRequest(request, segments, sample))
        computed = sum(e - s for s, e in segments)
        metrics = request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        metrics.computed_tokens += computed
        redo = min(end, request.max_computed_ever) - segments[0][0]
        if request.metrics.num_preemptions and redo > 0:
            metrics.preempted_tokens += min(redo, computed)
        request.max_computed_ever = max(request.max_computed_ever, end)

    def _pick_victim(self, current: int) -> Request:
        """Lowest-priority running request at or after ``current`` (never one already planned).

        Requests on their job's last step are spared while another victim exists (Continuum).
        """
        tail = self.running[current:]
        spare = [r for r in tail if not r.is_last_step]
        return (spare or tail)[-1]

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and queues it again to recompute from scratch."""
        if self.job_admission is not None:
            self.job_admission.on_released(request, self.clock(), preempted=True)
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.waiting.append(request)
        if self.waiting_hits is not None:
            self.waiting_hits.join(request)
