"""Async agent runtime over the embedded engine: jobs, turns, tool loops, Continuum pins.

Threading model: the engine is not thread-safe, so exactly one thread (the *engine thread*,
started by :class:`AgentRuntime`) owns it. Everything else talks to it through a thread-safe
command queue: submitting a request, aborting one, or running a function against the engine
(:meth:`AgentRuntime.call`). Streamed outputs come back to the submitting event loop through
``loop.call_soon_threadsafe`` into an :class:`asyncio.Queue`, so many jobs (and the HTTP server)
await their tokens concurrently while the engine thread batches them into shared steps.

Tokenizer and grammar work (encoding prompts, building the xgrammar logits processor) also runs
on the engine thread, because the engine decodes with the same tokenizer object. Rendering the
chat template (jinja only) runs on the caller's side.

One turn, end to end: :meth:`Job.chat` renders the messages -> the engine thread encodes,
closes the job's tool pause (the controller records the tool's duration), queues the request
-> steps stream tokens back -> when the request finishes the engine thread parses its tool
calls and, right then (before the next step could evict anything), lets the
:class:`~agent_runtime.continuum.ContinuumController` pin the job's blocks for tau* and hint the
pause to the eviction policy -> :class:`AssistantTurn` with per-turn metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from agent_runtime.chat_template import ChatRenderer
from agent_runtime.constrained import GrammarCache, make_tool_call_processor, tool_choice_name
from agent_runtime.continuum import ContinuumController, PinDecision
from agent_runtime.policies import PolicySpec, resolve_policy
from agent_runtime.tool_parsing import (
    ParsedMessage,
    ParsedToolCall,
    ToolCallFormat,
    parse_tool_calls,
)
from agent_runtime.tools import Tool, ToolRegistry, ToolResult, validate_tool_schema
from asymcache_core.request import RequestOutput
from asymcache_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
ToolChoice = str | Mapping[str, Any] | None
ToolsArg = ToolRegistry | Sequence[Mapping[str, Any]] | Sequence[Tool] | None

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Jobs whose last token list is remembered (to count recomputed history); oldest dropped.
_MAX_TRACKED_JOBS = 4096


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


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
    """One turn of :meth:`Job.run`: the reply and the tools it ran.

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
    """Outcome of :meth:`Job.run`.

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


# ----------------------------------------------------------------------------------------------
# Engine-thread plumbing
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamEvent:
    """One item a :class:`RequestStream` yields.

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


