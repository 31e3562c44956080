"""The agent loop: one job's turns, its tool calls, and its metrics.

A :class:`Job` is created by :meth:`~agent_runtime.runtime.AgentRuntime.job`. Its requests share
``job_id``, the engine's and Continuum's job: when a turn ends in a tool call the runtime may
pin the job's KV for the tool's pause, and the job's last step (or :meth:`Job.finish`)
releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Unpack

from agent_runtime.presets import ServingPreset
from agent_runtime.protocol import ChatSampling, ToolChoice, ToolsArg, normalize_tools
from agent_runtime.tools import ToolRegistry
from agent_runtime.types import AssistantTurn, JobMetrics, JobResult, ToolCallRecord, TurnRecord

if TYPE_CHECKING:
    from agent_runtime.runtime import AgentRuntime


def _as_registry(tools: Any) -> ToolRegistry | None:
    """A registry from a registry, tools or callables; None for schemas or nothing."""
    if tools is None:
        return None
    if isinstance(tools, ToolRegistry):
        return tools
    if isinstance(tools, str | Mapping) or not isinstance(tools, Iterable):
        raise ValueError(f"tools: a ToolRegistry, or a list of tools, functions or OpenAI schemas, got {tools!r}")
    items = list(tools)
    if not items or all(isinstance(t, Mapping) for t in items):
        return None
    reg = ToolRegistry()
    for i, t in enumerate(items):
        if isinstance(t, Mapping):
            raise ValueError(f"tools[{i}]: mix of schemas and tools; pass one kind")
        reg.register(t)
    return reg


class Job:
    """A multi-turn agent job: its requests share ``job_id`` (the engine's and Continuum's job).

    Create with :meth:`AgentRuntime.job`.

    Attributes:
        job_id: the id.
        runtime: the runtime.
        registry: executable tools (None when only schemas or nothing were given).
        schemas: the tools' OpenAI schemas.
        policy: the job's policy (pinning and TTL rule).
        system_prompt: system message of :meth:`run`.
        turns: every :class:`AssistantTurn` of this job so far.
    """

    def __init__(
        self,
        runtime: AgentRuntime,
        job_id: str,
        tools: Any,
        policy: ServingPreset,
        system_prompt: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.job_id = job_id
        self.registry = _as_registry(tools)
        self.schemas = normalize_tools(self.registry if self.registry is not None else tools)
        self.policy = policy
        self.system_prompt = system_prompt
        self.turns: list[AssistantTurn] = []
        self.finished = False

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        *,
        is_last_step: bool = False,
        **sampling: Unpack[ChatSampling],
    ) -> AssistantTurn:
        """One assistant turn of this job.

        Args:
            messages: the whole conversation so far (OpenAI format).
            tools: tool schemas/registry (default: the job's tools).
            tool_choice: ``auto``, ``none``, ``required`` or a named function (the last two
                constrain decoding so even a small model emits a valid call).
            is_last_step: this is the job's last LLM call (its KV is released right after).
            **sampling: ``max_tokens`` (default 256), ``temperature`` (0: greedy), ``seed``,
                ``stop``, ``logprobs``, ``response_format``, ``structured_outputs``,
                ``chat_template_kwargs``, ``documents``
                (:class:`~agent_runtime.protocol.ChatSampling`).

        Returns:
            The turn; when it ends in a tool call and the policy pins, ``turn.pin`` says for how
            long the job's KV is kept.

        Raises:
            ValueError: bad input (the message names the field).
        """
        turn = await self.runtime.chat(
            messages,
            tools=self.schemas if tools is None else tools,
            tool_choice=tool_choice,
            job_id=self.job_id,
            is_last_step=is_last_step,
            pinning=self.policy.pinning,
            ttl_rule=self.policy.ttl_rule,
            **sampling,
        )
        self.turns.append(turn)
        if is_last_step and turn.finish_reason != "abort":
            self.finished = True
        return turn

    async def finish(self) -> None:
        """Mark the job done (releases pins, teaches eta); a no-op after an ``is_last_step`` turn."""
        if not self.finished:
            self.finished = True
            await self.runtime.finish_job(self.job_id, len(self.turns) or None)

    async def run(
        self,
        task: str,
        tools: ToolsArg | Iterable[Callable[..., Any]] = None,
        max_turns: int = 8,
        *,
        tool_choice: ToolChoice | Sequence[ToolChoice] = "auto",
        max_tokens: int = 256,
        system_prompt: str | None = None,
        on_turn: Callable[[TurnRecord], None] | None = None,
        parallel_tool_calls: bool = True,
    ) -> JobResult:
        """The agent loop: generate -> parse tool calls -> run them -> append results -> repeat.

        The loop ends when a reply has no tool call (its content is the answer) or after
        ``max_turns`` replies; the last allowed turn (and any turn with ``tool_choice="none"``)
        is sent with ``is_last_step`` so the engine releases the job's KV right away.

        Args:
            task: the user's task (first user message).
            tools: executable tools (a registry, tools, or functions); default: the job's.
            max_turns: LLM calls at most (>= 1).
            tool_choice: one choice for every turn, or a list with one per turn (turns past the
                list use ``auto``); e.g. ``["required", "required"]`` to force the first two turns
                of a small model into tool calls.
            max_tokens: generated tokens per turn.
            system_prompt: first system message (default: the job's).
            on_turn: called after each turn with its record (e.g. to print it).
            parallel_tool_calls: a reply may make several calls, all run (OpenAI's default; a
                forced ``"required"`` turn makes one or more); False: one call a turn.

        Returns:
            The job's result and metrics.

        Raises:
            ValueError: empty task, ``max_turns < 1``, no executable tools, or bad input.
        """
        if not isinstance(task, str) or not task.strip():
            raise ValueError("task: must be a non-empty string")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: must be an integer >= 1, got {max_turns!r}")
        registry = _as_registry(tools) if tools is not None else self.registry
        if registry is None or not len(registry):
            raise ValueError("tools: Job.run needs executable tools (a ToolRegistry, Tools or functions)")
        schemas = registry.openai_schemas()
        choices = _per_turn_choices(tool_choice, max_turns)
        if on_turn is not None and not callable(on_turn):
            raise ValueError(f"on_turn: a callable taking each turn's record, got {on_turn!r}")
        system = system_prompt if system_prompt is not None else self.system_prompt
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system_prompt: a string or None, got {system!r}")
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": task})
        records: list[TurnRecord] = []
        answer = ""
        reason: Literal["answer", "max_turns"] = "max_turns"
        clock = self.runtime.clock
        try:
            for i in range(max_turns):
                choice = choices[i]
                last = i == max_turns - 1 or choice == "none"
                turn = await self.chat(
                    messages, tools=schemas, tool_choice=choice, max_tokens=max_tokens, is_last_step=last,
                    parallel_tool_calls=parallel_tool_calls,
                )
                messages.append(turn.message)
                calls: list[ToolCallRecord] = []
                tool_s = 0.0
                if not turn.parsed.tool_calls:
                    answer, reason = turn.parsed.content, "answer"
                elif not last:
                    start = clock()
                    for call in turn.parsed.tool_calls:
                        result = await registry.call(call.name, call.arguments)
                        calls.append(ToolCallRecord(call, result))
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result.content}
                        )
                    tool_s = max(0.0, clock() - start)
                record = TurnRecord(i, turn, calls, tool_s)
                records.append(record)
                if on_turn is not None:
                    on_turn(record)
                if reason == "answer" or last:
                    break
        finally:
            await self.finish()
        return JobResult(self.job_id, answer, reason, messages, records, _job_metrics(records))


def _per_turn_choices(tool_choice: Any, max_turns: int) -> list[ToolChoice]:
    if isinstance(tool_choice, str | Mapping) or tool_choice is None:
        return [tool_choice] * max_turns
    if not isinstance(tool_choice, Sequence):
        raise ValueError(f"tool_choice: a choice, or a list of one per turn, got {tool_choice!r}")
    given = list(tool_choice)
    return (given + ["auto"] * max_turns)[:max_turns]


def _job_metrics(records: Sequence[TurnRecord]) -> JobMetrics:
    ms = [r.turn.metrics for r in records]
    if not ms:
        return JobMetrics(0.0, 0, 0, 0.0, None, None, 0.0, 0, 0, 0, 0, 0.0, 0.0)
    first = min(m.arrival_time for m in ms)
    last = max((m.finish_time for m in ms if m.finish_time is not None), default=first)
    ttfts = [m.ttft for m in ms if m.ttft is not None]
    tpots = [m.tpot for m in ms if m.tpot is not None]
    return JobMetrics(
        jct_s=last - first,
        num_turns=len(ms),
        num_tool_calls=sum(len(r.tool_calls) for r in records),
        tool_s=sum(r.tool_s for r in records),
        mean_ttft=sum(ttfts) / len(ttfts) if ttfts else None,
        mean_tpot=sum(tpots) / len(tpots) if tpots else None,
        queue_s=sum(m.queue_s or 0.0 for m in ms),
        cached_tokens=sum(m.cached_tokens for m in ms),
        recomputed_tokens=sum(m.recomputed_tokens for m in ms),
        prompt_tokens=sum(m.prompt_tokens for m in ms),
        completion_tokens=sum(m.completion_tokens for m in ms),
        first_arrival=first,
        last_departure=last,
    )


__all__ = ["Job"]
