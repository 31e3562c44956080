"""The engine: ``step()`` is schedule -> run -> update_from_output -> outputs.

The scheduler plans the step, the runner executes it (the model, or the latency model on a
virtual clock: :meth:`Engine.simulated`), the scheduler appends the sampled tokens, stops and
frees the requests they end, and the engine turns those updates into :class:`RequestOutput`
(detokenizing and checking stop strings on the way).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from asymcache_core.async_steps import AsyncSteps, InFlight
from asymcache_core.budget import AdaptiveBudget, FixedBudget
from asymcache_core.config import EngineConfig
from asymcache_core.detokenizer import detokenize_incrementally
from asymcache_core.engine_stats import EngineCounters, EngineStats, GenerationOutput, StepStats
from asymcache_core.errors import EngineDeadError
from asymcache_core.host_tier import HostTier
from asymcache_core.host_tier_driver import HostTierDriver
from asymcache_core.job_stats import JobStats
from asymcache_core.kv_stack import build_kv_stack
from asymcache_core.latency_model import LatencyFeedback, LatencyModel
from asymcache_core.memory_budget import GIB, KVPoolPlan, plan_for_device
from asymcache_core.request import Request, RequestOutput, RequestStatus
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.scheduler import (
    RequestUpdate,
    Scheduler,
    SchedulerOutput,
    fcfs_key,
)
from asymcache_core.sim_runner import SimulatedRunner, VirtualClock
from asymcache_core.step_faults import StepResult, execute_isolating_faults
from asymcache_core.step_timeline import DeviceTimeline

if TYPE_CHECKING:
    from asymcache_core.tensor_parallel import TensorParallelWorkers

logger = logging.getLogger(__name__)

#: Seconds a job may stay idle (nothing in flight, no pin) before its per-job state is dropped.
JOB_IDLE_S = 1800.0
#: Jobs whose per-job state is kept at most.
MAX_TRACKED_JOBS = 10_000
#: Engine seconds between idle-job sweeps.
JOB_SWEEP_INTERVAL_S = 10.0

class Runner(Protocol):
    """Runs a planned step and returns ``request_id -> sampled token`` for finished contexts."""

    def execute(self, plan: SchedulerOutput) -> dict[str, int]: ...


class Engine(AsyncSteps):
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
        if isinstance(config, str):
            if "model" in overrides:
                raise ValueError("model: given both as the first argument and as model=")
            config = EngineConfig(model=config, **overrides)
        elif config is None:
            config = EngineConfig(**overrides)
        elif not isinstance(config, EngineConfig):
            raise ValueError(
                f"config: expected an EngineConfig or a model name, not {type(config).__name__}"
            )
        elif overrides:
            from dataclasses import replace

            config = replace(config, **overrides)
        if config.async_scheduling and runner_factory is not None:
            raise ValueError("async_scheduling: needs the model runner (a simulated engine plans each step after the last)")
        self.config = config
        self.clock = clock or time.monotonic
        device, dtype = config.torch_device, config.torch_dtype
        #: steps are planned while the one before runs (``config.async_scheduling`` resolved)
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else runner_factory is None and device.type == "cuda" and config.tensor_parallel_size == 1
        )

        self.loaded = None
        #: the worker ranks of a tensor-parallel engine (``None``: one rank)
        self.tp_workers: TensorParallelWorkers | None = None
        #: why the engine can run no more steps (``None``: it can)
        self.dead: EngineDeadError | None = None
        if runner_factory is None:
            from asymcache_core.loaders import load_model

            if loaded is not None:
                if loaded.name != config.model:
                    raise ValueError(f"model: the shared model is {loaded.name!r}, not {config.model!r}")
                if config.tensor_parallel_size > 1:
                    raise ValueError("tensor_parallel_size: a shared, already loaded model cannot be split")
                self.loaded = loaded
            elif config.tensor_parallel_size > 1:
                from asymcache_core.tensor_parallel import start_workers

                self.tp_workers = start_workers(config, device, dtype)
                group = self.tp_workers.group
                self.loaded = load_model(config.model, device, dtype, config.seed, config.max_model_len, group)
            else:
                self.loaded = load_model(config.model, device, dtype, config.seed, config.max_model_len)
            self.model_config = self.loaded.config
            self.tokenizer = self.loaded.tokenizer
        else:
            from asymcache_core.loaders import resolve_hf_config
            from asymcache_core.models import ModelConfig

            self.model_config = model_config or ModelConfig.from_hf(resolve_hf_config(config.model)[0])
            self.tokenizer = tokenizer
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        dtype_bytes = torch.finfo(dtype).bits // 8
        #: How ``gpu_memory_utilization`` split the device memory (``None``: not used).
        self.memory_plan: KVPoolPlan | None = None
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(dtype_bytes)
        self.block_size = config.block_size

        if latency is not None:
            self.latency = latency
        elif config.latency_profile is not None:
            self.latency = LatencyModel.from_json(config.latency_profile)
        else:
            self.latency = LatencyModel.analytic(mc, device.type, dtype_bytes, config.model)
        self.job_stats = JobStats()
        self.block_bytes = mc.kv_bytes_per_token(dtype_bytes) * config.block_size
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
        self._stalled = False
        fixed = config.chunk_budget()
        # NOTE: measured steps correct the model the adaptive budget plans with (LatencyFeedback)
        self.latency_feedback = LatencyFeedback()
        self.budget = (
            FixedBudget(fixed)
            if fixed is not None
            else AdaptiveBudget(
                self.latency, config.tpot_slo_ms / 1e3, config.block_size, config.max_num_batched_tokens,
                feedback=self.latency_feedback, clock=self.clock, slack=config.chunking == "adaptive:slack",
            )
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.scheduler = Scheduler(
            self.kv,
            config.block_size,
            config.max_num_seqs,
            self.budget,
            self.continuum.program_key if config.priority == "program" else fcfs_key,
            admission_key=self.continuum.adaptive_program_key if config.priority == "adaptive" else None,
            reclaim=self.pins.release_for_pressure,
            on_admit=self.continuum.on_admit,
            on_finish=self._on_finish,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            clock=self.clock,
            align_chunks=fixed is None,
            admit_full_prompt=config.admit_full_prompt,
            least_work_first=config.least_work_first,
            least_work_patience=config.least_work_patience,
            work_seconds=self.latency.prefill_latency,
            job_admission=self.job_admission,
            async_output=self.async_scheduling,
        )
        if runner_factory is None:
            from asymcache_core.model_runner import ModelRunner
            from kernels.dispatch import select_attention_backend

            backend = select_attention_backend(
                device, config.attention_backend, dtype, batch_invariant=config.batch_invariant,
                fused=config.fused_kernels,
            )
            runner_kwargs: dict[str, Any] = dict(
                num_blocks=self.num_blocks, block_size=config.block_size, seed=config.seed,
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                # NOTE: tensor-parallel steps run eagerly: a captured graph would have to hold
                # the collectives of every rank in lockstep.
                cuda_graphs=not config.enforce_eager and device.type == "cuda" and backend.name == "triton"
                and self.tp_workers is None,
                mixed_graph_tokens=config.mixed_graph_max_tokens,
                num_host_blocks=self.num_host_blocks,
                # NOTE: a step's rows: its chunk budget plus a token per running decode.
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.chunk_budget() or 0)
                + config.max_num_seqs,
            )
            if self.tp_workers is not None:
                from asymcache_core.tensor_parallel import TensorParallelRunner

                try:
                    self.runner: Runner = TensorParallelRunner(
                        self.tp_workers, self.loaded, device, dtype, backend, **runner_kwargs
                    )
                except BaseException:
                    self.tp_workers.close()
                    raise
            else:
                self.runner = ModelRunner(self.loaded, device=device, dtype=dtype, backend=backend, **runner_kwargs)
            self.attention_backend = backend.name
        else:
            self.runner = runner_factory(self)
            self.attention_backend = "simulated"
        #: issues the host tier's copies and prefetches (``None``: no tier)
        self.host_driver: HostTierDriver | None = None
        if self.host_tier is not None:
            self.host_tier.is_complete = self.runner.transfer_complete  # type: ignore[attr-defined]
            self.host_tier.wait = self.runner.wait_transfers  # type: ignore[attr-defined]
            self.host_driver = HostTierDriver(
                self.host_tier, self.kv, self.scheduler, self.pins, self.job_stats, self.runner
            )
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        # NOTE: a deque, bounded by ``max_step_log`` for servers that run for days.
        self.step_log: deque[StepStats] = deque(maxlen=config.max_step_log)
        self._ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        #: the step on the device whose tokens are not back yet (async scheduling)
        self._in_flight: InFlight | None = None
        #: when the last step's tokens came back (engine clock)
        self._last_end = 0.0
        #: where launched steps ran on the device, for the step log (async scheduling)
        self.device_timeline = DeviceTimeline()
        #: a job idle this long (nothing in flight, no pin) loses its per-job state
        self.job_idle_s = JOB_IDLE_S
        #: jobs whose state is kept at most (the longest idle dropped first)
        self.max_tracked_jobs = MAX_TRACKED_JOBS
        self._next_job_sweep = 0.0
        self._logged_recomputed = 0
        if runner_factory is None:
            ready = {
                "model": config.model, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                "eviction_policy": config.eviction_policy, "kv_blocks": self.num_blocks,
                "kv_gib": self.num_blocks * config.block_size * mc.kv_bytes_per_token(dtype_bytes) / GIB,
            }
            logger.info("engine ready: %s", ready, extra={"engine_ready": ready})

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
        """
        clock = VirtualClock()

        def runner(engine: Engine) -> Runner:
            return SimulatedRunner(
                device_latency or engine.latency, clock, engine.model_config.vocab_size, engine.host_tier
            )

        return cls(config, clock=clock, runner_factory=runner, latency=latency, **overrides)

    # -- setup helpers -----------------------------------------------------------------------
    def _rank_model_config(self) -> Any:
        """The model as rank 0 holds it: its share of the KV heads sizes its share of a block.

        NOTE: rank 0 holds the largest share, so a pool that fits rank 0 fits every rank.
        """
        mc = self.model_config
        if self.tp_workers is None:
            return mc
        return dataclasses.replace(mc, num_key_value_heads=self.tp_workers.shards[0].num_kv_heads)

    def _blocks_from_memory(self, dtype_bytes: int) -> int:
        per_block = self._rank_model_config().kv_bytes_per_token(dtype_bytes) * self.config.block_size
        device = self.config.torch_device
        if self.config.gpu_memory_utilization is not None:
            self.memory_plan = self._memory_plan(dtype_bytes)
            return self.memory_plan.num_blocks
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * self.config.kv_memory_fraction
        else:
            import os

            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(avail * self.config.kv_memory_fraction, 1 << 30)
        return max(16, int(budget // per_block))

    def _memory_plan(self, dtype_bytes: int) -> KVPoolPlan:
        """The pool ``gpu_memory_utilization`` leaves on this engine's device
        (:func:`~asymcache_core.memory_budget.plan_for_device`)."""
        config = self.config
        assert config.gpu_memory_utilization is not None
        return plan_for_device(
            self._rank_model_config(), gpu_memory_utilization=config.gpu_memory_utilization, device=config.torch_device,
            block_size=config.block_size, dtype_bytes=dtype_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            weights=self.loaded.model if self.loaded is not None else None,
            device_memory_bytes=None if config.device_memory_gib is None else int(config.device_memory_gib * GIB),
        )

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
    ) -> str:
        """Queues a request.

        Args:
            prompt: token ids, or a string for models with a tokenizer.
            params: sampling parameters (defaults: greedy, 16 tokens).
            job_id: the agent job or chat the request is a turn of: its blocks are grouped by
                it for eviction and pins, and it is the unit of job admission and of program
                order (``None``: a standalone request).
            request_id: a caller-chosen id (unique among unfinished requests).
            is_last_step: the job ends with this request (its blocks will not be reused).
            priority: smaller runs first among equal keys.

        Returns:
            The request id.

        Raises:
            ValueError: empty prompt, ids out of vocabulary, too long for ``max_model_len`` or
                for the KV pool, or a duplicate request id.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab})")
        for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in token_ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit max_model_len={self.max_model_len} "
                "(at least one token must be generated)"
            )
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        blocks = -(-longest // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"num_kv_blocks: the request needs up to {blocks} KV blocks "
                f"(prompt {len(ids)} + max_tokens {params.max_tokens}) but the pool has {self.num_blocks}"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        now = self.clock()
        request = Request(
            request_id, ids, params, now, job_id=job_id,
            priority=priority, is_last_step=is_last_step,
        )
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

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; returns False when it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if self.tokenizer is not None:  # flush text held back inside an unfinished character
            detokenize_incrementally(self.tokenizer, request.output_token_ids, request.detok, final=True)
            request.text = request.detok.text
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED, self.clock())
        self._pending_outputs.append(self._output(request, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def idle_until(self, when: float) -> None:
        """Nothing is left to run until engine time ``when`` (e.g. every job is in a tool pause).

        On the virtual clock of :meth:`simulated` time jumps to ``when`` (never back). A real
        clock is not the engine's to move: the caller waits, and this call only does what an
        idle engine owes. Either way, pins whose TTL has passed by now expire (inside
        :meth:`step` they expire at the start of every step).
        """
        if isinstance(self.clock, VirtualClock):
            self.clock.advance_to(when)
        self.pins.expire(self.clock())
        self._sweep_jobs(self.clock())

    def _sweep_jobs(self, now: float) -> None:
        """Drops the per-job state of idle jobs: job statistics, remembered blocks, the
        controller's tables. A job is idle when nothing of it is in flight and it holds no pin;
        those idle past :attr:`job_idle_s` go, and past :attr:`max_tracked_jobs` the longest
        idle go first (down to 90% of it), so abandoned jobs cannot grow memory without bound.
        """
        jobs = self.job_stats.jobs
        over = len(jobs) > self.max_tracked_jobs
        if now < self._next_job_sweep and not over:
            return
        self._next_job_sweep = now + JOB_SWEEP_INTERVAL_S
        idle = sorted(
            (st.last_active, job) for job, st in jobs.items() if st.running == 0 and not self.pins.is_pinned(job)
        )
        drop = [job for last, job in idle if now - last > self.job_idle_s]
        if over:
            keep = int(0.9 * self.max_tracked_jobs)
            extra = len(jobs) - len(drop) - keep
            if extra > 0:
                dropped = set(drop)
                drop += [job for _, job in idle if job not in dropped][:extra]
        for job in drop:
            jobs.pop(job, None)
            self.pins.forget(job)
            self.continuum.forget_job(job)

    def tracked_jobs(self) -> dict[str, int]:
        """Sizes of every per-job table of the engine (they stay bounded; see :meth:`_sweep_jobs`).

        Returns:
            Table name -> entries.
        """
        return {
            "job_stats": len(self.job_stats.jobs),
            "pins_last_blocks": len(self.pins.last_blocks),
            "pins": len(self.pins.pins),
            **{f"controller_{k}": v for k, v in self.continuum.tracked_jobs().items()},
        }

    @property
    def stalled(self) -> bool:
        """The last :meth:`step` planned nothing although requests are unfinished: they wait
        for room or for job admission, and only time (a pause ending, a pin expiring) or a new
        request changes that. A loop should wait for one of those rather than step again."""
        return self._stalled

    def reset_prefix_cache(self) -> int:
        """Evicts every cached block that no request holds and no pin protects.

        Returns:
            Blocks evicted.
        """
        evicted = self.pool.evict_all()
        if self.kv_events is not None:
            self.kv_events.flush()  # routers learn of the removals now, not at the next step
        return evicted

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
        outputs, self._pending_outputs = self._pending_outputs, []
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
            outputs.append(self._output(request, []))
        take_failures = getattr(self.runner, "take_failures", None)
        for rid, error in (take_failures() if take_failures is not None else {}).items():
            request = self.requests.get(rid)
            if request is not None:
                self._fail_request(request, error, end)
                outputs.append(self._output(request, []))
        updates = self.scheduler.update_from_output(ran, sampled, end)
        self._last_end = end
        return outputs + [self._process_output(update, end) for update in updates]

    # -- step faults ---------------------------------------------------------------------------
    def _execute(self, plan: SchedulerOutput) -> StepResult:
        """Runs the step; a fault of the forward pass fails only the requests that cause it
        (:func:`~asymcache_core.step_faults.execute_isolating_faults`). A dead engine (a
        tensor-parallel rank gone) is recorded, and every later step raises."""
        try:
            return execute_isolating_faults(plan, self.runner, self.kv, self.pool, self.scheduler, self.block_size)
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
        self.counters.generated_tokens += len(update.new_token_ids)
        if self.tokenizer is not None:
            try:
                self._detokenize(request, now)
            except Exception as exc:  # noqa: BLE001 - the request fails, not the step
                self._fail_request(request, f"detokenizing failed: {type(exc).__name__}: {exc}", now)
        return self._output(request, update.new_token_ids)

    def _detokenize(self, request: Request, now: float) -> None:
        """Extends ``request.text`` by its new tokens; a stop string found in it ends the request.

        NOTE: the scheduler has already applied the token-level stops; a stop string (text) is
        found only here, so its request is freed after the step's other finished requests (as
        vLLM's output processor aborts it), and it overrides an EOS or length finish of the
        same token (the text is cut at the stop string either way).
        """
        params = request.params
        detok = request.detok
        before = len(detok.text)
        new = detokenize_incrementally(self.tokenizer, request.output_token_ids, detok, final=request.finished)
        request.text = detok.text
        if not (new and params.stop):
            return
        # NOTE: only text that can hold a stop string for the first time is searched: the new
        # piece and the longest stop string's length before it. The first stop string of the
        # list that occurs wins (vLLM's rule).
        start = max(0, before - max(len(stop) for stop in params.stop) + 1)
        for stop in params.stop:
            idx = detok.text.find(stop, start)
            if idx >= 0:
                request.text = detok.text[:idx]
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, now, stop)
                return

    def _on_finish(self, request: Request, now: float) -> None:
        """The scheduler's finish hook: runs before the request's blocks are freed."""
        if request.job_id is not None:
            held = [
                (b, self.pool.blocks[b].block_hash)
                for b in self.kv.held_blocks(request)
                if self.pool.blocks[b].block_hash is not None
            ]
            self.pins.remember(request.job_id, held)  # type: ignore[arg-type]
            self.job_stats.on_finish(request.job_id, now, request.is_last_step, request.num_tokens)
            if request.is_last_step:
                self.pins.forget(request.job_id)
        runner_sampler = getattr(self.runner, "sampler", None)
        if runner_sampler is not None:
            runner_sampler.forget(request.request_id)
        m = request.metrics
        c = self.counters
        c.hit_tokens += m.cached_tokens
        c.hole_tokens += m.hole_tokens
        c.suffix_recomputed_tokens += m.suffix_recomputed_tokens
        c.preempted_tokens += m.preempted_tokens
        c.computed_tokens += m.computed_tokens
        c.num_preemptions += m.num_preemptions
        c.reload_tokens += m.reload_tokens
        self.continuum.on_request_finished(request)
        del self.requests[request.request_id]

    def _output(self, request: Request, new: list[int]) -> RequestOutput:
        # NOTE: _detokenize keeps request.text current (decoded incrementally, cut at a stop).
        text = request.text
        reason = request.status.value if request.finished else None
        return RequestOutput(
            request.request_id, new, list(request.output_token_ids), text, request.finished,
            reason, request.metrics, request.num_prompt_tokens, request.error,
        )

    def _log_step(self, plan: SchedulerOutput, start: float, end: float, schedule_s: float) -> None:
        pairs = plan.attn_pairs
        decode_only = plan.is_decode_only
        decode_kv = plan.decode_kv_tokens
        predicted = self.latency.step_latency(plan.num_tokens, pairs, decode_only, decode_kv)
        self.latency_feedback.observe(predicted, end - start, decode_only)
        transfers = plan.transfers
        recomputed = 0
        if self.host_tier is not None:
            recomputed = self.host_tier.counters.recompute_chosen - self._logged_recomputed
            self._logged_recomputed = self.host_tier.counters.recompute_chosen
        self.step_log.append(
            StepStats(
                start=start,
                duration_s=end - start,
                budget=plan.budget,
                num_tokens=plan.num_tokens,
                num_segments=sum(len(s.segments) for s in plan.scheduled),
                num_seqs=len(plan.scheduled),
                num_decodes=sum(1 for s in plan.scheduled if s.num_tokens == 1),
                blocks_in_use=self.pool.num_in_use,
                schedule_s=schedule_s,
                attn_pairs=pairs,
                num_hole_tokens=plan.num_hole_tokens,
                decode_only=decode_only,
                predicted_s=predicted,
                decode_kv_tokens=decode_kv,
                reload_blocks=len(transfers.reloads) if transfers is not None else 0,
                offload_blocks=len(transfers.offloads) if transfers is not None else 0,
                host_recomputed_blocks=recomputed,
            )
        )

    # -- pins ----------------------------------------------------------------------------------
    def pin_job(self, job_id: str, ttl_s: float) -> int:
        """Pins the blocks of ``job_id``'s last finished request for ``ttl_s`` seconds.

        Returns:
            Blocks pinned (0 when the pin was refused or nothing was cached).
        """
        return self.pins.pin(job_id, ttl_s, self.clock())

    def unpin_job(self, job_id: str) -> bool:
        """Releases ``job_id``'s pin; whether it had one."""
        return self.pins.unpin(job_id)

    def hint_job(self, job_id: str, expected_gap_s: float | None = None, finished: bool | None = None) -> None:
        """Passes the runtime's reuse hints (tool-pause estimate, job done) to the policies."""
        self.continuum.hint(job_id, expected_gap_s, finished)

    # -- blocking API ------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        job_ids: Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Runs prompts to completion; one output per prompt, in order (``job_ids``: each one's
        job, see :meth:`add_request`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError("params: one SamplingParams per prompt, or a single one")
        ids: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
                job_id = job_ids[i] if job_ids else None
                encoded = self.encode(prompt)  # type: ignore[arg-type]
                rid = self.add_request(encoded, p, job_id=job_id)
                ids.append(rid)
                prompt_ids[rid] = encoded
        except ValueError:
            for rid in ids:
                self.abort(rid)
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in ids]
            raise
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        results = []
        for rid in ids:
            out = finals[rid]
            results.append(
                GenerationOutput(rid, prompt_ids[rid], out.token_ids, out.text, out.finish_reason, out.metrics)
            )
        return results

    # -- checks and stats ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Gauges and counters of the engine now (call it from the thread that steps it)."""
        c, pool, pins, target = self.counters, self.pool, self.pins, self.continuum.ttft_target
        return EngineStats(
            kv_blocks_total=self.num_blocks,
            kv_blocks_in_use=pool.num_in_use,
            kv_blocks_peak_in_use=pool.peak_in_use,
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting),
            pinned_blocks=pins.num_pinned_blocks,
            pins_total=pins.num_pins,
            pins_expired_total=pins.num_expired,
            pins_released_pressure_total=pins.num_released_pressure,
            evictions_total=pool.num_evictions,
            engine_prompt_tokens_total=c.prompt_tokens,
            engine_cache_hit_tokens_total=c.hit_tokens,
            engine_hole_tokens_total=c.hole_tokens,
            engine_suffix_recomputed_tokens_total=c.suffix_recomputed_tokens,
            engine_preempted_tokens_total=c.preempted_tokens,
            engine_computed_tokens_total=c.computed_tokens,
            engine_generated_tokens_total=c.generated_tokens,
            preemptions_total=c.num_preemptions,
            requests_total=c.num_requests,
            jobs_admitted=self.job_admission.num_jobs if self.job_admission is not None else 0,
            jobs_held_back_total=self.job_admission.num_held_back if self.job_admission is not None else 0,
            job_gate_capacity_tokens=self.job_admission.capacity_tokens if self.job_admission is not None else 0,
            engine_reload_tokens_total=c.reload_tokens,
            kv_block_size=self.block_size,
            order_slack_seconds=target.slack_s if target is not None else math.inf,
            **(self.host_driver.stats() if self.host_driver is not None else {}),
        )

    def check_integrity(self) -> None:
        """Pool invariants plus: every block held by a request is counted by its ref count."""
        self.pool.check_integrity()
        if self.host_tier is not None:
            self.host_tier.check_integrity()
        if self.continuum.ttft_target is not None:
            self.continuum.ttft_target.check_integrity()
        if self.job_admission is not None:
            self.job_admission.check_integrity()
        table_rows = getattr(self.runner, "block_table_rows", None)  # the model runner's, on a real backend
        if table_rows is not None:
            table_rows.check_integrity(self.scheduler.running + self.scheduler.waiting)
        refs: dict[int, int] = {}
        for request in self.scheduler.running + self.scheduler.waiting:
            for b in self.kv.held_blocks(request):
                refs[b] = refs.get(b, 0) + 1
        for b in self.kv.prefetch_held_blocks():
            refs[b] = refs.get(b, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {refs.get(block.block_id, 0)}"
            )
        pinned: dict[int, int] = {}
        for pin in self.pins.pins.values():
            for b in pin.block_ids:
                pinned[b] = pinned.get(b, 0) + 1
        for block in self.pool.blocks:
            assert block.pin_cnt == pinned.get(block.block_id, 0), f"block {block.block_id}: pin count"
