"""The OpenAI protocol: request bodies and their validation, shared by the server and the runtime.

Two layers:

- :func:`validate_messages`, :func:`normalize_tools` and :func:`normalize_tool_choice` check the
  conversation-shaped inputs. :class:`~agent_runtime.runtime.AgentRuntime` calls them for every
  chat turn (its Python API accepts registries and :class:`~agent_runtime.tools.Tool` objects
  too), so the HTTP server and library callers see the same ``field: message`` errors.
- :class:`ChatCompletionRequest` and :class:`CompletionRequest` are the HTTP bodies as pydantic
  models: sampling parameters, Continuum's ``job_id`` / ``is_last_step``, streaming flags and the
  completion prompt. :func:`parse_request` turns a pydantic error into a :class:`RequestError`
  naming the offending field the way OpenAI's ``param`` does (``messages[0].role``).
- The response bodies are pydantic models too, with OpenAI's field names and shapes
  (:class:`ChatCompletionResponse`, :class:`ChatCompletionChunk`, :class:`CompletionResponse`,
  :class:`CompletionChunk`, :class:`ModelList`, :class:`ErrorResponse`, :class:`Usage`).
  ``model_dump()`` is the wire JSON: fields OpenAI always sends are there even when null
  (``finish_reason``, ``logprobs``, an error's ``param``); the optional ones
  (a chunk's ``usage``, a delta's fields, vLLM's ``token_ids``) are left out when unset.

Every error is a :class:`ValueError` whose text starts with the field (``"max_tokens: ..."``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Generic, Literal, TypedDict, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agent_runtime.chat_template_options import (
    check_documents,
    check_template_kwargs,
    check_template_source,
)
from agent_runtime.constrained import check_schema_compiles, needs_constraint, tool_choice_name
from agent_runtime.tools import Tool, ToolRegistry, validate_tool_schema
from asymcache_core.logprobs import MAX_LOGPROBS
from asymcache_core.sampling_params import SamplingParams

ToolChoice = str | Mapping[str, Any] | None
ToolsArg = ToolRegistry | Sequence[Mapping[str, Any]] | Sequence[Tool] | None
ModelT = TypeVar("ModelT", bound=BaseModel)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Stop strings per request at most (OpenAI allows 4; vLLM more).
MAX_STOP_STRINGS = 16
MAX_JOB_ID_CHARS = 256
#: OpenAI's rule for a ``response_format.json_schema.name``.
_SCHEMA_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class RequestError(ValueError):
    """A client error in a request body, naming the field.

    Args:
        message: the text, starting with ``param:`` when there is one.
        param: the offending field in OpenAI's notation (``messages[0].role``), if any.
        code: a machine-readable code (``invalid_json``), if any.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# ----------------------------------------------------------------------------------------------
# Conversation inputs (shared with the runtime's Python API)
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
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {sorted(ROLES)}, got {role!r}")
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


