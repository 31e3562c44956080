"""Hermes tool calls read off a reply while it is generated, for streams that send a call's
arguments as they come (OpenAI's ``tool_calls`` deltas, vLLM's streaming tool parsers).

A call is announced (its index, a fresh id and its name) once its head is complete
(``<tool_call>`` then ``{"name": "...", "arguments": {``); its arguments' text then streams as
the model writes it, up to the arguments object's closing brace (read once, as the text grows:
:class:`~asymcache_core.json_scan.ObjectScan`), so
what was sent is exactly the text the finished reply's parse keeps
(:attr:`~asymcache_core.tool_parsing.ParsedToolCall.raw_arguments`; the parse reads calls by the
same rule, :func:`~asymcache_core.tool_parsing.parse_hermes`): a stream and the non-streamed
reply carry the same string. A call written otherwise (arguments first, a list of calls) stops
the incremental stream: it and the calls after it are sent whole at the end. A call whose head
was announced but whose object the parse refuses (malformed, cut off) cannot be taken back: it
stays as sent, and the parsed calls after it follow at the next indexes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asymcache_core.json_scan import ObjectScan
from asymcache_core.tool_parsing import CALL_HEADER_RE, ParsedToolCall, new_call_id

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
    scan: ObjectScan  # its arguments read so far (each event reads only the new text)
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
                # NOTE: a trailing replacement character is a split UTF-8 sequence: the next
                # token completes it (and may change the text's length there): read up to it
                ready = len(text)
                while ready > call.args_start and text[ready - 1] == "\ufffd":
                    ready -= 1
                end = call.scan.end(text, ready)
                upto = ready if end is None else end
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
                # NOTE: the text only grows: the next search starts where a tag could still begin
                self._scan_from = max(self._scan_from, len(text) - len(_OPEN_TAG) + 1)
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
            self.calls.append(_OpenCall(self.make_id(), name, head.end(), ObjectScan(head.end())))
            pieces.append(CallPiece(len(self.calls) - 1, self.calls[-1].id, name, ""))
        return pieces

    def finish(self, text: str, parsed: Sequence[ParsedToolCall]) -> list[CallPiece]:
        """The pieces still owed once the reply is done.

        Args:
            text: the whole reply (past any thinking).
            parsed: its calls as the finished reply's parse found them.

        Returns:
            The rest of each streamed call's arguments, then the parsed calls the stream did not
            send (whole, at the next free indexes).
        """
        pieces = self.feed(text)
        index = len(self.calls)
        for call, streamed in zip(parsed, self._match(parsed), strict=True):
            if streamed is None:
                pieces.append(CallPiece(index, call.id, call.name, call.arguments_json()))
                index += 1
        return pieces

    def refused_ids(self, parsed: Sequence[ParsedToolCall]) -> set[str]:
        """The ids of the streamed calls the finished reply's parse has no call for (a malformed
        object, a call cut off): sent, and not calls a client can run."""
        matched = {k for k in self._match(parsed) if k is not None}
        return {call.id for k, call in enumerate(self.calls) if k not in matched}

    def _match(self, parsed: Sequence[ParsedToolCall]) -> list[int | None]:
        """The streamed call each parsed call is, in order (None: not streamed)."""
        # NOTE: a parsed call is the streamed one it matches in order (its name, and its
        # arguments' text as sent); a streamed call the parse refused (a malformed object the
        # head had announced) matches none, and cannot be taken back
        out: list[int | None] = []
        nxt = 0
        for call in parsed:
            found = next((k for k in range(nxt, len(self.calls)) if self._sent_as(self.calls[k], call)), None)
            if found is not None:
                nxt = found + 1
            out.append(found)
        return out

    @staticmethod
    def _sent_as(sent: _OpenCall, call: ParsedToolCall) -> bool:
        return sent.closed and sent.name == call.name and sent.sent == call.arguments_json()

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


def merged_pieces(pieces: Sequence[CallPiece]) -> list[CallPiece]:
    """``pieces`` with each call's pieces joined into one, in the order the calls first appear.

    NOTE: an OpenAI stream chunk carries at most one entry a call (clients rebuild a call from
    ``delta.tool_calls[i]`` by its index, and many read only the first entry of an index);
    one event can hold a call's opening piece and the first of its arguments.

    Args:
        pieces: what :meth:`HermesCallStream.feed` or :func:`final_pieces` gave.

    Returns:
        One piece a call: its first id and name, and its arguments' pieces joined in order.
    """
    merged: dict[int, CallPiece] = {}
    for piece in pieces:
        first = merged.get(piece.index)
        if first is None:
            merged[piece.index] = piece
        else:
            merged[piece.index] = CallPiece(
                piece.index, first.id or piece.id, first.name or piece.name, first.arguments + piece.arguments
            )
    return list(merged.values())
