"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), which
Claude Code and the Anthropic SDKs speak, served by the chat machinery as vLLM serves it.

A request's ``system`` and ``messages`` become chat messages (:func:`chat_messages`; the system
prompt, Anthropic's ``system`` messages anywhere in ``messages`` and Claude Code's per-request
billing block: :mod:`~agent_runtime.server.anthropic_system`): text blocks the message's
content (empty ones left out), an assistant's ``tool_use`` blocks the tool calls of its message (after its text, so the next turn's prompt repeats the tokens the model generated and its KV
stays reusable), a user's ``tool_result`` blocks tool messages before its text. ``tools``
(``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) become the
chat's, constrained decoding included; ``output_config``'s ``format`` (a JSON schema) is the
chat's ``response_format`` and its ``effort`` the template's ``reasoning_effort``, as vLLM maps
them; ``stop_sequences`` are stop strings; Continuum's
``job_id`` / ``is_last_step`` travel in the body as on chat completions; a conversation that
ends in an assistant message is Anthropic's prefill, which the reply continues. The reply comes back
as content blocks (``text``, then one ``tool_use`` per call) with Anthropic's ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and ``usage`` (cached prompt
tokens as ``cache_read_input_tokens``, those it wrote to the prefix cache as
``cache_creation_input_tokens``, the rest as ``input_tokens``); streamed, as its events
(``message_start`` ... ``content_block_delta`` ... ``message_stop``). Errors on these routes
are Anthropic's body, ``{"type": "error", "error": {"type", "message"}}``
(:func:`anthropic_error_body`), and its ``x-api-key`` header is accepted as the key.

With a reasoning parser (``serve --reasoning-parser``) a reasoning model's thinking comes first as
a ``thinking`` block (streamed as ``thinking_delta``s; its ``signature`` is empty: nothing is
signed here), and the ``thinking`` blocks of an assistant message go back into its
``reasoning_content``, as the chat route takes them. The request's ``thinking`` settings are
Anthropic's (:func:`~agent_runtime.thinking_budget.anthropic_thinking`): ``{"type": "enabled",
"budget_tokens": N}`` closes the block once it holds N tokens (N below ``max_tokens``), ``adaptive``
leaves its length to the model, both turn the template's ``enable_thinking`` on and are refused
with ``tool_choice`` ``any`` or ``tool`` (Anthropic's rule); ``disabled`` turns it off (Qwen3 and
its kind think unless told not to); without the field the template decides. Without a reasoning
parser the reply is all text, as vLLM serves it. A prefill's continuation is text: it continues
the answer. A text block is sent only when it has text or is the reply's only block (Anthropic
refuses an empty one sent back); several text blocks of a message are joined by newlines.

An assistant's ``redacted_thinking`` blocks (encrypted by Anthropic, readable by no model here)
are left out, as vLLM leaves them out. Not served (a 400 naming the field, never ignored): image
and document blocks, server tools (``web_search``, ``bash``, ...), ``mcp_servers``, ``container``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from agent_runtime.protocol import MAX_STOP_STRINGS, ContextLengthError
from agent_runtime.server.anthropic_replies import (
    content_blocks,
    error_event,
    message_body,
    message_events,
    stop_reason,
    thinking_block,
    usage,
)
from agent_runtime.server.anthropic_system import (
    accepts_inline_system,
    block_texts,
    has_inline_system,
    merge_inline_system,
    system_text,
)
from agent_runtime.server.auth import MESSAGES_COUNT_PATH, MESSAGES_PATH
from agent_runtime.server.body_parsing import base_request_id
from agent_runtime.server.errors import APIError, from_value_error
from agent_runtime.server.frontend import log_request
from agent_runtime.server.request_fields import (
    JobId,
    PositiveInt,
    Temperature,
    TopK,
    TopP,
    sampling_fields,
)
from agent_runtime.server.responses import SSE_HEADERS
from agent_runtime.server.serving import finish_one, parse_body, request_id_header
from agent_runtime.server.streamed_text import StreamedText, without_cut_off_call
from agent_runtime.thinking_budget import AnthropicThinking, anthropic_thinking
from asymcache_core.chat_messages import TEXT_PART_SEPARATOR
from asymcache_core.chat_template import ChatRenderer
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.tool_call_stream import HermesCallStream

PATH = MESSAGES_PATH
COUNT_PATH = MESSAGES_COUNT_PATH

