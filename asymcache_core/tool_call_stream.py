"""Hermes tool calls read off a reply while it is generated, for streams that send a call's
arguments as they come (OpenAI's ``tool_calls`` deltas, vLLM's streaming tool parsers).

A call is announced (its index, a fresh id and its name) once its head is complete
(``<tool_call>`` then ``{"name": "...", "arguments": {``); its arguments' text then streams as
the model writes it, up to the arguments object's closing brace (:func:`arguments_span`), so
what was sent is exactly the text the finished reply's parse keeps
(:attr:`~asymcache_core.tool_parsing.ParsedToolCall.raw_arguments`): a stream and the
non-streamed reply carry the same string. A call written otherwise (arguments first, a list of
calls) stops the incremental stream: it and the calls after it are sent whole at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asymcache_core.tool_parsing import CALL_HEADER_RE, ParsedToolCall, arguments_span, new_call_id

_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
#: How far past its tag a call's head may run before the stream gives up waiting for it.
_MAX_HEAD_CHARS = 512


@dataclass(frozen=True)
class CallPiece:
    """One streamed piece of a tool call.

    Attributes:
        index: the call's place in the reply.
        id: its id, on its first piece only.
        name: its name, on its first piece only.
        arguments: more of its arguments' JSON text.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class _OpenCall:
    id: str
    name: str
    args_start: int  # where its arguments' text starts in the reply
    sent: str = ""  # the arguments' text sent so far
    closed: bool = False  # its arguments object ended


class HermesCallStream:
    """The Hermes calls of one growing reply (one instance per reply).

    Args:
        max_calls: calls the reply keeps (OpenAI's ``parallel_tool_calls: false`` is 1; None:
            all): the ones past it are not streamed.
        make_id: id factory.
    """

    def __init__(self, max_calls: int | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        self.max_calls = max_calls
        self.make_id = make_id
        self.calls: list[_OpenCall] = []
        self._scan_from = 0
        #: a call the stream cannot follow came: the rest go whole at the end
        self.stopped = False

    def feed(self, text: str) -> list[CallPiece]:
        """The pieces ``text`` (the reply so far, past any thinking) adds.

        Args:
            text: the reply's text so far (each call gets a longer one).

        Returns:
            New pieces, in order.
        """
        pieces: list[CallPiece] = []
        while not self.stopped:
            if self.calls and not self.calls[-1].closed:
                call = self.calls[-1]
                end = arguments_span(text, call.args_start)
                upto = len(text) if end is None else end
                # NOTE: a trailing replacement character is a split UTF-8 sequence: the next
                # token completes it
                while end is None and upto > call.args_start and text[upto - 1] == "\ufffd":
                    upto -= 1
                more = text[call.args_start + len(call.sent) : upto]
                if more:
                    call.sent += more
                    pieces.append(CallPiece(len(self.calls) - 1, None, None, more))
                if end is None:
                    break
                call.closed, self._scan_from = True, end
                continue
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break
            at = text.find(_OPEN_TAG, self._scan_from)
            if at < 0:
                break
            head = CALL_HEADER_RE.match(text, at + len(_OPEN_TAG))
            if head is None:
                tail = text[at + len(_OPEN_TAG) :]
                if _CLOSE_TAG in tail or len(tail) > _MAX_HEAD_CHARS:
                    self.stopped = True  # not a head this stream reads: the rest go whole
                break
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                self.stopped = True
                break
            self.calls.append(_OpenCall(self.make_id(), name, head.end()))
            pieces.append(CallPiece(len(self.calls) - 1, self.calls[-1].id, name, ""))
        return pieces

    def finish(self, text: str, parsed: Sequence[ParsedToolCall]) -> list[CallPiece]:
        """The pieces still owed once the reply is done.

        Args:
            text: the whole reply (past any thinking).
            parsed: its calls as the finished reply's parse found them.

        Returns:
            The rest of each streamed call's arguments, then the calls not streamed, whole.
        """
        pieces = self.feed(text)
        for index, call in enumerate(parsed):
            if index < len(self.calls):
                continue  # NOTE: streamed: its text is the parse's raw_arguments
            pieces.append(CallPiece(index, call.id, call.name, call.arguments_json()))
        return pieces

    def streamed_ids(self) -> list[str]:
        """The ids the stream gave its calls, in order."""
        return [call.id for call in self.calls]


def final_pieces(stream: HermesCallStream | None, text: str, parsed: Sequence[ParsedToolCall]) -> list[CallPiece]:
    """What a finished reply's stream still owes of its calls.

    Args:
        stream: the reply's call stream (None: its calls were not streamed as written).
        text: the whole reply (past any thinking).
        parsed: its calls as the finished reply's parse found them.

    Returns:
        :meth:`HermesCallStream.finish`'s pieces, or without a stream every call whole.
    """
    if stream is None:
        return [CallPiece(i, c.id, c.name, c.arguments_json()) for i, c in enumerate(parsed)]
    return stream.finish(text, parsed)


__all__ = ["CallPiece", "HermesCallStream", "final_pieces"]
