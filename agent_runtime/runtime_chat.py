"""The chat half of :class:`~agent_runtime.runtime.AgentRuntime` (a mixin): a chat rendered with
the model's template and submitted as one request per choice, vLLM's ``/tokenize`` and
``/detokenize``, the thinking budget and the conversation a jobless chat continues.

Validation of messages, tools and tool choice is :mod:`agent_runtime.protocol`'s, shared with the
HTTP server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Unpack

from agent_runtime.constrained import needs_constraint
from agent_runtime.engine_client import AsyncEngine
from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import (
    ChatSampling,
    ToolChoice,
    ToolsArg,
    chat_sampling_params,
    normalize_response_format,
    normalize_tool_choice,
    normalize_tools,
)
from agent_runtime.reasoning import reply_parser
from agent_runtime.rendered_turns import RenderedTurns, previous_turn_chat
from agent_runtime.request_stream import RequestStream
from agent_runtime.structured_outputs import normalize_structured_outputs
from agent_runtime.thinking_budget import check_thinking_budget, thinking_budget_processor
from agent_runtime.types import AssistantTurn
from asymcache_core import Engine
from asymcache_core.chat_template import ChatTemplates
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.tool_parsing import ToolCallFormat

#: :meth:`ChatTurns.start_chat`'s keywords that :meth:`ChatTurns.start_chat_choices` takes.
_CHAT_OPTIONS = frozenset({
    "tools", "tool_choice", "response_format", "structured_outputs", "job_id", "is_last_step", "pinning", "ttl_rule",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "thinking_token_budget", "strict_max_tokens", "constrain_thinking",
})

#: Errors of the chat's rendering that name a field of their own (the rest name ``messages``).
_NAMED_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "documents",
                 "default_chat_template_kwargs")


class ChatTurns:
    """Chat turns over the runtime's engine client (a mixin of
    :class:`~agent_runtime.runtime.AgentRuntime`, which sets the attributes below).

    Invariant: a chat is validated and rendered on the caller's side, once for all its choices;
    nothing here touches the engine but through :meth:`submit` and the engine client.
    """

    engine: Engine
    templates: ChatTemplates | None
    reasoning_parser: str | None
    tool_call_format: ToolCallFormat
    rendered_turns: RenderedTurns
    _client: AsyncEngine

    if TYPE_CHECKING:
        async def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                         **options: Any) -> RequestStream: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]:
        """Render a chat to prompt text with the model's template (validated).

        Args:
            messages: OpenAI messages.
            tools: validated tool schemas.
            add_generation_prompt: end with the opening of an assistant turn.
            continue_final_message: end inside the final message, for the model to go on
                writing it (vLLM's; not with ``add_generation_prompt``).
            chat_template: this chat's template source instead of the runtime's (vLLM's
                request field; the server takes it only with ``--trust-request-chat-template``).
            chat_template_kwargs: this chat's template variables, over the runtime's defaults.
            documents: the ``documents`` variable of retrieval templates.

        Returns:
            The prompt text, or its token ids when caller text spells special tokens (encoded
            as text: :meth:`ChatRenderer.prompt`).

        Raises:
            ValueError: malformed messages (the message names ``messages[i]...``), template
                options (``chat_template...``, ``documents...``) or a template failing on the
                chat (``chat_template: ...``), or a model without a tokenizer.
        """
        if self.templates is None:
            loaded = getattr(self.engine, "loaded", None)
            why = f" ({loaded.tokenizer_source})" if loaded is not None else ""
            raise ValueError(f"messages: this model has no tokenizer/chat template{why}")
        try:
            return self.templates.prompt(
                messages, tools, add_generation_prompt, continue_final_message, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs, documents=documents,
            )
        except ValueError as e:
            if str(e).startswith(_NAMED_FIELDS):
                raise
            raise ValueError(f"messages: {e}") from None

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: ToolsArg = None,
        add_special_tokens: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids the engine would run for a prompt or a chat (vLLM's ``/tokenize``).

        Args:
            prompt: a text prompt, encoded as :meth:`submit` encodes it.
            messages: or a chat, rendered as :meth:`start_chat` renders it (with the generation
                prompt and ``tools``).
            tools: the chat's tool schemas, a registry, or tools.
            add_special_tokens: let the tokenizer add its special tokens to ``prompt`` (the
                engine never does).
            add_generation_prompt: end a chat with the opening of an assistant turn.
            continue_final_message: end a chat inside its final message.
            chat_template: a chat's template instead of the runtime's.
            chat_template_kwargs: a chat's template variables.
            documents: a chat's ``documents`` variable.

        Returns:
            The ids.

        Raises:
            ValueError: neither or both of ``prompt`` and ``messages``, bad messages or tools,
                a model without a tokenizer, or a text too long for ``max_model_len``.
        """
        if prompt is None and messages is None:
            raise ValueError("prompt: give a prompt or messages")
        if prompt is not None and messages is not None:
            raise ValueError("messages: give a prompt or messages, not both")
        encoder = self._client.encoder
        if messages is not None:
            rendered = self.render_chat(
                messages, normalize_tools(tools), add_generation_prompt, continue_final_message,
                chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, documents=documents,
            )
            if not isinstance(rendered, str):
                return list(rendered)
            prompt, add_special_tokens = rendered, False
        if not isinstance(prompt, str):
            raise ValueError("prompt: must be a string")
        if encoder is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return await encoder.encode_async(prompt, add_special_tokens)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included (vLLM's ``/detokenize``).

        Raises:
            ValueError: an id outside the vocabulary, or a model without a tokenizer.
        """
        vocab = self.engine.model_config.vocab_size
        ids = list(token_ids)
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"tokens: {bad!r} is not a token id of this model (vocabulary of {vocab})")
        encoder = self._client.encoder
        if encoder is None:
            raise ValueError("tokens: this model has no tokenizer")
        return await encoder.decode_async(ids)

    async def start_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        response_format: Mapping[str, Any] | None = None,
        structured_outputs: Mapping[str, Any] | None = None,
        params: SamplingParams | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        request_id: str | None = None,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
        parallel_tool_calls: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        thinking_token_budget: int | None = None,
        strict_max_tokens: bool = False,
        constrain_thinking: bool = False,
    ) -> tuple[RequestStream, str]:
        """Validate, render and submit one chat turn.

        Args:
            messages: OpenAI messages.
            tools: tool schemas, a registry, or tools.
            tool_choice: ``auto``, ``none``, ``required`` or ``{"type": "function",
                "function": {"name": ...}}``.
            response_format: OpenAI's ``response_format`` (``text``, ``json_object`` or
                ``json_schema``): JSON replies are constrained to it.
            structured_outputs: vLLM's ``structured_outputs`` (one of ``json``, ``regex``,
                ``choice``, ``grammar``, ``json_object``, ``structural_tag``): the reply is
                constrained to it
                (:mod:`agent_runtime.structured_outputs`; not with a JSON ``response_format``).
            params: sampling parameters.
            job_id: the job.
            is_last_step: the job's last step.
            request_id: caller-chosen id.
            pinning: per-request pinning override.
            ttl_rule: per-request TTL rule override.
            parallel_tool_calls: OpenAI's flag; False keeps the reply's first tool call only.
            add_generation_prompt: end the prompt with the opening of an assistant turn (vLLM's;
                False lets the model go on from the chat as rendered).
            continue_final_message: end the prompt inside the final message, without its end
                of turn: the reply continues that message (vLLM's; an assistant prefix such as
                ``{"answer":``; needs ``add_generation_prompt=False``).
            chat_template: this chat's template source instead of the runtime's.
            chat_template_kwargs: this chat's template variables (``{"enable_thinking":
                False}``), over the runtime's defaults.
            documents: the ``documents`` variable of retrieval templates.
            thinking_token_budget: with a reasoning parser, the reply's thinking block is
                closed once it holds this many tokens (vLLM's field;
                :mod:`agent_runtime.thinking_budget`; not with ``constrain_thinking`` and a
                constrained reply).
            strict_max_tokens: reject (:class:`~agent_runtime.protocol.ContextLengthError`) a
                chat whose prompt and ``params.max_tokens`` pass ``max_model_len``, as the
                servers do, instead of stopping the reply at the limit.
            constrain_thinking: with a reasoning parser, a constrained reply (a forced tool
                call, ``response_format``, ``structured_outputs``) is constrained from its first
                token, its thinking too (vLLM's ``include_reasoning: false``); by default from
                where its thinking ends (vLLM's structured outputs:
                :mod:`agent_runtime.reasoning_gate`).

        Returns:
            The stream and the normalised tool choice.

        Raises:
            ValueError: bad messages, tools, tool_choice, response_format or structured_outputs,
                or rejected by the engine.
        """
        streams, choice = await self.start_chat_choices(
            messages, [params or SamplingParams()], tools=tools, tool_choice=tool_choice,
            response_format=response_format, structured_outputs=structured_outputs, job_id=job_id, is_last_step=is_last_step, request_id=request_id,
            pinning=pinning, ttl_rule=ttl_rule, parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, documents=documents,
            thinking_token_budget=thinking_token_budget, strict_max_tokens=strict_max_tokens,
            constrain_thinking=constrain_thinking,
        )
        return streams[0], choice

    async def start_chat_choices(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: Sequence[SamplingParams],
        *,
        request_id: str | None = None,
        **options: Any,
    ) -> tuple[list[RequestStream], str]:
        """:meth:`start_chat` for several choices of one chat (OpenAI's ``n``): the chat is
        checked and rendered once, and one request per parameters is submitted.

        Args:
            messages: OpenAI messages.
            params: each choice's sampling parameters.
            request_id: caller-chosen id (one choice only).
            **options: :meth:`start_chat`'s other keywords.

        Returns:
            The streams, in the order of ``params``, and the normalised tool choice.

        Raises:
            ValueError: as :meth:`start_chat`; the choices submitted before are aborted.
        """
        unknown = sorted(set(options) - _CHAT_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        if request_id is not None and len(params) != 1:
            raise ValueError("request_id: names one request; leave it out for several choices")
        schemas = normalize_tools(options.get("tools"))
        choice = normalize_tool_choice(options.get("tool_choice", "auto"), schemas)
        fmt = normalize_response_format(options.get("response_format"), choice)
        constraint = normalize_structured_outputs(options.get("structured_outputs"), choice)
        if constraint is not None:
            if fmt is not None:
                raise ValueError("structured_outputs: set either structured_outputs or a JSON response_format, "
                                 "not both")
            fmt = constraint
        constrain_thinking = _flag(options.get("constrain_thinking", False), "constrain_thinking")
        if options.get("thinking_token_budget") is not None:
            constrained = needs_constraint(choice) or fmt is not None
            params = self._with_thinking_budget(params, options["thinking_token_budget"], constrained,
                                                constrain_thinking, options.get("chat_template_kwargs"))
        prompt = self.render_chat(
            messages, schemas, options.get("add_generation_prompt", True), options.get("continue_final_message", False),
            chat_template=options.get("chat_template"), chat_template_kwargs=options.get("chat_template_kwargs"),
            documents=options.get("documents"),
        )
        parse = self.tool_call_format if schemas and choice != "none" else None
        if parse in ("hermes", "auto"):
            # NOTE: vLLM's hermes parser does the same: a model whose tokenizer marks
            # ``<tool_call>`` special (Hermes 2 Pro, Hermes 3) would lose its tags in the text
            params = [replace(p, skip_special_tokens=False) for p in params]
        # NOTE: a reply that continues the final message (a prefill) is that message's content,
        # not a thinking block: the reasoning parser would take it all for thinking
        thinking = self.reply_reasoning_parser(options.get("continue_final_message", False),
                                               options.get("chat_template_kwargs"))
        # NOTE: several choices without a job: the client goes on with one of them at most, so
        # none joins a conversation's job (an implicit job's pin or gate reservation would
        # outlive the choices it drops)
        joins = len(params) == 1
        continues = None
        if joins and options.get("job_id") is None:
            continues = self._continued_job(messages, schemas, options, params[0].cache_salt)
        streams: list[RequestStream] = []
        try:
            for choice_params in params:
                streams.append(await self.submit(
                    prompt, choice_params, job_id=options.get("job_id"), request_id=request_id,
                    is_last_step=options.get("is_last_step", False), tools=schemas, tool_choice=choice,
                    response_format=fmt, parse_format=parse, pinning=options.get("pinning"),
                    ttl_rule=options.get("ttl_rule"),
                    max_tool_calls=None if options.get("parallel_tool_calls", True) else 1,
                    reasoning_parser=thinking, joins_conversation=joins, continues_job=continues,
                    strict_max_tokens=options.get("strict_max_tokens", False),
                    constrain_thinking=constrain_thinking,
                ))
        except BaseException:
            # NOTE: rejected, or the caller cancelled between two submits: none runs on alone
            for stream in streams:
                stream.abort()
            raise
        if joins and options.get("job_id") is None and streams[0].job_id is not None:
            self.rendered_turns.remember(prompt, streams[0].job_id, params[0].cache_salt)
        return streams, choice if isinstance(choice, str) else "named"

    def reply_reasoning_parser(self, continues: bool, chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
        """The reasoning parser that reads one chat reply (None: all content).

        NOTE: explicit per request, as vLLM builds its parser per request: a reply that
        continues the final message (a prefill) is that message's content, not a thinking block
        (the parser would take it all for thinking); ``qwen3`` reads the template's
        ``enable_thinking`` (:func:`~agent_runtime.reasoning.reply_parser`), the runtime's
        default template variables under the request's own (vLLM's
        ``_effective_chat_template_kwargs``).

        Args:
            continues: the reply continues the final message.
            chat_template_kwargs: the request's template variables.

        Returns:
            The parser, or None.
        """
        if continues:
            return None
        defaults = self.templates.default_kwargs if self.templates is not None else {}
        return reply_parser(self.reasoning_parser, {**defaults, **(chat_template_kwargs or {})})

    def _with_thinking_budget(self, params: Sequence[SamplingParams], budget: object, constrained: bool,
                              constrain_thinking: bool,
                              chat_template_kwargs: Mapping[str, Any] | None = None) -> list[SamplingParams]:
        """Each choice's parameters with its own :class:`ThinkingBudget` (vLLM's
        ``thinking_token_budget``); ``constrained``: a grammar takes the reply over where its
        thinking ends."""
        budget = check_thinking_budget(budget)
        if self.reasoning_parser is None or self.engine.tokenizer is None:
            raise ValueError("thinking_token_budget: needs a reasoning parser (serve --reasoning-parser)")
        if constrained and constrain_thinking:
            # NOTE: the grammar holds from the first token: the thinking it would close is
            # none the grammar allows (the forced close would leave no token to sample)
            raise ValueError("thinking_token_budget: not with a reply constrained from its first token "
                             "(constrain_thinking, include_reasoning false)")
        if self.reply_reasoning_parser(False, chat_template_kwargs) is None:
            # NOTE: qwen3 with thinking off: the reply has no thinking to cap (vLLM's
            # is_reasoning_end holds from the first token)
            return list(params)
        return [replace(p, logits_processors=(*p.logits_processors, thinking_budget_processor(
            budget, self.reasoning_parser, self.engine.tokenizer, grammar_follows=constrained))) for p in params]

    def _continued_job(self, messages: Sequence[Mapping[str, Any]], schemas: Sequence[Mapping[str, Any]] | None,
                       options: Mapping[str, Any], salt: str | None = None) -> str | None:
        """The job of the earlier turn a chat without a job continues, by rendering the chat
        before its last reply (:mod:`agent_runtime.rendered_turns`; None: none known)."""
        earlier = previous_turn_chat(messages)
        if (earlier is None or not self.rendered_turns or not options.get("add_generation_prompt", True)
                or options.get("continue_final_message", False)):
            return None
        try:
            prompt = self.render_chat(earlier, schemas, chat_template=options.get("chat_template"),
                                      chat_template_kwargs=options.get("chat_template_kwargs"),
                                      documents=options.get("documents"))
        except ValueError:
            return None  # a template that renders no chat ending there: no earlier turn to find
        return self.rendered_turns.take(prompt, salt)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        job_id: str | None = None,
        is_last_step: bool = False,
        pinning: bool | None = None,
        ttl_rule: str | None = None,
        **sampling: Unpack[ChatSampling],
    ) -> AssistantTurn:
        """One assistant turn (see :meth:`~agent_runtime.job.Job.chat`, which adds the job's defaults).

        Args:
            messages: OpenAI messages.
            tools: tool schemas, a registry, or tools.
            tool_choice: see :meth:`start_chat`.
            job_id: the job.
            is_last_step: the job's last step.
            pinning: per-request pinning override.
            ttl_rule: per-request TTL rule override.
            **sampling: ``max_tokens``, ``temperature``, ``seed``, ``stop``, ``logprobs``,
                ``response_format``, ``structured_outputs``, ``chat_template_kwargs``,
                ``documents``, ``thinking_token_budget``, ``parallel_tool_calls``,
                ``constrain_thinking`` (:class:`~agent_runtime.protocol.ChatSampling`).

        Returns:
            The assistant turn.

        Raises:
            TypeError: an unknown keyword argument.
            ValueError: bad input (the message names the field).
        """
        params = chat_sampling_params(sampling)
        stream, _ = await self.start_chat(
            messages, tools=tools, tool_choice=tool_choice, response_format=sampling.get("response_format"),
            structured_outputs=sampling.get("structured_outputs"), params=params, job_id=job_id, is_last_step=is_last_step, pinning=pinning, ttl_rule=ttl_rule,
            chat_template_kwargs=sampling.get("chat_template_kwargs"), documents=sampling.get("documents"),
            thinking_token_budget=sampling.get("thinking_token_budget"),
            parallel_tool_calls=_flag(sampling.get("parallel_tool_calls", True), "parallel_tool_calls"),
            constrain_thinking=sampling.get("constrain_thinking", False),
        )
        try:
            final = await stream.result()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return build_turn(stream, final)


def _flag(value: object, field: str) -> bool:
    """``value`` as a boolean option.

    Raises:
        ValueError: not a bool (naming ``field``).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{field}: must be true or false, got {value!r}")
    return value


__all__ = ["ChatTurns"]