#: The chat form's field names in an error, and what the Messages body calls them.
_ANTHROPIC_FIELDS = (
    (re.compile(r"^(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
    (re.compile(r"^(tools\[\d+\])\.function\.(name|description)"), r"\1.\2"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
    (re.compile(r"^response_format(\.json_schema)?"), "output_config.format"),
)

#: ``output_config.effort``'s values (the template's ``reasoning_effort``).
_EFFORTS = ("low", "medium", "high", "xhigh", "max")

#: Anthropic's error type for each status (its ``error.type``).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status (``api_error`` past the ones it names)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of this module's routes, or under them (their errors are
    Anthropic's: an SDK asking for a route not served here, ``/v1/messages/batches``, reads
    Anthropic's 404)."""
    return path == PATH or path.startswith(PATH + "/")


class _MessagesFields(BaseModel):
    """What a Messages body and a token count share: the conversation and its tools."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: fields this server does not serve, with the values that mean "off"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "mcp_servers": (None, []), "container": (None,),
    }

    #: required, as Anthropic's and vLLM's Messages route require it (the OpenAI routes do not),
    #: and not empty (vLLM's "Model is required")
    model: Annotated[StrictStr, Field(min_length=1)]
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_shape(cls, value: Any) -> Any:
        # NOTE: checked before the union, whose error would name a member (``system.str``)
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError(f"system: must be a string or a list of text blocks, got {type(value).__name__}")
        return value

    def chat(self, renderer: ChatRenderer | None = None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Any, bool]:
        """The chat form: ``(messages, tools, tool_choice, parallel_tool_calls)``.

        Args:
            renderer: the chat template's renderer: system messages after the first message
                join the leading system prompt where it refuses them there
                (:func:`~agent_runtime.server.anthropic_system.merge_inline_system`).

        Raises:
            ValueError: a block, tool or choice the server does not serve (naming it).
        """
        choice, parallel = chat_tool_choice(self.tool_choice)
        if choice not in ("auto", "none") and not self.tools:
            raise ValueError(f"tool_choice: type {self.tool_choice.get('type')!r} needs at least one tool in 'tools'"
                             if self.tool_choice else "tool_choice: needs at least one tool in 'tools'")
        messages = chat_messages(self.messages, self.system)
        if has_inline_system(messages) and not accepts_inline_system(renderer):
            messages = merge_inline_system(messages)
        return messages, chat_tools(self.tools), choice, parallel

    def output_settings(self) -> tuple[dict[str, Any] | None, str | None]:
        """``output_config`` as the chat's ``(response_format, reasoning_effort)``: a
        ``json_schema`` format constrains the reply to the schema, as vLLM's
        ``response_format``; ``effort`` is the template's ``reasoning_effort`` (vLLM's).

        Raises:
            ValueError: a malformed setting (naming ``output_config...``).
        """
        config = self.output_config or {}
        effort, fmt = config.get("effort"), config.get("format")
        if effort is not None and effort not in _EFFORTS:
            raise ValueError(f"output_config.effort: one of {', '.join(_EFFORTS)}, got {effort!r}")
        if fmt is None:
            return None, effort
        if not isinstance(fmt, Mapping) or fmt.get("type", "json_schema") != "json_schema":
            raise ValueError(f"output_config.format: must be {{'type': 'json_schema', 'schema': {{...}}}}, got {fmt!r}")
        return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": fmt.get("schema")}}, effort

    def template_kwargs(self, thinking: AnthropicThinking) -> dict[str, Any] | None:
        """The chat template's variables: the thinking switch and the ``reasoning_effort``."""
        effort = self.output_settings()[1]
        kwargs = {**(thinking.template_kwargs or {}), **({"reasoning_effort": effort} if effort else {})}
        return kwargs or None

    def thinking_settings(self, max_tokens: int, reasoning_parser: str | None) -> AnthropicThinking:
        """The budget and template variable of the request's ``thinking`` (see
        :func:`~agent_runtime.thinking_budget.anthropic_thinking`).

        Raises:
            ValueError: a malformed setting, or thinking with a forced tool.
        """
        forced = isinstance(self.tool_choice, Mapping) and self.tool_choice.get("type") in ("any", "tool")
        return anthropic_thinking(self.thinking, max_tokens, reasoning_parser, forced)

    @property
    def prefilled(self) -> bool:
        """The conversation ends in an assistant message without tool calls: Anthropic's
        prefill, which the reply continues (rendered open, without its end of turn)."""
        last = self.messages[-1] if self.messages else None
        content = last.get("content") if isinstance(last, Mapping) else None
        return (isinstance(last, Mapping) and last.get("role") == "assistant"
                and not (isinstance(content, list) and any(
                    isinstance(b, Mapping) and b.get("type") == "tool_use" for b in content)))


class MessagesRequest(_MessagesFields):
    """``POST /v1/messages``: what the server reads of Anthropic's body, plus Continuum's
    ``job_id`` / ``is_last_step``."""

    max_tokens: PositiveInt
    stop_sequences: list[StrictStr] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    job_id: JobId | None = None
    is_last_step: StrictBool | None = None

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's sampling parameters: fields left out take the server's defaults, as a
        chat completion's do (:func:`~agent_runtime.server.request_fields.sampling_fields`).

        Args:
            defaults: the server's sampling defaults (None: vLLM's, temperature 1).

        Raises:
            ValueError: too many or empty stop sequences.
        """
        stops = tuple(self.stop_sequences or ())
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop_sequences: up to {MAX_STOP_STRINGS} non-empty strings")
        return SamplingParams(
            max_tokens=self.max_tokens,
            **sampling_fields(self, defaults),
            stop=stops,
        )


class CountTokensRequest(_MessagesFields):
    """``POST /v1/messages/count_tokens``."""


# ----------------------------------------------------------------------------------------------
# The request as a chat
# ----------------------------------------------------------------------------------------------


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise ValueError(f"{where}: must be a string or a list of content blocks")
    return content


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text: must be a string")
    return text


def _tool_result_text(content: Any, where: str) -> str:
    """A ``tool_result``'s content: a string or text blocks (empty ones left out)."""
    return "" if content is None else TEXT_PART_SEPARATOR.join(block_texts(content, where))


def chat_messages(messages: Sequence[Mapping[str, Any]], system: str | list[dict[str, Any]] | None = None
                  ) -> list[dict[str, Any]]:
    """The chat messages of a Messages conversation.

    Args:
        messages: Anthropic's ``messages`` (``user`` / ``assistant``, string or block content).
        system: the system prompt: a string or text blocks.

    Returns:
        OpenAI chat messages.

    Raises:
        ValueError: a role, block or field the server does not serve, or a malformed one
            (naming ``messages[i].content[j]...`` or ``system``).
    """
    out: list[dict[str, Any]] = []
    text = system_text(system, "system") if system else ""
    if text:
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        role, where = message.get("role"), f"messages[{i}]"
        if role == "system":
            # NOTE: Anthropic's system message, at its place in the conversation
            text = system_text(message.get("content"), f"{where}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role: must be user, assistant or system, got {role!r}")
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{j}]", block.get("type")
            if kind == "text":
                if text := _text(block, at):  # NOTE: an empty block adds no newline (vLLM skips it)
                    texts.append(text)
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise ValueError(f"{at}.thinking: must be a string")
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                # NOTE: Anthropic's encrypted thinking, which a client sends back as it came (a
                # conversation begun on Anthropic's API): no model here can read it; left out,
                # as vLLM leaves it out, rather than refusing the conversation
                continue
            elif kind == "tool_use" and role == "assistant":
                name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
                if not (isinstance(name, str) and name and isinstance(call_id, str) and isinstance(args, Mapping)):
                    raise ValueError(f"{at}: a tool_use needs a string id and name and an object input")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise ValueError(f"{at}.tool_use_id: must be the tool_use's id")
                result = _tool_result_text(block.get("content"), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": result})
            else:
                raise ValueError(f"{at}.type: not served by this server in a {role} message: {kind!r}")
        if role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": TEXT_PART_SEPARATOR.join(texts) or None}
            if thoughts:
                reply["reasoning_content"] = TEXT_PART_SEPARATOR.join(thoughts)
            out.append({**reply, **({"tool_calls": calls} if calls else {})})
        elif texts or not any(m["role"] == "tool" for m in out[-1:]):
            out.append({"role": "user", "content": TEXT_PART_SEPARATOR.join(texts)})
    if not any(m["role"] != "system" for m in out):
        raise ValueError("messages: must hold at least one message")
    return out


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The chat form of Anthropic's client tools (``name``, ``description``, ``input_schema``).

    Raises:
        ValueError: a server tool (``web_search``, ``bash``, ...: a ``type`` other than
            ``custom``) or a tool without a name.
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise ValueError(f"tools[{i}].type: only client tools are served, got {tool.get('type')!r}")
        # NOTE: OpenAI's key order (name, description, parameters): the schemas are rendered
        # into the prompt as JSON, and the same tools must give the same prompt on every route
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema")
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """The chat form of Anthropic's ``tool_choice``: ``(tool_choice, parallel_tool_calls)``.

    Raises:
        ValueError: a type other than ``auto``, ``any``, ``tool`` and ``none``.
    """
    if choice is None:
        return "auto", True
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise ValueError(f"tool_choice.disable_parallel_tool_use: must be a boolean, got {disable!r}")
    parallel = not disable
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError(f"tool_choice: type auto, any, tool (with a name) or none, got {dict(choice)!r}")


# ----------------------------------------------------------------------------------------------
# The routes
# ----------------------------------------------------------------------------------------------


async def create_message(request: Request) -> Response:
    """``POST /v1/messages``."""
    state, req = await parse_body(request, MessagesRequest)
    # NOTE: vLLM names a message by its chat completion's id, which follows the X-Request-Id
    # header; here as Anthropic's ``msg_`` id, with the header sent back as on chat completions
    base_id = base_request_id(request.headers, None)
    rt = state.require_runtime()
    try:
        params = req.sampling_params(state.sampling_defaults)
        log_request(state.frontend, f"msg_{base_id}", params, req)
        messages, tools, choice, parallel = req.chat(rt.renderer)
        thinking = req.thinking_settings(req.max_tokens, rt.reasoning_parser)
        streams, choice = await rt.start_chat_choices(
            messages, [params], tools=tools, tool_choice=choice, job_id=req.job_id,
            is_last_step=bool(req.is_last_step), parallel_tool_calls=parallel,
            add_generation_prompt=not req.prefilled, continue_final_message=req.prefilled,
            thinking_token_budget=thinking.budget, chat_template_kwargs=req.template_kwargs(thinking),
            response_format=req.output_settings()[0], strict_max_tokens=True,
        )
    except ContextLengthError as e:
        # NOTE: Anthropic's wording, which its clients parse to retry with a smaller max_tokens
        raise APIError(400, f"input length and `max_tokens` exceed context limit: {e.prompt_tokens} + "
                       f"{e.max_tokens} > {e.max_model_len}, decrease input length or `max_tokens` and try again",
                       param="max_tokens", code=e.code) from None
    except ValueError as e:
        raise from_value_error(e, "messages", _ANTHROPIC_FIELDS) from None
    mid = f"msg_{base_id}"
    id_header = request_id_header(base_id)
    stream = streams[0]
    if not req.stream:
        final, turn = await finish_one(request, state, stream, PATH)
        # NOTE: a prefill's continuation is returned as generated (its first character may be
        # the space after the prefill's last word), and as text: it continues the answer, not
        # a thinking block
        text = final.output.text if req.prefilled and not turn.parsed.tool_calls else turn.message.get("content")
        text = without_cut_off_call(text or "", final.output.finish_reason == "length", bool(tools) and choice != "none",
                                    rt.tool_call_format)
        body = message_body(mid, state.model_name, content_blocks(turn, text, thinking=not req.prefilled),
                        stop_reason(turn, final), usage(final))
        return JSONResponse(body, headers=id_header)
    state.metrics.count(PATH, 200)
    parser = rt.reply_reasoning_parser(req.prefilled, req.template_kwargs(thinking))
    tools_possible = bool(tools) and choice != "none"
    calls = HermesCallStream(None if parallel else 1) if tools_possible and rt.tool_call_format == "hermes" else None
    events = message_events(stream, mid, state.model_name, StreamedText(tools_possible, rt.tool_call_format, parser),
                     state.metrics, calls)
    return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **id_header})