class _Sink:
    """Delivers events from the engine thread into one event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

    def put(self, item: StreamEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more


@dataclass
class _Submit:
    prompt: str | list[int]
    params: SamplingParams
    job_id: str | None
    session_id: str | None
    request_id: str | None
    is_last_step: bool
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    parse_format: ToolCallFormat | None
    pinning: bool | None
    ttl_rule: str | None
    pause_tool: str | None
    sink: _Sink
    accepted: concurrent.futures.Future[tuple[str, list[int]]]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class _Active:
    submit: _Submit
    prompt_ids: list[int]


class _Stop:
    pass


class RequestStream:
    """Async iterator over one request's :class:`StreamEvent` s (ends after the final one).

    Attributes:
        request_id: the engine request id.
        prompt_token_ids: the encoded prompt.
        final: the final event once seen.
    """

    def __init__(self, runtime: AgentRuntime, request_id: str, prompt_ids: list[int], sink: _Sink) -> None:
        self._runtime = runtime
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self._sink = sink
        self.final: StreamEvent | None = None

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if self.final is not None:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.output.finished:
            self.final = item
        return item

    async def result(self) -> StreamEvent:
        """Consume the rest of the stream.

        Returns:
            The final event.
        """
        async for _ in self:
            pass
        assert self.final is not None
        return self.final

    def abort(self) -> None:
        """Abort the request (thread-safe, returns at once; a no-op once it finished)."""
        if self.final is None:
            self._runtime.abort_nowait(self.request_id)


# ----------------------------------------------------------------------------------------------
# Runtime
# ----------------------------------------------------------------------------------------------


class AgentRuntime:
    """The engine in its own thread, plus jobs, chat rendering and Continuum decisions.

    Args:
        engine: an :class:`asymcache_core.Engine` (the runtime takes ownership of it: only the
            engine thread may touch it from now on; use :meth:`call` to inspect it).
        policy: a policy name or spec (:mod:`agent_runtime.policies`); its engine settings must
            match the engine's config, and it decides whether turns that end in a tool call pin
            the job's KV.
        clock: the runtime's time source for tool timing; defaults to the engine's clock (pass
            the same virtual clock as the engine's in simulations).
        tool_call_format: how assistant text is parsed for tool calls (``hermes``, ``bash_block``
            or ``auto``).
        controller: a Continuum controller to use (default: a fresh one over ``engine``).
        idle_poll_s: how often the idle engine thread wakes to expire pins.

    Raises:
        ValueError: unknown policy, or one whose engine settings differ from the engine's.
    """

    def __init__(
        self,
        engine: Any,
        *,
        policy: str | PolicySpec = "vllm-apc",
        clock: Callable[[], float] | None = None,
        tool_call_format: ToolCallFormat = "hermes",
        controller: ContinuumController | None = None,
        idle_poll_s: float = 0.02,
    ) -> None:
        spec = resolve_policy(policy) if isinstance(policy, str) else policy
        for key, want in spec.engine_overrides.items():
            have = getattr(engine.config, key, None)
            if have != want:
                raise ValueError(
                    f"policy: {spec.name!r} needs {key}={want!r} but the engine has {key}={have!r}; "
                    "build the engine with resolve_policy(name).engine_overrides"
                )
        if tool_call_format not in ("hermes", "bash_block", "auto"):
            raise ValueError(f"tool_call_format: one of hermes, bash_block, auto; got {tool_call_format!r}")
        self.engine = engine
        self.policy = spec
        self.clock: Callable[[], float] = clock or engine.clock
        self.tool_call_format: ToolCallFormat = tool_call_format
        self.controller = controller or ContinuumController(
            engine, ttl_rule=spec.ttl_rule, pinning=spec.pinning
        )
        self.model_name: str = engine.config.model
        self.max_model_len: int = engine.max_model_len
        self.renderer: ChatRenderer | None = (
            ChatRenderer(engine.tokenizer) if engine.tokenizer is not None else None
        )
        self._grammars = GrammarCache(max_threads=1)
        self._commands: queue.Queue[_Submit | _Abort | _Call | _Stop] = queue.Queue()
        self._active: dict[str, _Active] = {}
        self._job_tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._ids = itertools.count()
        self._idle_poll_s = idle_poll_s
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="asymcache-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(
        cls,
        model: str = "smollm2-135m",
        policy: str = "vllm-apc",
        *,
        loaded: Any = None,
        clock: Callable[[], float] | None = None,
        **engine_kwargs: Any,
    ) -> AgentRuntime:
        """Build an engine for ``model`` configured for ``policy``, and a runtime over it.

        Args:
            model: model spec (see :class:`asymcache_core.EngineConfig`).
            policy: policy name.
            loaded: an already loaded model to share.
            clock: engine and runtime clock (default: monotonic).
            **engine_kwargs: further :class:`asymcache_core.EngineConfig` fields.

        Returns:
            The runtime.

        Raises:
            ValueError: bad policy or engine settings.
        """
        from asymcache_core import Engine

        spec = resolve_policy(policy)
        kwargs = {**engine_kwargs, **spec.engine_overrides}
        engine = Engine(model=model, loaded=loaded, clock=clock, **kwargs)
        return cls(engine, policy=spec, clock=clock)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    async def close(self) -> None:
        """Abort what is in flight and stop the engine thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    def close_sync(self, timeout: float | None = 30.0) -> None:
        """:meth:`close` for code without an event loop.

        Args:
            timeout: seconds to wait for the engine thread.
        """
        if not self._closed:
            self._closed = True
            self._commands.put(_Stop())
        self._thread.join(timeout)

    async def __aenter__(self) -> AgentRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("runtime: closed")

    # -- engine access -------------------------------------------------------------------------
    def call_threadsafe(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread, between steps.

        Args:
            fn: the function (must not block for long: it stalls every request).

        Returns:
            A future with its result or exception.
        """
        self._check_open()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(fn, fut))
        return fut

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Async :meth:`call_threadsafe`.

        Args:
            fn: the function, given the engine.

        Returns:
            Its result.
        """
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def abort_nowait(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (no-op when unknown or finished).

        Args:
            request_id: the engine request id.
        """
        if not self._closed:
            self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request.

        Args:
            request_id: the engine request id.
        """
        self.abort_nowait(request_id)

    # -- submission ----------------------------------------------------------------------------
    async def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        job_id: str | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        is_last_step: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = None,
        parse_format: ToolCallFormat | None = None,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
        pause_tool: str | None = None,
    ) -> RequestStream:
        """Queue one request and return its stream once the engine accepted it.

        Args:
            prompt: text (encoded on the engine thread) or token ids.
            params: sampling parameters.
            job_id: the Continuum job (also the engine session).
            session_id: engine session when there is no job.
            request_id: caller-chosen id.
            is_last_step: the job ends with this request.
            tools: tool schemas (for constrained decoding when ``tool_choice`` forces a call).
            tool_choice: ``required`` or a named function constrains decoding.
            parse_format: parse tool calls out of the final text with this format (needed for
                pinning); None: no parsing.
            pinning: per-request override of the policy's pinning.
            ttl_rule: per-request override of the TTL rule.
            pause_tool: for a job request that is not its last step and whose text has no
                parsed tool call (token-level clients such as ``/v1/completions``): the job
                pauses for this tool after it, so it is pinned as after a tool call.

        Returns:
            The stream.

        Raises:
            ValueError: rejected by the engine or by the grammar builder (message names the field).
            RuntimeError: the runtime is closed.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        accepted: concurrent.futures.Future[tuple[str, list[int]]] = concurrent.futures.Future()
        sink = _Sink(loop)
        cmd = _Submit(
            prompt if isinstance(prompt, str) else list(prompt),
            params or SamplingParams(),
            job_id, session_id, request_id, is_last_step,
            [dict(t) for t in tools] if tools else None,
            tool_choice, parse_format, pinning, ttl_rule, pause_tool, sink, accepted,
        )
        self._commands.put(cmd)
        try:
            rid, prompt_ids = await asyncio.shield(asyncio.wrap_future(accepted))
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting: abort once it is in.
            accepted.add_done_callback(
                lambda f: self.abort_nowait(f.result()[0]) if f.exception() is None else None
            )
            raise
        return RequestStream(self, rid, prompt_ids, sink)

    # -- chat ----------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render a chat to prompt text with the model's template (validated).

        Args:
            messages: OpenAI messages.
            tools: validated tool schemas.

        Returns:
            The prompt text.

        Raises:
            ValueError: malformed messages (the message names ``messages[i]...``), or a model
                without a tokenizer.
        """
        if self.renderer is None:
            raise ValueError("messages: this model has no tokenizer/chat template (dummy weights)")
        validate_messages(messages)
        try:
            return self.renderer.render(messages, tools or None, add_generation_prompt=True)
        except ValueError as e:
            raise ValueError(f"messages: {e}") from None

    async def start_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        params: SamplingParams | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        request_id: str | None = None,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
    ) -> tuple[RequestStream, str]:
        """Validate, render and submit one chat turn.

        Args:
            messages: OpenAI messages.
            tools: tool schemas, a registry, or tools.
            tool_choice: ``auto``, ``none``, ``required`` or ``{"type": "function",
                "function": {"name": ...}}``.
            params: sampling parameters.
            job_id: the job.
            is_last_step: the job's last step.
            request_id: caller-chosen id.
            pinning: per-request pinning override.
            ttl_rule: per-request TTL rule override.

        Returns:
            The stream and the normalised tool choice.

        Raises:
            ValueError: bad messages, tools or tool_choice, or rejected by the engine.
        """
        schemas = normalize_tools(tools)
        choice = normalize_tool_choice(tool_choice, schemas)
        prompt = self.render_chat(messages, schemas)
        parse = self.tool_call_format if schemas and choice != "none" else None
        stream = await self.submit(
            prompt, params, job_id=job_id, request_id=request_id, is_last_step=is_last_step,
            tools=schemas, tool_choice=choice, parse_format=parse, pinning=pinning,
            ttl_rule=ttl_rule,
        )
        return stream, choice if isinstance(choice, str) else "named"

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        job_id: str | None = None,
        is_last_step: bool = False,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
    ) -> AssistantTurn:
        """One assistant turn (see :meth:`Job.chat`, which adds the job's defaults).

        Args:
            messages: OpenAI messages.
            tools: tool schemas, a registry, or tools.
            tool_choice: see :meth:`start_chat`.
            max_tokens: generated tokens at most.
            temperature: 0 is greedy.
            seed: sampling seed.
            stop: stop strings.
            job_id: the job.
            is_last_step: the job's last step.
            pinning: per-request pinning override.
            ttl_rule: per-request TTL rule override.

        Returns:
            The assistant turn.

        Raises:
            ValueError: bad input (the message names the field).
        """
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=tuple(stop))
        stream, _ = await self.start_chat(
            messages, tools=tools, tool_choice=tool_choice, params=params, job_id=job_id,
            is_last_step=is_last_step, pinning=pinning, ttl_rule=ttl_rule,
        )
        try:
            final = await stream.result()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return build_turn(stream, final)

    async def finish_job(self, job_id: str, num_turns: int | None = None) -> None:
        """Tell the controller and the engine that a job is done (releases its pins).

        Args:
            job_id: the job.
            num_turns: its LLM calls (default: what the controller counted).
        """
        def done(engine: Any) -> None:
            self.controller.on_job_finished(job_id, num_turns)
            self._job_tokens.pop(job_id, None)

        await self.call(done)

    def job(
        self,
        job_id: str | None = None,
        tools: ToolsArg | Iterable[Callable[..., Any]] = None,
        policy: str | PolicySpec | None = None,
        system_prompt: str | None = None,
    ) -> Job:
        """A new job.

        Args:
            job_id: its id (default: a fresh ``job-...`` id).
            tools: a :class:`ToolRegistry`, tools/functions to register, or OpenAI schemas
                (schemas only: :meth:`Job.run` then has nothing to execute).
            policy: per-job override of pinning and the TTL rule (engine settings stay the
                runtime's).
            system_prompt: system message that :meth:`Job.run` puts first.

        Returns:
            The job.

        Raises:
            ValueError: unknown policy or invalid tools.
        """
        spec = self.policy if policy is None else (resolve_policy(policy) if isinstance(policy, str) else policy)
        return Job(self, job_id or f"job-{uuid.uuid4().hex[:12]}", tools, spec, system_prompt)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        stopping = False
        while not stopping:
            try:
                # Busy: take what is queued and step at once. Idle: sleep until a command comes,
                # waking now and then so that expired pins are released on time.
                if engine.has_unfinished():
                    cmd = self._commands.get_nowait()
                else:
                    cmd = self._commands.get(timeout=self._idle_poll_s)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    stopping = True
                else:
                    self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if stopping:
                break
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - keep serving; fail the victims loudly
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._dispatch(out)
        self._shutdown()

    def _handle(self, cmd: _Submit | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    cmd.future.set_exception(exc)
            return
        if isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            return
        if not cmd.accepted.set_running_or_notify_cancel():
            return  # the submitter cancelled before the engine saw it
        try:
            params = cmd.params
            processor = None
            if cmd.tool_choice is not None and cmd.tool_choice not in ("auto", "none"):
                processor = make_tool_call_processor(
                    self._grammars, engine.tokenizer, cmd.tools or [], cmd.tool_choice,
                    vocab_size=engine.model_config.vocab_size,
                )
            if processor is not None:
                params = replace(params, logits_processors=(*params.logits_processors, processor))
            ids = engine.encode(cmd.prompt)
            rid = cmd.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            rid = engine.add_request(
                ids, params, session_id=cmd.session_id, job_id=cmd.job_id, request_id=rid,
                is_last_step=cmd.is_last_step,
            )
        except Exception as exc:  # noqa: BLE001 - rejected input goes back to the caller
            cmd.accepted.set_exception(exc)
            return
        if cmd.job_id is not None:
            arrival = engine.requests[rid].metrics.arrival_time
            self.controller.on_request_arrival(cmd.job_id, arrival)
        self._active[rid] = _Active(cmd, ids)
        cmd.accepted.set_result((rid, ids))

    def _dispatch(self, out: RequestOutput) -> None:
        active = self._active.get(out.request_id)
        if active is None:
            return
        if not out.finished:
            active.submit.sink.put(StreamEvent(out))
            return
        del self._active[out.request_id]
        try:
            event = self._finalize(active, out)
        except Exception as exc:  # noqa: BLE001 - the output stands even if a decision failed
            logger.exception("finalizing %s failed", out.request_id)
            event = StreamEvent(out)
            del exc
        active.submit.sink.put(event)

    def _finalize(self, active: _Active, out: RequestOutput) -> StreamEvent:
        """Engine thread, right after a request finished: metrics, parse, pin decision."""
        sub = active.submit
        m = out.metrics
        ctl = self.controller
        ctl.on_request_scheduled(m.arrival_time, m.first_scheduled_time)
        parsed = parse_tool_calls(out.text, sub.parse_format) if sub.parse_format else None
        pin: PinDecision | None = None
        job = sub.job_id
        all_ids = active.prompt_ids + list(out.token_ids)
        if job is not None:
            recomputed = self._job_recomputed(job, active.prompt_ids, m.cached_tokens) + m.preempted_tokens
            self._job_tokens[job] = all_ids
            self._job_tokens.move_to_end(job)
            while len(self._job_tokens) > _MAX_TRACKED_JOBS:
                self._job_tokens.popitem(last=False)
        else:
            recomputed = m.hole_tokens + m.suffix_recomputed_tokens + m.preempted_tokens
        if job is not None and out.finish_reason != "abort":
            if sub.is_last_step:
                ctl.on_job_finished(job)
                self._job_tokens.pop(job, None)
            elif (parsed is not None and parsed.tool_calls) or sub.pause_tool is not None:
                names = [c.name for c in parsed.tool_calls] if parsed is not None else []
                pin = ctl.on_tool_call(
                    job,
                    names or [sub.pause_tool or "unknown"],
                    len(all_ids),
                    ended_at=m.finish_time,
                    pinning=sub.pinning,
                    ttl_rule=sub.ttl_rule,  # type: ignore[arg-type]
                )
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

    def _job_recomputed(self, job: str, prompt_ids: list[int], cached: int) -> int:
        """History tokens of ``job`` that had to be computed again in this request."""
        prev = self._job_tokens.get(job)
        if not prev:
            return 0
        common = 0
        for a, b in zip(prev, prompt_ids, strict=False):
            if a != b:
                break
            common += 1
        bs = self.engine.block_size
        # Only full blocks are cacheable, and the prompt's last token is always computed.
        reusable = min(common // bs * bs, (len(prompt_ids) - 1) // bs * bs)
        return max(0, reusable - cached)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, active in list(self._active.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort while failing
                logger.exception("abort of %s failed", rid)
            active.submit.sink.put(RuntimeError(f"engine step failed: {exc!r}"))
        self._active.clear()

    def _shutdown(self) -> None:
        # Answer whatever is still queued, then abort what is in flight.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                cmd.accepted.set_exception(RuntimeError("runtime: closed"))
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(RuntimeError("runtime: closed"))
        for rid, active in list(self._active.items()):
            self.engine.abort(rid)
            active.submit.sink.put(RuntimeError("runtime: closed"))
        self._active.clear()
        self.engine.step()  # flush the aborts' outputs so the engine is left consistent


# ----------------------------------------------------------------------------------------------
# Validation helpers (shared with the server)
# ----------------------------------------------------------------------------------------------


def validate_messages(messages: Any) -> None:
    """Check the shape of an OpenAI ``messages`` list.

    Args:
        messages: the value to check.

    Raises:
        ValueError: naming ``messages`` or ``messages[i].<field>``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {sorted(_ROLES)}, got {role!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ValueError(f"messages[{i}].content: must be a string, a list of parts, or null")
        if m.get("tool_calls") is not None and not isinstance(m.get("tool_calls"), list):
            raise ValueError(f"messages[{i}].tool_calls: must be a list")


def normalize_tools(tools: ToolsArg | Iterable[Callable[..., Any]]) -> list[dict[str, Any]]:
    """OpenAI tool schemas from schemas, a registry, or tools; validated.

    Args:
        tools: schemas, a :class:`ToolRegistry`, :class:`Tool` s, or None.

    Returns:
        The schemas (empty list for None).

    Raises:
        ValueError: ``tools[i].<field>`` of the first invalid schema, or duplicate names.
    """
    if tools is None:
        return []
    if isinstance(tools, ToolRegistry):
        return tools.openai_schemas()
    if isinstance(tools, Mapping) or isinstance(tools, str) or not isinstance(tools, Iterable):
        raise ValueError("tools: must be a list of tool schemas")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        schema = t.openai_schema() if isinstance(t, Tool) else t
        try:
            validate_tool_schema(schema)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"tools[{i}].{e}") from None
        name = schema["function"]["name"]  # type: ignore[index]
        if name in seen:
            raise ValueError(f"tools[{i}].function.name: duplicate tool {name!r}")
        seen.add(name)
        out.append(dict(schema))  # type: ignore[arg-type]
    return out


def normalize_tool_choice(tool_choice: ToolChoice, tools: Sequence[Mapping[str, Any]]) -> str | dict[str, Any]:
    """Validate an OpenAI ``tool_choice`` against the tools.

    Args:
        tool_choice: ``auto``, ``none``, ``required``, None (auto with tools, else none), or
            ``{"type": "function", "function": {"name": ...}}``.
        tools: the request's tool schemas.

    Returns:
        ``"auto"``, ``"none"``, ``"required"`` or the named-function dict.

    Raises:
        ValueError: naming ``tool_choice``.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ValueError(
                f"tool_choice: must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}"
            )
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice: 'required' needs at least one tool in 'tools'")
        return tool_choice
    if isinstance(tool_choice, Mapping):
        if tool_choice.get("type", "function") != "function":
            raise ValueError(f"tool_choice.type: must be 'function', got {tool_choice.get('type')!r}")
        name = tool_choice_name(tool_choice)
        if name is None:
            raise ValueError("tool_choice.function.name: missing")
        if name not in names:
            raise ValueError(f"tool_choice.function.name: {name!r} is not among the tools {names}")
        return {"type": "function", "function": {"name": name}}
    raise ValueError(f"tool_choice: must be a string or an object, got {type(tool_choice).__name__}")


def build_turn(stream: RequestStream, final: StreamEvent) -> AssistantTurn:
    """The :class:`AssistantTurn` of a finished chat stream.

    Args:
        stream: the stream.
        final: its final event.

    Returns:
        The turn.
    """
    out = final.output
    parsed = final.parsed if final.parsed is not None else ParsedMessage(out.text.strip(), [])
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
        list(stream.prompt_token_ids), list(out.token_ids), final.pin,
    )


def _as_registry(tools: Any) -> ToolRegistry | None:
    """A registry from a registry, tools or callables; None for schemas or nothing."""
    if tools is None:
        return None
    if isinstance(tools, ToolRegistry):
        return tools
    items = list(tools)
    if not items or all(isinstance(t, Mapping) for t in items):
        return None
    reg = ToolRegistry()
    for i, t in enumerate(items):
        if isinstance(t, Mapping):
            raise ValueError(f"tools[{i}]: mix of schemas and tools; pass one kind")
        reg.register(t)
    return reg


# ----------------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------------


class Job:
    """A multi-turn agent job: its requests share ``job_id`` (engine session, Continuum job).

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
        policy: PolicySpec,
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
        max_tokens: int = 256,
        is_last_step: bool = False,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> AssistantTurn:
        """One assistant turn of this job.

        Args:
            messages: the whole conversation so far (OpenAI format).
            tools: tool schemas/registry (default: the job's tools).
            tool_choice: ``auto``, ``none``, ``required`` or a named function (the last two
                constrain decoding so even a small model emits a valid call).
            max_tokens: generated tokens at most.
            is_last_step: this is the job's last LLM call (its KV is released right after).
            temperature: 0 is greedy.
            seed: sampling seed.
            stop: stop strings.

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
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop,
            job_id=self.job_id,
            is_last_step=is_last_step,
            pinning=self.policy.pinning,
            ttl_rule=self.policy.ttl_rule,
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

        Returns:
            The job's result and metrics.

        Raises:
            ValueError: empty task, ``max_turns < 1``, no executable tools, or bad input.
        """
        if not isinstance(task, str) or not task.strip():
            raise ValueError("task: must be a non-empty string")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: must be an integer >= 1, got {max_turns!r}")
        registry = _as_registry(tools) if tools is not None else self.registry
        if registry is None or not len(registry):
            raise ValueError("tools: Job.run needs executable tools (a ToolRegistry, Tools or functions)")
        schemas = registry.openai_schemas()
        choices = _per_turn_choices(tool_choice, max_turns)
        system = system_prompt if system_prompt is not None else self.system_prompt
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
                    messages, tools=schemas, tool_choice=choice, max_tokens=max_tokens, is_last_step=last
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


__all__ = [
    "AgentRuntime",
    "AssistantTurn",
    "Job",
    "JobMetrics",
    "JobResult",
    "RequestStream",
    "StreamEvent",
    "ToolCallRecord",
    "TurnMetrics",
    "TurnRecord",
    "build_turn",
    "normalize_tool_choice",
    "normalize_tools",
    "validate_messages",
]