def normalize_response_format(response_format: Any, tool_choice: ToolChoice = None) -> dict[str, Any] | None:
    """Validate an OpenAI ``response_format``.

    ``{"type": "text"}`` (or None) is free text. ``{"type": "json_object"}`` asks for any JSON
    object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
    "description"?}}`` for JSON matching the schema, which must be one constrained decoding can
    compile (checked here when xgrammar is installed, so a bad schema is a client error before
    anything runs). The schema is enforced whatever ``strict`` says (vLLM does the same).

    Args:
        response_format: the value given.
        tool_choice: the request's ``tool_choice``; one that forces a tool call contradicts a
            JSON reply.

    Returns:
        None for free text, else the normalised format (unknown keys dropped).

    Raises:
        ValueError: naming ``response_format`` or the offending key below it.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    if needs_constraint(tool_choice):
        raise ValueError("response_format: a JSON reply cannot be combined with a tool_choice that forces a tool call")
    if kind == "json_object":
        return {"type": "json_object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema: must be an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= _SCHEMA_NAME_CHARS:
        raise ValueError("response_format.json_schema.name: must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("response_format.json_schema.strict: must be a boolean or null")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError("response_format.json_schema.description: must be a string")
    check_schema_compiles(schema, "response_format.json_schema.schema")
    out: dict[str, Any] = {"name": name, "schema": dict(schema), "strict": strict}
    if description is not None:
        out["description"] = description
    return {"type": "json_schema", "json_schema": out}


class ChatSampling(TypedDict, total=False):
    """How one chat turn of the Python API samples; every key is optional.

    Keys:
        max_tokens: generated tokens at most (default 256).
        temperature: 0 (the default) is greedy.
        seed: sampling seed (default: none).
        stop: stop strings (default: none).
        response_format: OpenAI's ``response_format`` (default: free text;
            :func:`normalize_response_format`); not a sampling parameter, so
            :func:`chat_sampling_params` leaves it to the caller.
        logprobs: report each token's log probability and this many alternatives
            (:attr:`AssistantTurn.logprobs <agent_runtime.types.AssistantTurn.logprobs>`;
            default: none).
        chat_template_kwargs: variables of the chat template (``{"enable_thinking": False}``);
            like ``response_format``, left to the caller.
        documents: the template's ``documents`` (retrieval templates); left to the caller.
    """

    max_tokens: int
    temperature: float
    seed: int | None
    stop: Sequence[str]
    response_format: Mapping[str, Any] | None
    logprobs: int | None
    chat_template_kwargs: Mapping[str, Any] | None
    documents: Sequence[Mapping[str, Any]] | None


def chat_sampling_params(sampling: ChatSampling) -> SamplingParams:
    """The engine's parameters for a :class:`ChatSampling`.

    Args:
        sampling: the keys given (the others take their defaults).

    Returns:
        The parameters.

    Raises:
        TypeError: a key that is not a :class:`ChatSampling` key.
        ValueError: rejected by :class:`SamplingParams` (the text names the field).
    """
    unknown = sorted(set(sampling) - ChatSampling.__optional_keys__)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    return SamplingParams(
        max_tokens=sampling.get("max_tokens", 256),
        temperature=sampling.get("temperature", 0.0),
        seed=sampling.get("seed"),
        stop=tuple(sampling.get("stop", ())),
        logprobs=sampling.get("logprobs"),
    )


# ----------------------------------------------------------------------------------------------
# HTTP request bodies
# ----------------------------------------------------------------------------------------------

PositiveInt = Annotated[StrictInt, Field(ge=1)]
Temperature = Annotated[float, Field(strict=True, ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[StrictInt, Field(ge=-1)]
JobId = Annotated[StrictStr, Field(min_length=1, max_length=MAX_JOB_ID_CHARS)]
#: Ranges are checked by SamplingParams (one place for the engine's API and the server's).
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: ``n`` at most: each choice is a request of its own in the engine.
MAX_CHOICES = 16
#: Nesting of the JSON body at most (a deeper body is a 400, never a RecursionError).
MAX_JSON_DEPTH = 64
#: OpenAI fields this server does not implement, with the value that means "off".
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # NOTE: vLLM's extensions that change what is generated or returned: a 400, not ignored.
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}),
    # NOTE: vLLM's older spellings of structured output; ``response_format`` is the one served.
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None


class _GenerationRequest(BaseModel):
    """Fields common to chat and text completions.

    ``temperature`` defaults to 0 (greedy) so agent runs are reproducible; ``top_k`` and
    ``ignore_eos`` are vLLM's extensions; ``job_id`` / ``is_last_step`` are Continuum's (the
    openai client's ``extra_body``). Unknown fields are ignored, as OpenAI-compatible servers do.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: StrictStr | None = None
    max_tokens: PositiveInt | None = None
    n: StrictInt | None = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: StrictInt | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: StrictBool = False
    min_p: Penalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Penalty | None = None
    logit_bias: dict[str, Penalty] | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    bad_words: list[StrictStr] | None = None
    job_id: JobId | None = None
    is_last_step: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, response_format: Any) -> dict[str, Any] | None:
        return normalize_response_format(response_format)

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

    def requested_max_tokens(self) -> int | None:
        """The generation limit the client asked for (None: the server's default)."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report log probabilities for (None: no log probabilities)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to report log probabilities for (None: none)."""
        return self.prompt_logprobs

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters.

        Args:
            default_max_tokens: ``max_tokens`` when the request gives none.

        Returns:
            The parameters.

        Raises:
            ValueError: rejected by :class:`SamplingParams` (the text names the field).
        """
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=0.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
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
    #: the last message, not served)
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {"echo": (None, False)}

    max_completion_tokens: PositiveInt | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        # NOTE: OpenAI's rule; ``logprobs`` is declared first, so it is validated already.
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs: needs logprobs=true")
        return top_logprobs

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
    lm-evaluation-harness's log-likelihood requests ask).
    """

    #: a chat's fields: a text completion is not rendered with a template
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None,),
    }

    prompt: str | list[int]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool | None = None
    tool_name: StrictStr | None = None
    return_token_ids: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

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

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        return completion_prompt(prompt)


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize`` (vLLM's): a ``prompt`` or chat ``messages`` (with ``tools`` and the
    template fields), the latter rendered as a chat completion renders them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = False
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None

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
    tokens: list[StrictInt]


