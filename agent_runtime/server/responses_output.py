"""The replies of OpenAI's Responses API (:mod:`agent_runtime.server.openai_responses`): a finished
turn as output items (``reasoning``, ``message``, ``function_call``) in its ``response`` object,
and a streamed one as the API's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``), a Hermes call's ``function_call``
item streamed as it is written (``response.function_call_arguments.delta`` pieces,
:mod:`asymcache_core.tool_call_stream`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from agent_runtime.request_stream import RequestStream
from agent_runtime.server.errors import failed_request_error
from agent_runtime.server.logprobs import TokenTexts
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.responses_input import ResponsesRequest
from agent_runtime.server.streamed_text import StreamedText, finished_reply
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.sampling_params import SamplingParams
from asymcache_core.tool_call_stream import CallPiece, HermesCallStream
from asymcache_core.tool_parsing import to_openai_tool_calls


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``message`` output item with one ``output_text`` part (with its tokens' ``logprobs``,
    when the request asked for them)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item: the thinking as one ``reasoning_text`` part, no summary."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def text_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, with_bytes: bool = True
                  ) -> list[dict[str, Any]]:
    """The ``logprobs`` of an ``output_text`` part (``with_bytes``) or of a text delta or done
    event (OpenAI's forms: ``{token, logprob, bytes, top_logprobs}``, the events' without bytes).

    Args:
        entries: one per generated token.
        texts: the token decoder.
        with_bytes: the part's form.
    """
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = texts(token_id)
        return {"token": text, "logprob": logprob, **({"bytes": raw or []} if with_bytes else {})}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


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
        # NOTE: vLLM's ``InputTokensDetails`` has the prompt's cache writes beside its hits
        "input_tokens_details": {"cached_tokens": out.metrics.cached_tokens,
                                 "cache_write_tokens": out.metrics.cache_creation_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": out.num_prompt_tokens + generated,
    }


class ResponseEnvelope:
    """The ``response`` object of one request, in its states (in progress, done).

    Args:
        response_id: its id.
        req: the request.
        model: the served model name.
        params: its sampling parameters.
        stored: whether it will be stored.
        count_reasoning: the reasoning tokens of a finished reply (its text, its tokens).
        texts: the token decoder of the message's log probabilities (None: not asked for).
    """

    def __init__(self, response_id: str, req: ResponsesRequest, model: str, params: SamplingParams, stored: bool,
                 count_reasoning: Callable[[str, Sequence[int]], int], texts: TokenTexts | None = None) -> None:
        self.id = response_id
        self.count_reasoning = count_reasoning
        self.texts = texts
        self.fields: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "metadata": dict(req.metadata or {}),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": list(req.tools or []), "text": dict(req.text or {"format": {"type": "text"}}),
            "previous_response_id": req.previous_response_id,
            "store": stored, "background": req.background is True, "max_tool_calls": req.max_tool_calls,
            "top_logprobs": req.top_logprobs or 0,
            "truncation": "disabled", "user": req.user, "error": None,
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
        # NOTE: the engine's reason too: a turn with a complete call reports tool_calls even
        # where the limit cut off the text after it
        if reason == "length" or (final is not None and final.output.finish_reason == "length"):
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            if output and output[-1]["type"] in ("message", "reasoning"):
                # NOTE: the text cut off is the last item's: it is incomplete too (the spec's
                # item status)
                output[-1]["status"] = "incomplete"
        return body


def final_output(turn: AssistantTurn, text: str | None = None, logprobs: list[dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """The output items of a finished turn: its thinking (with a reasoning parser), its text (if
    any, or when no other item is), then its calls.

    Args:
        turn: the turn.
        text: its text, if not the message's content (a tool call cut off taken out).
        logprobs: the message's ``logprobs`` (:func:`text_logprobs`), if asked for.
    """
    text = (turn.message.get("content") or "") if text is None else text
    items = [reasoning_item(_new_id("rs"), turn.parsed.reasoning)] if turn.parsed.reasoning is not None else []
    if text or not (turn.parsed.tool_calls or items):
        items.append(message_item(_new_id("msg"), text, logprobs=logprobs))
    return items + call_items(turn)


def error_event(exc: BaseException, sequence_number: int = 0) -> str:
    """The ``error`` event that ends a stream whose request failed.

    Args:
        exc: what failed.
        sequence_number: the event's place in the stream (a gateway relaying a stream that
            lost its replica does not know it: 0).

    Returns:
        The SSE event.
    """
    err = failed_request_error(exc)
    # NOTE: a client error (the request's own constraints allow no token) keeps its code
    code = err.code if err.status < 500 and err.code else "server_error"
    data = {"type": "error", "sequence_number": sequence_number, "code": code,
            "message": str(exc) or type(exc).__name__, "param": None}
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _ItemStream:
    """The typed events of one streamed response's output items, numbered in order."""

    def __init__(self, texts: TokenTexts | None = None) -> None:
        self.texts = texts  # the decoder of the message's log probabilities (None: not asked for)
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning, message or function_call item being streamed

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

    def text(self, kind: str, piece: str, logprobs: Sequence[TokenLogprob] = ()) -> list[str]:
        """Frames that stream ``piece`` of the ``reasoning`` or ``message`` item (opening it,
        and closing the item before it), a message's with the ``logprobs`` of the tokens
        generated since its last delta."""
        frames = []
        if self.open is not None and self.open["type"] != kind:
            frames += self.close()
        if self.open is None:
            frames += self._start(reasoning_item(_new_id("rs"), "") if kind == "reasoning"
                                  else message_item(_new_id("msg"), ""))
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": self.add_logprobs(logprobs)}
        if piece:
            frames.append(self.event(delta, **self._where(), delta=piece, **extra))
        return frames

    def add_logprobs(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Add ``entries`` to the open message's logprobs (none when it asked for none, or no
        message is open); returns them in the delta events' form."""
        item = self.open
        if self.texts is None or not entries or item is None or item["type"] != "message":
            return []
        item["content"][0]["logprobs"] += text_logprobs(entries, self.texts)
        return text_logprobs(entries, self.texts, with_bytes=False)

    def close(self, status: str = "completed") -> list[str]:
        """Frames that end the open item (none when none is open), with its ``status``
        (``incomplete``: the reply was cut off in it)."""
        item, frames = self.open, []
        if item is None:
            return frames
        index = len(self.output)
        if item["type"] == "function_call":
            # NOTE: a streamed call the reply's parse refused stays incomplete (see below)
            item["status"] = "incomplete" if item.get("status") == "incomplete" else "completed"
            frames.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            item["status"] = status
            where, part = self._where(), item["content"][0]
            if item["type"] == "reasoning":
                frames.append(self.event("response.reasoning_text.done", **where, text=part["text"]))
            else:
                done = [{k: v for k, v in e.items() if k != "bytes"} | {"top_logprobs": [
                    {k: v for k, v in t.items() if k != "bytes"} for t in e["top_logprobs"]]} for e in part["logprobs"]]
                frames.append(self.event("response.output_text.done", **where, text=part["text"], logprobs=done))
            frames.append(self.event("response.content_part.done", **where, part=part))
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open = None
        return frames

    def call_piece(self, piece: CallPiece) -> list[str]:
        """Frames of one streamed piece of a ``function_call`` item: its start (closing the item
        before it) or more of its arguments."""
        frames = []
        if piece.id is not None:
            frames += self.close()
            self.open = {"type": "function_call", "id": _new_id("fc"), "call_id": piece.id, "name": piece.name,
                         "arguments": "", "status": "in_progress"}
            frames.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=dict(self.open)))
        if piece.arguments:
            assert self.open is not None and self.open["type"] == "function_call"
            self.open["arguments"] += piece.arguments
            frames.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output), delta=piece.arguments))
        return frames


