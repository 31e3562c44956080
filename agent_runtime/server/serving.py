"""The endpoints' handlers; chat and text completions share one response path.

Both completions endpoints validate their body (:mod:`agent_runtime.protocol`), submit through
the runtime, and then answer with :func:`_respond`: a JSON body once the request finished, or
the one SSE path of :func:`_sse_events` (chunks from an endpoint-specific encoder, then the
optional usage chunk and ``[DONE]``; a client that goes away has its request aborted, so its KV
blocks are freed). Only the body models (:data:`_CHAT`, :data:`_COMPLETION`) and the choices
(:class:`_ChatChunks`, :class:`_CompletionChunks`) differ between the endpoints; every body is a
response model of :mod:`agent_runtime.protocol`, and its ``model_dump()`` is what goes on the wire.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agent_runtime.engine_client import RequestStream
from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    Usage,
    parse_json_body,
    parse_request,
)
from agent_runtime.server.errors import from_value_error, stream_error_frame
from agent_runtime.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from agent_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from agent_runtime.server.state import AppState, app_state
from agent_runtime.tool_parsing import to_openai_tool_calls
from agent_runtime.types import StreamEvent
from asymcache_core import EngineStats
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.sampling_params import SEED_MAX, SamplingParams

_TOOL_OPEN = "<tool_call>"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: ``max_tokens`` of a text completion that gives none (OpenAI's default), capped by the server's.
_COMPLETION_DEFAULT_MAX_TOKENS = 16
#: int64 seeds wrap around: choice ``i`` of a request seeded ``SEED_MAX`` samples with ``SEED_MIN + i - 1``.
SEED_SPAN = SEED_MAX + 1
RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


# ----------------------------------------------------------------------------------------------
# Small endpoints
# ----------------------------------------------------------------------------------------------


async def health(request: Request) -> dict[str, str]:
    """``GET /health``: ok while the engine runs, else 503."""
    app_state(request).require_runtime()
    return {"status": "ok"}


async def models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the one served model."""
    state = app_state(request)
    state.check_auth(request)
    state.metrics.count("/v1/models", 200)
    return JSONResponse(ModelList(data=[ModelCard(id=state.model_name, created=state.created)]).model_dump())


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text, engine gauges read on the engine thread."""
    state = app_state(request)
    stats: EngineStats = await state.require_runtime().call(lambda engine: engine.stats())
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> JSONResponse:
    """``POST /tokenize``: the ids a prompt or a chat runs as (vLLM's endpoint)."""
    state, req = await _parse(request, TokenizeRequest, model_required=False)
    rt = state.require_runtime()
    try:
        ids = await rt.tokenize(req.prompt, messages=req.messages, tools=req.tools,
                                add_special_tokens=req.add_special_tokens,
                                add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise from_value_error(e, "prompt" if req.messages is None else "messages") from None
    state.metrics.count("/tokenize", 200)
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=rt.max_model_len, tokens=ids).model_dump())


async def detokenize(request: Request) -> JSONResponse:
    """``POST /detokenize``: the text of token ids (vLLM's endpoint)."""
    state, req = await _parse(request, DetokenizeRequest, model_required=False)
    try:
        text = await state.require_runtime().detokenize(req.tokens)
    except ValueError as e:
        raise from_value_error(e, "tokens") from None
    state.metrics.count("/detokenize", 200)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


