"""The endpoints' handlers; chat and text completions share one response path.

Both completions endpoints validate their body (:mod:`agent_runtime.protocol`), submit through
the runtime, and then answer with :func:`_respond`: a JSON body once the request finished, or
the one SSE path of :func:`_sse_events` (chunks from an endpoint-specific encoder, then the
optional usage chunk and ``[DONE]``; a client that goes away has its request aborted, so its KV
blocks are freed). Only the chunk payloads differ between the endpoints
(:class:`_ChatChunks`, :class:`_CompletionChunks`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent_runtime.engine_client import RequestStream
from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    parse_json_body,
    parse_request,
)
from agent_runtime.server.errors import from_value_error, stream_error_frame
from agent_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from agent_runtime.server.state import AppState, app_state
from agent_runtime.tool_parsing import to_openai_tool_calls
from agent_runtime.types import StreamEvent
from asymcache_core import EngineStats
from asymcache_core.sampling_params import SamplingParams

_TOOL_OPEN = "<tool_call>"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: ``max_tokens`` of a text completion that gives none (OpenAI's default), capped by the server's.
_COMPLETION_DEFAULT_MAX_TOKENS = 16
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


# ----------------------------------------------------------------------------------------------
# Small endpoints
# ----------------------------------------------------------------------------------------------


async def health(request: Request) -> dict[str, str]:
    """``GET /health``: ok while the engine runs, else 503."""
    app_state(request).require_runtime()
    return {"status": "ok"}


async def models(request: Request) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    state = app_state(request)
    state.check_auth(request)
    state.metrics.count("/v1/models", 200)
    return {
        "object": "list",
        "data": [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "asymcache"}],
    }


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text, engine gauges read on the engine thread."""
    state = app_state(request)
    stats: EngineStats = await state.require_runtime().call(lambda engine: engine.stats())
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


# ----------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state, req = await _parse(request, ChatCompletionRequest)
    rt = state.require_runtime()
    params = _sampling_params(req, state.default_max_tokens)
    try:
        stream, choice = await rt.start_chat(
            req.messages,  # validated in depth by the runtime (ValueError names the field)
            tools=req.tools,
            tool_choice=req.tool_choice,
            params=params,
            job_id=req.job_id,
            is_last_step=req.last_step,
        )
    except ValueError as e:
        raise from_value_error(e, "messages") from None
    chunks = _ChatChunks(stream, tools_possible=bool(req.tools) and choice != "none")
    return await _respond(request, state, req, stream, chunks, "/v1/chat/completions")


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state, req = await _parse(request, CompletionRequest)
    rt = state.require_runtime()
    params = _sampling_params(req, min(_COMPLETION_DEFAULT_MAX_TOKENS, state.default_max_tokens))
    try:
        # A job's non-last completion is followed by a tool pause (Continuum's API): pin as
        # after a tool call, attributing the pause to ``tool_name`` when the client names it.
        stream = await rt.submit(
            req.prompt, params, job_id=req.job_id, is_last_step=req.last_step,
            pause_tool=(req.tool_name or "default") if req.job_id is not None and not req.last_step else None,
        )
    except ValueError as e:
        raise from_value_error(e, "prompt") from None
    chunks = _CompletionChunks(stream, return_ids=req.return_token_ids is True)
    return await _respond(request, state, req, stream, chunks, "/v1/completions")


async def _parse(request: Request, model: type[RequestT]) -> tuple[AppState, RequestT]:
    """Auth, JSON, the served model, then the body model; every failure an :class:`APIError`."""
    state = app_state(request)
    state.check_auth(request)
    try:
        body = parse_json_body(await request.body())
        # NOTE: the model is checked before the other fields: a wrong model is a 404 whatever
        # else the body holds.
        state.check_model(body.get("model"))
        return state, parse_request(model, body)
    except RequestError as e:
        raise from_value_error(e, "prompt") from None


def _sampling_params(req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int) -> SamplingParams:
    try:
        return req.sampling_params(default_max_tokens)
    except ValueError as e:
        raise from_value_error(e, "prompt") from None


# ----------------------------------------------------------------------------------------------
# The shared response path
# ----------------------------------------------------------------------------------------------


class _Chunks(Protocol):
    """What differs between chat and text completions: the response's payloads."""

    id_prefix: str
    object: str
    chunk_object: str

    def opening(self) -> list[dict[str, Any]]:
        """Choices sent before the first token."""
        ...

    def on_event(self, event: StreamEvent) -> list[dict[str, Any]]:
        """Choices for one event of the stream (the final one included)."""
        ...

    def final_choice(self, final: StreamEvent) -> dict[str, Any]:
        """The choice of the non-streamed response."""
        ...


async def _respond(
    request: Request,
    state: AppState,
    req: ChatCompletionRequest | CompletionRequest,
    stream: RequestStream,
    chunks: _Chunks,
    endpoint: str,
) -> Response:
    """The response of a submitted completion: one JSON body, or the SSE stream."""
    rid = f"{chunks.id_prefix}-{uuid.uuid4().hex[:24]}"
    model, metrics = state.model_name, state.metrics
    if not req.streaming:
        final = await _await_final(request, stream)
        metrics.observe(final)
        choice = chunks.final_choice(final)
        metrics.count(endpoint, 200)
        return JSONResponse({
            "id": rid, "object": chunks.object, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(final),
        })
    metrics.count(endpoint, 200)
    return StreamingResponse(
        _sse_events(stream, chunks, rid, model, req.include_usage, metrics),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )


