"""The HTTP request bodies of the OpenAI-compatible server, as pydantic models, and their parsing.

:class:`ChatCompletionRequest`, :class:`CompletionRequest`, :class:`TokenizeRequest` and
:class:`DetokenizeRequest`: sampling parameters (vLLM's extensions too), Continuum's ``job_id`` /
``is_last_step``, streaming flags, the completion prompt and the chat-template fields.
:mod:`agent_runtime.server.body_parsing` turns a raw body into one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agent_runtime.protocol import (
    MAX_STOP_STRINGS,
    normalize_response_format,
)
from agent_runtime.server.body_parsing import completion_prompts, lift_vllm_xargs
from agent_runtime.server.request_fields import (
    MAX_BATCH_SEQUENCES,
    MAX_CHOICES,
    CacheSalt,
    Int,
    JobId,
    Penalty,
    PositiveInt,
    ReasoningEffort,
    StreamOptions,
    Temperature,
    TopK,
    TopP,
    check_chat_tool_fields,
    sampling_fields,
)
from agent_runtime.structured_outputs import lift_guided_fields, normalize_structured_outputs
from asymcache_core.chat_template_options import (
    check_documents,
    check_template_kwargs,
    check_template_source,
)
from asymcache_core.sampling_params import SamplingParams

# ----------------------------------------------------------------------------------------------
# HTTP request bodies
# ----------------------------------------------------------------------------------------------



class _GenerationRequest(BaseModel):
    """Fields common to chat and text completions.

    Sampling fields left out take the server's defaults (vLLM's: the model's generation
    config, else temperature 1; :mod:`agent_runtime.server.generation_defaults`); ``top_k`` and
    ``ignore_eos`` are vLLM's extensions; ``job_id`` / ``is_last_step`` are Continuum's (the
    openai client's ``extra_body``, or vLLM's ``vllm_xargs``: :func:`lift_vllm_xargs`). Unknown
    fields are ignored, as OpenAI-compatible servers do.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _hints_in_xargs(cls, data: Any) -> Any:
        return lift_guided_fields(lift_vllm_xargs(data))

    model: StrictStr | None = None
    #: OpenAI's end-user id: not used here, but one of another type is a client's error
    user: StrictStr | None = None
    max_tokens: PositiveInt | None = None
    n: Int | None = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: StrictBool = False
    min_p: Penalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Penalty | None = None
    logit_bias: dict[str, Penalty] | None = None
    stop_token_ids: list[Int] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: Annotated[Int, Field(ge=0)] | None = None
    allowed_token_ids: list[Int] | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    #: vLLM's: the prompt's and the reply's token ids beside the text
    return_token_ids: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    bad_words: list[StrictStr] | None = None
    job_id: JobId | None = None
    is_last_step: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    #: vLLM's: the response's id is ``chatcmpl-`` / ``cmpl-`` and this (else a random one)
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    response_format: dict[str, Any] | None = None
    #: vLLM's (and, through :func:`lift_guided_fields`, its older ``guided_*`` fields): kept as
    #: given once valid; the runtime builds the constraint
    structured_outputs: dict[str, Any] | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, response_format: Any) -> dict[str, Any] | None:
        return normalize_response_format(response_format)

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured_outputs(cls, structured_outputs: Any) -> dict[str, Any] | None:
        normalize_structured_outputs(structured_outputs)
        return None if structured_outputs is None else dict(structured_outputs)

    @model_validator(mode="after")
    def _one_reply_constraint(self) -> _GenerationRequest:
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("structured_outputs: set either structured_outputs or a JSON response_format, not both")
        if self.stream_options is not None and not self.stream:
            # NOTE: OpenAI's and vLLM's rule: options of a stream that is not asked for
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int | None) -> int | None:
        if n is not None and not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n: must be in [1, {MAX_CHOICES}], got {n!r}")
        return n

    @field_validator("job_id")
    @classmethod
    def _one_choice_per_job_turn(cls, job_id: str | None, info: ValidationInfo) -> str | None:
        # NOTE: a job's turn is one request (its KV is pinned across the tool pause that
        # follows, and the job's next turn extends that one context): n choices have n.
        if job_id is not None and (info.data.get("n") or 1) > 1:
            raise ValueError("job_id: a job's turn has one choice; send n=1 (or no job_id for several)")
        return job_id

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            if not stop:
                raise ValueError("stop: stop strings must be non-empty")
            return (stop,)
        if isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop):
            return tuple(stop)
        raise ValueError(f"stop: must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings")

    @property
    def num_choices(self) -> int:
        """``n`` with null read as 1."""
        return self.n or 1

    @property
    def last_step(self) -> bool:
        """``is_last_step`` with null read as false."""
        return bool(self.is_last_step)

    @property
    def streaming(self) -> bool:
        """``stream`` with null read as false."""
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a streamed response carries its choice's usage so far
        (vLLM's ``continuous_usage_stats``, which counts only with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        """The generation limit the client asked for (None: the server's default)."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report log probabilities for (None: no log probabilities)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to report log probabilities for (None: none)."""
        return self.prompt_logprobs

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's sampling parameters.

        Args:
            default_max_tokens: ``max_tokens`` when the request gives none.
            defaults: the server's defaults of the sampling fields the request leaves out
                (:func:`~agent_runtime.server.generation_defaults.sampling_defaults`); fields in
                neither take vLLM's (:data:`~agent_runtime.server.generation_defaults.VLLM_SAMPLING_DEFAULTS`:
                temperature 1).

        Returns:
            The parameters.

        Raises:
            ValueError: rejected by :class:`SamplingParams` (the text names the field).
        """
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            **sampling_fields(self, defaults),
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            logit_bias=self.logit_bias,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            skip_special_tokens=self.skip_special_tokens is not False,
            bad_words=tuple(self.bad_words or ()),
            min_tokens=self.min_tokens or 0,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            cache_salt=self.cache_salt,
        )


#: ``chat_template_kwargs`` entries vLLM reads as the body's own fields (they override them).
_TEMPLATE_OVERRIDES = ("chat_template", "add_generation_prompt", "continue_final_message", "documents")


class _ChatTemplateFields(BaseModel):
    """vLLM's chat-template fields of a chat (completion or ``/tokenize``): the template's own
    variables, retrieval ``documents``, and a template of the request's own (served only with
    ``--trust-request-chat-template``). As in vLLM, ``chat_template_kwargs`` may also carry
    ``chat_template``, ``add_generation_prompt``, ``continue_final_message`` and ``documents``,
    which then override the body's fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lift_template_overrides(cls, data: Any) -> Any:
        kwargs = data.get("chat_template_kwargs") if isinstance(data, Mapping) else None
        if not isinstance(kwargs, Mapping) or not any(k in kwargs for k in _TEMPLATE_OVERRIDES):
            return data
        rest = {k: v for k, v in kwargs.items() if k not in _TEMPLATE_OVERRIDES}
        return {**data, **{k: kwargs[k] for k in _TEMPLATE_OVERRIDES if k in kwargs}, "chat_template_kwargs": rest}

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, template: str | None) -> str | None:
        return None if template is None else check_template_source(template)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if kwargs is None else check_template_kwargs(kwargs)

    @field_validator("documents")
    @classmethod
    def _documents(cls, documents: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_documents(documents)

    def template_options(self) -> dict[str, Any]:
        """The runtime's keywords for these fields (``chat_template``, ``chat_template_kwargs``,
        ``documents``)."""
        return {"chat_template": self.chat_template, "chat_template_kwargs": self.chat_template_kwargs,
                "documents": self.documents}


class ChatCompletionRequest(_ChatTemplateFields, _GenerationRequest):
    """``POST /v1/chat/completions``.

    ``messages``, ``tools`` and ``tool_choice`` are checked for their JSON shape here and in
    depth by the runtime (:func:`validate_messages`, :func:`normalize_tools`,
    :func:`normalize_tool_choice`), which library callers go through too.
    """

    #: fields of text completions a chat completion does not take (vLLM's chat ``echo`` repeats
    #: the last message, not served), and vLLM's chat fields not served
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "echo": (None, False),
        # NOTE: the chat template writes the special tokens
        "add_special_tokens": (None, False),
    }

    max_completion_tokens: PositiveInt | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[Int, Field(ge=0)] | None = None
    #: vLLM's: close a reasoning model's thinking block once it holds this many tokens
    thinking_token_budget: Annotated[Int, Field(ge=0)] | None = None
    reasoning_effort: ReasoningEffort | None = None
    #: vLLM's: false leaves a reasoning reply's thinking (``reasoning_content``) out
    include_reasoning: StrictBool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        # NOTE: OpenAI's rule; ``logprobs`` is declared first, so it is validated already.
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs: needs logprobs=true")
        return top_logprobs

    @model_validator(mode="after")
    def _tools_for_tool_choice(self) -> ChatCompletionRequest:
        check_chat_tool_fields(self.tools, self.tool_choice)
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``logprobs: true`` with ``top_logprobs`` alternatives (0 when not given)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``.

    Besides OpenAI's fields: ``tool_name`` (the tool a job pauses for after this completion,
    for Continuum's duration estimates) and ``return_token_ids`` (vLLM's: the prompt's and the
    output's token ids in each choice). ``echo`` puts the prompt before each choice's text
    (and, with ``logprobs``, its tokens before the generated ones, the first with a null log
    probability); ``max_tokens: 0`` with it returns the prompt alone (as vLLM does, and as
    lm-evaluation-harness's log-likelihood requests ask). A batch of prompts (a list of texts
    or of token-id lists) is answered in one body: prompt ``i``'s choice ``j`` has index
    ``i * n + j``, and usage counts every prompt once.
    """

    #: a chat's fields: a text completion is not rendered with a template
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None,),
    }

    #: one prompt, or a batch of them (a tuple once validated: :attr:`prompts`)
    prompt: str | list[int] | tuple[str | list[int], ...]
    max_tokens: Annotated[Int, Field(ge=0)] | None = None
    echo: StrictBool | None = None
    #: vLLM's (default true): the tokenizer's special tokens (Llama's ``<|begin_of_text|>``)
    #: start a text prompt
    add_special_tokens: StrictBool | None = None
    tool_name: StrictStr | None = None
    logprobs: Annotated[Int, Field(ge=0)] | None = None

    @property
    def adds_special_tokens(self) -> bool:
        """``add_special_tokens`` with vLLM's default (true)."""
        return self.add_special_tokens is not False

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt back, nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            if not self.echo:
                raise ValueError("max_tokens: must be at least 1 (0 only with echo=true)")
            # NOTE: the engine samples one token, which the response leaves out
            return 1
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """The legacy ``logprobs``: alternatives per token (0: the sampled token's alone)."""
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or ``logprobs`` when the prompt is echoed (vLLM's rule: the
        echoed tokens carry log probabilities too)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts (one, unless ``prompt`` is a list of texts or of token lists)."""
        return list(self.prompt) if isinstance(self.prompt, tuple) else [self.prompt]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> str | list[int] | tuple[str | list[int], ...]:
        prompts = completion_prompts(prompt)
        return prompts[0] if len(prompts) == 1 else tuple(prompts)

    @model_validator(mode="after")
    def _batch_bounds(self) -> CompletionRequest:
        batch = len(self.prompts)
        if batch > 1:
            if batch * self.num_choices > MAX_BATCH_SEQUENCES:
                raise ValueError(f"prompt: {batch} prompts x n={self.num_choices} are more than "
                                 f"{MAX_BATCH_SEQUENCES} sequences in one request")
            if self.job_id is not None:
                raise ValueError("job_id: names one conversation; send a batch of prompts without it")
        return self


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize`` (vLLM's): a ``prompt`` or chat ``messages`` (with ``tools`` and the
    template fields), the latter rendered as a chat completion renders them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    #: vLLM's defaults: a ``prompt``'s special tokens are added (as ``/v1/completions`` adds
    #: them), a chat's are the template's
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None

    @property
    def adds_special_tokens(self) -> bool:
        """``add_special_tokens`` with vLLM's default (true for a ``prompt``)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    @property
    def chat_ending(self) -> tuple[bool, bool]:
        """``(add_generation_prompt, continue_final_message)`` as a chat completion reads them."""
        return chat_ending(self.add_generation_prompt, self.continue_final_message)


def chat_ending(add_generation_prompt: bool | None, continue_final_message: bool | None) -> tuple[bool, bool]:
    """How a rendered chat ends: ``(add_generation_prompt, continue_final_message)``.

    NOTE: ``add_generation_prompt`` defaults to true, or to false with ``continue_final_message``
    (vLLM asks the client to turn it off; both set true stays an error, raised by the runtime).
    """
    cont = bool(continue_final_message)
    return (not cont if add_generation_prompt is None else add_generation_prompt), cont


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: StrictStr | None = None
    tokens: list[Int]


__all__ = [
    "chat_ending",
    "ChatCompletionRequest",
    "lift_vllm_xargs",
    "completion_prompts",
    "CompletionRequest",
    "DetokenizeRequest",
    "MAX_BATCH_SEQUENCES",
    "MAX_CHOICES",
    "sampling_fields",
    "StreamOptions",
    "TokenizeRequest",
]
