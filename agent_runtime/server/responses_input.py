"""OpenAI's Responses API input: the body of ``POST /v1/responses`` as the server reads it
(:class:`ResponsesRequest`), and its items, function tools, tool choice and ``text.format`` in
the chat route's forms (:mod:`agent_runtime.server.openai_responses` serves them).

``message`` items become their role's messages, consecutive ``function_call`` items the tool
calls of one assistant message (after the text the model wrote before them, so the next turn's
prompt repeats the tokens it generated and its KV stays reusable), ``function_call_output``
items tool messages, and a ``reasoning`` item the ``reasoning_content`` of the assistant message
after it (or, with none after it, of an assistant message of its own, as vLLM renders it).

An input whose last item is a ``message`` with status ``in_progress`` or ``incomplete`` is a
partial message the reply continues (vLLM's ``should_continue_final_message``: the chat is
rendered with ``continue_final_message``); an assistant message after such a partial one is the
rest of it, and the two are one message of the chat.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from agent_runtime.server.request_fields import (
    CacheSalt,
    Int,
    JobId,
    PositiveInt,
    ReasoningEffort,
    Temperature,
    TopK,
    TopP,
    sampling_fields,
)
from agent_runtime.server.requests import lift_vllm_xargs
from asymcache_core.chat_messages import TEXT_PART_KEYS, TEXT_PART_SEPARATOR
from asymcache_core.logprobs import MAX_LOGPROBS
from asymcache_core.sampling_params import SamplingParams

_ROLES = frozenset({"user", "assistant", "system", "developer"})
#: The ``include`` values served. NOTE: reasoning items are sent in the clear, so asking for
#: their encrypted content (Codex does) changes nothing
SERVED_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")


class ReasoningSettings(BaseModel):
    """The request's ``reasoning``: an effort (the template's ``reasoning_effort``) and the
    summary asked for (accepted; none is written: the reasoning item holds the thinking)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # OpenAI's older name


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: what the server reads of OpenAI's body, plus vLLM's ``top_k`` and
    Continuum's ``job_id`` / ``is_last_step`` (the openai client's ``extra_body``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: fields this server does not serve, with the values that mean "off"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "conversation": (None,), "prompt": (None,), "truncation": (None, "disabled"),
    }

    model: StrictStr | None = None
    input: str | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Int | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    background: StrictBool | None = None
    #: OpenAI's cap on calls of built-in tools: none is served, so it caps nothing here (echoed)
    max_tool_calls: PositiveInt | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    text: dict[str, Any] | None = None
    user: StrictStr | None = None
    reasoning: ReasoningSettings | None = None
    job_id: JobId | None = None
    is_last_step: StrictBool | None = None
    cache_salt: CacheSalt | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _hints_in_xargs(cls, data: Any) -> Any:
        return lift_vllm_xargs(data, ("job_id", "is_last_step"))

    @field_validator("include")
    @classmethod
    def _served_includes(cls, value: list[str] | None) -> list[str] | None:
        for i, name in enumerate(value or ()):
            if name not in SERVED_INCLUDES:
                raise ValueError(f"include[{i}]: not served by this server: {name!r} "
                                 f"({', '.join(SERVED_INCLUDES)} are)")
        return value

    @property
    def reports_logprobs(self) -> bool:
        """Whether the message's text carries its tokens' log probabilities: the request
        includes ``message.output_text.logprobs``, or asks for alternatives (``top_logprobs``)."""
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        # NOTE: checked before the union, whose error would name a member (``input.str``)
        if not isinstance(value, (str, list)):
            raise ValueError(f"input: must be a string or a list of input items, got {type(value).__name__}")
        return value

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's sampling parameters: fields left out take the server's defaults, as a
        chat completion's do (:func:`~agent_runtime.server.request_fields.sampling_fields`).

        Args:
            default_max_tokens: ``max_tokens`` when ``max_output_tokens`` is not given.
            defaults: the server's sampling defaults (None: vLLM's, temperature 1).
        """
        return SamplingParams(
            max_tokens=self.max_output_tokens or default_max_tokens,
            **sampling_fields(self, defaults),
            seed=self.seed,
            cache_salt=self.cache_salt,
            logprobs=(self.top_logprobs or 0) if self.reports_logprobs else None,
        )


def _text_of(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or a list of text parts (the chat's kinds:
    :data:`asymcache_core.chat_messages.TEXT_PART_KEYS`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            raise ValueError(f"{where}[{j}].type: only text parts are served ({', '.join(TEXT_PART_KEYS)}), "
                             f"got {kind!r}")
        texts.append(part[key])
    return TEXT_PART_SEPARATOR.join(texts)


def input_messages(items: str | Sequence[Mapping[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``.

    Args:
        items: a string (one user message) or the input items.
        instructions: the system message put first, if any.

    Returns:
        OpenAI chat messages.

    Raises:
        ValueError: an item the server does not serve or a malformed one (naming
            ``input[i]...``), or a ``function_call_output`` without a ``call_id``.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    thought: str | None = None  # a reasoning item's text, for the assistant message it precedes
    partial = False  # the last item was an assistant message the reply to it went on writing

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal thought
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"], thought = thought, None
        messages.append(message)
        return message

    def flush_thought() -> None:
        # NOTE: thinking no assistant message follows (the reply was cut off in it, or ended
        # after it): a message of its own, as vLLM renders it, not the next turn's
        if thought is not None:
            assistant("")

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        was_partial, partial = partial, False
        if kind == "reasoning":
            thought = (thought or "") + _reasoning_text(item, where)
        elif kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValueError(f"{where}.role: must be one of {sorted(_ROLES)}, got {role!r}")
            content = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                last = messages[-1] if messages else None
                if was_partial and thought is None and last is not None and isinstance(last.get("content"), str):
                    # NOTE: the rest of a partial message (the reply that continued it): one
                    # message, rendered as the model wrote it, so its KV stays reusable
                    last["content"] += content
                else:
                    assistant(content)
                partial = item.get("status") in PARTIAL_STATUSES
            else:
                flush_thought()
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and name and isinstance(arguments, str) and isinstance(call_id, str)):
                raise ValueError(f"{where}: a function_call needs string name, arguments and call_id")
            _check_arguments(arguments, f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            # NOTE: the calls of one turn, after the text the model wrote before them: one
            # assistant message, rendered as the model generated it
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant(None)["tool_calls"] = [call]
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.call_id: must be the call's id")
            flush_thought()
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise ValueError(f"{where}.type: not served by this server: {kind!r} (message, reasoning, "
                             "function_call and function_call_output are)")
    if not messages:
        # NOTE: thinking alone is no conversation
        raise ValueError("input: must hold at least one item")
    flush_thought()
    return messages


#: The statuses of a message item that the model was still writing (``in_progress``) or that
#: was cut off (``incomplete``): as the last input item, the reply continues it.
PARTIAL_STATUSES = ("in_progress", "incomplete")


def continues_final_message(items: str | Sequence[Mapping[str, Any]]) -> bool:
    """Whether the reply continues the input's last item instead of starting a new assistant
    turn (vLLM's ``should_continue_final_message``): it is a ``message`` with status
    ``in_progress`` or ``incomplete``. Only the request's own ``input`` is read, as vLLM reads
    it: a chain's last output, continued with no new item, is not continued.

    Args:
        items: the request's ``input``.

    Returns:
        True: the chat is rendered with ``continue_final_message`` (no generation prompt).

    Raises:
        ValueError: naming ``input[i].status``, a partial ``reasoning`` item last: the chat
            templates render no open thinking block to continue (vLLM's renderer fails on it
            too: the message it becomes has no content to continue).
    """
    if isinstance(items, str) or not items:
        return False
    last = items[-1]
    kind = last.get("type", "message")
    if last.get("status") not in PARTIAL_STATUSES or kind not in ("message", "reasoning"):
        return False
    if kind == "reasoning":
        raise ValueError(f"input[{len(items) - 1}].status: continuing a reasoning item is not served (a message "
                         f"item with status {' or '.join(PARTIAL_STATUSES)} is continued)")
    return True


def check_call_outputs(items: Sequence[Mapping[str, Any]], own: int) -> None:
    """Every ``function_call_output`` of the request's own input answers a ``function_call``
    before it (in its chain or its own input), as OpenAI's API requires.

    NOTE: vLLM's chat-template path passes such an output on to the template (its Harmony path
    refuses it, as OpenAI does): a tool result for no call is a prompt the model never saw, and
    a client's bug (a lost call, a mistyped id) best seen at once.

    Args:
        items: the chain's items, then the request's own (:func:`chain_items`).
        own: how many of them, the last, are the request's own input.

    Raises:
        ValueError: naming ``input[i].call_id`` (its index in the request's own input).
    """
    first_own = len(items) - own
    calls: set[str] = set()
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "function_call" and isinstance(item.get("call_id"), str):
            calls.add(item["call_id"])
        elif kind == "function_call_output" and i >= first_own and item.get("call_id") not in calls:
            raise ValueError(f"input[{i - first_own}].call_id: no tool call found for function call output with "
                             f"call_id {item.get('call_id')!r}")


def _check_arguments(arguments: str, where: str) -> None:
    """A ``function_call`` item's arguments must be JSON text of an object (empty: none), as
    a chat's tool call's are; checked here so that the error names the item, not the chat
    message it becomes."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be JSON text of an object, got {type(value).__name__}")


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """A ``reasoning`` input item's thinking: its ``reasoning_text`` content (its summary when it
    has none, as a client that kept only the summary sends it)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise ValueError(f"{where}.content: must be a list of reasoning_text parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}]: a reasoning part needs its text")
        texts.append(part["text"])
    # NOTE: one thinking, cut into parts: joined as it was generated, not as separate texts
    return "".join(texts)


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The chat form of Responses function tools (``{"type": "function", "name", ...}`` flat).

    Raises:
        ValueError: a built-in tool (``web_search``, ...) or a function without a name.
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type: only function tools are served, got {tool.get('type')!r}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """The chat form of a Responses ``tool_choice`` (``{"type": "function", "name"}`` flat).

    Raises:
        ValueError: a choice of a built-in tool or of ``allowed_tools``.
    """
    if choice is None or isinstance(choice, str):
        return "auto" if choice is None else choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice: auto, none, required or {{'type': 'function', 'name': ...}}, got {choice!r}")


def chat_response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The chat ``response_format`` of a Responses ``text.format``.

    Raises:
        ValueError: a format of another type, or a JSON schema without its fields.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError(f"text.format: type text, json_object or json_schema, got {fmt!r}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


__all__ = [
    "PARTIAL_STATUSES", "chat_response_format", "chat_tool_choice", "chat_tools", "check_call_outputs",
    "continues_final_message", "input_messages",
]