async def response_events(
    stream: RequestStream, envelope: ResponseEnvelope, text: StreamedText, metrics: ServerMetrics,
    keep: Callable[[dict[str, Any]], None], calls_stream: HermesCallStream | None = None,
    on_failed: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of one streamed response; aborts the request if the client goes away.

    Args:
        stream: the request's stream.
        envelope: its ``response`` object.
        text: what of the reply's text went out.
        metrics: the server's metrics.
        keep: stores the finished response's body (if the request asked to).
        calls_stream: Hermes calls streamed as they are written (a ``function_call`` item each,
            its arguments as delta events); None: calls go whole at the end.
        on_failed: given the failed response's body when the request fails (a background
            response stores it); None: it is not kept.
    """
    items = _ItemStream(envelope.texts)
    logprobs_seen = 0  # the generated tokens whose log probabilities went out (or wait in pending)
    pending: list[TokenLogprob] = []  # those no message delta has carried yet
    try:
        yield items.event("response.created", response=envelope.body("in_progress", []))
        yield items.event("response.in_progress", response=envelope.body("in_progress", []))
        try:
            async for ev in stream:
                if ev.output.finished:
                    metrics.observe(ev)
                    break
                thought, piece = text.pieces(ev)
                if envelope.texts is not None and ev.output.logprobs:
                    pending += ev.output.logprobs[logprobs_seen:]
                    logprobs_seen = len(ev.output.logprobs)
                for kind, part in (("reasoning", thought), ("message", piece)):
                    if part:
                        for frame in items.text(kind, part, pending if kind == "message" else ()):
                            yield frame
                        if kind == "message":
                            pending = []
                if calls_stream is not None:
                    for call in calls_stream.feed(text.content):
                        for frame in items.call_piece(call):
                            yield frame
        except Exception as exc:  # noqa: BLE001 - the request failed: say so, then end the stream
            yield error_event(exc, items.seq)
            items.seq += 1
            # NOTE: and the response's own end, status failed with its error (the spec's
            # response.failed), which clients that wait for a terminal response event read
            err = failed_request_error(exc)
            body = envelope.body("failed", items.output)
            body["error"] = {"code": err.code if err.status < 500 and err.code else "server_error",
                             "message": str(exc) or type(exc).__name__}
            if on_failed is not None:
                on_failed(body)
            yield items.event("response.failed", response=body)
            return
        final = stream.final
        assert final is not None
        turn, owed, streamed, thought, content = finished_reply(stream, final, text, calls_stream)
        if envelope.texts is not None and final.output.logprobs:
            pending += final.output.logprobs[logprobs_seen:]
        calls = turn.parsed.tool_calls
        frames = items.text("reasoning", thought) if thought else []
        if turn.parsed.reasoning is not None and items.open is None and not items.output:
            frames += items.text("reasoning", "")  # NOTE: an empty thinking block is still an item
        if streamed:
            # NOTE: the calls streamed as written end first; text after them is a message of
            # its own
            for call in owed:
                frames += items.call_piece(call)
            refused = calls_stream.refused_ids(calls) if calls_stream is not None else set()
            for item in [*items.output, *([items.open] if items.open else [])]:
                if item["type"] == "function_call" and item["call_id"] in refused:
                    # NOTE: sent as a call, but no call the reply made (cut off, malformed): the
                    # response says so, and its chain leaves it out (its arguments may not be JSON)
                    item["status"] = "incomplete"
            if content:
                frames += items.text("message", content, pending)
                pending = []
        else:
            if text.sent or content or not (calls or items.output or items.open):
                frames += items.text("message", content, pending)
                pending = []
            for call in owed:
                frames += items.call_piece(call)
        # NOTE: the tokens no delta carried (a stop token's) are the open message's all the same
        items.add_logprobs(pending)
        frames += items.close("incomplete" if "length" in (turn.finish_reason, final.output.finish_reason)
                              else "completed")
        for frame in frames:
            yield frame
        body = envelope.body("completed", items.output, final, turn.finish_reason)
        keep(body)
        yield items.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                          response=body)
    finally:
        if stream.final is None:
            metrics.count_abort(stream.last)
            stream.abort()


__all__ = ["ResponseEnvelope", "call_items", "error_event", "final_output", "message_item", "reasoning_item",
           "response_events", "text_logprobs", "usage"]