# ----------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state, req = await _parse(request, ChatCompletionRequest)
    rt = state.require_runtime()
    params = _sampling_params(req, state.default_max_tokens)
    texts = state.token_texts() if params.logprobs is not None else None
    chunks: list[_Chunks] = []
    try:
        for index, choice_params in enumerate(choice_sampling_params(params, req.num_choices)):
            stream, choice = await rt.start_chat(
                req.messages,  # validated in depth by the runtime (ValueError names the field)
                tools=req.tools,
                tool_choice=req.tool_choice,
                response_format=req.response_format,
                params=choice_params,
                job_id=req.job_id,
                is_last_step=req.last_step,
                parallel_tool_calls=req.parallel_tool_calls is not False,
                add_generation_prompt=req.add_generation_prompt is not False,
            )
            chunks.append(_ChatChunks(stream, index, texts, tools_possible=bool(req.tools) and choice != "none"))
    except ValueError as e:
        _abort_all(chunks)
        raise from_value_error(e, "messages") from None
    return await _respond(request, state, req, chunks, _CHAT)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state, req = await _parse(request, CompletionRequest)
    rt = state.require_runtime()
    params = _sampling_params(req, min(_COMPLETION_DEFAULT_MAX_TOKENS, state.default_max_tokens))
    texts = state.token_texts() if params.logprobs is not None else None
    chunks: list[_Chunks] = []
    try:
        for index, choice_params in enumerate(choice_sampling_params(params, req.num_choices)):
            # A job's non-last completion is followed by a tool pause (Continuum's API): pin as
            # after a tool call, attributing the pause to ``tool_name`` when the client names it.
            stream = await rt.submit(
                req.prompt, choice_params, job_id=req.job_id, is_last_step=req.last_step,
                response_format=req.response_format,
                pause_tool=(req.tool_name or "default") if req.job_id is not None and not req.last_step else None,
            )
            chunks.append(
                _CompletionChunks(stream, index, texts, params.logprobs or 0, return_ids=req.return_token_ids is True)
            )
    except ValueError as e:
        _abort_all(chunks)
        raise from_value_error(e, "prompt") from None
    return await _respond(request, state, req, chunks, _COMPLETION)


