"""The replies of Anthropic's Messages API (:mod:`agent_runtime.server.anthropic_messages`): a
finished turn as content blocks (``thinking``, ``text``, ``tool_use``) with its ``stop_reason``
and ``usage``, and a streamed one as its events (``message_start`` ... ``content_block_delta``
... ``message_stop``), a Hermes call's ``tool_use`` block streamed as it is written
(``input_json_delta`` pieces, :mod:`asymcache_core.tool_call_stream`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from agent_runtime.request_stream import RequestStream
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.streamed_text import StreamedText, finished_reply
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.tool_call_stream import CallPiece, HermesCallStream


def stop_reason(turn: AssistantTurn, final: StreamEvent) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished turn.

    NOTE: the length limit always gives ``max_tokens``, complete calls before the cut or not
    (vLLM's ``_to_anthropic_stop_reason``, and Anthropic's own API: a reply the limit cut off
    says so, and a call it cut short must not run); the engine's finish reason decides, as the
    turn's is ``tool_calls`` once a call is complete.
    """
    if final.output.finish_reason == "length":
        return "max_tokens", None
    if turn.parsed.tool_calls:
        return "tool_use", None
    sequence = final.output.stop_reason
    if isinstance(sequence, str):
        return "stop_sequence", sequence
    return "end_turn", None


def thinking_block(thinking: str) -> dict[str, Any]:
    """A ``thinking`` content block (unsigned: its signature is empty)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def content_blocks(turn: AssistantTurn, text: str, thinking: bool = True) -> list[dict[str, Any]]:
    """A finished turn's content: its thinking (with a reasoning parser), its text (when there is
    any, or no other block: Anthropic refuses an empty text block sent back), then one
    ``tool_use`` block per call.

    Args:
        turn: the turn.
        text: its text.
        thinking: a thinking block may come first (False: a prefill's continuation is all text).
    """
    calls = [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in turn.parsed.tool_calls]
    thought = [thinking_block(turn.parsed.reasoning)] if thinking and turn.parsed.reasoning is not None else []
    return thought + ([{"type": "text", "text": text}] if text or not (calls or thought) else []) + calls


def usage(final: StreamEvent) -> dict[str, int]:
    """Anthropic's ``usage``: the prompt split into its cache hits (``cache_read_input_tokens``),
    the tokens it wrote to the prefix cache (``cache_creation_input_tokens``) and the rest
    (``input_tokens``); the three add up to the prompt (vLLM's ``_build_anthropic_usage``).

    NOTE: the cache writes are the prompt's full blocks that this request computed and
    registered before its first token (``RequestMetrics.cache_creation_tokens``, vLLM's
    ``PrefillStats.num_cache_creation_tokens``); the partial last block is ``input_tokens``.
    """
    m = final.output.metrics
    cached, created = m.cached_tokens, m.cache_creation_tokens
    return {"input_tokens": max(0, final.output.num_prompt_tokens - cached - created),
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached,
            "output_tokens": len(final.output.token_ids)}


def message_body(mid: str, model: str, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
             use: dict[str, int]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": use}


async def message_events(
    stream: RequestStream, mid: str, model: str, text: StreamedText, metrics: ServerMetrics,
    calls_stream: HermesCallStream | None = None,
) -> AsyncIterator[str]:
    """The SSE events of one streamed message; aborts the request if the client goes away.

    Args:
        stream: the request's stream.
        mid: the message's id.
        model: the served model's name.
        text: what of the reply's text went out.
        metrics: the server's metrics.
        calls_stream: Hermes calls streamed as they are written (a ``tool_use`` block each, its
            input as ``input_json_delta`` pieces); None: calls go whole at the end.
    """

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def start(ev: StreamEvent | None) -> list[str]:
        # NOTE: sent with the first event, once the prompt's cached share is known
        # (its cache writes too: they are counted before the first token, and fixed then)
        use = {**usage(ev), "output_tokens": 0} if ev is not None else {
            "input_tokens": len(stream.prompt_token_ids), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0}
        return [event("message_start", message=message_body(mid, model, [], (None, None), use)), event("ping")]

    index = 0  # the block being streamed, or the next one
    open_kind: str | None = None  # "thinking", "text" or "tool_use" while a block is open

    def close() -> list[str]:
        nonlocal index, open_kind
        if open_kind is None:
            return []
        frames = [event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
                  ] if open_kind == "thinking" else []
        frames.append(event("content_block_stop", index=index))
        index, open_kind = index + 1, None
        return frames

    def stream_piece(kind: str, piece: str) -> list[str]:
        nonlocal open_kind
        frames = close() if open_kind not in (None, kind) else []
        if open_kind is None:
            block = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            frames.append(event("content_block_start", index=index, content_block=block))
            open_kind = kind
        if piece:
            delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else {
                "type": "text_delta", "text": piece}
            frames.append(event("content_block_delta", index=index, delta=delta))
        return frames

    def call_piece(piece: CallPiece) -> list[str]:
        nonlocal open_kind
        frames = []
        if piece.id is not None:
            frames += close()
            frames.append(event("content_block_start", index=index, content_block={
                "type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}))
            open_kind = "tool_use"
        if piece.arguments:
            frames.append(event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": piece.arguments}))
        return frames

    started = False
    try:
        try:
            async for ev in stream:
                if not started:
                    started = True
                    for frame in start(ev):
                        yield frame
                if ev.output.finished:
                    metrics.observe(ev)
                    break
                thought, piece = text.pieces(ev)
                for kind, part in (("thinking", thought), ("text", piece)):
                    if part:
                        for frame in stream_piece(kind, part):
                            yield frame
                if calls_stream is not None:
                    for call in calls_stream.feed(text.content):
                        for frame in call_piece(call):
                            yield frame
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            if not started:
                for frame in start(None):
                    yield frame
            yield error_event(exc)
            return
        final = stream.final
        assert final is not None
        turn, owed, streamed, thought, rest = finished_reply(stream, final, text, calls_stream)
        calls = turn.parsed.tool_calls
        frames = stream_piece("thinking", thought) if thought else []
        if turn.parsed.reasoning is not None and index == 0 and open_kind is None:
            frames += stream_piece("thinking", "")  # NOTE: an empty thinking block is still a block
        if streamed:
            # NOTE: the calls streamed as written end first; text still owed (a piece of the text
            # before them held back, such as a split character) is a block of its own
            for call in owed:
                frames += call_piece(call)
            if rest:
                frames += stream_piece("text", rest)
        else:
            if text.sent or rest or not (calls or index or open_kind):
                frames += stream_piece("text", rest)
            for call in owed:
                frames += call_piece(call)
        frames += close()
        for frame in frames:
            yield frame
        reason, sequence = stop_reason(turn, final)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage(final))
        yield event("message_stop")
    finally:
        if stream.final is None:
            metrics.count_abort(stream.last)
            stream.abort()


def error_event(exc: BaseException) -> str:
    """The ``error`` event that ends a stream whose request failed."""
    data = {"type": "error", "error": {"type": "api_error", "message": str(exc) or type(exc).__name__}}
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"



__all__ = ["content_blocks", "error_event", "message_body", "message_events", "stop_reason", "thinking_block", "usage"]
