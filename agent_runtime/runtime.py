"""AgentRuntime: the small facade over the engine client, the output processor and jobs.

One turn, end to end: :meth:`Job.chat <agent_runtime.job.Job.chat>` renders the messages (the
chat template runs on the caller's side) -> :class:`~agent_runtime.engine_client.AsyncEngine`
encodes on the engine thread, where the
:class:`~agent_runtime.output_processor.OutputProcessor` closes the job's tool pause, and queues
the request -> steps stream tokens back -> when the request finishes the output processor parses
its tool calls and lets the :class:`~asymcache_core.continuum.controller.ContinuumController` pin the job's
blocks for tau* -> :func:`~agent_runtime.output_processor.build_turn` makes the
:class:`~agent_runtime.types.AssistantTurn` with per-turn metrics.

Request validation (messages, tools, tool_choice) is :mod:`agent_runtime.protocol`'s, shared
with the HTTP server.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from agent_runtime.engine_client import AsyncEngine
from agent_runtime.job import Job
from agent_runtime.output_processor import OutputOptions, OutputProcessor
from agent_runtime.presets import ServingPreset, preset_for_engine, resolve_preset
from agent_runtime.protocol import (
    ToolChoice,
    ToolsArg,
    check_request_options,
)
from agent_runtime.reasoning import REASONING_PARSERS
from agent_runtime.rendered_turns import RenderedTurns
from agent_runtime.request_stream import RequestStream
from agent_runtime.runtime_chat import ChatTurns
from agent_runtime.structured_outputs import normalize_structured_outputs
from asymcache_core import Engine
from asymcache_core.chat_template import ChatRenderer, ChatTemplates
from asymcache_core.chat_template_options import check_template_source
from asymcache_core.continuum.controller import ContinuumController
from asymcache_core.engine_checks import check_id
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.tool_parsing import TOOL_CALL_FORMATS, ToolCallFormat

if TYPE_CHECKING:
    from asymcache_core.loaders import LoadedModel

T = TypeVar("T")


class AgentRuntime(ChatTurns):
    """The engine in its own thread, plus jobs, chat rendering and Continuum decisions.

    Args:
        engine: the engine (the runtime takes ownership of it: only the engine thread may touch
            it from now on; use :meth:`call` to inspect it).
        policy: a policy name or spec (:mod:`agent_runtime.presets`); its engine settings must
            match the engine's config, and it decides whether turns that end in a tool call pin
            the job's KV. ``None``: the preset the engine's config is built for
            (:func:`~agent_runtime.presets.preset_for_engine`).
        clock: the runtime's time source for tool timing; defaults to the engine's clock (pass
            the same virtual clock as the engine's in simulations).
        tool_call_format: how assistant text is parsed for tool calls, and the form constrained
            decoding forces a call into (``hermes``: tagged calls, Qwen's and this project's
            instruction for templates without tools; ``llama3_json``: Llama 3.1+'s bare JSON,
            with a template that renders tools itself; ``bash_block``; ``auto``).
        controller: a Continuum controller to use (default: a fresh one over ``engine``).
        idle_poll_s: how often the idle engine thread wakes to expire pins.
        chat_template: the chat template's source instead of the tokenizer's (vLLM's
            ``--chat-template``; :func:`~asymcache_core.chat_template_options.load_chat_template`
            reads a file).
        chat_template_kwargs: template variables every chat gets unless it sets its own
            (vLLM's ``--default-chat-template-kwargs``, e.g. ``{"enable_thinking": False}``).
        reasoning_parser: split a reasoning model's thinking off its chat replies
            (``deepseek_r1`` or ``qwen3``, vLLM's ``--reasoning-parser``): it goes in the
            message's ``reasoning_content``, and tool calls are parsed from the rest.

    Raises:
        ValueError: unknown policy, or one whose engine settings differ from the engine's; a
            template that does not parse, bad template variables, or a template for a model
            without a tokenizer.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        policy: str | ServingPreset | None = None,
        clock: Callable[[], float] | None = None,
        tool_call_format: ToolCallFormat = "hermes",
        controller: ContinuumController | None = None,
        idle_poll_s: float = 0.02,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise ValueError(f"engine: an asymcache_core.Engine, got {type(engine).__name__}")
        if policy is None:
            spec = preset_for_engine(engine.config)
        else:
            spec = resolve_preset(policy) if isinstance(policy, str) else policy
        for key, want in spec.engine_overrides.items():
            have = getattr(engine.config, key, None)
            if have != want:
                raise ValueError(
                    f"policy: {spec.name!r} needs {key}={want!r} but the engine has {key}={have!r}; "
                    "build the engine with resolve_preset(name).engine_overrides"
                )
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: one of {', '.join(REASONING_PARSERS)}; got {reasoning_parser!r}")
        #: vLLM's reasoning parser for chat replies (None: none)
        self.reasoning_parser: str | None = reasoning_parser
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format: one of {', '.join(TOOL_CALL_FORMATS)}; got {tool_call_format!r}")
        self.engine = engine
        self.policy = spec
        self.clock: Callable[[], float] = clock or engine.clock
        self.tool_call_format: ToolCallFormat = tool_call_format
        self.controller = controller or engine.continuum.configure(ttl_rule=spec.ttl_rule, pinning=spec.pinning)
        self.model_name: str = engine.config.model
        self.max_model_len: int = engine.max_model_len
        if engine.tokenizer is None and (chat_template is not None or chat_template_kwargs):
            raise ValueError("chat_template: this model has no tokenizer to render chats with")
        #: the chat templates (None: a model without a tokenizer or a chat template; its chats
        #: are refused, its text completions served)
        self.templates: ChatTemplates | None = None
        template = None if chat_template is None else check_template_source(chat_template)
        if engine.tokenizer is not None and (template or getattr(engine.tokenizer, "chat_template", None)):
            self.templates = ChatTemplates(engine.tokenizer, template, chat_template_kwargs)
        if tool_call_format == "llama3_json" and (self.templates is None or not self.templates.default.native_tools):
            # NOTE: a template without a tools section gets this project's Hermes instruction,
            # which asks for tagged calls: the model would not write Llama's JSON
            raise ValueError("tool_call_format: llama3_json needs a chat template that renders tools itself "
                             "(Llama 3.1 and later); this one does not: use hermes")
        # NOTE: jobs for clients that name none: this runtime ends one whose reply calls no tool
        #: whether the engine gives requests that name no job their conversation's (where job
        #: admission is on)
        self.implicit_jobs: bool = bool(engine.use_implicit_jobs())
        #: the jobs the engine gave chat turns, by rendered prompt (templates that drop thinking)
        self.rendered_turns = RenderedTurns()
        self._processor = OutputProcessor(self.controller, engine.block_size, end_job=engine.end_job)
        self._client = AsyncEngine(engine, self._processor, idle_poll_s=idle_poll_s)
        #: close the engine too (its KV event sockets, its tensor-parallel workers) on close
        self.owns_engine = False

    @classmethod
    def from_model(
        cls,
        model: str = "smollm2-135m",
        policy: str = "asymcache+continuum",
        *,
        loaded: LoadedModel | None = None,
        clock: Callable[[], float] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tool_call_format: ToolCallFormat = "hermes",
        reasoning_parser: str | None = None,
        **engine_kwargs: Any,
    ) -> AgentRuntime:
        """Build an engine for ``model`` configured for ``policy``, and a runtime over it.

        Args:
            model: model spec (see :class:`asymcache_core.EngineConfig`).
            policy: policy name.
            loaded: an already loaded model to share.
            clock: engine and runtime clock (default: monotonic).
            chat_template: the chat template's source instead of the model's.
            chat_template_kwargs: template variables every chat gets by default.
            tool_call_format: how replies' tool calls are written and parsed (see the class).
            reasoning_parser: split a reasoning model's thinking off its replies (see the class).
            **engine_kwargs: further :class:`asymcache_core.EngineConfig` fields.

        Returns:
            The runtime.

        Raises:
            ValueError: bad policy, engine settings (or one the policy sets otherwise) or
                template options.
        """
        spec = resolve_preset(policy)
        if chat_template is not None:
            check_template_source(chat_template)  # before the model loads
        for key, want in spec.engine_overrides.items():
            if key in engine_kwargs and engine_kwargs[key] != want:
                raise ValueError(f"{key}: the policy {spec.name!r} sets it to {want!r}; "
                                 f"got {engine_kwargs[key]!r} (pick a policy, or leave {key} out)")
        kwargs = {**engine_kwargs, **spec.engine_overrides}
        engine = Engine(model=model, loaded=loaded, clock=clock, **kwargs)
        try:
            runtime = cls(engine, policy=spec, clock=clock, chat_template=chat_template,
                          chat_template_kwargs=chat_template_kwargs, tool_call_format=tool_call_format,
                          reasoning_parser=reasoning_parser)
        except BaseException:
            engine.close()
            raise
        runtime.owns_engine = True
        return runtime

    @property
    def renderer(self) -> ChatRenderer | None:
        """The default chat template's renderer (None: the model renders no chats)."""
        return None if self.templates is None else self.templates.default

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._client.closed

    async def close(self) -> None:
        """Abort what is in flight and stop the engine thread (idempotent); a runtime built by
        :meth:`from_model` also closes its engine."""
        await self._client.close()
        self._close_engine()

    def close_sync(self, timeout: float | None = 30.0) -> None:
        """:meth:`close` for code without an event loop.

        Args:
            timeout: seconds to wait for the engine thread.
        """
        self._client.close_sync(timeout)
        self._close_engine()

    def _close_engine(self) -> None:
        if self.owns_engine:
            self.engine.close()

    async def __aenter__(self) -> AgentRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- engine access -------------------------------------------------------------------------
    def call_threadsafe(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread, between steps.

        Args:
            fn: the function (must not block for long: it stalls every request).

        Returns:
            A future with its result or exception.
        """
        return self._client.call_threadsafe(fn)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Async :meth:`call_threadsafe`.

        Args:
            fn: the function, given the engine.

        Returns:
            Its result.
        """
        return await self._client.call(fn)

    def abort_nowait(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (no-op when unknown or finished).

        Args:
            request_id: the engine request id.
        """
        self._client.abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request.

        Args:
            request_id: the engine request id.
        """
        self._client.abort_nowait(request_id)

    # -- submission ----------------------------------------------------------------------------
    async def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        job_id: str | None = None,
        request_id: str | None = None,
        is_last_step: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = None,
        response_format: Mapping[str, Any] | None = None,
        structured_outputs: Mapping[str, Any] | None = None,
        parse_format: ToolCallFormat | None = None,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
        pause_tool: str | None = None,
        max_tool_calls: int | None = None,
        reasoning_parser: str | None = None,
        joins_conversation: bool = True,
        continues_job: str | None = None,
        strict_max_tokens: bool = False,
        constrain_thinking: bool = False,
    ) -> RequestStream:
        """Queue one request and return its stream once the engine accepted it.

        Args:
            prompt: text (encoded on the engine thread) or token ids.
            params: sampling parameters.
            job_id: the job (Continuum's, and the engine's grouping for eviction and admission).
            request_id: caller-chosen id.
            is_last_step: the job ends with this request.
            tools: tool schemas (for constrained decoding when ``tool_choice`` forces a call).
            tool_choice: ``required`` or a named function constrains decoding.
            response_format: a normalised ``response_format`` (JSON replies are constrained).
            structured_outputs: vLLM's ``structured_outputs`` (a JSON schema, a regular
                expression, a list of strings, an EBNF grammar or a structural tag: the reply
                is constrained to it;
                :mod:`agent_runtime.structured_outputs`); not with ``response_format``.
            parse_format: parse tool calls out of the final text with this format (needed for
                pinning); None: no parsing.
            pinning: per-request override of the policy's pinning.
            ttl_rule: per-request override of the TTL rule.
            pause_tool: for a job request that is not its last step and whose text has no
                parsed tool call (token-level clients such as ``/v1/completions``): the job
                pauses for this tool after it, so it is pinned as after a tool call.
            max_tool_calls: keep at most this many parsed tool calls, the first (None: all).
            reasoning_parser: split a reasoning model's thinking off the final text first.
            joins_conversation: without a ``job_id``, the request may join the job of the
                conversation it continues (:meth:`~asymcache_core.engine.Engine.use_implicit_jobs`).
            continues_job: the job of the turn this one continues, found by the rendered chat
                (taken where the prompt's tokens match no conversation).
            strict_max_tokens: reject (:class:`~agent_runtime.protocol.ContextLengthError`) a
                prompt whose ``max_tokens`` reach past ``max_model_len``, as vLLM's server
                does, instead of stopping it at the limit.
            constrain_thinking: with ``reasoning_parser``, a constrained reply (``tool_choice``,
                ``response_format``, ``structured_outputs``) is constrained from its first token,
                its thinking too (vLLM's ``include_reasoning: false``); by default the
                constraint starts where the thinking ends, as vLLM's structured outputs do
                (:mod:`agent_runtime.reasoning_gate`).

        Returns:
            The stream.

        Raises:
            ValueError: rejected by the engine or by the grammar builder (message names the field).
            RuntimeError: the runtime is closed.
        """
        check_request_options(job_id, is_last_step, pinning, ttl_rule)
        constraint = normalize_structured_outputs(structured_outputs, tool_choice)
        if constraint is not None:
            if response_format is not None:
                raise ValueError("structured_outputs: set either structured_outputs or a JSON response_format, "
                                 "not both")
            response_format = constraint
        options = OutputOptions(
            job_id, is_last_step, parse_format, pinning, ttl_rule, pause_tool, max_tool_calls, reasoning_parser,
            joins_conversation=joins_conversation, continues_job=continues_job,
        )
        return await self._client.submit(
            prompt, params, options=options, request_id=request_id,
            tools=tools, tool_choice=tool_choice, response_format=response_format,
            strict_max_tokens=strict_max_tokens, constrain_thinking=constrain_thinking,
        )

    async def finish_job(self, job_id: str, num_turns: int | None = None) -> None:
        """Tell the controller and the engine that a job is done (releases its pins).

        Args:
            job_id: the job.
            num_turns: its LLM calls (default: what the controller counted).

        Raises:
            ValueError: a job id that is no non-empty string, or ``num_turns`` no integer >= 1.
        """
        check_id("job_id", job_id)
        if num_turns is not None and (isinstance(num_turns, bool) or not isinstance(num_turns, int) or num_turns < 1):
            raise ValueError(f"num_turns: an integer >= 1 or None, got {num_turns!r}")
        await self.call(lambda _engine: self._processor.finish_job(job_id, num_turns))

    def job(
        self,
        job_id: str | None = None,
        tools: ToolsArg | Iterable[Callable[..., Any]] = None,
        policy: str | ServingPreset | None = None,
        system_prompt: str | None = None,
    ) -> Job:
        """A new job.

        Args:
            job_id: its id (default: a fresh ``job-...`` id).
            tools: a :class:`ToolRegistry`, tools/functions to register, or OpenAI schemas
                (schemas only: :meth:`~agent_runtime.job.Job.run` then has nothing to execute).
            policy: per-job override of pinning and the TTL rule (engine settings stay the
                runtime's).
            system_prompt: system message that :meth:`~agent_runtime.job.Job.run` puts first.

        Returns:
            The job.

        Raises:
            ValueError: unknown policy or invalid tools.
        """
        spec = self.policy if policy is None else (resolve_preset(policy) if isinstance(policy, str) else policy)
        return Job(self, job_id or f"job-{uuid.uuid4().hex[:12]}", tools, spec, system_prompt)


__all__ = ["AgentRuntime"]
