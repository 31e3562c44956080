"""vLLM's per-request and per-iteration statistics, accumulated on the engine thread.

What vLLM 0.32's Prometheus logger (``vllm/v1/metrics/loggers.py``) computes from the engine's
outputs, computed here from the engine's own records: each finished request's
:class:`~asymcache_core.request.RequestMetrics` (:meth:`ServingStats.on_finish`, the
scheduler's finish hook) and each step's computed tokens (:meth:`ServingStats.on_step`, when
the step is logged). The histograms are cumulative (bounded memory whatever the uptime), so a
``/metrics`` scrape reads a :class:`ServingStatsSnapshot` on the engine thread and loses nothing
between scrapes.

Semantics, as vLLM's:

- a request finished by the client (:meth:`Engine.abort <asymcache_core.engine.Engine.abort>`,
  a disconnect) is no finished request of vLLM's: it is not in ``finished`` nor the
  per-request histograms, but its time to first token and inter-token latencies count (vLLM
  observes those step by step, while the request runs);
- a request that failed alone (``request.error``: a fault of its forward pass, its sampler or
  its detokenizer) finishes as ``error``, also when it failed after the scheduler had finished
  it (its last token's text failed to decode): vLLM counts the reason its output processor
  settles on after detokenizing, and ``error`` is its documented reason of a request-level
  failure (always a 500); a stop string found in that last token's text likewise turns a
  ``length`` finish into ``stop`` (:meth:`ServingStats.on_reason_settled`);
- inter-token latencies are one per step that gave the request tokens (tokens that a
  constraint forced in the same step, jump-forward, are no interval of their own);
- queue time runs from arrival to the first step that ran any of its tokens (preemptions
  aside), as vLLM's ``QUEUED`` to first ``SCHEDULED``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asymcache_core.request import RequestStatus

if TYPE_CHECKING:
    from asymcache_core.request import Request

# NOTE: vLLM 0.32's default bucket boundaries (vllm/v1/metrics/buckets.py), so that a dashboard's
# histogram_quantile reads the same resolution from this server as from vLLM.
#: e2e, queue, inference, prefill and decode times
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
#: inter-token latencies and each request's mean time per output token
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)
#: the ``n`` of each parent request (``vllm:request_params_n``)
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
#: vLLM's ``FinishReason`` values, in its order (``repetition`` never happens here: no detector)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets of per-request token counts: 1, 2, 5, 10, 20, 50, ... up to the context.

    Args:
        max_model_len: the engine's context limit (the last bucket is at most this).

    Returns:
        The boundaries.
    """
    out: list[float] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(value)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class HistogramSnapshot:
    """A cumulative histogram at one moment.

    Attributes:
        bounds: the buckets' upper bounds (``le``), ascending; ``+Inf`` is implied.
        counts: observations per bucket, not cumulative: ``counts[i]`` fell in
            ``(bounds[i-1], bounds[i]]``, the last one above every bound.
        total: the sum of every observation.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        """Observations in all."""
        return sum(self.counts)


class CumulativeHistogram:
    """Observations counted into fixed buckets (Prometheus's ``le`` rule: ``value <= bound``).

    Args:
        bounds: the buckets' upper bounds, ascending.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Counts one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        """The histogram now (a copy)."""
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


@dataclass(frozen=True)
class ServingStatsSnapshot:
    """:class:`ServingStats` at one moment (what ``/metrics`` renders under vLLM's names).

    Attributes:
        finished: finish reason -> requests finished so (every one of :data:`FINISH_REASONS`).
        time_to_first_token: seconds from arrival to the first token.
        inter_token_latency: seconds between steps that gave a request tokens.
        e2e_latency: seconds from arrival to finish.
        queue_time: seconds from arrival to the first step that ran any of its tokens.
        prefill_time: seconds from that step to the first token.
        decode_time: seconds from the first token to the last.
        inference_time: seconds from the first scheduled step to the last token.
        time_per_output_token: each request's decode time over its tokens after the first.
        prompt_tokens: each finished request's prompt length.
        generation_tokens: each finished request's generated tokens.
        num_preemptions: times each finished request was preempted.
        iteration_tokens: tokens each engine step computed.
        params_max_tokens: each finished request's ``max_tokens`` as it ran (at most the rest of
            the context: the value vLLM's server sets).
        prefill_kv_computed: each finished request's prompt tokens less its cache hits at first
            admission.
    """

    finished: dict[str, int]
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    e2e_latency: HistogramSnapshot
    queue_time: HistogramSnapshot
    prefill_time: HistogramSnapshot
    decode_time: HistogramSnapshot
    inference_time: HistogramSnapshot
    time_per_output_token: HistogramSnapshot
    prompt_tokens: HistogramSnapshot
    generation_tokens: HistogramSnapshot
    num_preemptions: HistogramSnapshot
    iteration_tokens: HistogramSnapshot
    params_max_tokens: HistogramSnapshot
    prefill_kv_computed: HistogramSnapshot


def step_times(token_times: list[float]) -> list[float]:
    """The distinct times of the steps that gave a request tokens (forced tokens share their
    step's time), in order."""
    return [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]


class ServingStats:
    """vLLM's statistics of the engine's requests and steps (the module docstring says which).

    Call it from the thread that steps the engine.

    Args:
        max_model_len: the engine's context limit (the token-count buckets end there).
    """

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        tokens = request_tokens_buckets(max_model_len)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.time_to_first_token = CumulativeHistogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = CumulativeHistogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = CumulativeHistogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.prompt_tokens = CumulativeHistogram(tokens)
        self.generation_tokens = CumulativeHistogram(tokens)
        self.num_preemptions = CumulativeHistogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.iteration_tokens = CumulativeHistogram(ITERATION_TOKENS_BUCKETS)
        self.params_max_tokens = CumulativeHistogram(tokens)
        self.prefill_kv_computed = CumulativeHistogram(tokens)

    @staticmethod
    def finish_reason(request: Request) -> str | None:
        """vLLM's ``finished_reason`` of a finished request.

        Args:
            request: the request (finished).

        Returns:
            ``error`` for a request that failed alone, else its status's reason; None for the
            client's abort (no finished request of vLLM's).
        """
        if request.error is not None:
            return "error"
        if request.status is RequestStatus.FINISHED_ABORTED:
            return None
        return request.status.value

    def on_reason_settled(self, request: Request, counted: str | None) -> None:
        """Moves a finished request from the reason it was counted under to its reason now.

        NOTE: the scheduler finishes a request (its length, an EOS) before its last token is
        detokenized; a stop string in that token's text, or a detokenizer that fails on it,
        settles its reason after :meth:`on_finish` counted it. vLLM counts the reason its output
        processor gives after detokenizing: so do these counters.

        Args:
            request: the request, after its last token's text.
            counted: the reason :meth:`on_finish` counted it under (:meth:`finish_reason` then).
        """
        now = self.finish_reason(request)
        if counted is None or now is None or now == counted:
            return
        self.finished[counted] -= 1
        self.finished[now] += 1

    def on_step(self, num_tokens: int) -> None:
        """Counts one step that ran.

        Args:
            num_tokens: the tokens it computed (prompt chunks, decodes, refilled holes).
        """
        self.iteration_tokens.observe(num_tokens)

    def on_finish(self, request: Request) -> None:
        """Counts a request that has just finished (its ``finish_time`` set).

        Args:
            request: the request.
        """
        m = request.metrics
        steps = step_times(m.token_times)
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
        for prev, cur in itertools.pairwise(steps):
            self.inter_token_latency.observe(max(0.0, cur - prev))
        reason = self.finish_reason(request)
        if reason is None:
            return  # the client's abort: no finished request of vLLM's
        self.finished[reason] += 1
        finish = m.finish_time if m.finish_time is not None else m.arrival_time
        # NOTE: a request that never ran waited until it finished; one without tokens ran until then
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else finish
        first_token = m.first_token_time if m.first_token_time is not None else finish
        last_token = steps[-1] if steps else finish
        generated = len(request.output_token_ids)
        decode = max(0.0, last_token - first_token)
        for histogram, value in (
            (self.e2e_latency, finish - m.arrival_time),
            (self.queue_time, scheduled - m.arrival_time),
            (self.prefill_time, first_token - scheduled),
            (self.decode_time, decode),
            (self.inference_time, last_token - scheduled),
            (self.time_per_output_token, decode / (generated - 1) if generated > 1 else 0.0),
        ):
            histogram.observe(max(0.0, value))
        prompt = len(request.prompt_token_ids)
        self.prompt_tokens.observe(prompt)
        self.generation_tokens.observe(generated)
        self.num_preemptions.observe(m.num_preemptions)
        self.prefill_kv_computed.observe(prompt - max(m.cached_tokens, 0))
        # NOTE: vLLM's server always states max_tokens, at most the rest of the context (its
        # default when the client gives none); this engine takes a larger one and stops at
        # the context, so the value it ran with is the smaller of the two.
        max_tokens = min(request.params.max_tokens, self.max_model_len - prompt)
        if max_tokens > 0:
            self.params_max_tokens.observe(max_tokens)

    def snapshot(self) -> ServingStatsSnapshot:
        """The statistics now (a copy, safe to hand to another thread)."""
        return ServingStatsSnapshot(
            finished=dict(self.finished),
            time_to_first_token=self.time_to_first_token.snapshot(),
            inter_token_latency=self.inter_token_latency.snapshot(),
            e2e_latency=self.e2e_latency.snapshot(),
            queue_time=self.queue_time.snapshot(),
            prefill_time=self.prefill_time.snapshot(),
            decode_time=self.decode_time.snapshot(),
            inference_time=self.inference_time.snapshot(),
            time_per_output_token=self.time_per_output_token.snapshot(),
            prompt_tokens=self.prompt_tokens.snapshot(),
            generation_tokens=self.generation_tokens.snapshot(),
            num_preemptions=self.num_preemptions.snapshot(),
            iteration_tokens=self.iteration_tokens.snapshot(),
            params_max_tokens=self.params_max_tokens.snapshot(),
            prefill_kv_computed=self.prefill_kv_computed.snapshot(),
        )


class ParentRequestStats:
    """vLLM's series of parent requests: a request's ``n`` (its choices) and the most tokens
    one of its choices generated (``vllm:request_params_n``,
    ``vllm:request_max_num_generation_tokens``).

    vLLM observes both once per parent request, when its last choice finishes (its
    ``ParentRequest``; a request without ``n`` is a parent of one), and never for a request the
    client aborted (its choices are aborted, the parent never completes). The engine runs each
    choice as a request of its own, so the server, which knows the choices of each request,
    counts them (:meth:`on_finished`).

    Args:
        max_model_len: the engine's context limit (the token-count buckets end there).
    """

    def __init__(self, max_model_len: int) -> None:
        self.params_n = CumulativeHistogram(REQUEST_PARAMS_N_BUCKETS)
        self.max_num_generation_tokens = CumulativeHistogram(request_tokens_buckets(max_model_len))

    def on_finished(self, generated: Sequence[int]) -> None:
        """Counts one parent request whose every choice finished.

        Args:
            generated: the tokens each of its choices generated (one entry a choice).

        Raises:
            ValueError: no choice.
        """
        if not generated:
            raise ValueError("generated: a parent request has at least one choice")
        self.params_n.observe(len(generated))
        self.max_num_generation_tokens.observe(max(generated))


__all__ = [
    "FINISH_REASONS",
    "REQUEST_PARAMS_N_BUCKETS",
    "CumulativeHistogram",
    "HistogramSnapshot",
    "ParentRequestStats",
    "ServingStats",
    "ServingStatsSnapshot",
    "request_tokens_buckets",
    "step_times",
]
