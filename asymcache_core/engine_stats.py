"""What the engine reports: per-step records, run-wide counters, the stats snapshot that
``/metrics``, the harness and the runtime read, and :meth:`Engine.generate`'s results.

Plain records, filled by :mod:`asymcache_core.engine`, and :func:`collect_stats`, which reads
the snapshot off an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from asymcache_core.engine import Engine
    from asymcache_core.scheduler import SchedulerOutput


class CacheReset(NamedTuple):
    """What :meth:`~asymcache_core.engine.Engine.reset_prefix_cache` dropped.

    Attributes:
        device_blocks: cached device blocks evicted.
        host_blocks: host-tier slots dropped (0 unless asked, or without a tier).
    """

    device_blocks: int
    host_blocks: int


@dataclass
class StepStats:
    """Per-step metrics.

    Attributes:
        start: engine time the step began (with async scheduling: began on the device,
            :class:`~asymcache_core.step_timeline.DeviceTimeline`).
        duration_s: its wall (or virtual) duration; with async scheduling on CUDA, its time
            on the device.
        budget: token budget chosen.
        num_tokens: tokens computed.
        num_segments: MSA segments in the launch.
        num_seqs: sequences in the batch.
        num_decodes: sequences that computed exactly one token.
        blocks_in_use: pool blocks held or pinned after the step.
        schedule_s: host seconds spent planning it, a part of ``duration_s``; with async
            scheduling, planning and launching it while the step before ran.
        attn_pairs: query-key pairs of the step (the latency model's ``A``).
        num_hole_tokens: tokens refilling holes (positions below a request's last cache hit).
        decode_only: every sequence ran one token, its last (CUDA-graph eligible).
        predicted_s: what the engine's latency model predicted for the step; the gap to
            ``duration_s`` is the model's error on live traffic.
        decode_kv_tokens: keys read by the step's decodes (the latency model's ``K``).
        reload_blocks: blocks copied host -> device for this step's plan (host tier).
        offload_blocks: blocks copied device -> host.
        host_recomputed_blocks: host hits the lookups of this step chose to recompute instead
            of reloading (cheaper by the cost model).
    """

    start: float
    duration_s: float
    budget: int
    num_tokens: int
    num_segments: int
    num_seqs: int
    num_decodes: int
    blocks_in_use: int
    schedule_s: float = 0.0
    attn_pairs: float = 0.0
    num_hole_tokens: int = 0
    decode_only: bool = False
    predicted_s: float = 0.0
    decode_kv_tokens: float = 0.0
    reload_blocks: int = 0
    offload_blocks: int = 0
    host_recomputed_blocks: int = 0


    @classmethod
    def of_plan(
        cls, plan: SchedulerOutput, start: float, end: float, schedule_s: float, predicted_s: float,
        blocks_in_use: int, host_recomputed_blocks: int,
    ) -> StepStats:
        """The record of a step that ran ``plan`` from ``start`` to ``end``."""
        transfers = plan.transfers
        return cls(
            start=start,
            duration_s=end - start,
            budget=plan.budget,
            num_tokens=plan.num_tokens,
            num_segments=sum(len(s.segments) for s in plan.scheduled),
            num_seqs=len(plan.scheduled),
            num_decodes=sum(1 for s in plan.scheduled if s.num_tokens == 1),
            blocks_in_use=blocks_in_use,
            schedule_s=schedule_s,
            attn_pairs=plan.attn_pairs,
            num_hole_tokens=plan.num_hole_tokens,
            decode_only=plan.is_decode_only,
            predicted_s=predicted_s,
            decode_kv_tokens=plan.decode_kv_tokens,
            reload_blocks=len(transfers.reloads) if transfers is not None else 0,
            offload_blocks=len(transfers.offloads) if transfers is not None else 0,
            host_recomputed_blocks=host_recomputed_blocks,
        )


@dataclass
class EngineCounters:
    """Run-wide cache counters (never inflated by preemption recompute)."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    hole_tokens: int = 0
    suffix_recomputed_tokens: int = 0
    preempted_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    num_preemptions: int = 0
    num_requests: int = 0
    reload_tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def add_finished(self, metrics: Any) -> None:
        """Counts a finished request's :class:`~asymcache_core.request.RequestMetrics`."""
        self.hit_tokens += metrics.cached_tokens
        self.hole_tokens += metrics.hole_tokens
        self.suffix_recomputed_tokens += metrics.suffix_recomputed_tokens
        self.preempted_tokens += metrics.preempted_tokens
        self.computed_tokens += metrics.computed_tokens
        self.num_preemptions += metrics.num_preemptions
        self.reload_tokens += metrics.reload_tokens


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and run-wide counters (:meth:`Engine.stats`).

    What the server's ``/metrics``, the harness and the runtime read, so that none of them
    reaches into the pool, the scheduler or the pin manager. Names ending in ``_total`` are
    monotonic counters; the rest are gauges.
    """

    kv_blocks_total: int
    kv_blocks_in_use: int
    kv_blocks_peak_in_use: int
    requests_running: int
    requests_waiting: int
    pinned_blocks: int
    pins_total: int
    pins_expired_total: int
    pins_released_pressure_total: int
    evictions_total: int
    engine_prompt_tokens_total: int
    engine_cache_hit_tokens_total: int
    engine_hole_tokens_total: int
    engine_suffix_recomputed_tokens_total: int
    engine_preempted_tokens_total: int
    engine_computed_tokens_total: int
    engine_generated_tokens_total: int
    preemptions_total: int
    requests_total: int
    jobs_admitted: int = 0
    jobs_held_back_total: int = 0
    #: the tokens job-level admission admits jobs against (the device pool, plus the part of
    #: a host tier the jobs' pauses leave room for; 0: no job admission)
    job_gate_capacity_tokens: int = 0
    #: requests that named no job and joined their conversation's (implicit jobs), and those
    #: that started one
    implicit_jobs_matched_total: int = 0
    implicit_jobs_started_total: int = 0
    engine_reload_tokens_total: int = 0
    #: output tokens a constraint forced, appended without a decode step each (jump-forward)
    engine_jump_forward_tokens_total: int = 0
    #: speculative decoding (vLLM's ``vllm:spec_decode_*``): drafts proposed at most per step
    #: (0: off), verified steps with drafts, drafts computed, drafts kept
    spec_decode_num_speculative_tokens: int = 0
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    host_kv_blocks_total: int = 0
    host_kv_blocks_cached: int = 0
    host_offloaded_blocks_total: int = 0
    host_reloaded_blocks_total: int = 0
    host_prefetched_blocks_total: int = 0
    host_recompute_chosen_blocks_total: int = 0
    host_evictions_total: int = 0
    host_bytes_to_host_total: int = 0
    host_bytes_to_device_total: int = 0
    kv_block_size: int = 0
    #: how far the adaptive program order may move a request ahead of its arrival, under the
    #: stated time-to-first-token target (``inf``: no target, or another order)
    order_slack_seconds: float = math.inf

    def as_dict(self) -> dict[str, int | float]:
        """Field name -> value, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CompletionOutput:
    """One sampled sequence of a prompt (vLLM's ``CompletionOutput``): choice ``index`` of
    its :class:`GenerationOutput`, run as request ``request_id``.

    ``cumulative_logprob`` is the sum of the sampled tokens' log probabilities when the
    params asked for ``logprobs`` (``None`` otherwise); ``metrics`` are the request's."""

    index: int
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[Any] | None
    cumulative_logprob: float | None
    metrics: Any


@dataclass(frozen=True)
class GenerationOutput:
    """Result of :meth:`Engine.generate` for one prompt (``logprobs``: one
    :class:`~asymcache_core.logprobs.TokenLogprob` per token when its params asked for them;
    ``prompt_logprobs``: one per prompt token, the first None, when they asked for those;
    ``stop_reason``: the stop string or stop token id that ended it, None for an EOS or a
    length limit, as vLLM's).

    ``outputs`` holds every choice of the prompt (``SamplingParams.n`` of them, vLLM's
    ``RequestOutput.outputs``); the fields before it are choice 0's, so one-choice code reads
    ``out.text`` and vLLM-style code ``out.outputs[0].text``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: Any
    logprobs: list[Any] | None = None
    prompt_logprobs: tuple[Any, ...] | None = None
    stop_reason: int | str | None = None
    outputs: tuple[CompletionOutput, ...] = ()


def collect_stats(engine: Engine) -> EngineStats:
    """The engine's gauges and counters now (:meth:`Engine.stats <asymcache_core.engine.Engine.stats>`)."""
    c, pool, pins, target = engine.counters, engine.pool, engine.pins, engine.continuum.ttft_target
    spec = engine.scheduler.speculation
    return EngineStats(
        kv_blocks_total=engine.num_blocks,
        kv_blocks_in_use=pool.num_in_use,
        kv_blocks_peak_in_use=pool.peak_in_use,
        requests_running=len(engine.scheduler.running),
        requests_waiting=len(engine.scheduler.waiting),
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
        jobs_admitted=engine.job_admission.num_jobs if engine.job_admission is not None else 0,
        jobs_held_back_total=engine.job_admission.num_held_back if engine.job_admission is not None else 0,
        implicit_jobs_matched_total=engine.implicit_jobs.matched if engine.implicit_jobs is not None else 0,
        implicit_jobs_started_total=engine.implicit_jobs.started if engine.implicit_jobs is not None else 0,
        job_gate_capacity_tokens=engine.job_admission.capacity_tokens if engine.job_admission is not None else 0,
        engine_reload_tokens_total=c.reload_tokens,
        engine_jump_forward_tokens_total=engine.scheduler.num_jump_forward_tokens,
        spec_decode_num_speculative_tokens=(
            engine.scheduler.proposer.config.num_speculative_tokens if engine.scheduler.proposer is not None else 0
        ),
        spec_decode_num_drafts_total=spec.num_drafts,
        spec_decode_num_draft_tokens_total=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens,
        kv_block_size=engine.block_size,
        order_slack_seconds=target.slack_s if target is not None else math.inf,
        **(engine.host_driver.stats() if engine.host_driver is not None else {}),
    )
