"""OpenAI's Responses API (``POST /v1/responses``), the one the OpenAI Agents SDK and Codex speak,
served by the chat machinery.

A request's ``input`` items become chat messages (:func:`chat_form`): ``instructions`` the system
message, ``message`` items their role's message, consecutive ``function_call`` items the tool
calls of one assistant message (after the text the model wrote before them, so the next turn's
prompt repeats the tokens it generated and its KV stays reusable), ``function_call_output``
items tool messages. Function ``tools`` and ``tool_choice`` become the chat's (constrained
decoding included), ``text.format`` its ``response_format``, and Continuum's ``job_id`` /
``is_last_step`` travel in the body as on chat completions. The reply comes back as output
items: a ``message`` with one ``output_text`` part, then one ``function_call`` item per call;
streamed, as the API's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``).

Not served (a 400 naming the field, never ignored): ``previous_response_id`` and
``conversation`` (nothing is stored: send the whole input, as with ``store: false``),
``reasoning``, ``background``, built-in tools, non-text inputs, ``include``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, model_validator

from agent_runtime.engine_client import RequestStream
from agent_runtime.output_processor import build_turn
from agent_runtime.server.choices import StreamedText
from agent_runtime.server.errors import APIError, from_value_error
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.requests import (
    JobId,
    PositiveInt,
    Temperature,
    TopK,
    TopP,
    lift_vllm_xargs,
)
from agent_runtime.server.serving import finish_one, parse_body
from agent_runtime.tool_parsing import to_openai_tool_calls
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.sampling_params import SamplingParams

PATH = "/v1/responses"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: what the server reads of OpenAI's body, plus vLLM's ``top_k`` and
    Continuum's ``job_id`` / ``is_last_step`` (the openai client's ``extra_body``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: fields this server does not serve, with the values that mean "off"
    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "previous_response_id": (None,), "conversation": (None,), "reasoning": (None,),
        # NOTE: no reasoning item is ever produced, so asking for their encrypted content
        # (Codex does) changes nothing; the other includes would
        "background": (None, False), "prompt": (None,), "include": (None, [], ["reasoning.encrypted_content"]),
        "top_logprobs": (None, 0),
        "truncation": (None, "disabled"), "max_tool_calls": (None,),
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
    seed: StrictInt | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    text: dict[str, Any] | None = None
    user: StrictStr | None = None
    job_id: JobId | None = None
    is_last_step: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _hints_in_xargs(cls, data: Any) -> Any:
        return lift_vllm_xargs(data, ("job_id", "is_last_step"))

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (greedy unless ``temperature`` says otherwise)."""
        return SamplingParams(
            max_tokens=self.max_output_tokens or default_max_tokens,
            temperature=0.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
        )


# ----------------------------------------------------------------------------------------------
# The request as a chat
# ----------------------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].type: only text parts are served ({', '.join(sorted(_TEXT_PARTS))}), "
                             f"got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


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
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValueError(f"{where}.role: must be one of {sorted(_ROLES)}, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and name and isinstance(arguments, str) and isinstance(call_id, str)):
                raise ValueError(f"{where}: a function_call needs string name, arguments and call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            # NOTE: the calls of one turn, after the text the model wrote before them: one
            # assistant message, rendered as the model generated it
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.call_id: must be the call's id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise ValueError(f"{where}.type: not served by this server: {kind!r} (message, function_call and "
                             "function_call_output are)")
    if not messages:
        raise ValueError("input: must hold at least one item")
    return messages


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


# ----------------------------------------------------------------------------------------------
# The reply as output items
# ----------------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``message`` output item with one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_items(turn: AssistantTurn) -> list[dict[str, Any]]:
    """One ``function_call`` output item per tool call of ``turn``."""
    return [
        {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
         "arguments": call["function"]["arguments"], "status": "completed"}
        for call in to_openai_tool_calls(turn.parsed.tool_calls)
    ]


def usage(final: StreamEvent) -> dict[str, Any]:
    """The Responses ``usage`` of a finished request."""
    out = final.output
    generated = len(out.token_ids)
    return {
        "input_tokens": out.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.metrics.cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.num_prompt_tokens + generated,
    }


class _Envelope:
    """The ``response`` object of one request, in its states (in progress, done)."""

    def __init__(self, req: ResponsesRequest, model: str, params: SamplingParams) -> None:
        self.id = _new_id("resp")
        self.fields: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "metadata": dict(req.metadata or {}),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": list(req.tools or []), "text": dict(req.text or {"format": {"type": "text"}}),
            "store": False, "truncation": "disabled", "user": req.user, "error": None,
            "incomplete_details": None,
        }

    def body(self, status: str, output: list[dict[str, Any]], final: StreamEvent | None = None,
             reason: str | None = None) -> dict[str, Any]:
        body = {**self.fields, "status": status, "output": output, "usage": usage(final) if final else None}
        if reason == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body


