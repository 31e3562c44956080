"""Turns the engine's outputs into stream events: tool-call parsing, the Continuum hand-off, metrics.

:class:`OutputProcessor` runs on the engine thread. When a request arrives it closes the job's
tool pause (the controller learns the tool's duration); when a request finishes it parses the
text for tool calls and, right then (before the next step could evict anything), lets the
:class:`~asymcache_core.continuum.controller.ContinuumController` pin the job's blocks for tau* and hint the
pause to the eviction policy. It also counts the tokens a job had to recompute because its
previous turn's context was no longer cached.

:func:`build_turn` (caller's side) assembles the :class:`~agent_runtime.types.AssistantTurn` of a
finished chat stream.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent_runtime.reasoning import split_reasoning
from agent_runtime.types import AssistantTurn, StreamEvent, TurnMetrics
from asymcache_core.continuum.controller import ContinuumController, PinDecision
from asymcache_core.request import RequestOutput
from asymcache_core.tool_parsing import ParsedMessage, ToolCallFormat, parse_tool_calls

if TYPE_CHECKING:
    from agent_runtime.request_stream import RequestStream

#: Jobs whose last token list is remembered (to count recomputed history); oldest dropped.
MAX_TRACKED_JOBS = 4096


@dataclass(frozen=True)
class OutputOptions:
    """How one request's final output is processed.

    Attributes:
        job_id: the Continuum job (None: a request without a job).
        is_last_step: the job ends with this request (its state is dropped, nothing pinned).
        parse_format: parse tool calls out of the final text with this format (None: no parsing).
        pinning: per-request override of the policy's pinning.
        ttl_rule: per-request override of the TTL rule.
        pause_tool: for a job request that is not its last step and has no parsed tool call
            (token-level clients such as ``/v1/completions``): the tool the job pauses for
            after it, so it is pinned as after a tool call.
        max_tool_calls: keep at most this many parsed calls, the first ones (OpenAI's
            ``parallel_tool_calls: false`` is 1; None: all).
        reasoning_parser: split a reasoning model's thinking off the text first
            (:mod:`agent_runtime.reasoning`; calls are parsed from the rest).
        implicit_job: the engine gave the request its job (the client named none): a reply
            without a tool call ends the job, as an agent loop's answer does.
        joins_conversation: a request without a job may be given its conversation's (False:
            one of several choices, whose client goes on with one at most).
        continues_job: the job of the turn the runtime found the request continues by its
            rendered chat (:class:`~agent_runtime.rendered_turns.RenderedTurns`).
    """

    job_id: str | None = None
    is_last_step: bool = False
    parse_format: ToolCallFormat | None = None
    pinning: bool | None = None
    ttl_rule: str | None = None
    pause_tool: str | None = None
    max_tool_calls: int | None = None
    reasoning_parser: str | None = None
    implicit_job: bool = False
    joins_conversation: bool = True
    continues_job: str | None = None


class OutputProcessor:
    """Engine-thread bookkeeping of requests' arrivals and finishes (not thread-safe).

    Args:
        controller: the Continuum controller that decides pins.
        block_size: the engine's KV block size (only full blocks are cacheable).
        max_tracked_jobs: jobs whose last token list is remembered.
        end_job: the engine's :meth:`~asymcache_core.engine.Engine.end_job` (job admission lets
            a finished job go), if any.
    """

    def __init__(
        self, controller: ContinuumController, block_size: int, max_tracked_jobs: int = MAX_TRACKED_JOBS,
        end_job: Callable[[str], None] | None = None,
    ) -> None:
        self.controller = controller
        self.block_size = block_size
        self.max_tracked_jobs = max_tracked_jobs
        self.end_job = end_job
        self._job_tokens: OrderedDict[str, list[int]] = OrderedDict()

    def on_request_added(self, job_id: str | None, arrival_time: float) -> None:
        """A request was accepted by the engine: close the job's tool pause.

        Args:
            job_id: its job (None: nothing to do).
            arrival_time: the engine's arrival time of the request.
        """
        if job_id is not None:
            self.controller.on_request_arrival(job_id, arrival_time)

    def finish_job(self, job_id: str, num_turns: int | None = None) -> None:
        """A job is done: release its pins, teach the controller, forget its tokens.

        Args:
            job_id: the job.
            num_turns: its LLM calls (default: what the controller counted).
        """
        self.controller.on_job_finished(job_id, num_turns)
        if self.end_job is not None:
            self.end_job(job_id)
        self._job_tokens.pop(job_id, None)

    def drop_forgotten(self, tracked: Collection[str]) -> None:
        """Forgets the tokens of jobs the engine no longer tracks (it dropped them when they
        idled: abandoned jobs, jobs whose last request failed or was aborted).

        NOTE: a no-op while this table is no larger than the engine's, so the engine thread
        can call it after every step; it scans only after the engine dropped jobs.

        Args:
            tracked: the engine's per-job table (``engine.job_stats.jobs``).
        """
        if len(self._job_tokens) <= len(tracked):
            return
        for job in [j for j in self._job_tokens if j not in tracked]:
            del self._job_tokens[job]

    def finalize(self, options: OutputOptions, prompt_ids: Sequence[int], out: RequestOutput) -> StreamEvent:
        """The final event of a request, right after it finished: metrics, parse, pin decision.

        Args:
            options: how to process it.
            prompt_ids: its encoded prompt.
            out: its final output.

        Returns:
            The event, with the parsed message, the pin decision and the turn metrics.
        """
        # NOTE: no queueing delay to report: the engine's controller records it when the request
        # is first admitted (ContinuumController.on_admit), once.
        m = out.metrics
        ctl = self.controller
        parsed = _parse(out.text, options)
        if parsed is not None and options.max_tool_calls is not None and len(parsed.tool_calls) > options.max_tool_calls:
            parsed = dataclasses.replace(parsed, tool_calls=parsed.tool_calls[: options.max_tool_calls])
        pin: PinDecision | None = None
        job = options.job_id
        all_ids = [*prompt_ids, *out.token_ids]
        if job is not None:
            recomputed = self._job_recomputed(job, prompt_ids, m.cached_tokens) + m.preempted_tokens
            self._remember(job, all_ids)
        else:
            recomputed = m.hole_tokens + m.suffix_recomputed_tokens + m.preempted_tokens
        if job is not None and out.finish_reason != "abort":
            if options.is_last_step:
                self.finish_job(job)
            elif (parsed is not None and parsed.tool_calls) or options.pause_tool is not None:
                names = [c.name for c in parsed.tool_calls] if parsed is not None else []
                pin = ctl.on_tool_call(
                    job,
                    names or [options.pause_tool or "unknown"],
                    len(all_ids),
                    ended_at=m.finish_time,
                    pinning=options.pinning,
                    ttl_rule=options.ttl_rule,  # type: ignore[arg-type]
                )
            elif options.implicit_job:
                # NOTE: the client named no job and will not say its last step: in an agent
                # loop a reply without a tool call is the answer, and the job gate must not keep
                # reserving a context that may never come back (a chat's next turn rejoins the
                # job as a new one)
                self.finish_job(job)
        metrics = TurnMetrics(
            ttft=m.ttft,
            tpot=m.tpot,
            queue_s=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
            cached_tokens=m.cached_tokens,
            recomputed_tokens=max(0, recomputed),
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=len(out.token_ids),
            hole_tokens=m.hole_tokens,
            arrival_time=m.arrival_time,
            finish_time=m.finish_time,
            ttl_s=pin.ttl_s if pin else 0.0,
            pinned_blocks=pin.blocks_pinned if pin else 0,
        )
        return StreamEvent(out, pin, parsed, metrics)

    def _remember(self, job: str, token_ids: list[int]) -> None:
        self._job_tokens[job] = token_ids
        self._job_tokens.move_to_end(job)
        while len(self._job_tokens) > self.max_tracked_jobs:
            self._job_tokens.popitem(last=False)

    def _job_recomputed(self, job: str, prompt_ids: Sequence[int], cached: int) -> int:
        """History tokens of ``job`` that had to be computed again in this request."""
        prev = self._job_tokens.get(job)
        if not prev:
            return 0
        common = 0
        for a, b in zip(prev, prompt_ids, strict=False):
            if a != b:
                break
            common += 1
        bs = self.block_size
        # Only full blocks are cacheable, and the prompt's last token is always computed.
        reusable = min(common // bs * bs, (len(prompt_ids) - 1) // bs * bs)
        return max(0, reusable - cached)


def _parse(text: str, options: OutputOptions) -> ParsedMessage | None:
    """A finished reply's thinking (with a reasoning parser) and tool calls (with a format);
    None when neither is asked for."""
    if options.reasoning_parser is None:
        return parse_tool_calls(text, options.parse_format) if options.parse_format else None
    reasoning, content = split_reasoning(text, options.reasoning_parser)
    # NOTE: the content as generated, as the stream sends it (and vLLM's parsers return it)
    parsed = parse_tool_calls(content, options.parse_format) if options.parse_format else ParsedMessage(content, [])
    return dataclasses.replace(parsed, reasoning=reasoning)


def build_turn(stream: RequestStream, final: StreamEvent) -> AssistantTurn:
    """The :class:`AssistantTurn` of a finished chat stream.

    Args:
        stream: the stream.
        final: its final event.

    Returns:
        The turn.
    """
    out = final.output
    # NOTE: the text as generated, as vLLM and OpenAI return it (once stripped: a non-streamed
    # reply then differed from its stream's text by its last space)
    parsed = final.parsed if final.parsed is not None else ParsedMessage(out.text, [])
    message = parsed.to_openai_message()
    reason = "tool_calls" if parsed.tool_calls else (out.finish_reason or "stop")
    metrics = final.metrics
    if metrics is None:  # finalisation failed: fall back to the raw engine numbers
        m = out.metrics
        metrics = TurnMetrics(
            m.ttft, m.tpot, None, m.cached_tokens, 0, out.num_prompt_tokens, len(out.token_ids),
            m.hole_tokens, m.arrival_time, m.finish_time,
        )
    return AssistantTurn(
        message, parsed, metrics, reason, out.text, stream.request_id,
        list(stream.prompt_token_ids), list(out.token_ids), final.pin, out.logprobs,
    )


__all__ = ["MAX_TRACKED_JOBS", "OutputOptions", "OutputProcessor", "build_turn"]
