"""The engine's blocking calls: :meth:`~BlockingCalls.generate` runs prompts to completion,
:meth:`~BlockingCalls.chat` renders conversations first (vLLM's ``LLM.generate`` and
``LLM.chat``; a mixin of :class:`~asymcache_core.engine.Engine`, which steps the requests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from asymcache_core.engine_outputs import generate_blocking, render_conversations
from asymcache_core.engine_stats import GenerationOutput
from asymcache_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asymcache_core.engine import Engine


class BlockingCalls:
    """:meth:`generate` and :meth:`chat` (a mixin: ``self`` is the engine; they step it until
    their requests finish, so no other caller may step it meanwhile)."""

    tokenizer: Any

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
        """vLLM's ``LLM.chat``: renders one conversation (a list of ``{"role", "content"}``
        messages) or a list of them with the model's chat template, then :meth:`generate`.
        The arguments after ``params`` are vLLM's; the texts are the model's raw replies (tool
        calls unparsed: the agent runtime and the server parse them)."""
        prompts = render_conversations(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        return generate_blocking(cast("Engine", self), prompts, params, job_ids)