async def _sse_events(
    stream: RequestStream,
    chunks: _Chunks,
    rid: str,
    model: str,
    include_usage: bool,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    """The SSE frames of one streamed completion; aborts the request if the client goes away."""
    created = int(time.time())

    def frame(choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = {"id": rid, "object": chunks.chunk_object, "created": created, "model": model,
               "choices": choices, **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        for choice in chunks.opening():
            yield frame([choice])
        try:
            async for event in stream:
                if event.output.finished:
                    metrics.observe(event)
                for choice in chunks.on_event(event):
                    yield frame([choice])
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield stream_error_frame(exc)
            yield "data: [DONE]\n\n"
            return
        final = stream.final
        assert final is not None
        if include_usage:
            yield frame([], usage=_usage(final))
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (the generator is cancelled or closed mid-stream): free the KV.
        if stream.final is None:
            metrics.count_abort()
            stream.abort()


async def _await_final(request: Request, stream: RequestStream) -> StreamEvent:
    """The final event of a non-streamed request; aborts it if the client goes away."""
    task = asyncio.ensure_future(stream.result())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                stream.abort()
    finally:
        if not task.done():
            stream.abort()
            task.cancel()


def _usage(final: StreamEvent) -> dict[str, Any]:
    out = final.output
    prompt, completion = out.num_prompt_tokens, len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.cached_tokens},
    }


def safe_text_len(text: str, hold_tool_tag: bool) -> int:
    """How much of ``text`` may be streamed as content now.

    Holds back a trailing replacement character (an incomplete UTF-8 sequence the next token
    completes) and, when tool calls are possible, everything from a ``<tool_call>`` tag on (or
    a trailing piece that may become one), which is sent as ``tool_calls`` at the end instead.

    Args:
        text: the text generated so far.
        hold_tool_tag: tool calls are possible in this reply.

    Returns:
        The length of the prefix that is safe to send.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    if hold_tool_tag:
        at = text.find(_TOOL_OPEN)
        if at >= 0:
            return min(end, at)
        for k in range(min(len(_TOOL_OPEN) - 1, end), 0, -1):
            if _TOOL_OPEN.startswith(text[end - k : end]):
                return end - k
    return end


class _ChatChunks:
    """Chat payloads: a role delta, content deltas, then tool calls or the rest, then the reason."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, stream: RequestStream, tools_possible: bool) -> None:
        self.stream = stream
        self.tools_possible = tools_possible
        self.sent = 0

    @staticmethod
    def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    def opening(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""})]

    def on_event(self, event: StreamEvent) -> list[dict[str, Any]]:
        text = event.output.text
        if not event.output.finished:
            upto = safe_text_len(text, self.tools_possible)
            if upto <= self.sent:
                return []
            piece, self.sent = text[self.sent : upto], upto
            return [self._delta({"content": piece})]
        turn = build_turn(self.stream, event)
        out: list[dict[str, Any]] = []
        if turn.parsed.tool_calls:
            # Text before the tags was streamed already; only a reply that is all tags
            # around some content (nothing sent yet) still owes its content.
            if self.sent == 0 and turn.parsed.content:
                out.append(self._delta({"content": turn.parsed.content}))
            calls = [{"index": i, **c} for i, c in enumerate(to_openai_tool_calls(turn.parsed.tool_calls))]
            out.append(self._delta({"tool_calls": calls}))
        elif len(text) > self.sent:
            out.append(self._delta({"content": text[self.sent :]}))
        out.append(self._delta({}, turn.finish_reason))
        return out

    def final_choice(self, final: StreamEvent) -> dict[str, Any]:
        turn = build_turn(self.stream, final)
        return {"index": 0, "message": turn.message, "finish_reason": turn.finish_reason, "logprobs": None}


class _CompletionChunks:
    """Text-completion payloads: text pieces (with their token ids on request), the last with the reason."""

    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, stream: RequestStream, return_ids: bool) -> None:
        self.stream = stream
        self.return_ids = return_ids
        self.sent = 0

    def _choice(self, text: str, finish: str | None, ids: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.return_ids:
            choice["token_ids"] = ids
        return choice

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_event(self, event: StreamEvent) -> list[dict[str, Any]]:
        out = event.output
        text = out.text
        upto = len(text) if out.finished else safe_text_len(text, False)
        piece = text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        new_ids = list(out.new_token_ids)
        if out.finished:
            return [self._choice(piece, out.finish_reason, new_ids)]
        if piece or (self.return_ids and new_ids):
            return [self._choice(piece, None, new_ids)]
        return []

    def final_choice(self, final: StreamEvent) -> dict[str, Any]:
        out = final.output
        choice: dict[str, Any] = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        if self.return_ids:
            choice["token_ids"] = list(out.token_ids)
            choice["prompt_token_ids"] = list(self.stream.prompt_token_ids)
        return choice


__all__ = ["chat_completions", "completions", "health", "metrics", "models", "safe_text_len"]
