"""The OpenAI protocol's conversation inputs, validated the same way for the server and the runtime.

:func:`validate_messages`, :func:`normalize_tools`, :func:`normalize_tool_choice` and
:func:`normalize_response_format` check the conversation-shaped inputs.
:class:`~agent_runtime.runtime.AgentRuntime` calls them for every chat turn (its Python API
accepts registries and :class:`~agent_runtime.tools.Tool` objects too), so the HTTP server and
library callers see the same ``field: message`` errors. :class:`ChatSampling` is how a turn of
the Python API samples. The HTTP bodies built on these are the server's
(:mod:`agent_runtime.server.requests`, :mod:`agent_runtime.server.responses`).

Every error is a :class:`ValueError` whose text starts with the field (``"max_tokens: ..."``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict, get_args

from agent_runtime.constrained import check_schema_compiles, needs_constraint, tool_choice_name
from agent_runtime.structural_tag import normalize_structural_tag_format
from agent_runtime.tool_schema import validate_tool_schema
from agent_runtime.tools import Tool, ToolRegistry
from asymcache_core.chat_messages import ROLES, validate_messages
from asymcache_core.continuum.ttl import TTLRule
from asymcache_core.engine_checks import check_id, truncated_prompt
from asymcache_core.sampling_params import SamplingParams

ToolChoice = str | Mapping[str, Any] | None
ToolsArg = ToolRegistry | Sequence[Mapping[str, Any]] | Sequence[Tool] | None

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


class ContextLengthError(RequestError):
    """A prompt and the ``max_tokens`` it asks for that together pass the context limit.

    The servers reject such a request as vLLM's, SGLang's and OpenAI's do (agent frameworks
    read ``context_length_exceeded`` as their cue to shorten the history) rather than stop it at
    the limit, which is what the engine does for the Python API.

    Args:
        prompt_tokens: the prompt's tokens, as the engine would run them.
        max_tokens: the tokens asked for.
        max_model_len: the context limit.
        param: the request field that asked for them.
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "max_tokens") -> None:
        super().__init__(
            f"{param}: too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens "
            f"and your request has {prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})",
            param=param, code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


def check_fits_context(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """Rejects a prompt whose ``params.max_tokens`` take it past ``max_model_len``.

    The prompt counts as the engine runs it (cut by ``truncate_prompt_tokens``); one that
    leaves no room at all is left to the engine's own check (its ``prompt`` error).

    Raises:
        ContextLengthError: the prompt and ``max_tokens`` together pass ``max_model_len``.
    """
    kept = len(truncated_prompt(prompt_ids, params, max_model_len))
    if kept < max_model_len < kept + params.max_tokens:
        raise ContextLengthError(kept, params.max_tokens, max_model_len)


# ----------------------------------------------------------------------------------------------
# Conversation inputs (shared with the runtime's Python API)
# ----------------------------------------------------------------------------------------------


def check_request_options(job_id: object, is_last_step: object, pinning: object, ttl_rule: object) -> None:
    """A request's job options, checked before it is queued (once taken as given: a truthy
    ``is_last_step="no"`` ended its job, an unknown ``ttl_rule`` ran as ``continuum``).

    Raises:
        ValueError: naming the option.
    """
    check_id("job_id", job_id, optional=True)
    if not isinstance(is_last_step, bool):
        raise ValueError(f"is_last_step: True or False, got {is_last_step!r}")
    if pinning is not None and not isinstance(pinning, bool):
        raise ValueError(f"pinning: True, False or None, got {pinning!r}")
    if ttl_rule is not None and ttl_rule not in get_args(TTLRule):
        raise ValueError(f"ttl_rule: one of {', '.join(get_args(TTLRule))} or None, got {ttl_rule!r}")


def normalize_tools(tools: ToolsArg | Iterable[Callable[..., Any]]) -> list[dict[str, Any]]:
    """OpenAI tool schemas from schemas, a registry, or tools; validated.

    Args:
        tools: schemas, a :class:`ToolRegistry`, :class:`Tool` s, or None.

    Returns:
        The schemas (empty list for None).

    Raises:
        ValueError: ``tools[i].<field>`` of the first invalid schema. A name given twice is
            not one: vLLM 0.32 does not check (a named ``tool_choice`` forces its last definition,
            :func:`agent_runtime.constrained.tool_call_json_schema`).
    """
    if tools is None:
        return []
    if isinstance(tools, ToolRegistry):
        return tools.openai_schemas()
    if isinstance(tools, Mapping) or isinstance(tools, str) or not isinstance(tools, Iterable):
        raise ValueError("tools: must be a list of tool schemas")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        schema = t.openai_schema() if isinstance(t, Tool) else t
        try:
            validate_tool_schema(schema)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"tools[{i}].{e}") from None
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
    ``{"type": "structural_tag", ...}`` (vLLM's: ``structures`` and ``triggers``, or xgrammar's
    ``format``) leaves the reply free but where a trigger starts a structure
    (:func:`agent_runtime.structural_tag.normalize_structural_tag_format`).

    Args:
        response_format: the value given.
        tool_choice: the request's ``tool_choice``; one that forces a tool call contradicts a
            JSON reply.

    Returns:
        None for free text, else the normalised format (unknown keys dropped, but a structural
        tag's, which xgrammar reads as vLLM passes them on).

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
    if kind not in ("json_object", "json_schema", "structural_tag"):
        raise ValueError("response_format.type: must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                         f"got {kind!r}")
    if needs_constraint(tool_choice):
        what = "a structural tag" if kind == "structural_tag" else "a JSON reply"
        raise ValueError(f"response_format: {what} cannot be combined with a tool_choice that forces a tool call")
    if kind == "structural_tag":
        return normalize_structural_tag_format(response_format)
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
        structured_outputs: vLLM's ``structured_outputs`` (``{"regex": ...}``, ``{"choice":
            [...]}``, ...; :mod:`agent_runtime.structured_outputs`); left to the caller.
        logprobs: report each token's log probability and this many alternatives
            (:attr:`AssistantTurn.logprobs <agent_runtime.types.AssistantTurn.logprobs>`;
            default: none).
        chat_template_kwargs: variables of the chat template (``{"enable_thinking": False}``);
            like ``response_format``, left to the caller.
        documents: the template's ``documents`` (retrieval templates); left to the caller.
        thinking_token_budget: with a reasoning parser, close the reply's thinking block once
            it holds this many tokens (vLLM's field); left to the caller.
        parallel_tool_calls: OpenAI's flag (default True): a reply may make several calls
            (under ``"required"`` one or more); False keeps one; left to the caller.
        constrain_thinking: with a reasoning parser, a constrained reply (a forced tool call,
            JSON, ``structured_outputs``) is constrained from its first token, its thinking too
            (default False: from where its thinking ends, as vLLM's structured outputs);
            left to the caller.
    """

    max_tokens: int
    temperature: float
    seed: int | None
    stop: Sequence[str]
    response_format: Mapping[str, Any] | None
    structured_outputs: Mapping[str, Any] | None
    logprobs: int | None
    chat_template_kwargs: Mapping[str, Any] | None
    documents: Sequence[Mapping[str, Any]] | None
    thinking_token_budget: int | None
    parallel_tool_calls: bool
    constrain_thinking: bool


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
        stop=sampling.get("stop", ()),  # one string is one stop string, as SamplingParams takes it
        logprobs=sampling.get("logprobs"),
    )


__all__ = [
    "chat_sampling_params",
    "check_request_options",
    "ChatSampling",
    "check_fits_context",
    "ContextLengthError",
    "MAX_JOB_ID_CHARS",
    "MAX_STOP_STRINGS",
    "normalize_response_format",
    "normalize_tool_choice",
    "normalize_tools",
    "RequestError",
    "ROLES",
    "ToolChoice",
    "ToolsArg",
    "validate_messages",
]
