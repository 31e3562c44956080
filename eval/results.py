"""The ``results.json`` schema of an eval run, and helpers to build it (:func:`summarize`,
:func:`serving_latency_keys`); :mod:`eval.results_io` saves and loads it.

One eval run (a workload replayed against a grid of bench variants, the entries of
``--policies``: a serving preset plus ablation suffixes) writes one folder::

    RUN_DIR/
      results.json         # a ``Results`` document (this module; eval.results_io writes it)
      results.schema.json  # ``Results.model_json_schema()``, for other tools and for humans
      report.md, report.html, *.png   # written by ``eval.report`` from results.json alone

All times are in seconds. They are wall-clock seconds for the ``real`` and ``http`` backends and
virtual seconds for the ``sim`` backend; ``RunInfo.backend`` says which.

This module depends only on pydantic and numpy (no torch, no engine code) so that reading a run
back, e.g. ``asymcache report RUN_DIR``, stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    model_validator,
)

#: The schema version this module writes and reads. Bump it on an incompatible change.
SCHEMA_VERSION = 2


class _Model(BaseModel):
    """Base of every schema model: unknown fields are errors, so typos in a writer show up; NaN
    and infinities are errors too (JSON has no spelling for them; a reader would get null)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


#: Slack of the percentile order check: numpy's interpolation may put equal percentiles an
#: ulp or so apart.
_ORDER_SLACK = 1e-9


def _ordered(low: float, high: float) -> bool:
    """Whether ``low <= high`` up to float noise."""
    return high >= low - _ORDER_SLACK * max(1.0, abs(low))


class Summary(_Model):
    """Distribution summary of one latency metric, in seconds.

    Percentiles use numpy's default (linear interpolation). When ``count`` is 0 the statistics
    are ``None``; when ``count`` is positive they must all be present, none negative, and the
    percentiles in order (p50 <= p90 <= p95 <= p99, up to float noise).
    """

    mean: float | None = Field(description="Arithmetic mean (s); None when count == 0.")
    p50: float | None = Field(description="Median (s); None when count == 0.")
    p90: float | None = Field(description="90th percentile (s); None when count == 0.")
    p95: float | None = Field(description="95th percentile (s); None when count == 0.")
    p99: float | None = Field(description="99th percentile (s); None when count == 0.")
    count: int = Field(ge=0, description="Number of samples summarized.")

    @model_validator(mode="after")
    def _stats_match_count(self) -> Summary:
        stats = (self.mean, self.p50, self.p90, self.p95, self.p99)
        if self.count > 0 and any(v is None for v in stats):
            raise ValueError(f"count is {self.count} but some statistics are null")
        if self.count == 0 and any(v is not None for v in stats):
            raise ValueError("count is 0 but some statistics are set")
        if self.count == 0:
            return self
        named = {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p95": self.p95, "p99": self.p99}
        for name, value in named.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} is negative ({value}); latencies are >= 0")
        order = ("p50", "p90", "p95", "p99")
        for low, high in zip(order, order[1:], strict=False):
            if not _ordered(named[low] or 0.0, named[high] or 0.0):
                raise ValueError(f"{high} ({named[high]}) is below {low} ({named[low]}); percentiles must rise")
        return self


class Recompute(_Model):
    """Prompt tokens whose KV had to be computed again although it had been computed before.

    ``hole``: tokens inside a reused prefix whose blocks had been evicted (a "hole" refilled);
    ``suffix``: evicted tokens at the end of a reused prefix; ``preempted``: tokens recomputed
    because their request was preempted. ``total`` is at least the sum of the three (a writer may
    count other causes in ``total`` only).
    """

    hole: int = Field(ge=0)
    suffix: int = Field(ge=0)
    preempted: int = Field(ge=0)
    total: int = Field(ge=0)

    @model_validator(mode="after")
    def _total_covers_parts(self) -> Recompute:
        parts = self.hole + self.suffix + self.preempted
        if self.total < parts:
            raise ValueError(
                f"total ({self.total}) is less than hole + suffix + preempted ({parts})"
            )
        return self


