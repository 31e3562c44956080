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
from eval.results import (
    SLO,
    HostTierResult,
    JobTime,
    PolicyResult,
    Recompute,
    RunMeans,
    Series,
    serving_latency_keys,
    summarize,
)
from workloads import Job, Trace, job_token_stream

if TYPE_CHECKING:
    from eval.variants import BenchVariant

@dataclass
class RequestRecord:
    """One LLM call of one job, as measured."""

    job_id: str
    turn: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finish: float
    prompt_tokens: int
    cached_tokens: int
    output: list[int]
    ttft: float | None
    tpot: float | None
    computed_tokens: int = 0
    hole_tokens: int = 0
    preemptions: int = 0
    itl: list[float] = field(default_factory=list)

    def log_row(self, t0: float) -> dict[str, Any]:
        """The record as one row of a request log (times in seconds from the run's start)."""

        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        return {
            "job_id": self.job_id, "turn": self.turn, "arrival": rel(self.arrival),
            "first_scheduled": rel(self.first_scheduled), "first_token": rel(self.first_token),
            "finish": rel(self.finish), "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "computed_tokens": self.computed_tokens,
            "hole_tokens": self.hole_tokens, "preemptions": self.preemptions,
            "output_tokens": len(self.output), "ttft": self.ttft, "tpot": self.tpot,
        }


@dataclass
class RunOutcome:
    """Everything one policy's run produced."""

    policy: str
    records: list[RequestRecord]
    jct: dict[str, float]
    duration_s: float
    engine_stats: dict[str, Any] = field(default_factory=dict)
    blocks_in_use: list[tuple[float, int]] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    pinned_peak: int = 0
    start: float = 0.0
    #: ``jct`` key -> the job id its records carry, where they differ (pooled runs key each
    #: run's job apart). NOTE: a map, not a suffix to cut off: a job id may hold any character.
    job_keys: dict[str, str] = field(default_factory=dict)

    def outputs(self) -> dict[tuple[str, int], list[int]]:
        return {(r.job_id, r.turn): r.output for r in self.records}


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


def serving_metrics(outcome: RunOutcome, slo: SLO | None) -> tuple[dict[str, float], float | None]:
    """The run's figures under vLLM `bench serve` key names, and its job goodput.

    Args:
        outcome: the run.
        slo: the targets (``None``: no goodput).

    Returns:
        ``(serving, goodput_jobs_per_hour)``: the key -> value table of
        :attr:`eval.results.PolicyResult.serving` and the jobs per hour that met every target
        (``None`` without an SLO).
    """
    records = outcome.records
    duration = max(outcome.duration_s, 1e-9)
    inputs = sum(r.prompt_tokens for r in records)
    outputs = sum(len(r.output) for r in records)
    serving: dict[str, float] = {
        "completed": float(len(records)),
        "duration": outcome.duration_s,
        "total_input_tokens": float(inputs),
        "total_output_tokens": float(outputs),
        "request_throughput": len(records) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "completed_jobs": float(len(outcome.jct)),
        "job_throughput": len(outcome.jct) / duration,
    }
    serving |= serving_latency_keys("ttft", [r.ttft for r in records if r.ttft is not None])
    serving |= serving_latency_keys("tpot", [r.tpot for r in records if r.tpot is not None])
    serving |= serving_latency_keys("itl", [gap for r in records for gap in r.itl])
    serving |= serving_latency_keys("e2el", [r.finish - r.arrival for r in records])
    serving |= serving_latency_keys("jct", list(outcome.jct.values()))
    if slo is None:
        return serving, None
    # NOTE: a one-token reply has no TPOT and nothing to miss it by (vLLM counts it as 0)
    request_good = [slo.request_ok(r.ttft, 0.0 if r.tpot is None and len(r.output) <= 1 else r.tpot) for r in records]
    serving["request_goodput"] = sum(request_good) / duration
    bad_jobs = {r.job_id for r, ok in zip(records, request_good, strict=True) if not ok}
    good_jobs = sum(
        1 for key, t in outcome.jct.items()
        if outcome.job_keys.get(key, key) not in bad_jobs and (slo.jct_s is None or t <= slo.jct_s)
    )
    serving["job_goodput"] = good_jobs / duration
    return serving, good_jobs / duration * 3600.0