def choice_sampling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of a request's ``n`` choices.

    NOTE: with a seed, choice ``i`` samples with ``seed + i`` (vLLM's rule), so the choices
    differ yet the response is reproducible; without one each choice draws its own stream.

    Args:
        params: the request's parameters.
        n: its number of choices.

    Returns:
        One per choice.
    """
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i + SEED_SPAN) % (2 * SEED_SPAN) - SEED_SPAN)
            for i in range(n)]


def _abort_all(chunks: list[_Chunks]) -> None:
    for chunk in chunks:
        chunk.stream.abort()


async def _parse(request: Request, model: type[RequestT], model_required: bool = True) -> tuple[AppState, RequestT]:
    """Auth, JSON, the served model (optional on the tokenizer routes, as in vLLM), then the
    body model; every failure an :class:`APIError`."""
    state = app_state(request)
    state.check_auth(request)
    try:
        body = parse_json_body(await request.body())
        # NOTE: the model is checked before the other fields: a wrong model is a 404 whatever
        # else the body holds.
        if model_required or body.get("model") is not None:
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


@dataclass(frozen=True)
class _Endpoint:
    """A completions endpoint's path and body models.

    Attributes:
        path: the route (the requests counter's ``endpoint`` label).
        id_prefix: its response ids' prefix.
        response_model: the non-streamed body.
        chunk_model: one SSE chunk.
    """

    path: str
    id_prefix: str
    response_model: type[ChatCompletionResponse] | type[CompletionResponse]
    chunk_model: type[ChatCompletionChunk] | type[CompletionChunk]


_CHAT = _Endpoint("/v1/chat/completions", "chatcmpl", ChatCompletionResponse, ChatCompletionChunk)
_COMPLETION = _Endpoint("/v1/completions", "cmpl", CompletionResponse, CompletionChunk)


class _Chunks(ABC):
    """An endpoint's choices for one request: the base keeps the stream, how much of its text
    went out and how many of its tokens' log probabilities; subclasses say what a choice holds.

    NOTE: a token's log probabilities go out with the first chunk sent after it was sampled
    (its text may be held back a while: part of a character, or of a ``<tool_call>`` tag).
    """

    def __init__(self, stream: RequestStream, index: int, texts: TokenTexts | None) -> None:
        self.stream = stream
        self.index = index
        self.texts = texts
        self.sent = 0
        self.logprobs_sent = 0

    def take_logprobs(self, event: StreamEvent) -> list[TokenLogprob]:
        """The entries of ``event`` not sent yet (none when the request asked for none)."""
        entries = event.output.logprobs
        if self.texts is None or entries is None:
            return []
        new, self.logprobs_sent = entries[self.logprobs_sent :], len(entries)
        return new

    def opening(self) -> list[Any]:
        """Choices sent before the first token (none by default)."""
        return []

    @abstractmethod
    def on_event(self, event: StreamEvent) -> list[Any]:
        """Choices for one event of the stream (the final one included)."""

    @abstractmethod
    def final_choice(self, final: StreamEvent) -> Any:
        """The choice of the non-streamed response."""


async def _respond(
    request: Request,
    state: AppState,
    req: ChatCompletionRequest | CompletionRequest,
    chunks: list[_Chunks],
    endpoint: _Endpoint,
) -> Response:
    """The response of a submitted completion (one stream per choice): one JSON body once every
    choice finished, or the SSE stream."""
    rid = f"{endpoint.id_prefix}-{uuid.uuid4().hex[:24]}"
    model, metrics = state.model_name, state.metrics
    if not req.streaming:
        finals = await _await_finals(request, [c.stream for c in chunks])
        for final in finals:
            metrics.observe(final)
        body = endpoint.response_model(
            id=rid, created=int(time.time()), model=model,
            choices=[c.final_choice(final) for c, final in zip(chunks, finals, strict=True)], usage=_usage(finals),
        )
        metrics.count(endpoint.path, 200)
        return JSONResponse(body.model_dump())
    metrics.count(endpoint.path, 200)
    return StreamingResponse(
        _sse_events(chunks, endpoint, rid, model, req.include_usage, metrics),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of several streams as they come, each with its stream's index.

    Raises:
        Exception: the first error of any stream (the others are left to the caller to abort).
    """
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _sse_events(
    chunks: list[_Chunks],
    endpoint: _Endpoint,
    rid: str,
    model: str,
    include_usage: bool,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    """The SSE frames of one streamed completion, its choices interleaved as their tokens come;
    aborts every choice's request if the client goes away."""
    created = int(time.time())
    streams = [c.stream for c in chunks]

    def frame(choices: list[Any], usage: Usage | None = None) -> str:
        chunk = endpoint.chunk_model(id=rid, created=created, model=model, choices=choices, usage=usage)
        return f"data: {json.dumps(chunk.model_dump(), ensure_ascii=False)}\n\n"

    try:
        for chunk in chunks:
            for choice in chunk.opening():
                yield frame([choice])
        try:
            async for index, event in _merged(streams):
                if event.output.finished:
                    metrics.observe(event)
                for choice in chunks[index].on_event(event):
                    yield frame([choice])
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield stream_error_frame(exc)
            yield "data: [DONE]\n\n"
            return
        finals = [stream.final for stream in streams]
        if include_usage:
            yield frame([], usage=_usage(finals))  # type: ignore[arg-type]
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (the generator is cancelled or closed mid-stream), or a choice failed:
        # free the KV of every choice still running.
        for stream in streams:
            if stream.final is None:
                metrics.count_abort()
                stream.abort()


async def _await_finals(request: Request, streams: list[RequestStream]) -> list[StreamEvent]:
    """The final events of a non-streamed request's choices; aborts them all if the client
    goes away or one of them fails."""
    tasks = [asyncio.ensure_future(stream.result()) for stream in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
            if not pending or any(t.exception() is not None for t in done):
                return [task.result() for task in tasks]
            if await request.is_disconnected():
                for stream in streams:
                    stream.abort()
    finally:
        for stream, task in zip(streams, tasks, strict=True):
            if not task.done():
                stream.abort()
                task.cancel()


def _usage(finals: list[StreamEvent]) -> Usage:
    """Usage of a response: the prompt once (every choice shares it), the choices' tokens summed."""
    first = finals[0].output
    return Usage.of(first.num_prompt_tokens, sum(len(f.output.token_ids) for f in finals), first.metrics.cached_tokens)


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


class _ChatChunks(_Chunks):
    """Chat payloads: a role delta, content deltas, then tool calls or the rest, then the reason."""

    def __init__(self, stream: RequestStream, index: int, texts: TokenTexts | None, tools_possible: bool) -> None:
        super().__init__(stream, index, texts)
        self.tools_possible = tools_possible

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(entries, self.texts) if self.texts is not None else None

    def opening(self) -> list[ChatCompletionStreamChoice]:
        return [ChatCompletionStreamChoice(index=self.index, delta=DeltaMessage(role="assistant", content=""))]

    def on_event(self, event: StreamEvent) -> list[ChatCompletionStreamChoice]:
        text = event.output.text
        if not event.output.finished:
            upto = safe_text_len(text, self.tools_possible)
            if upto <= self.sent:
                return []
            piece, self.sent = text[self.sent : upto], upto
            return [ChatCompletionStreamChoice(
                index=self.index, delta=DeltaMessage(content=piece), logprobs=self._logprobs(self.take_logprobs(event))
            )]
        turn = build_turn(self.stream, event)
        deltas: list[DeltaMessage] = []
        if turn.parsed.tool_calls:
            # Text before the tags was streamed already; only a reply that is all tags
            # around some content (nothing sent yet) still owes its content.
            if self.sent == 0 and turn.parsed.content:
                deltas.append(DeltaMessage(content=turn.parsed.content))
            calls = to_openai_tool_calls(turn.parsed.tool_calls)
            deltas.append(DeltaMessage(tool_calls=[ToolCallDelta(index=i, **c) for i, c in enumerate(calls)]))
        elif len(text) > self.sent:
            deltas.append(DeltaMessage(content=text[self.sent :]))
        out = [ChatCompletionStreamChoice(index=self.index, delta=d) for d in deltas]
        out.append(ChatCompletionStreamChoice(index=self.index, delta=DeltaMessage(), finish_reason=turn.finish_reason))
        pending = self.take_logprobs(event)
        if pending:
            out[0] = out[0].model_copy(update={"logprobs": self._logprobs(pending)})
        return out

    def final_choice(self, final: StreamEvent) -> ChatCompletionChoice:
        turn = build_turn(self.stream, final)
        return ChatCompletionChoice(
            index=self.index, message=ChatMessage.model_validate(turn.message), finish_reason=turn.finish_reason,
            logprobs=self._logprobs(final.output.logprobs or []),
        )


class _CompletionChunks(_Chunks):
    """Text-completion payloads: text pieces (with their token ids on request), the last with the reason."""

    def __init__(
        self, stream: RequestStream, index: int, texts: TokenTexts | None, num_top: int, return_ids: bool
    ) -> None:
        super().__init__(stream, index, texts)
        self.num_top = num_top
        self.return_ids = return_ids
        #: ``text_offset`` of the next token whose log probabilities go out
        self.offset = 0

    def _logprobs(self, entries: list[TokenLogprob]) -> CompletionLogprobs | None:
        if self.texts is None:
            return None
        logprobs = completion_logprobs(entries, self.texts, self.offset, self.num_top)
        self.offset += sum(len(token) for token in logprobs.tokens)
        return logprobs

    def on_event(self, event: StreamEvent) -> list[CompletionChoice]:
        out = event.output
        text = out.text
        upto = len(text) if out.finished else safe_text_len(text, False)
        piece = text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        new_ids = list(out.new_token_ids) if self.return_ids else None
        if out.finished or piece or new_ids:
            return [CompletionChoice(index=self.index, text=piece,
                                     finish_reason=out.finish_reason if out.finished else None,
                                     token_ids=new_ids, logprobs=self._logprobs(self.take_logprobs(event)))]
        return []

    def final_choice(self, final: StreamEvent) -> CompletionChoice:
        out = final.output
        return CompletionChoice(
            index=self.index,
            text=out.text,
            logprobs=self._logprobs(out.logprobs or []),
            finish_reason=out.finish_reason,
            token_ids=list(out.token_ids) if self.return_ids else None,
            prompt_token_ids=list(self.stream.prompt_token_ids) if self.return_ids else None,
        )


__all__ = [
    "chat_completions", "choice_sampling_params", "completions", "detokenize", "health", "metrics", "models",
    "safe_text_len", "tokenize",
]