def completion_prompt(prompt: Any) -> str | list[int]:
    """A ``/v1/completions`` prompt: a string, token ids, or a one-element batch of either.

    Args:
        prompt: the body's ``prompt``.

    Returns:
        The text or the token ids.

    Raises:
        ValueError: naming ``prompt``.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ValueError("prompt: batches are not supported; send one prompt per request")
    raise ValueError("prompt: must be a non-empty string or a list of token ids")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Args:
        raw: the body bytes.

    Returns:
        The object.

    Raises:
        RequestError: with code ``invalid_json``.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object", code="invalid_json")
    check_json_tree(body)
    return body


def check_json_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Reject bodies nested deeper than ``max_depth`` or holding text that is not Unicode.

    Iterative, so that no depth reaches Python's recursion limit; run before anything that
    recurses over the body (pydantic, the chat template, xgrammar). A lone surrogate
    (``"\\ud800"``, valid JSON but not encodable) would fail the tokenizer later.

    Args:
        body: the decoded JSON.
        max_depth: the deepest nesting allowed.

    Raises:
        RequestError: naming the offending field.
    """
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > max_depth:
            raise RequestError(f"{where or 'body'}: nested deeper than {max_depth}", param=where or None,
                               code="invalid_json")
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{where or 'body'}: not valid Unicode (a lone surrogate)",
                                   param=where or None, code="invalid_json") from None
        elif isinstance(node, dict):
            for key, value in node.items():
                stack.append((key, where, depth + 1))
                stack.append((value, f"{where}.{key}" if where else str(key), depth + 1))
        elif isinstance(node, list):
            stack.extend((value, f"{where}[{i}]", depth + 1) for i, value in enumerate(node))


def reject_unsupported(body: Mapping[str, Any], more: Mapping[str, tuple[Any, ...]] | None = None) -> None:
    """A 400 for OpenAI fields that are set but not implemented (never silently ignored).

    Args:
        body: the decoded request body.
        more: the endpoint's own such fields, with their "off" values.

    Raises:
        RequestError: naming the first such field.
    """
    for name, off in {**UNSUPPORTED_FIELDS, **(more or {})}.items():
        if name in body and body[name] not in off:
            raise RequestError(f"{name}: not supported by this server", param=name, code="unsupported_field")


def parse_request(model: type[ModelT], body: Mapping[str, Any]) -> ModelT:
    """Validate a decoded body against a request model.

    Args:
        model: :class:`ChatCompletionRequest` or :class:`CompletionRequest`.
        body: the decoded JSON object.

    Returns:
        The request.

    Raises:
        RequestError: for the first invalid field, with ``param`` naming it.
    """
    reject_unsupported(body, getattr(model, "unsupported_fields", None))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _request_error(exc) from None


# ----------------------------------------------------------------------------------------------
# HTTP response bodies
# ----------------------------------------------------------------------------------------------


def _omitted_when_none(value: Any) -> bool:
    return value is None


#: An optional field that is left out of the wire JSON while it is None (OpenAI omits it).
_OMIT = Field(default=None, exclude_if=_omitted_when_none)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Body):
    """``usage.prompt_tokens_details``: prompt tokens served from the KV cache."""

    cached_tokens: int


