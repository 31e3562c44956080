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

Stored responses (:mod:`agent_runtime.server.response_store`): a response is kept unless the
request says ``store: false`` (OpenAI's default), a request may continue one
(``previous_response_id``: its chain's items come first; its ``instructions`` are not carried
over), ``GET`` / ``DELETE /v1/responses/{id}`` read and forget one, and ``GET
/v1/responses/{id}/input_items`` lists its input items. A chain is one agent job, its KV pinned
across the tool calls between its turns: the ``job_id`` its first request named; else, where the
engine gives implicit jobs (job admission on), the implicit job a chat client naming none gets,
which an answer without a tool call ends; else its first response's id.

With a reasoning parser (``serve --reasoning-parser``), the thinking comes first as a
``reasoning`` item (``reasoning_text`` content, streamed as ``response.reasoning_text.delta``);
``reasoning`` input items go back into the next assistant message's ``reasoning_content``.

The request's ``reasoning.effort`` is the chat template's ``reasoning_effort`` variable, as vLLM
passes it (gpt-oss's template reads it; others ignore it); ``reasoning.summary`` is accepted and
echoed, but the reasoning item carries the thinking itself, never a summary.

Not served (a 400 naming the field, never ignored): ``conversation``, ``background``, built-in
tools, non-text inputs, ``include``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent_runtime.engine_client import RequestStream
from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import ContextLengthError
from agent_runtime.reasoning import reasoning_tokens
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server.choices import StreamedText
from agent_runtime.server.errors import APIError, from_value_error
from agent_runtime.server.job_router import response_digest, routing_key
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.requests import (
    with_reasoning_effort,
)
from agent_runtime.server.response_store import (
    ResponseStore,
    StoredResponse,
    chain_digest,
    chain_items,
    input_items_page,
    new_response_id,
    with_item_ids,
)
from agent_runtime.server.responses import SSE_HEADERS
from agent_runtime.server.responses_input import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from agent_runtime.server.serving import finish_one, parse_body
from agent_runtime.server.state import app_state
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.tool_parsing import to_openai_tool_calls

PATH = "/v1/responses"


# ----------------------------------------------------------------------------------------------
# The reply as output items
# ----------------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``message`` output item with one ``output_text`` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item: the thinking as one ``reasoning_text`` part, no summary."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_items(turn: AssistantTurn) -> list[dict[str, Any]]:
    """One ``function_call`` output item per tool call of ``turn``."""
    return [
        {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
         "arguments": call["function"]["arguments"], "status": "completed"}
        for call in to_openai_tool_calls(turn.parsed.tool_calls)
    ]


def usage(final: StreamEvent, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses ``usage`` of a finished request."""
    out = final.output
    generated = len(out.token_ids)
    return {
        "input_tokens": out.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.metrics.cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": out.num_prompt_tokens + generated,
    }


class _Envelope:
    """The ``response`` object of one request, in its states (in progress, done).

    Args:
        response_id: its id.
        req: the request.
        model: the served model name.
        params: its sampling parameters.
        stored: whether it will be stored.
        count_reasoning: the reasoning tokens of a finished reply (its text, its tokens).
    """

    def __init__(self, response_id: str, req: ResponsesRequest, model: str, params: SamplingParams, stored: bool,
                 count_reasoning: Callable[[str, Sequence[int]], int]) -> None:
        self.id = response_id
        self.count_reasoning = count_reasoning
        self.fields: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "metadata": dict(req.metadata or {}),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": list(req.tools or []), "text": dict(req.text or {"format": {"type": "text"}}),
            "previous_response_id": req.previous_response_id,
            "store": stored, "truncation": "disabled", "user": req.user, "error": None,
            "incomplete_details": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": (req.reasoning.summary or req.reasoning.generate_summary) if req.reasoning else None},
        }

    def body(self, status: str, output: list[dict[str, Any]], final: StreamEvent | None = None,
             reason: str | None = None) -> dict[str, Any]:
        use = None
        if final is not None:
            use = usage(final, self.count_reasoning(final.output.text, final.output.token_ids))
        body = {**self.fields, "status": status, "output": output, "usage": use}
        if reason == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            if output and output[-1]["type"] in ("message", "reasoning"):
                # NOTE: the text cut off is the last item's: it is incomplete too (the spec's
                # item status)
                output[-1]["status"] = "incomplete"
        return body


def final_output(turn: AssistantTurn) -> list[dict[str, Any]]:
    """The output items of a finished turn: its thinking (with a reasoning parser), its text (if
    any, or when no other item is), then its calls."""
    text = turn.message.get("content") or ""
    items = [reasoning_item(_new_id("rs"), turn.parsed.reasoning)] if turn.parsed.reasoning is not None else []
    if text or not (turn.parsed.tool_calls or items):
        items.append(message_item(_new_id("msg"), text))
    return items + call_items(turn)


# ----------------------------------------------------------------------------------------------
# The routes
# ----------------------------------------------------------------------------------------------


#: The chat's field names, as the Responses body spells them.
_CHAT_PARAMS = (("messages", "input"), ("response_format.json_schema", "text.format"),
                ("response_format", "text.format"), ("tool_choice.function", "tool_choice"))
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
    if param != "input" and error.message.startswith(f"{error.param}:"):
        # NOTE: the message names the field as the param does (a chat message's index is kept:
        # it says which rendered message)
        error.message = param + error.message[len(error.param):]
    error.param = param
    return error


class _Chain:
    """What storing a request's response needs: the chain's items through its input, its job,
    and the store (None: not stored)."""

    def __init__(self, store: ResponseStore | None, items: list[Mapping[str, Any]], job_id: str | None) -> None:
        self.store = store
        self.items = items
        self.job_id = job_id

    def keep(self, body: dict[str, Any]) -> None:
        """Store the finished response ``body`` (if the request asked to)."""
        if self.store is not None:
            self.store.put(StoredResponse(body, (*with_item_ids(self.items), *body["output"]), self.job_id))


def _decoder(rt: AgentRuntime) -> Callable[[Sequence[int]], str] | None:
    tokenizer = getattr(rt.engine, "tokenizer", None)
    decode = getattr(tokenizer, "decode", None)
    return None if decode is None else lambda ids: decode(list(ids))


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    state, req = await parse_body(request, ResponsesRequest)
    rt = state.require_runtime()
    responses = state.responses
    previous = None
    if req.previous_response_id is not None:
        previous = responses.require(req.previous_response_id, "previous_response_id")
    stored = req.store is not False and responses.enabled
    # NOTE: a chain's ids carry the digest of its first request's routing key (replicas route by it)
    digest = (response_digest(previous.id) if previous is not None else
              chain_digest(routing_key({"job_id": req.job_id, "input": req.input, "instructions": req.instructions})))
    assert digest is not None, "a stored response's id is this server's"
    response_id = new_response_id(digest)
    # NOTE: a chain is a job: the one its client named; else where the engine gives implicit
    # jobs, theirs (an answer ends it: an id of the server's own, which nothing ends, would hold
    # the job gate's reservation until its idle timeout); else its first response's id, so
    # Continuum's pins still hold its KV across its tool calls
    job_id = req.job_id or (previous.job_id if previous is not None else
                            None if rt.implicit_jobs or not stored else response_id)
    try:
        params = req.sampling_params(state.default_max_tokens)
        input_messages(req.input)  # NOTE: its own items first, so that an error names input[i] as sent
        items = chain_items(previous, req.input)
        messages = input_messages(items, req.instructions)
        tools = chat_tools(req.tools)
        choice = chat_tool_choice(req.tool_choice)
        fmt = chat_response_format(req.text)
        streams, choice = await rt.start_chat_choices(
            messages, [params], tools=tools, tool_choice=choice, response_format=fmt, job_id=job_id,
            is_last_step=bool(req.is_last_step), parallel_tool_calls=req.parallel_tool_calls is not False,
            strict_max_tokens=req.max_output_tokens is not None,
            **with_reasoning_effort({}, req.reasoning.effort if req.reasoning else None),
        )
    except ContextLengthError as e:
        raise _as_responses_error(from_value_error(
            ContextLengthError(e.prompt_tokens, e.max_tokens, e.max_model_len, param="max_output_tokens"), "input"
        )) from None
    except ValueError as e:
        raise _as_responses_error(from_value_error(e, "input")) from None
    decode = _decoder(rt)
    envelope = _Envelope(response_id, req, state.model_name, params, stored,
                         lambda text, ids: reasoning_tokens(text, ids, rt.reasoning_parser, decode))
    chain = _Chain(responses if stored else None, items, job_id)
    stream = streams[0]
    if not req.stream:
        final, turn = await finish_one(request, state, stream, PATH)
        body = envelope.body("completed", final_output(turn), final, turn.finish_reason)
        chain.keep(body)
        return JSONResponse(body)
    state.metrics.count(PATH, 200)
    text = StreamedText(bool(tools) and choice != "none", rt.tool_call_format, rt.reasoning_parser)
    return StreamingResponse(_events(stream, envelope, text, state.metrics, chain), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response."""
    state = app_state(request)
    found = state.responses.require(request.path_params["response_id"])
    state.metrics.count(PATH, 200)
    return JSONResponse(dict(found.body))


async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{response_id}/input_items``: the input items of a stored response
    (``limit``, ``order``, ``after``: OpenAI's paging)."""
    state = app_state(request)
    found = state.responses.require(request.path_params["response_id"])
    query = request.query_params
    limit = query.get("limit", "20")
    if not limit.isdigit():
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit!r}", param="limit")
    page = input_items_page(found, int(limit), query.get("order", "desc"), query.get("after"))
    state.metrics.count(PATH, 200)
    return JSONResponse(page)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: forget a stored response (its chain's earlier
    responses stay)."""
    state = app_state(request)
    response_id = request.path_params["response_id"]
    state.responses.require(response_id)
    state.responses.delete(response_id)
    state.metrics.count(PATH, 200)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


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


class _ItemStream:
    """The typed events of one streamed response's output items, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def _start(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        frames = [self.event("response.output_item.added", output_index=len(self.output),
                             item={**item, "status": "in_progress", "content": []})]
        # NOTE: a reasoning item's part is announced too (the spec's ``reasoning_text`` part):
        # its deltas name content_index 0
        frames.append(self.event("response.content_part.added", **self._where(), part={**item["content"][0],
                                                                                     "text": ""}))
        return frames

    def text(self, kind: str, piece: str) -> list[str]:
        """Frames that stream ``piece`` of the ``reasoning`` or ``message`` item (opening it,
        and closing the item before it)."""
        frames = []
        if self.open is not None and self.open["type"] != kind:
            frames += self.close()
        if self.open is None:
            frames += self._start(reasoning_item(_new_id("rs"), "") if kind == "reasoning"
                                  else message_item(_new_id("msg"), ""))
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        if piece:
            frames.append(self.event(delta, **self._where(), delta=piece, **extra))
        return frames

    def close(self, status: str = "completed") -> list[str]:
        """Frames that end the open item (none when none is open), with its ``status``
        (``incomplete``: the reply was cut off in it)."""
        item, frames = self.open, []
        if item is None:
            return frames
        item["status"] = status
        where, part = self._where(), item["content"][0]
        if item["type"] == "reasoning":
            frames.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
        else:
            frames.append(self.event("response.output_text.done", **where, text=part["text"], logprobs=[]))
        frames.append(self.event("response.content_part.done", **where, part=part))
        frames.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open = None
        return frames

    def call(self, call: dict[str, Any]) -> list[str]:
        """Frames of one whole ``function_call`` item."""
        index = len(self.output)
        self.output.append(call)
        return [
            self.event("response.output_item.added", output_index=index, item={**call, "arguments": "",
                                                                                "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                       delta=call["arguments"]),
            self.event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                       name=call["name"], arguments=call["arguments"]),
            self.event("response.output_item.done", output_index=index, item=call),
        ]


async def _events(
    stream: RequestStream, envelope: _Envelope, text: StreamedText, metrics: ServerMetrics, chain: _Chain
) -> AsyncIterator[str]:
    """The SSE events of one streamed response; aborts the request if the client goes away."""
    items = _ItemStream()
    try:
        yield items.event("response.created", response=envelope.body("in_progress", []))
        yield items.event("response.in_progress", response=envelope.body("in_progress", []))
        try:
            async for ev in stream:
                if ev.output.finished:
                    metrics.observe(ev)
                    break
                thought, piece = text.pieces(ev)
                for kind, part in (("reasoning", thought), ("message", piece)):
                    if part:
                        for frame in items.text(kind, part):
                            yield frame
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield error_event(exc, items.seq)
            return
        final = stream.final
        assert final is not None
        turn = build_turn(stream, final)
        calls = call_items(turn)
        thought, content = text.rest(turn, final)
        frames = items.text("reasoning", thought) if thought else []
        if turn.parsed.reasoning is not None and items.open is None and not items.output:
            frames += items.text("reasoning", "")  # NOTE: an empty thinking block is still an item
        if text.sent or content or not (calls or items.output or items.open):
            frames += items.text("message", content)
        frames += items.close("incomplete" if turn.finish_reason == "length" else "completed")
        for call in calls:
            frames += items.call(call)
        for frame in frames:
            yield frame
        body = envelope.body("completed", items.output, final, turn.finish_reason)
        chain.keep(body)
        yield items.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                          response=body)
    finally:
        if stream.final is None:
            metrics.count_abort()
            stream.abort()


__all__ = [
    "PATH", "ResponsesRequest", "chat_response_format", "chat_tool_choice", "chat_tools", "create_response",
    "delete_response", "error_event", "get_response", "input_messages", "list_input_items",
]
