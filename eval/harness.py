"""The benchmark harness: one workload, a grid of policies, side by side, in one run.

Backends:

- ``real``: the engine runs the model; tool pauses are real sleeps scaled by ``time_scale``;
  outputs are greedy with the trace's lengths (``ignore_eos``), so every policy must produce the
  same tokens as an unbounded-pool run (the lossless check).
- ``sim``: the same scheduler, cache manager, policies and pins; the forward pass is replaced by
  the latency model on a virtual clock (thousands of jobs in seconds).
- ``http``: any OpenAI-compatible server (ours or a real vLLM) through httpx
  (:mod:`eval.http_backend`).

Jobs are driven turn by turn: turn k's prompt is the job's whole context so far (previous
prompts, the model's answers, the new input), so a cache that kept the job's blocks serves it.
What a run measured, and its summaries into the results schema, are :mod:`eval.outcomes`.
"""

from __future__ import annotations

import heapq
import itertools
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from asymcache_core import Engine, EngineConfig, SamplingParams
from eval.outcomes import (
    PER_RUN_SERVING_KEYS,
    RequestRecord,
    RunOutcome,
    job_time,
    policy_result,
    repeated_result,
    serving_metrics,
)
from workloads import Job, Trace, job_token_stream

if TYPE_CHECKING:
    from eval.variants import BenchVariant

# NOTE: the records and their summaries live in eval.outcomes; they are exported here too, under
# their old home's names, which the bench, the scripts and the tests use
__all__ = [
    "PER_RUN_SERVING_KEYS", "RequestRecord", "RunOutcome", "drive", "job_time", "largest_request_blocks",
    "machine_description", "make_engine", "policy_result", "repeated_result", "serving_metrics", "warm_up",
    "working_set_blocks",
]


@dataclass
class _JobState:
    job: Job
    inputs: list[list[int]]
    context: list[int] = field(default_factory=list)
    turn: int = 0
    first_arrival: float | None = None


