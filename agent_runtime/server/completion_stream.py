"""The SSE path of the completions endpoints (:mod:`agent_runtime.server.serving`): an endpoint's
body models, the events of a request's choices merged as they come, and the stream of chunks
(each choice's pieces from its :class:`~agent_runtime.server.choices.Chunks`, then the optional
usage chunk and ``[DONE]``); a client that goes away has every choice's request aborted."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from agent_runtime.reasoning import ReasoningCount
from agent_runtime.request_stream import RequestStream
from agent_runtime.server.choices import Chunks
from agent_runtime.server.errors import stream_error_frame
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    Usage,
)
from agent_runtime.types import StreamEvent


@dataclass(frozen=True)
class Endpoint:
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


CHAT = Endpoint("/v1/chat/completions", "chatcmpl", ChatCompletionResponse, ChatCompletionChunk)
COMPLETION = Endpoint("/v1/completions", "cmpl", CompletionResponse, CompletionChunk)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamEvent]]:
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


class UsageReport(NamedTuple):
    """Where a streamed response reports usage.

    Attributes:
        final: a last chunk with the whole response's usage (``include_usage``).
        continuous: every chunk with its choice's usage so far (vLLM's ``continuous_usage_stats``).
        choices_per_prompt: ``n`` (each prompt's usage is counted once).
        reasoning: one counter per choice where usage reports ``completion_tokens_details``
            (chat with a reasoning parser); None: left out.
    """

    final: bool
    continuous: bool
    choices_per_prompt: int
    reasoning: list[ReasoningCount] | None = None


async def sse_events(
    chunks: list[Chunks],
    endpoint: Endpoint,
    rid: str,
    model: str,
    report: UsageReport,
    metrics: ServerMetrics,
    generated: bool = True,
) -> AsyncIterator[str]:
    """The SSE frames of one streamed completion, its choices interleaved as their tokens come;
    aborts every choice's request if the client goes away."""
    created = int(time.time())
    streams = [c.stream for c in chunks]

    def frame(choices: list[Any], usage: Usage | None = None, **fields: Any) -> str:
        body = endpoint.chunk_model(
            id=rid, created=created, model=model, choices=choices, usage=usage, **fields).model_dump()
        if report.final:
            # NOTE: OpenAI's ``include_usage``: every other chunk carries ``"usage": null``
            body.setdefault("usage", None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def so_far(index: int, event: StreamEvent | None) -> Usage | None:
        # NOTE: vLLM's continuous usage: the choice's prompt and its tokens so far (no
        # prompt_tokens_details: vLLM sets them on the final usage chunk only), and with a
        # reasoning parser the thinking among them (0 on the opening chunks)
        if not report.continuous:
            return None
        counters = report.reasoning
        if event is None:
            return Usage.so_far(len(streams[index].prompt_token_ids), 0, None if counters is None else 0)
        out = event.output
        thinking = None if counters is None else counters[index].count(out.text, out.token_ids)
        return Usage.so_far(out.num_prompt_tokens, len(out.token_ids) if generated else 0, thinking)

    try:
        for index, chunk in enumerate(chunks):
            for choice in chunk.opening():
                yield frame([choice], so_far(index, None), **chunk.opening_fields())
        try:
            async for index, event in merged(streams):
                if event.output.finished:
                    metrics.observe(event, one_choice=False)
                for choice in chunks[index].on_event(event):
                    yield frame([choice], so_far(index, event))
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield stream_error_frame(exc)
            yield "data: [DONE]\n\n"
            return
        finals = [stream.final for stream in streams]
        metrics.observe_choices(finals, report.choices_per_prompt)  # type: ignore[arg-type]
        if report.final:
            yield frame([], usage=usage_of(finals, report.choices_per_prompt, generated,  # type: ignore[arg-type]
                                           cache_writes=endpoint is CHAT, reasoning=report.reasoning))
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (the generator is cancelled or closed mid-stream), or a choice failed:
        # free the KV of every choice still running.
        for stream in streams:
            if stream.final is None:
                metrics.count_abort(stream.last)
                stream.abort()


def usage_of(
    finals: list[StreamEvent], choices_per_prompt: int, generated: bool = True, cache_writes: bool = False,
    reasoning: list[ReasoningCount] | None = None,
) -> Usage:
    """Usage of a response: each prompt once (its ``n`` choices, consecutive, share it), the
    choices' tokens summed (none where nothing generated is returned: ``echo`` with
    ``max_tokens: 0``), and with ``reasoning`` (one counter per choice) the choices' thinking
    tokens summed (vLLM's ``completion_tokens_details``).

    NOTE: ``cache_writes``: the prompts' tokens written to the prefix cache as
    ``created_cache_tokens``, which vLLM's chat route reports beside ``cached_tokens`` and its
    completions route does not (``_make_prompt_tokens_details``).
    """
    firsts = [f.output for f in finals[::choices_per_prompt]]
    completion = sum(len(f.output.token_ids) for f in finals) if generated else 0
    created = sum(o.metrics.cache_creation_tokens for o in firsts) if cache_writes else None
    thinking = None if reasoning is None else sum(
        counter.count(f.output.text, f.output.token_ids) for counter, f in zip(reasoning, finals, strict=True))
    return Usage.of(sum(o.num_prompt_tokens for o in firsts), completion, sum(o.metrics.cached_tokens for o in firsts),
                    created, thinking)


def token_decoder(engine: Any) -> Callable[[Sequence[int]], str] | None:
    """The decode of an engine's tokenizer (None when it has none)."""
    decode = getattr(getattr(engine, "tokenizer", None), "decode", None)
    return None if decode is None else lambda ids: decode(list(ids))


def reasoning_counters(engine: Any, parser: str | None, choices: int, split: bool = True) -> list[ReasoningCount] | None:
    """The thinking counters of a chat's choices (:class:`UsageReport`'s ``reasoning``).

    NOTE: vLLM's ``_include_reasoning_tokens_details``: a server with a reasoning parser reports
    ``completion_tokens_details`` on every chat usage; without one it is left out.

    Args:
        engine: the runtime's engine (its tokenizer decodes the tokens).
        parser: the server's reasoning parser.
        choices: how many.
        split: False where the reply is not split into thinking and content (a continued
            message): its count is 0.

    Returns:
        One counter per choice, or None without a reasoning parser.
    """
    if parser is None:
        return None
    decode, markers = token_decoder(engine), {}  # type: ignore[var-annotated]
    return [ReasoningCount(parser if split else None, decode, markers) for _ in range(choices)]


__all__ = [
    "CHAT", "COMPLETION", "Endpoint", "UsageReport", "merged", "reasoning_counters", "sse_events", "token_decoder",
    "usage_of",
]