class Usage(_Body):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        """The usage of a completion (``total_tokens`` is the sum).

        Args:
            prompt_tokens: its prompt's length.
            completion_tokens: tokens it generated.
            cached_tokens: prompt tokens that were cache hits.

        Returns:
            The usage.
        """
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class FunctionCall(_Body):
    """A called function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Body):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(_Body):
    """A tool call in a streamed delta: a :class:`ToolCall` with its ``index`` first."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """The assistant message of a chat completion (``content`` null when it is only calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _OMIT


class DeltaMessage(_Body):
    """What a streamed chat chunk adds to the message; unset fields are left out."""

    role: Literal["assistant"] | None = _OMIT
    content: str | None = _OMIT
    tool_calls: list[ToolCallDelta] | None = _OMIT


class TopLogprob(_Body):
    """One of the most likely tokens at a position of a chat completion."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """A generated token's log probability, and its most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    """A chat choice's ``logprobs``: one entry per generated token (of this chunk, streamed)."""

    content: list[ChatTokenLogprob] | None


class PromptLogprob(_Body):
    """vLLM's entry of ``prompt_logprobs`` for one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token, null for the first, else the prompt token's and
#: its likeliest alternatives' entries keyed by token id (a JSON string).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Body):
    """A text completion's legacy ``logprobs``: parallel lists, one item per generated token;
    ``top_logprobs`` maps the alternatives' texts to their log probabilities (null for 0)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatCompletionChoice(_Body):
    """The choice of a chat completion."""

    index: int = 0
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionStreamChoice(_Body):
    """The choice of a streamed chat chunk."""

    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(_Body):
    """The choice of a text completion or of one of its chunks; ``token_ids`` and
    ``prompt_token_ids`` (vLLM's ``return_token_ids``) only when asked for."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _OMIT
    prompt_token_ids: list[int] | None = _OMIT
    prompt_logprobs: PromptLogprobs | None = _OMIT


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Envelope(_Body):
    """The fields every completion body and chunk starts with (``object`` names its kind)."""

    id: str
    object: str
    created: int
    model: str


class _Completion(_Envelope, Generic[ChoiceT]):
    """A non-streamed completion body: its one choice and the usage."""

    choices: list[ChoiceT]
    usage: Usage


class _Chunk(_Envelope, Generic[ChoiceT]):
    """One SSE chunk: its choices, and ``usage`` only in the last one, when asked for."""

    choices: list[ChoiceT]
    usage: Usage | None = _OMIT


class ChatCompletionResponse(_Completion[ChatCompletionChoice]):
    """``POST /v1/chat/completions``, not streamed."""

    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = _OMIT


class ChatCompletionChunk(_Chunk[ChatCompletionStreamChoice]):
    """One SSE chunk of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionResponse(_Completion[CompletionChoice]):
    """``POST /v1/completions``, not streamed."""

    object: Literal["text_completion"] = "text_completion"


class CompletionChunk(_Chunk[CompletionChoice]):
    """One SSE chunk of a streamed text completion."""

    object: Literal["text_completion"] = "text_completion"


class TokenizeResponse(_Body):
    """``POST /tokenize``: the ids, their number and the context limit."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body):
    """``POST /detokenize``: the text."""

    prompt: str


class ModelCard(_Body):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asymcache"


class ModelList(_Body):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Body):
    """OpenAI's error object (``param`` and ``code`` are null when there is none)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    """Every error's body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def _param(loc: Sequence[int | str]) -> str | None:
    """OpenAI's notation for a pydantic location: ``("messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _request_error(exc: ValidationError) -> RequestError:
    err = exc.errors(include_url=False)[0]
    param = _param(err["loc"])
    msg = str(err["msg"])
    if err["type"] == "value_error":
        # NOTE: our validators already write "field: message"; pydantic prefixes "Value error, ".
        msg = msg.removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if param is not None and (head == param or head.startswith((f"{param}.", f"{param}["))):
            # NOTE: a validator may name a key below its field (``response_format.json_schema.name``).
            return RequestError(msg, head)
    elif err["type"] != "missing" and "input" in err:
        shown = repr(err["input"])
        msg = f"{msg}, got {shown if len(shown) <= 80 else shown[:77] + '...'}"
    return RequestError(f"{param}: {msg}" if param else msg, param)


__all__ = [
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "ChatSampling",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "PromptLogprob",
    "PromptLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "RequestError",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolsArg",
    "TopLogprob",
    "Usage",
    "chat_ending",
    "chat_sampling_params",
    "check_json_tree",
    "completion_prompt",
    "normalize_response_format",
    "normalize_tool_choice",
    "normalize_tools",
    "parse_json_body",
    "parse_request",
    "reject_unsupported",
    "validate_messages",
]