def working_set_blocks(trace: Trace, block_size: int) -> int:
    """Blocks the workload would cache if nothing were evicted (shared prefixes counted once)."""
    shared: dict[str, int] = {}
    own = 0
    for job in trace.jobs:
        total = job.total_tokens
        if job.shared_prefix_id:
            shared[job.shared_prefix_id] = max(shared.get(job.shared_prefix_id, 0), job.shared_prefix_tokens)
            total -= job.shared_prefix_tokens
        own += -(-total // block_size)
    return own + sum(-(-t // block_size) for t in shared.values())


def largest_request_blocks(trace: Trace, block_size: int) -> int:
    return max(-(-job.total_tokens // block_size) for job in trace.jobs) + 1


def drive(
    engine: Engine,
    trace: Trace,
    policy: BenchVariant,
    *,
    time_scale: float,
    seed: int,
    concurrency: int | None,
    sleep: Callable[[float], None] | None,
    on_progress: Callable[[int], None] | None = None,
) -> RunOutcome:
    """Runs ``trace`` through ``engine`` and measures every request and job.

    Args:
        engine: a fresh engine (its clock is the run's clock).
        trace: the workload.
        policy: pins and TTL rule (the engine already has the policy's overrides).
        time_scale: multiplies tool pauses (and think times). Arrivals are not scaled: a job's
            ``arrival_s`` is seconds of the run, so ``--rate`` is jobs per second of the run.
        seed: token streams' seed.
        concurrency: closed loop with this many jobs in flight (None: the trace's arrivals).
        sleep: waits for real time to pass; ``None`` for an engine on a virtual clock
            (:meth:`Engine.simulated`), which :meth:`Engine.idle_until` moves instead.
        on_progress: called with the number of finished jobs.
    """
    clock = engine.clock
    t0 = clock()
    vocab = engine.model_config.vocab_size
    controller = engine.continuum.configure(pinning=policy.pinning, ttl_rule=policy.ttl_rule)
    if policy.anonymous:
        engine.use_implicit_jobs()  # NOTE: as the agent runtime does (it ends jobs the same way below)
    states = {j.job_id: _JobState(j, job_token_stream(j, vocab, seed)) for j in trace.jobs}
    events: list[tuple[float, int, str]] = []
    order = itertools.count()
    pending_jobs = list(trace.jobs)
    if concurrency is not None:
        for job in pending_jobs[:concurrency]:
            heapq.heappush(events, (t0, next(order), job.job_id))
        pending_jobs = pending_jobs[concurrency:]
    else:
        for job in pending_jobs:
            heapq.heappush(events, (t0 + job.arrival_s, next(order), job.job_id))
        pending_jobs = []
    running: dict[str, str] = {}  # request id -> job id
    engine_jobs: dict[str, str | None] = {}  # trace job id -> the job the engine has it under
    records: list[RequestRecord] = []
    jct: dict[str, float] = {}
    pinned_peak = 0
    token_times: dict[str, float] = {}  # request id -> when its last token came
    itls: dict[str, list[float]] = {}

    def submit(job_id: str, now: float) -> None:
        """Queues the job's next turn, which arrived (was due) at ``now``."""
        st = states[job_id]
        turn = st.job.turns[st.turn]
        st.context = st.context + st.inputs[st.turn]
        if st.first_arrival is None:
            st.first_arrival = now
        last = st.turn == len(st.job.turns) - 1
        if not policy.anonymous:
            controller.on_request_arrival(job_id, now)
        rid = engine.add_request(
            st.context,
            SamplingParams(max_tokens=max(1, turn.output_tokens), ignore_eos=True),
            job_id=None if policy.anonymous else job_id,
            request_id=f"{job_id}/{st.turn}",
            is_last_step=last and not policy.anonymous,
            arrival_time=now,
        )
        engine_jobs[job_id] = engine.requests[rid].job_id
        known = engine_jobs[job_id]
        if policy.anonymous and known is not None:
            controller.on_request_arrival(known, now)
        running[rid] = job_id

    while events or running:
        now = clock()
        while events and events[0][0] <= now:
            due, _, job_id = heapq.heappop(events)
            # NOTE: a turn due while a step ran reaches the engine at the step's end, but its
            # client sent it when due: its TTFT, queueing and its job's JCT count from then.
            submit(job_id, due)
        if running:
            for out in engine.step():
                if out.new_token_ids:
                    # NOTE: the step's end is when its tokens reach a client; the gaps between a
                    # request's token steps are its inter-token latencies.
                    now = clock()
                    last = token_times.get(out.request_id)
                    if last is not None:
                        itls.setdefault(out.request_id, []).append(now - last)
                    token_times[out.request_id] = now
                if not out.finished:
                    continue
                token_times.pop(out.request_id, None)
                job_id = running.pop(out.request_id)
                st = states[job_id]
                m = out.metrics
                end = m.finish_time if m.finish_time is not None else clock()
                records.append(
                    RequestRecord(
                        job_id, st.turn, m.arrival_time, m.first_scheduled_time, m.first_token_time, end,
                        out.num_prompt_tokens, m.cached_tokens, list(out.token_ids), m.ttft, m.tpot,
                        m.computed_tokens, m.hole_tokens, m.num_preemptions, itls.pop(out.request_id, []),
                    )
                )
                st.context = st.context + list(out.token_ids)
                turn = st.job.turns[st.turn]
                st.turn += 1
                known = engine_jobs.get(job_id)
                if policy.anonymous and known is not None and not turn.tool:
                    # NOTE: what the agent runtime does for a job the engine gave: a reply that
                    # calls no tool ends it (the client never says its last step)
                    controller.on_job_finished(known)
                    engine.end_job(known)
                if st.turn < len(st.job.turns):
                    if turn.tool and known is not None:
                        controller.on_tool_call(known, [turn.tool], len(st.context), ended_at=end)
                    pause = st.job.pause_after(st.turn - 1) * time_scale
                    heapq.heappush(events, (end + pause, next(order), job_id))
                else:
                    if not policy.anonymous:
                        controller.on_job_finished(job_id, len(st.job.turns))
                    assert st.first_arrival is not None
                    jct[job_id] = end - st.first_arrival
                    if on_progress is not None:
                        on_progress(len(jct))
                    if pending_jobs:
                        nxt = pending_jobs.pop(0)
                        heapq.heappush(events, (end, next(order), nxt.job_id))
            pinned_peak = max(pinned_peak, engine.stats().pinned_blocks)
            if engine.stalled:
                # NOTE: everything submitted waits (job admission holds it back between turns):
                # only the next event (a pause ending, a job arriving) can change that.
                if not events:
                    raise RuntimeError("the engine stalled with no event left to wait for")
                wait = events[0][0] - clock()
                if wait > 0 and sleep is not None:
                    sleep(wait)
                engine.idle_until(max(events[0][0], clock()))
        elif events:
            wait = events[0][0] - clock()
            if wait > 0 and sleep is not None:
                sleep(wait)
            # NOTE: the virtual clock jumps to the next event; a real one has just been slept
            # through. Either way the idle engine expires the pins due by then.
            engine.idle_until(events[0][0])
    engine.check_integrity()
    final = engine.stats()
    stats = {
        "prompt_tokens": final.engine_prompt_tokens_total,
        "hit_tokens": final.engine_cache_hit_tokens_total,
        "hole_tokens": final.engine_hole_tokens_total,
        "suffix_recomputed_tokens": final.engine_suffix_recomputed_tokens_total,
        "preempted_tokens": final.engine_preempted_tokens_total,
        "computed_tokens": final.engine_computed_tokens_total,
        "generated_tokens": final.engine_generated_tokens_total,
        "evictions": final.evictions_total,
        "peak_blocks_in_use": final.kv_blocks_peak_in_use,
        "num_preemptions": final.preemptions_total,
    }
    if final.host_kv_blocks_total:
        stats |= {
            "host_blocks": final.host_kv_blocks_total,
            "host_offloaded_blocks": final.host_offloaded_blocks_total,
            "host_reloaded_blocks": final.host_reloaded_blocks_total,
            "host_prefetched_blocks": final.host_prefetched_blocks_total,
            "host_recompute_chosen_blocks": final.host_recompute_chosen_blocks_total,
            "host_evictions": final.host_evictions_total,
            "host_bytes_to_host": final.host_bytes_to_host_total,
            "host_bytes_to_device": final.host_bytes_to_device_total,
            "host_reload_tokens": final.engine_reload_tokens_total,
            "host_gate_blocks": final.job_gate_capacity_tokens // max(1, final.kv_block_size),
        }
    series = [(s.start - t0, s.blocks_in_use) for s in engine.step_log]
    stride = max(1, len(series) // 400)
    return RunOutcome(
        policy.name, records, jct, clock() - t0, stats, series[::stride],
        [s.budget for s in engine.step_log][::stride], pinned_peak, t0,
    )


def machine_description(device: str) -> str:
    import torch

    desc = f"{platform.machine()} {platform.system()}, {__import__('os').cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    if device.startswith("cuda") and torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name(0)}"
    return desc


def warm_up(loaded: Any, config: EngineConfig, long_context: int = 10_000) -> None:
    """Runs the kernels' launch shapes once on a throwaway engine sharing ``loaded``.

    NOTE: Triton compiles each MSA tile configuration (tile height, KV split or not) on its
    first use, about a second each on a GPU. Without a warm-up the first policy of a grid pays
    every compile inside its TTFTs. The compiled kernels are process-wide, so a separate engine
    (its own pool, nothing left in the measured engines' caches) is enough.

    Args:
        loaded: the shared model.
        config: the benchmark's engine config (its pool size is replaced).
        long_context: a context long enough for split-K launches.
    """
    blocks = 2 * (-(-(long_context + 64) // config.block_size)) + 64
    engine = Engine(
        replace(config, num_kv_blocks=blocks, eviction_policy="vllm-apc", hole_reuse=None, enforce_eager=True),
        loaded=loaded,
    )
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    long_prompt = [(7 * i) % (vocab - 3) + 3 for i in range(long_context)]
    prompts = [[5 + n] * n for n in (3, 6, 12, 24, 48, 100)]  # each tile height, no split
    prompts.append(long_prompt)
    prompts += [long_prompt + [4] * n for n in (3, 6, 12, 24, 48)]  # the same, split over long KV
    for prompt in prompts:
        engine.generate([prompt], params)
    engine.check_integrity()


def make_engine(
    config: EngineConfig,
    backend: str,
    loaded: Any = None,
) -> Engine:
    """A fresh engine for one policy's run (``sim``: :meth:`Engine.simulated`)."""
    if backend == "sim":
        return Engine.simulated(config)
    return Engine(config, loaded=loaded, clock=time.monotonic)