class Series(_Model):
    """Raw per-job / per-request / per-step data behind the summaries and the plots."""

    jct: list[NonNegativeFloat] = Field(default_factory=list, description="Job completion time per job (s).")
    ttft: list[NonNegativeFloat] = Field(
        default_factory=list, description="Time to first token per request (s)."
    )
    tpot: list[NonNegativeFloat] = Field(
        default_factory=list, description="Time per output token per request (s)."
    )
    blocks_in_use: list[tuple[float, int]] = Field(
        default_factory=list, description="(time in s since the start, KV blocks in use) samples."
    )
    budget: list[int] = Field(
        default_factory=list, description="Token budget per engine step (may be empty)."
    )


class JobTime(_Model):
    """Where a job's completion time goes, in seconds, mean over jobs.

    For each of a job's requests (turns): waiting before its first scheduling (``queue_s``:
    admission, job admission included), from then to its first token (``prefill_s``: the
    prompt's computation, recomputed history included, and the steps it shared) and from there
    to its end (``decode_s``); ``pause_s`` is the rest of the job's time, between a turn's end
    and its next turn's arrival (tool calls, the client). The four add up to the mean JCT.
    """

    queue_s: float = Field(ge=0.0)
    prefill_s: float = Field(ge=0.0)
    decode_s: float = Field(ge=0.0)
    pause_s: float = Field(ge=0.0)


class RunMeans(_Model):
    """The headline means of one run of a policy (``--repeats``: one per repetition)."""

    jct_mean: float | None = Field(default=None, description="Mean JCT of the run (s).")
    ttft_mean: float | None = Field(default=None, description="Mean TTFT of the run (s).")
    tpot_mean: float | None = Field(default=None, description="Mean TPOT of the run (s).")
    computed_tokens: int = Field(ge=0, description="Tokens computed in the run.")