def job_time(outcome: RunOutcome) -> JobTime | None:
    """Where the mean job's completion time goes (:class:`~eval.results.JobTime`), over the
    jobs that completed; ``None`` when none did or no request has a scheduling time.

    NOTE: per request, its time before its first scheduling is queueing, from there to its
    first token prefill (a request preempted before its first token counts its wait again as
    prefill), and the rest decode; whatever of the job's time no request covers is a pause.
    """
    if not outcome.jct or all(r.first_scheduled is None for r in outcome.records):
        # NOTE: without scheduling times (a client of an HTTP server) the split is unknown
        return None
    spans: dict[str, list[float]] = {job: [0.0, 0.0, 0.0] for job in outcome.jct}
    for r in outcome.records:
        span = spans.get(r.job_id)
        if span is None or r.first_scheduled is None:
            continue
        first_token = r.first_token if r.first_token is not None else r.finish
        span[0] += r.first_scheduled - r.arrival
        span[1] += first_token - r.first_scheduled
        span[2] += r.finish - first_token
    n = len(spans)
    queue, prefill, decode = (sum(span[i] for span in spans.values()) / n for i in range(3))
    jct = sum(outcome.jct.values()) / n
    return JobTime(
        queue_s=max(queue, 0.0), prefill_s=max(prefill, 0.0), decode_s=max(decode, 0.0),
        pause_s=max(jct - queue - prefill - decode, 0.0),
    )


def policy_result(
    outcome: RunOutcome, reference: dict[tuple[str, int], list[int]] | None, slo: SLO | None = None
) -> PolicyResult:
    """Summarises a run into the results schema (lossless agreement against ``reference``,
    goodput against ``slo``)."""
    s = outcome.engine_stats
    ttft = [r.ttft for r in outcome.records if r.ttft is not None]
    tpot = [r.tpot for r in outcome.records if r.tpot is not None]
    queue = [r.first_scheduled - r.arrival for r in outcome.records if r.first_scheduled is not None]
    agreement = None
    if reference is not None:
        outs = outcome.outputs()
        same = sum(1 for key, toks in outs.items() if reference.get(key) == toks)
        agreement = same / max(1, len(outs))
    hole, suffix, pre = s["hole_tokens"], s["suffix_recomputed_tokens"], s["preempted_tokens"]
    jcts = list(outcome.jct.values())
    serving, goodput = serving_metrics(outcome, slo)
    return PolicyResult(
        jct=summarize(jcts),
        ttft=summarize(ttft),
        tpot=summarize(tpot),
        itl=summarize([gap for r in outcome.records for gap in r.itl]),
        queue=summarize(queue),
        hit_rate=s["hit_tokens"] / max(1, s["prompt_tokens"]),
        recomputed_tokens=Recompute(hole=hole, suffix=suffix, preempted=pre, total=hole + suffix + pre),
        evictions=s["evictions"],
        throughput_tok_s=s["generated_tokens"] / max(outcome.duration_s, 1e-9),
        lossless_agreement=agreement,
        num_jobs=len(outcome.jct),
        num_requests=len(outcome.records),
        prompt_tokens=s["prompt_tokens"],
        hit_tokens=s["hit_tokens"],
        computed_tokens=s["computed_tokens"],
        generated_tokens=s["generated_tokens"],
        peak_blocks_in_use=s["peak_blocks_in_use"],
        pinned_blocks_peak=outcome.pinned_peak,
        duration_s=outcome.duration_s,
        jobs_per_hour=len(outcome.jct) / max(outcome.duration_s, 1e-9) * 3600.0,
        goodput_jobs_per_hour=goodput,
        serving=serving,
        series=Series(jct=jcts, ttft=ttft, tpot=tpot, blocks_in_use=outcome.blocks_in_use, budget=outcome.budgets),
        job_time=job_time(outcome),
        host_tier=HostTierResult(**{k.removeprefix("host_"): v for k, v in s.items() if k.startswith("host_")})
        if "host_blocks" in s
        else None,
    )


