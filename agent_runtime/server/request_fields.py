"""The typed fields of the server's request bodies (pydantic ``Annotated`` types shared by the
OpenAI, Responses and Anthropic routes), their bounds, and the sampling fields' defaults
(:func:`sampling_fields`: the request's value, else the server's generation config, else vLLM's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from agent_runtime.protocol import MAX_JOB_ID_CHARS
from agent_runtime.server.generation_defaults import VLLM_SAMPLING_DEFAULTS
from asymcache_core.sampling_params import MAX_CACHE_SALT_CHARS


def _integral_float(value: Any) -> Any:
    """An integral float (``2.0``) as the int it names; anything else as it is.

    NOTE: vLLM's request models validate in pydantic's lax mode, which takes ``max_tokens: 2.0``
    as 2 and rejects ``2.5``; strings and booleans stay errors here (strict ints).
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field: an int, or a float with no fractional part (vLLM's lax pydantic takes both).
Int = Annotated[StrictInt, BeforeValidator(_integral_float)]
PositiveInt = Annotated[Int, Field(ge=1)]
Temperature = Annotated[float, Field(strict=True, ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[Int, Field(ge=-1)]
JobId = Annotated[StrictStr, Field(min_length=1, max_length=MAX_JOB_ID_CHARS)]
#: vLLM's ``cache_salt``: the request's prefix-cache namespace (SamplingParams.cache_salt)
CacheSalt = Annotated[StrictStr, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
#: OpenAI's reasoning efforts (chat ``reasoning_effort``, Responses ``reasoning.effort``): the
#: chat template's ``reasoning_effort`` variable, as vLLM passes it (gpt-oss's template reads it)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def with_reasoning_effort(options: dict[str, Any], effort: str | None) -> dict[str, Any]:
    """Template options (``chat_template_kwargs`` ...) with ``effort`` as the template's
    ``reasoning_effort`` variable, unless the request's own variables set it."""
    if effort is None:
        return options
    return {**options, "chat_template_kwargs": {"reasoning_effort": effort, **(options.get("chat_template_kwargs") or {})}}


#: Ranges are checked by SamplingParams (one place for the engine's API and the server's).
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: ``n`` at most: each choice is a request of its own in the engine.
MAX_CHOICES = 16
#: Prompts x choices of one ``/v1/completions`` batch at most (each a request of the engine).
MAX_BATCH_SEQUENCES = 256


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``, and vLLM's ``continuous_usage_stats`` (with
    ``include_usage``: every chunk carries the usage of its choice so far)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


def check_chat_tool_fields(tools: list[Any] | None, tool_choice: Any) -> None:
    """A chat completion's ``tools`` and ``tool_choice`` against each other, by vLLM's rules
    (OpenAI's too): an empty ``tools`` array is refused, and a ``tool_choice`` other than
    ``"none"`` (or null) needs tools.

    NOTE: the HTTP route's rule only: the Python API's ``tool_choice`` defaults to ``"auto"``
    with or without tools, and the Responses route takes both without tools (as vLLM's does).

    Args:
        tools: the request's ``tools`` (None: not given).
        tool_choice: the request's ``tool_choice`` (None: not given).

    Raises:
        ValueError: naming ``tools`` or ``tool_choice``.
    """
    if tools is not None and not tools:
        raise ValueError("tools: must not be an empty array; give at least one tool or leave the field out")
    if tools is None and tool_choice is not None and tool_choice != "none":
        raise ValueError(f"tool_choice: {tool_choice!r} needs tools; send tools, or leave tool_choice out")


def sampling_fields(request: Any, defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling fields vLLM defaults (``temperature``, ``top_p``, ``top_k``, ``min_p``, the
    penalties) of ``request``: its own value, else the server's default, else vLLM's.

    NOTE: vLLM's order (user, then the server's generation config, then vLLM's default); a
    request model without one of the fields (Anthropic's, the Responses API's) takes the
    defaults for it.

    Args:
        request: a request model.
        defaults: the server's defaults (None: vLLM's alone).

    Returns:
        Field -> value, for :class:`SamplingParams`.
    """
    given = defaults or {}
    values: dict[str, Any] = {}
    for name, default in VLLM_SAMPLING_DEFAULTS.items():
        value = getattr(request, name, None)
        values[name] = value if value is not None else given.get(name, default)
    return values


__all__ = ["CacheSalt", "check_chat_tool_fields", "Int", "JobId", "MAX_BATCH_SEQUENCES", "MAX_CHOICES", "Penalty", "PositiveInt", "ReasoningEffort", "StreamOptions", "Temperature", "TopK", "TopP", "sampling_fields", "with_reasoning_effort"]