class SLO(_Model):
    """Service-level objectives a job must meet to count towards goodput (``--slo``).

    A job is *good* when its completion time is within ``jct_s`` and every one of its requests
    meets ``ttft_ms`` and ``tpot_ms`` (an unset target is not checked). A request is good (vLLM's
    ``request_goodput``) when it meets ``ttft_ms`` and ``tpot_ms``.
    """

    jct_s: float | None = Field(default=None, gt=0, description="Job completion time target (s).")
    ttft_ms: float | None = Field(default=None, gt=0, description="Time-to-first-token target (ms).")
    tpot_ms: float | None = Field(default=None, gt=0, description="Time-per-output-token target (ms).")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """Parses ``jct:S,ttft:MS,tpot:MS`` (any subset, any order).

        Raises:
            ValueError: an unknown key or a value that is not a positive number (names ``slo``).
        """
        values: dict[str, float] = {}
        keys = {"jct": "jct_s", "ttft": "ttft_ms", "tpot": "tpot_ms"}
        for part in (p.strip() for p in text.split(",")):
            key, _, raw = part.partition(":")
            if not part:
                raise ValueError(f"slo: an empty item in {text!r}")
            if key not in keys:
                raise ValueError(f"slo: unknown target {key!r} in {text!r}; known: jct:S, ttft:MS, tpot:MS")
            if keys[key] in values:
                raise ValueError(f"slo: {key} is given twice in {text!r}")
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"slo: {key} needs a positive number, got {raw!r}")
            values[keys[key]] = value
        if not values:
            raise ValueError(f"slo: no target in {text!r}; e.g. jct:300,ttft:2000,tpot:100")
        return cls(**values)

    def request_ok(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether one request meets the TTFT and TPOT targets.

        Args:
            ttft_s: its time to first token (``None``: not measured, e.g. no token came).
            tpot_s: its time per output token (``None``: not measured; a caller passes 0 for
                a reply of one token, which has no time between tokens, as vLLM does).

        Returns:
            False when a set target is missed or its figure is missing (NOTE: a request whose
            latency is unknown cannot be shown to meet a target, so it is not good).
        """
        for target, value in ((self.ttft_ms, ttft_s), (self.tpot_ms, tpot_s)):
            if target is not None and (value is None or value * 1e3 > target):
                return False
        return True


class HostTierResult(_Model):
    """The host KV tier's counters of one run (per-run means with ``--repeats``)."""

    blocks: int = Field(ge=0, description="Host tier size in blocks.")
    offloaded_blocks: int = Field(ge=0, description="Blocks copied device -> host.")
    reloaded_blocks: int = Field(ge=0, description="Blocks copied host -> device (prefetches included).")
    prefetched_blocks: int = Field(ge=0, description="Reloads ahead of a paused job's next turn.")
    recompute_chosen_blocks: int = Field(ge=0, description="Host hits recomputed because that was cheaper.")
    evictions: int = Field(ge=0, description="Host slots evicted.")
    bytes_to_host: int = Field(ge=0)
    bytes_to_device: int = Field(ge=0)
    reload_tokens: int = Field(ge=0, description="Request tokens served by reloads instead of computed.")
    gate_blocks: int = Field(
        default=0, ge=0,
        description="Blocks job admission admitted jobs against at the run's end: the device pool plus the part "
        "of the tier the jobs' tool pauses leave room for (0: no job admission).",
    )


class PolicyResult(_Model):
    """Everything measured for one entry of ``--policies`` (a bench variant) on the run's workload.

    When the variant ran more than once (``--repeats``), latency summaries pool the requests of
    every run, counters and volumes are per-run means, and ``runs`` keeps each run's means.
    """

    jct: Summary = Field(description="Job (whole agent task) completion time.")
    ttft: Summary = Field(description="Time to first token, per request.")
    tpot: Summary = Field(description="Time per output token after the first, per request.")
    itl: Summary | None = Field(default=None, description="Inter-token latency, per token after the first.")
    queue: Summary = Field(description="Time a request waited before its first scheduling.")
    hit_rate: float = Field(ge=0.0, le=1.0, description="hit_tokens / prompt_tokens.")
    recomputed_tokens: Recompute
    evictions: int = Field(ge=0, description="KV blocks evicted.")
    throughput_tok_s: float = Field(ge=0.0, description="Generated tokens / run time (tok/s).")
    lossless_agreement: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description=(
            "Fraction of requests whose generated tokens equal those of the unbounded-pool run; "
            "None if not checked."
        ),
    )
    num_jobs: int = Field(ge=0)
    num_requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    hit_tokens: int = Field(ge=0)
    computed_tokens: int = Field(ge=0)
    generated_tokens: int = Field(ge=0)
    peak_blocks_in_use: int = Field(ge=0)
    pinned_blocks_peak: int = Field(default=0, ge=0)
    duration_s: float = Field(ge=0.0, description="Run time of this policy (s).")
    jobs_per_hour: float = Field(default=0.0, ge=0.0, description="Jobs completed per hour of the run (one GPU).")
    goodput_jobs_per_hour: float | None = Field(
        default=None, ge=0.0, description="Jobs per hour that met every target of the run's SLO; None without one."
    )
    serving: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "The run's figures under vLLM `bench serve` key names (milliseconds: mean_ttft_ms, p99_itl_ms, "
            "request_throughput, request_goodput, ...), plus the same shape for jobs (mean_jct_ms, p90_jct_ms, "
            "job_goodput)."
        ),
    )
    series: Series = Field(default_factory=Series)
    job_time: JobTime | None = Field(
        default=None, description="Where the mean job's completion time goes; None for runs without jobs."
    )
    host_tier: HostTierResult | None = Field(default=None, description="The host KV tier's counters; None without one.")
    runs: list[RunMeans] = Field(
        default_factory=list, description="Each run's means when the policy ran more than once."
    )

    @model_validator(mode="after")
    def _hits_within_prompts(self) -> PolicyResult:
        if self.hit_tokens > self.prompt_tokens:
            raise ValueError(f"hit_tokens ({self.hit_tokens}) exceed prompt_tokens ({self.prompt_tokens})")
        negative = sorted(k for k, v in self.serving.items() if v < 0)
        if negative:
            raise ValueError(f"serving.{negative[0]} is negative ({self.serving[negative[0]]})")
        return self