#: The ``serving`` keys that are counts or rates of one run: per-run means under ``--repeats``.
PER_RUN_SERVING_KEYS = (
    "completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "completed_jobs", "job_throughput",
    "request_goodput", "job_goodput",
)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def repeated_result(
    outcomes: list[RunOutcome], reference: dict[tuple[str, int], list[int]] | None, slo: SLO | None = None
) -> PolicyResult:
    """Summarises one or more runs of the same policy (``--repeats``).

    Latency summaries pool the requests and jobs of every run; counters (tokens, evictions,
    requests, jobs), throughputs and the run time are per-run means; lossless agreement is the
    mean of each run's; ``runs`` holds each run's own means, so the run-to-run spread stays
    visible.

    Args:
        outcomes: the runs of one policy.
        reference: the lossless reference outputs (``None``: not checked).
        slo: the goodput targets (``None``: no goodput).

    Returns:
        The policy's result; that of the run itself for a single run.

    Raises:
        ValueError: ``outcomes`` is empty.
    """
    if not outcomes:
        raise ValueError("outcomes: no run to summarise")
    single = [policy_result(o, reference, slo) for o in outcomes]
    if len(outcomes) == 1:
        return single[0]
    stats = {k: round(sum(o.engine_stats[k] for o in outcomes) / len(outcomes)) for k in outcomes[0].engine_stats}
    keys = {(i, job): f"{job}#{i}" for i, o in enumerate(outcomes) for job in o.jct}
    merged = RunOutcome(
        outcomes[0].policy,
        [r for o in outcomes for r in o.records],
        {keys[i, job]: t for i, o in enumerate(outcomes) for job, t in o.jct.items()},
        sum(o.duration_s for o in outcomes) / len(outcomes),
        stats,
        outcomes[0].blocks_in_use,
        outcomes[0].budgets,
        max(o.pinned_peak for o in outcomes),
        job_keys={key: job for (_, job), key in keys.items()},
    )
    pooled = policy_result(merged, None, slo)
    agreements = [r.lossless_agreement for r in single if r.lossless_agreement is not None]
    runs = [
        RunMeans(jct_mean=r.jct.mean, ttft_mean=r.ttft.mean, tpot_mean=r.tpot.mean, computed_tokens=r.computed_tokens)
        for r in single
    ]
    goodputs = [r.goodput_jobs_per_hour for r in single if r.goodput_jobs_per_hour is not None]
    serving = dict(pooled.serving)
    # NOTE: per run, then averaged: the pooled records hold every run's requests and jobs, but
    # the pooled duration is one run's (the mean), so pooled counts over it are N times too high.
    for key in PER_RUN_SERVING_KEYS:
        if key in serving:
            serving[key] = _mean([r.serving[key] for r in single])
    # NOTE: per run, then weighted by jobs: the pooled records repeat every job id once per run.
    times = [(r.job_time, r.num_jobs) for r in single if r.job_time is not None]
    jobs = sum(n for _, n in times)
    pooled_time = (
        JobTime(**{k: sum(getattr(t, k) * n for t, n in times) / jobs for k in JobTime.model_fields})
        if jobs else None
    )
    return pooled.model_copy(
        update={
            "job_time": pooled_time,
            "goodput_jobs_per_hour": sum(goodputs) / len(goodputs) if goodputs else None,
            "serving": serving,
            "lossless_agreement": sum(agreements) / len(agreements) if agreements else None,
            "num_jobs": round(_mean([r.num_jobs for r in single])),
            "num_requests": round(_mean([r.num_requests for r in single])),
            "jobs_per_hour": _mean([r.jobs_per_hour for r in single]),
            "throughput_tok_s": _mean([r.throughput_tok_s for r in single]),
            "runs": runs,
        }
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
