"""Result types of the runtime: per-turn and per-job metrics, turns, job results, stream events.

Plain frozen dataclasses with no behaviour, shared by the engine client, the output processor,
the job loop and the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from agent_runtime.tools import ToolResult
from asymcache_core.continuum.controller import PinDecision
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.request import RequestOutput
from asymcache_core.tool_parsing import ParsedMessage, ParsedToolCall


@dataclass(frozen=True)
class TurnMetrics:
    """Metrics of one LLM call (times on the engine clock, seconds).

    Attributes:
        ttft: arrival -> first token.
        tpot: mean time between output tokens after the first.
        queue_s: arrival -> first scheduled step.
        cached_tokens: prompt tokens served from the KV cache.
        recomputed_tokens: tokens computed again although the job had computed them before
            (its previous turn's context that was not cached any more, plus preemption
            recompute); for requests without a job, hole + suffix + preemption recompute.
        prompt_tokens: prompt length.
        completion_tokens: generated tokens.
        hole_tokens: tokens recomputed inside holes (hole reuse).
        arrival_time: when the engine took the request.
        finish_time: when it finished.
        ttl_s: TTL the job was pinned for after this turn (0: none).
        pinned_blocks: blocks pinned after this turn.
    """

    ttft: float | None
    tpot: float | None
    queue_s: float | None
    cached_tokens: int
    recomputed_tokens: int
    prompt_tokens: int
    completion_tokens: int
    hole_tokens: int
    arrival_time: float
    finish_time: float | None
    ttl_s: float = 0.0
    pinned_blocks: int = 0


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant reply.

    Attributes:
        message: the OpenAI assistant message (``role``, ``content``, ``tool_calls`` when any).
        parsed: content and tool calls as parsed.
        metrics: the turn's metrics.
        finish_reason: ``tool_calls``, ``stop``, ``length`` or ``abort``.
        text: the raw generated text.
        request_id: the engine request id.
        prompt_token_ids: the rendered prompt's ids.
        token_ids: the generated ids.
        pin: the Continuum decision taken at the end of the turn (None without a tool call).
        logprobs: one entry per generated id when the turn's ``SamplingParams.logprobs`` was
            set, else None.
    """

    message: dict[str, Any]
    parsed: ParsedMessage
    metrics: TurnMetrics
    finish_reason: str
    text: str
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    pin: PinDecision | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ToolCallRecord:
    """A tool call of the loop and what it returned.

    Attributes:
        call: the parsed call.
        result: the tool's result (errors included).
    """

    call: ParsedToolCall
    result: ToolResult


@dataclass(frozen=True)
class TurnRecord:
    """One turn of :meth:`~agent_runtime.job.Job.run`: the reply and the tools it ran.

    Attributes:
        index: turn number, from 0.
        turn: the assistant reply.
        tool_calls: the calls executed after it.
        tool_s: time the tools took (runtime clock).
    """

    index: int
    turn: AssistantTurn
    tool_calls: list[ToolCallRecord]
    tool_s: float


@dataclass(frozen=True)
class JobMetrics:
    """Per-job metrics.

    Attributes:
        jct_s: job completion time: last departure - first arrival, tool time included.
        num_turns: LLM calls.
        num_tool_calls: tool calls executed.
        tool_s: total tool time (runtime clock).
        mean_ttft: mean TTFT over turns.
        mean_tpot: mean TPOT over turns that have one.
        queue_s: total queueing time.
        cached_tokens: total cached prompt tokens.
        recomputed_tokens: total recomputed tokens.
        prompt_tokens: total prompt tokens.
        completion_tokens: total generated tokens.
        first_arrival: engine time of the first request.
        last_departure: engine time the last request finished.
    """

    jct_s: float
    num_turns: int
    num_tool_calls: int
    tool_s: float
    mean_ttft: float | None
    mean_tpot: float | None
    queue_s: float
    cached_tokens: int
    recomputed_tokens: int
    prompt_tokens: int
    completion_tokens: int
    first_arrival: float
    last_departure: float


@dataclass(frozen=True)
class JobResult:
    """Outcome of :meth:`~agent_runtime.job.Job.run`.

    Attributes:
        job_id: the job.
        answer: the final assistant content (empty when the loop ran out of turns).
        finish_reason: ``answer`` (the model replied without a tool call) or ``max_turns``.
        messages: the whole conversation (OpenAI format).
        turns: per-turn records.
        metrics: job metrics.
    """

    job_id: str
    answer: str
    finish_reason: Literal["answer", "max_turns"]
    messages: list[dict[str, Any]]
    turns: list[TurnRecord]
    metrics: JobMetrics


@dataclass(frozen=True)
class StreamEvent:
    """One item a :class:`~agent_runtime.request_stream.RequestStream` yields.

    Attributes:
        output: the engine's output of one step for the request.
        pin: the Continuum decision (only on the final event of a tool-calling turn).
        parsed: the parsed message (only on the final event, when tool calls were parsed).
        metrics: turn metrics (only on the final event).
    """

    output: RequestOutput
    pin: PinDecision | None = None
    parsed: ParsedMessage | None = None
    metrics: TurnMetrics | None = None


__all__ = [
    "AssistantTurn",
    "JobMetrics",
    "JobResult",
    "StreamEvent",
    "ToolCallRecord",
    "TurnMetrics",
    "TurnRecord",
]