class RunInfo(_Model):
    """What was run, where and how: enough to reproduce the run and to label the report."""

    workload: str
    backend: Literal["real", "sim", "http"]
    model: str
    device: str
    seed: int
    num_jobs: int = Field(ge=0)
    kv_blocks: int | None = Field(default=None, ge=0, description="KV pool size; None = unbounded.")
    block_size: int = Field(gt=0, description="Tokens per KV block.")
    latency_profile: str
    started: str = Field(description="Start time, ISO 8601.")
    duration_s: float = Field(ge=0.0, description="Wall time of the whole run (s).")
    command: str = Field(description="The command line that produced the run.")
    machine: str = Field(description="Host description (CPU/GPU, OS, Python, torch).")
    notes: list[str] = Field(default_factory=list)
    concurrency: int | None = Field(default=None, description="Jobs in flight (closed loop); None with --rate.")
    rate: float | None = Field(
        default=None, description="Poisson job arrivals (jobs per second of the run, not scaled); None: closed loop."
    )
    time_scale: float | None = Field(
        default=None, ge=0.0, description="Multiplier of the tool pauses and think times; None: not recorded."
    )
    slo: SLO | None = Field(default=None, description="The targets goodput counts against.")


class Results(_Model):
    """The whole ``results.json`` document of one eval run."""

    schema_version: int = Field(default=SCHEMA_VERSION, description="Format version.")
    run: RunInfo
    policies: dict[str, PolicyResult] = Field(
        description="Results per --policies entry (bench variant); insertion order is the display order."
    )

    @model_validator(mode="after")
    def _known_version(self) -> Results:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported (expected {SCHEMA_VERSION})"
            )
        return self


def summarize(values: Sequence[float]) -> Summary:
    """Summarize a list of latencies.

    Args:
        values: Samples in seconds, any order. Must be finite: a NaN or infinite latency is a
            bug in the caller, and silently dropping it would shift the statistics.

    Returns:
        A ``Summary`` with mean and p50/p95/p99 (numpy linear interpolation) and the count;
        all statistics are ``None`` for an empty input.

    Raises:
        ValueError: If a value is NaN or infinite.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return Summary(mean=None, p50=None, p90=None, p95=None, p99=None, count=0)
    if not np.all(np.isfinite(arr)):
        raise ValueError("summarize() got NaN or infinite values")
    p50, p90, p95, p99 = np.percentile(arr, [50.0, 90.0, 95.0, 99.0])
    return Summary(
        mean=float(arr.mean()), p50=float(p50), p90=float(p90), p95=float(p95), p99=float(p99),
        count=int(arr.size),
    )


#: The percentiles written under vLLM `bench serve` names (``p99_ttft_ms``; 50 is ``median_``).
SERVING_PERCENTILES = (90.0, 95.0, 99.0)


def serving_latency_keys(name: str, values: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_<name>_ms`` of latencies given in seconds, as vLLM's
    `bench serve` names them; empty for no samples."""
    arr = np.asarray(list(values), dtype=np.float64) * 1e3
    if arr.size == 0:
        return {}
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p, v in zip(SERVING_PERCENTILES, np.percentile(arr, SERVING_PERCENTILES), strict=True):
        out[f"p{int(p)}_{name}_ms"] = float(v)
    return out


def results_json_schema() -> dict[str, Any]:
    """The JSON schema of ``results.json``.

    Returns:
        ``Results.model_json_schema()``, a JSON-serializable dict.
    """
    return Results.model_json_schema()