def final_output(turn: AssistantTurn) -> list[dict[str, Any]]:
    """The output items of a finished turn: its text (if any), then its calls."""
    text = turn.message.get("content") or ""
    items = [message_item(_new_id("msg"), text)] if text or not turn.parsed.tool_calls else []
    return items + call_items(turn)


# ----------------------------------------------------------------------------------------------
# The route
# ----------------------------------------------------------------------------------------------


#: The chat's field names, as the Responses body spells them.
_CHAT_PARAMS = (("messages", "input"), ("response_format.json_schema", "text.format"),
                ("response_format", "text.format"))
_FUNCTION_PARAM = re.compile(r"^tools\[(\d+)\]\.function(\.|$)")


def _as_responses_error(error: APIError) -> APIError:
    """``error`` with its ``param`` named as the Responses body names it (the chat's checks ran
    on the converted request: ``messages`` is ``input``, ``response_format`` ``text.format``,
    ``tools[i].function.x`` ``tools[i].x``)."""
    param = error.param
    if param is None:
        return error
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            param = ours if chat == "messages" else ours + param[len(chat):]
            break
    param = _FUNCTION_PARAM.sub(lambda m: f"tools[{m.group(1)}]{m.group(2)}", param)
    error.param = param
    return error


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    state, req = await parse_body(request, ResponsesRequest)
    rt = state.require_runtime()
    try:
        params = req.sampling_params(state.default_max_tokens)
        messages = input_messages(req.input, req.instructions)
        tools = chat_tools(req.tools)
        choice = chat_tool_choice(req.tool_choice)
        fmt = chat_response_format(req.text)
        streams, choice = await rt.start_chat_choices(
            messages, [params], tools=tools, tool_choice=choice, response_format=fmt, job_id=req.job_id,
            is_last_step=bool(req.is_last_step), parallel_tool_calls=req.parallel_tool_calls is not False,
        )
    except ValueError as e:
        raise _as_responses_error(from_value_error(e, "input")) from None
    envelope = _Envelope(req, state.model_name, params)
    stream = streams[0]
    if not req.stream:
        final, turn = await finish_one(request, state, stream, PATH)
        return JSONResponse(envelope.body("completed", final_output(turn), final, turn.finish_reason))
    state.metrics.count(PATH, 200)
    events = _events(stream, envelope, StreamedText(bool(tools) and choice != "none", rt.tool_call_format, rt.reasoning_parser), state.metrics)
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)


def error_event(exc: BaseException, sequence_number: int = 0) -> str:
    """The ``error`` event that ends a stream whose request failed.

    Args:
        exc: what failed.
        sequence_number: the event's place in the stream (a gateway relaying a stream that
            lost its replica does not know it: 0).

    Returns:
        The SSE event.
    """
    data = {"type": "error", "sequence_number": sequence_number, "code": "server_error",
            "message": str(exc) or type(exc).__name__, "param": None}
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(
    stream: RequestStream, envelope: _Envelope, text: StreamedText, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """The SSE events of one streamed response; aborts the request if the client goes away."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    msg_id = _new_id("msg")
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    def open_message() -> list[str]:
        return [event("response.output_item.added", output_index=0, item={**message_item(msg_id, ""),
                                                                         "status": "in_progress", "content": []}),
                event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    try:
        yield event("response.created", response=envelope.body("in_progress", []))
        yield event("response.in_progress", response=envelope.body("in_progress", []))
        try:
            async for ev in stream:
                if ev.output.finished:
                    metrics.observe(ev)
                    break
                opened = bool(text.sent)
                piece = text.piece(ev)
                if piece:
                    if not opened:
                        for frame in open_message():
                            yield frame
                    yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield error_event(exc, seq)
            return
        final = stream.final
        assert final is not None
        turn = build_turn(stream, final)
        calls = call_items(turn)
        full = text.full(turn, final)
        output: list[dict[str, Any]] = []
        if full or not calls:
            if not text.sent:
                for frame in open_message():
                    yield frame
            if len(full) > len(text.sent):
                yield event("response.output_text.delta", **where, delta=full[len(text.sent):], logprobs=[])
            message = message_item(msg_id, full)
            yield event("response.output_text.done", **where, text=full, logprobs=[])
            yield event("response.content_part.done", **where, part=message["content"][0])
            yield event("response.output_item.done", output_index=0, item=message)
            output.append(message)
        for call in calls:
            index = len(output)
            yield event("response.output_item.added", output_index=index,
                        item={**call, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                        delta=call["arguments"])
            yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                        name=call["name"], arguments=call["arguments"])
            yield event("response.output_item.done", output_index=index, item=call)
            output.append(call)
        body = envelope.body("completed", output, final, turn.finish_reason)
        yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
    finally:
        if stream.final is None:
            metrics.count_abort()
            stream.abort()


__all__ = [
    "PATH", "ResponsesRequest", "chat_response_format", "chat_tool_choice", "chat_tools", "create_response",
    "error_event", "input_messages",
]