async def count_tokens(request: Request) -> JSONResponse:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as the messages route renders it."""
    state, req = await parse_body(request, CountTokensRequest)
    rt = state.require_runtime()
    try:
        messages, tools, _, _ = req.chat(rt.renderer)
        # NOTE: max_tokens is not sent here: any budget passes; the template variables count
        thinking = req.thinking_settings(1 << 62, rt.reasoning_parser)
        ids = await rt.tokenize(messages=messages, tools=tools, add_generation_prompt=not req.prefilled,
                                continue_final_message=req.prefilled, chat_template_kwargs=req.template_kwargs(thinking))
    except ValueError as e:
        raise from_value_error(e, "messages", _ANTHROPIC_FIELDS) from None
    state.metrics.count(COUNT_PATH, 200)
    # NOTE: vLLM's body: the count, and the same count before context management (none here)
    return JSONResponse({"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}})


def error_response(error: APIError) -> JSONResponse:
    """An :class:`APIError` as Anthropic's error body."""
    return JSONResponse(anthropic_error_body(error.status, error.message), status_code=error.status)


__all__ = [
    "COUNT_PATH", "PATH", "CountTokensRequest", "MessagesRequest", "anthropic_error_body", "chat_messages",
    "chat_tool_choice", "chat_tools", "content_blocks", "count_tokens", "create_message", "error_event",
    "error_response", "is_messages_path", "stop_reason", "thinking_block",
]
