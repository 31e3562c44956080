"""A run's measurements and their summaries: every request's record (:class:`RequestRecord`),
one policy's run (:class:`RunOutcome`), and how runs become the results schema's
:class:`~eval.results.PolicyResult` (vLLM `bench serve` figures, goodput, where job time goes,
``--repeats`` pooled). Every backend (:mod:`eval.harness`, :mod:`eval.http_backend`) produces
these records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
