"""The engine: ``step()`` is schedule -> run -> update_from_output -> outputs.

The scheduler plans the step, the runner executes it (the model, or the latency model on a
virtual clock: :meth:`Engine.simulated`), the scheduler appends the sampled tokens, stops and
frees the requests they end, and the engine turns those updates into :class:`RequestOutput`
(detokenizing and checking stop strings on the way).

This module holds the engine's construction, its request calls and the loop that orders a
step's phases; the phases themselves (plan, execute, complete) are the
:class:`~asymcache_core.engine_step.StepPhases` mixin, and the other mixins hold async
scheduling (``async_steps.py``), job-level calls (``engine_jobs.py``) and the blocking
``generate``/``chat`` (``engine_blocking.py``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asymcache_core.async_steps import AsyncSteps, InFlight
from asymcache_core.budget import AdaptiveBudget, FixedBudget
from asymcache_core.config import EngineConfig
from asymcache_core.engine_blocking import BlockingCalls
from asymcache_core.engine_checks import (
    check_engine_integrity,
    check_request_fields,
    check_seconds,
    truncated_prompt,
    validate_request,
)
from asymcache_core.engine_jobs import JobControl
from asymcache_core.engine_outputs import flush_text, request_output
from asymcache_core.engine_setup import (
    Runner,
    build_model_runner,
    build_scheduler,
    check_max_model_len,
    check_pool_fits,
    eos_token_ids,
    load_engine_model,
    log_ready,
    pool_blocks,
    resolve_config,
)
from asymcache_core.engine_stats import (
    CacheReset,
    EngineCounters,
    EngineStats,
    StepStats,
    collect_stats,
)
from asymcache_core.engine_step import StepPhases
from asymcache_core.errors import EngineDeadError
from asymcache_core.host_tier import HostTier
from asymcache_core.host_tier_driver import HostTierDriver
from asymcache_core.implicit_jobs import ImplicitJobs
from asymcache_core.job_stats import JobStats
from asymcache_core.kv_stack import build_kv_stack
from asymcache_core.latency_model import LatencyFeedback, LatencyModel
from asymcache_core.memory_budget import KVPoolPlan
from asymcache_core.request import Request, RequestOutput, RequestStatus
from asymcache_core.request_masks import with_engine_processors
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.serving_stats import ServingStats
from asymcache_core.sim_runner import SimulatedRunner, VirtualClock
from asymcache_core.speculative import SpeculativeConfig
from asymcache_core.step_timeline import DeviceTimeline

if TYPE_CHECKING:
    from asymcache_core.tensor_parallel import TensorParallelWorkers


class Engine(AsyncSteps, StepPhases, JobControl, BlockingCalls):
    """Embedded inference engine.

    Args:
        config: the engine configuration (keyword overrides are applied on top), or a model
            spec (``Engine("smollm2-135m")``), the same as ``EngineConfig(model=...)``.
        clock: time source (virtual in the simulator); ``time.monotonic`` by default.
        runner_factory: builds a :class:`Runner` instead of loading the model (the simulator);
            receives the engine and returns the runner.
        model_config: the model's shape when ``runner_factory`` is given (else read from the spec).
        tokenizer: a tokenizer when ``runner_factory`` is given.
        loaded: an already loaded model (:class:`~asymcache_core.loaders.LoadedModel`) to share
            between engines, e.g. one per policy of a benchmark grid; it must match ``model``,
            ``device`` and ``dtype``.
        latency: the latency model the budget, the eviction policies and the step log use
            (default: ``config.latency_profile`` if set, else the analytic model).
        **overrides: fields of :class:`EngineConfig`.
    """

    def __init__(
        self,
        config: EngineConfig | str | None = None,
        *,
        clock: Callable[[], float] | None = None,
        runner_factory: Callable[[Engine], Runner] | None = None,
        model_config: Any = None,
        tokenizer: Any = None,
        loaded: Any = None,
        latency: LatencyModel | None = None,
        **overrides: Any,
    ) -> None:
        config = resolve_config(config, overrides)
        if config.async_scheduling and runner_factory is not None:
            raise ValueError("async_scheduling: needs the model runner (a simulated engine plans each step after the last)")
        self.config = config
        self.clock = clock or time.monotonic
        device, dtype = config.torch_device, config.torch_dtype
        #: steps are planned while the one before runs (``config.async_scheduling`` resolved)
        speculative = SpeculativeConfig.parse(config.speculative_config)
        if speculative is not None and runner_factory is not None:
            raise ValueError("speculative_config: needs the model runner (a simulated step samples no token)")
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else runner_factory is None and device.type == "cuda" and config.tensor_parallel_size == 1
            # NOTE: a draft follows the token before it: speculating steps are synchronous
            and speculative is None
        )

        self.loaded = None
        #: the worker ranks of a tensor-parallel engine (``None``: one rank)
        self.tp_workers: TensorParallelWorkers | None = None
        #: why the engine can run no more steps (``None``: it can)
        self.dead: EngineDeadError | None = None
        if runner_factory is None:
            self.loaded, self.tp_workers = load_engine_model(config, loaded)
            self.model_config = self.loaded.config
            self.tokenizer = self.loaded.tokenizer
        else:
            from asymcache_core.loaders import resolve_hf_config
            from asymcache_core.models import ModelConfig

            self.model_config = model_config or ModelConfig.from_hf(resolve_hf_config(config.model)[0])
            # NOTE: the simulator refuses what the real engine refuses, not a limit kept silently
            # in ``config`` while the engine runs the model's
            check_max_model_len(config, self.model_config)
            self.tokenizer = tokenizer
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        dtype_bytes = torch.finfo(dtype).bits // 8
        #: How ``gpu_memory_utilization`` split the device memory (``None``: not used).
        self.memory_plan: KVPoolPlan | None = None
        if config.num_kv_blocks:
            self.num_blocks = config.num_kv_blocks
        else:
            weights = self.loaded.model if self.loaded is not None else None
            self.num_blocks, self.memory_plan = pool_blocks(config, mc, self.tp_workers, weights, dtype_bytes)
        self.block_size = config.block_size

        if latency is not None:
            self.latency = latency
        elif config.latency_profile is not None:
            self.latency = LatencyModel.from_json(config.latency_profile)
        else:
            self.latency = LatencyModel.analytic(mc, device.type, dtype_bytes, config.model)
        self.job_stats = JobStats()
        self.block_bytes = mc.kv_bytes_per_token(dtype_bytes) * config.block_size
        if runner_factory is None:
            check_pool_fits(config, mc, self.tp_workers, self.num_blocks, dtype_bytes)
        stack = build_kv_stack(
            config, num_blocks=self.num_blocks, block_bytes=self.block_bytes, latency=self.latency,
            job_stats=self.job_stats, clock=self.clock, check_host_memory=runner_factory is None,
        )
        self.pool = stack.pool
        #: the host KV tier below the device pool (``None``: no ``cpu_offload_gb``)
        self.host_tier: HostTier | None = stack.host_tier
        self.num_host_blocks = stack.num_host_blocks
        self.kv = stack.kv
        #: publishes the pools' stored / removed blocks for KV-aware routers (``kv_events_config``)
        self.kv_events = stack.kv_events
        self.pins = stack.pins
        self.continuum = stack.continuum
        self.job_admission = stack.job_admission
        #: jobs for requests that name none (``None``: off; :attr:`EngineConfig.implicit_jobs`,
        #: :meth:`use_implicit_jobs`)
        self.implicit_jobs = ImplicitJobs(config.block_size) if config.implicit_jobs else None
        self._stalled = False
        # NOTE: measured steps correct the model the adaptive budget plans with (LatencyFeedback)
        self.latency_feedback = LatencyFeedback()
        self.eos_token_ids = eos_token_ids(mc, self.tokenizer)
        self.scheduler = build_scheduler(
            config, stack, self.latency, self.latency_feedback, self.clock, on_finish=self._on_finish,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, async_output=self.async_scheduling,
        )
        #: the chunk budget the scheduler plans each step with
        self.budget: FixedBudget | AdaptiveBudget = self.scheduler.budget_fn  # type: ignore[assignment]
        if runner_factory is None:
            self.runner, self.attention_backend = build_model_runner(
                config, self.loaded, self.tp_workers, num_blocks=self.num_blocks,
                max_model_len=self.max_model_len, num_host_blocks=self.num_host_blocks,
            )
        else:
            self.runner = runner_factory(self)
            self.attention_backend = "simulated"
        #: issues the host tier's copies and prefetches (``None``: no tier)
        self.host_driver: HostTierDriver | None = None
        if self.host_tier is not None:
            self.host_tier.copies_landed = self.runner.transfer_complete  # type: ignore[attr-defined]
            self.host_tier.wait = self.runner.wait_transfers  # type: ignore[attr-defined]
            self.host_driver = HostTierDriver(
                self.host_tier, self.kv, self.scheduler, self.pins, self.job_stats, self.runner
            )
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        # NOTE: a deque, bounded by ``max_step_log`` for servers that run for days.
        self.step_log: deque[StepStats] = deque(maxlen=config.max_step_log)
        #: vLLM's per-request and per-step histograms (``/metrics``); cumulative, unlike the step log
        self.serving_stats = ServingStats(self.max_model_len)
        self._ids = itertools.count()
        #: final outputs of aborts not reported yet, by request id: the id stays in use (a new
        #: request may not take it) until a step has reported its final output
        self._pending_outputs: dict[str, RequestOutput] = {}
        #: the step on the device whose tokens are not back yet (async scheduling)
        self._in_flight: InFlight | None = None
        #: when the last step's tokens came back (engine clock)
        self._last_end = 0.0
        #: where launched steps ran on the device, for the step log (async scheduling)
        self.device_timeline = DeviceTimeline()
        self._logged_recomputed = 0
        if runner_factory is None:
            log_ready(config, self.num_blocks, self.block_bytes)

    @classmethod
    def simulated(
        cls,
        config: EngineConfig | None = None,
        *,
        latency: LatencyModel | None = None,
        device_latency: LatencyModel | None = None,
        **overrides: Any,
    ) -> Engine:
        """An engine on a virtual clock whose forward pass is the latency model.

        The scheduler, cache manager, eviction policies and pins are the real ones; each step
        advances the clock by the step's predicted latency and samples synthetic tokens
        (:class:`~asymcache_core.sim_runner.SimulatedRunner`). No weights are loaded and there
        is no tokenizer: prompts are token ids. Time moves only through steps and
        :meth:`idle_until`.

        Args:
            config: the engine configuration (keyword overrides are applied on top).
            latency: the engine's latency model (see :class:`Engine`).
            device_latency: what the simulated device's steps cost (default: ``latency``, the
                engine's model), to simulate a device the engine's model mispredicts.
            **overrides: fields of :class:`EngineConfig`.

        Raises:
            ValueError: naming the field, as :class:`Engine` does (a ``max_model_len`` past the
                model's positions included).
        """
        clock = VirtualClock()

        def runner(engine: Engine) -> Runner:
            return SimulatedRunner(
                device_latency or engine.latency, clock, engine.model_config.vocab_size, engine.host_tier
            )

        return cls(config, clock=clock, runner_factory=runner, latency=latency, **overrides)

    # -- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (strings go through the tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                why = f" ({self.loaded.tokenizer_source})" if self.loaded is not None else ""
                raise ValueError(f"prompt: this model has no tokenizer{why}; pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        job_id: str | None = None,
        request_id: str | None = None,
        is_last_step: bool = False,
        priority: float = 0.0,
        joins_conversation: bool = True,
        continues_job: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queues a request.

        Args:
            prompt: token ids, or a string for models with a tokenizer.
            params: sampling parameters (defaults: greedy, 16 tokens).
            job_id: the agent job or chat the request is a turn of: its blocks are grouped by
                it for eviction and pins, and it is the unit of job admission and of program
                order (``None``: a standalone request).
            request_id: a caller-chosen id, unique among the requests whose final output has
                not been reported yet (an aborted request's id is free once the step after the
                abort has reported its ``finish_reason="abort"`` output).
            is_last_step: the job ends with this request (its blocks will not be reused).
            priority: smaller runs first among equal keys.
            joins_conversation: without a ``job_id``, the request may join the job of the
                conversation it continues (where the engine gives such jobs:
                :meth:`use_implicit_jobs`); False: it stays without one (one of several choices).
            continues_job: with ``joins_conversation``, the job of the turn the caller found
                the request continues (a chat runtime, by the rendered messages), for templates
                that render earlier replies otherwise (a reasoning model's dropped thinking).
            arrival_time: when the request arrived, on the engine clock, if before now (a
                client whose request was due while a step ran); ``None``: now. TTFT, queueing
                time and the job's arrival count from it.

        Returns:
            The request id.

        Raises:
            ValueError: naming the argument: empty prompt, ids out of vocabulary, too long for
                ``max_model_len`` or for the KV pool, a request id in use, an ``arrival_time``
                after now, ``params.n`` other than 1, or an argument of the wrong type.
        """
        check_request_fields(prompt, request_id, job_id, is_last_step, priority, continues_job)
        if arrival_time is not None:
            check_seconds("arrival_time", arrival_time, allow_negative=True)
            if arrival_time > self.clock():
                raise ValueError(f"arrival_time: {arrival_time!r} is after the engine clock's now ({self.clock()!r})")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if params.n != 1:
            # NOTE: a request is one sequence with one id and one stream of outputs; the
            # blocking calls fan n choices out into n requests (vLLM's parallel sampling)
            raise ValueError(f"n: add_request queues one sequence (n=1), got n={params.n}; "
                             "Engine.generate and Engine.chat run n choices")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None and not hasattr(self.runner, "take_logprobs"):
                raise ValueError(f"{name}: this backend computes no logits (the simulated runner)")
        params = with_engine_processors(params, self.eos_token_ids, self.tokenizer)
        ids = truncated_prompt(self.encode(prompt), params, self.max_model_len)
        validate_request(ids, params, self.model_config.vocab_size, self.max_model_len, self.block_size, self.num_blocks)
        if request_id is None:
            # NOTE: a caller's own id may have taken the next one: skip ids in use
            request_id = f"req-{next(self._ids)}"
            while self._id_in_use(request_id):
                request_id = f"req-{next(self._ids)}"
        elif self._id_in_use(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        now = self.clock() if arrival_time is None else arrival_time
        request = Request(
            request_id, ids, params, now, job_id=job_id,
            priority=priority, is_last_step=is_last_step,
        )
        if joins_conversation:
            job_id = self._join_conversation(request, continues_job)
        self.continuum.on_request_added(request)
        if job_id is not None:
            # NOTE: the turn's new tokens, not the whole prompt: they size the step that will
            # rebuild the job's evicted blocks (AsymCache's marginal cost under the knee).
            new_tokens = self.job_stats.turn_tokens(job_id, len(ids))
            self.job_stats.on_arrival(job_id, now, new_tokens)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.counters.num_requests += 1
        self.counters.prompt_tokens += len(ids)
        return request_id

    def _id_in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` belongs to a request whose final output is not reported yet.

        NOTE: an aborted request leaves :attr:`requests` at once, but its final output goes
        out with the next step: a new request under its id then would share the id with that
        output, and a consumer keyed by id would end the new request's stream on the old one's
        abort. The id is free again once the output is reported (as after any finish).
        """
        return request_id in self.requests or request_id in self._pending_outputs

    def abort(self, request_id: str, *, emit: bool = True) -> bool:
        """Stops a request and frees its blocks; returns False when it is unknown or done. With
        ``emit`` the next step reports its final output (``finish_reason="abort"``)."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if self.tokenizer is not None:
            flush_text(self.tokenizer, request)
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED, self.clock())
        if emit:
            self._pending_outputs[request_id] = request_output(request, [])
        return True

    def has_unfinished(self) -> bool:
        """Whether a :meth:`step` has outputs to report: requests not finished, a launched step
        not collected, or an abort's final output not reported yet.

        NOTE: the pending outputs count, so that ``while engine.has_unfinished(): engine.step()``
        delivers every ``finish_reason="abort"`` output (one step after the abort) instead of
        ending with it still queued.
        """
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._pending_outputs)

    @property
    def stalled(self) -> bool:
        """The last :meth:`step` planned nothing although requests are unfinished: they wait
        for room or for job admission, and only time (a pause ending, a pin expiring) or a new
        request changes that. A loop should wait for one of those rather than step again."""
        return self._stalled

    def reset_prefix_cache(self, *, host_tier: bool = False) -> CacheReset:
        """Evicts every cached block that no request holds and no pin protects.

        Args:
            host_tier: also drop the host tier's copies (vLLM's ``reset_external``); without
                it the evicted blocks' content lives on there, as any eviction's does.

        Returns:
            The device blocks evicted and the host slots dropped.

        Raises:
            ValueError: ``host_tier`` is not a bool (nothing is reset).
        """
        if not isinstance(host_tier, bool):
            raise ValueError(f"host_tier: must be a bool, got {host_tier!r}")
        evicted = self.pool.evict_all()
        dropped = self.host_tier.clear() if host_tier and self.host_tier is not None else 0
        if self.kv_events is not None:
            # NOTE: routers learn of the removals now, not at the next step; the evicted
            # blocks' tokens stay for their host copies, which the next schedule makes
            self.kv_events.flush(age_tokens=False)
        return CacheReset(evicted, dropped)

    def close(self) -> None:
        """Closes the KV event publisher and stops the tensor-parallel workers, if any
        (idempotent)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.tp_workers is not None:
            self.tp_workers.close()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step (:meth:`_step`); its KV events, if published, go out as one batch.

        Raises:
            EngineDeadError: the engine can run no more steps (a tensor-parallel rank died);
                every later call raises it too.
        """
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.flush()
        return outputs

    def _step(self) -> list[RequestOutput]:
        """Runs one step: schedule -> run -> update_from_output -> outputs. Returns its outputs
        (with async scheduling, those of the step launched in the previous call)."""
        start = self.clock()
        outputs, self._pending_outputs = list(self._pending_outputs.values()), {}
        if self._in_flight is not None and not self._in_flight.launched.device_sampled:
            # NOTE: its rows sample on the host, so the next step's inputs exist only after it
            outputs += self._finish_in_flight()[0]
        plan = self._plan(start)
        if plan.is_empty:
            if self._in_flight is not None:
                return outputs + self._finish_in_flight()[0]
            self._stalled = self.scheduler.has_unfinished()
            if self._stalled and any(r.kv_ticket is not None for r in self.scheduler.running):
                # NOTE: nothing to compute but copies in flight: wait for them, not for an event.
                self.runner.wait_transfers(None)  # type: ignore[attr-defined]
                self._stalled = False
            return outputs
        self._stalled = False
        if self.async_scheduling:
            return outputs + self._launch(plan, start)
        planned = self.clock()
        result = self._execute(plan)
        end = self.clock()
        self._log_step(plan, start, end, planned - start)
        outputs += self._complete(result, end)
        if isinstance(self.runner, SimulatedRunner):
            # NOTE: after the outputs, as a live loop pays it: a step's duration does not hold it
            self.runner.between_steps()
        return outputs

    # -- checks and stats ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Gauges and counters of the engine now (call it from the thread that steps it)."""
        return collect_stats(self)

    def check_integrity(self) -> None:
        """Pool invariants plus: every block held by a request is counted by its ref count
        (:func:`~asymcache_core.engine_checks.check_engine_integrity`)."""
        check_engine_integrity(self)
