"""The engine's blocking calls: :meth:`~BlockingCalls.generate` runs prompts to completion,
:meth:`~BlockingCalls.chat` renders conversations first (vLLM's ``LLM.generate`` and
``LLM.chat``; a mixin of :class:`~asymcache_core.engine.Engine`, which steps the requests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from asymcache_core.chat_template import ChatTemplates
from asymcache_core.chat_template_options import check_template_source
from asymcache_core.engine_outputs import generate_blocking
from asymcache_core.engine_stats import GenerationOutput
from asymcache_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asymcache_core.engine import Engine


class BlockingCalls:
    """:meth:`generate` and :meth:`chat` (a mixin: ``self`` is the engine; they step it until
    their requests finish, so no other caller may step it meanwhile)."""

    tokenizer: Any
    _chat_templates: ChatTemplates | None = None

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        job_ids: Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Runs prompts to completion; one output per prompt, in order (``job_ids``: each one's
        job, see :meth:`add_request`)."""
        return generate_blocking(cast("Engine", self), prompts, params, job_ids)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        job_ids: Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """vLLM's ``LLM.chat``: renders one conversation (a list of OpenAI chat messages) or a
        list of them with the model's chat template, then :meth:`generate`.

        The rendering is the server's (:class:`~asymcache_core.chat_template.ChatRenderer`), so
        a conversation gives the same prompt tokens here as through ``/v1/chat/completions``:
        ``tools`` reach a template without a tool section as a Hermes tools section in the
        system message (vLLM's ``LLM.chat`` drops them there), assistant ``tool_calls`` and
        ``tool`` results are rendered as the model writes and reads them, content parts are
        joined, and caller text that spells a special token stays text. The arguments after
        ``params`` are vLLM's; the texts are the model's raw replies (tool calls unparsed: the
        agent runtime and the server parse them).

        Raises:
            ValueError: naming the argument: no tokenizer, a conversation that is not a
                non-empty list of messages with a ``role``, both ``add_generation_prompt`` and
                ``continue_final_message``, bad ``chat_template`` or ``chat_template_kwargs``,
                or a template that fails on a conversation (``messages[i]: ...``).
        """
        prompts = self.render_chats(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
        )
        return generate_blocking(cast("Engine", self), prompts, params, job_ids)

    def render_chats(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[str | list[int]]:
        """:meth:`chat`'s prompts: each conversation's text, or its token ids where caller text
        spells a special token (:meth:`ChatRenderer.prompt
        <asymcache_core.chat_template.ChatRenderer.prompt>`). Arguments and errors as :meth:`chat`.
        """
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer (and so no chat template); use generate() with token ids")
        if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages: a conversation (a list of messages) or a list of conversations")
        if tools is not None and (
            isinstance(tools, str | Mapping) or not isinstance(tools, Sequence)
            or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools: a list of OpenAI tool schemas (dicts)")
        templates = self._chat_templates
        if templates is None:
            if not getattr(self.tokenizer, "chat_template", None):
                if chat_template is None:
                    raise ValueError("chat_template: the model's tokenizer has none; pass the template's source")
                templates = ChatTemplates(self.tokenizer, check_template_source(chat_template))
            else:
                # NOTE: kept: a renderer probes its template for a tool section when it is made
                templates = self._chat_templates = ChatTemplates(self.tokenizer)
        single = isinstance(messages[0], Mapping)
        prompts: list[str | list[int]] = []
        for i, conversation in enumerate([messages] if single else messages):
            try:
                prompts.append(templates.prompt(
                    cast("Sequence[Mapping[str, Any]]", conversation), tools, add_generation_prompt,
                    continue_final_message, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                ))
            except ValueError as exc:
                # NOTE: one conversation's errors are the server's (``messages[j].content``);
                # a batch's name the conversation first
                if single:
                    raise
                text = str(exc)
                raise ValueError(f"messages[{i}]{text.removeprefix('messages')}" if text.startswith("messages")
                                 else f"messages[{i}]: {text}") from None
        return prompts
