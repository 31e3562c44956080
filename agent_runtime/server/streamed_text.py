"""What of a reply's text a stream may send, and what a finished stream still owes: text held
back while it may be part of a character or a tool call's markup (:func:`safe_text_len`), a
reply's thinking and content sent so far (:class:`StreamedText`), and the rest of a finished
reply on the routes whose calls are blocks or items of their own (:func:`finished_reply`)."""

from __future__ import annotations

import re
from typing import NamedTuple

from agent_runtime.output_processor import build_turn
from agent_runtime.reasoning import reply_content, stream_split
from agent_runtime.request_stream import RequestStream
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.json_scan import arguments_span
from asymcache_core.llama3_calls import Llama3JsonHold
from asymcache_core.tool_call_stream import CallPiece, HermesCallStream, final_pieces
from asymcache_core.tool_parsing import CALL_HEADER_RE, parse_hermes

_TOOL_OPEN = "<tool_call>"
_TOOL_CLOSE = "</tool_call>"
_BLANKS = re.compile(r"\s*")


def safe_text_len(text: str, hold_tool_tag: bool, call_format: str = "hermes",
                  hold: Llama3JsonHold | None = None) -> int:
    """How much of ``text`` may be streamed as content now.

    Holds back a trailing replacement character (an incomplete UTF-8 sequence the next token
    completes) and, when tool calls are possible, everything from a ``<tool_call>`` tag on (or
    a trailing piece that may become one), which goes out as ``tool_calls`` instead (a Hermes call
    as it is written, others at the end).
    In Llama's ``llama3_json`` format, the text from the first ``{`` on while the reply may
    still be calls (:class:`~asymcache_core.llama3_calls.Llama3JsonHold`; a stream keeps one).

    Args:
        text: the text generated so far.
        hold_tool_tag: tool calls are possible in this reply.
        call_format: the runtime's tool-call format.
        hold: the reply's llama3_json hold, read on as the text grows (None: a fresh one).

    Returns:
        The length of the prefix that is safe to send.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    if hold_tool_tag and call_format == "llama3_json":
        return (hold or Llama3JsonHold()).safe_len(text, end)
    if hold_tool_tag:
        at = text.find(_TOOL_OPEN)
        if at >= 0:
            return min(end, at)
        for k in range(min(len(_TOOL_OPEN) - 1, end), 0, -1):
            if _TOOL_OPEN.startswith(text[end - k : end]):
                return end - k
    return end


def unparsed_call_start(text: str) -> int | None:
    """Where the first Hermes call the parse did not take begins: a ``<tool_call>`` with
    nothing after it, one whose JSON value never closes (the length limit or a stop cut it) and
    no closing tag follows, or one whose value opens with a call's head (``{"name": "...",
    "arguments": {``) that the parse refused (malformed JSON after the head, something else
    before its closing tag). A stream announces a call at its head and holds text from its tag
    on: such markup is never its content (vLLM's streamed replies send none), so the
    non-streamed reply leaves it out too. A tag followed by anything else (prose naming the
    tag, a closed value that is no call) is text.

    Args:
        text: the reply's text (past any thinking), or its parsed content.

    Returns:
        The index of the call's tag, or None when the text holds no such call.
    """
    search = 0
    while (at := text.find(_TOOL_OPEN, search)) >= 0:
        start = _BLANKS.match(text, at + len(_TOOL_OPEN)).end()  # type: ignore[union-attr]
        if start == len(text):
            return at
        if text[start] not in "{[":
            search = start
            continue
        head = CALL_HEADER_RE.match(text, at + len(_TOOL_OPEN)) is not None
        end = arguments_span(text, start)
        if end is None:
            # NOTE: a closing tag after a value that never closes: malformed, text unless its
            # head was announced
            return at if head or _TOOL_CLOSE not in text[start:] else None
        if head and not _taken(text, at, end):
            return at
        search = end
    return None


def _taken(text: str, at: int, end: int) -> bool:
    """Whether the parse takes the call whose tag is at ``at`` and whose value ends at ``end``
    (:func:`~asymcache_core.tool_parsing.parse_hermes`'s rule: a call, then its closing tag, the
    next call's tag, or the reply's end)."""
    tail = text[_BLANKS.match(text, end).end() :]  # type: ignore[union-attr]
    if not (tail.startswith((_TOOL_CLOSE, _TOOL_OPEN)) or _TOOL_CLOSE.startswith(tail)):
        return False
    return bool(parse_hermes(text[at:end]).tool_calls)


def without_cut_off_call(text: str, hit_length: bool, tools_possible: bool, call_format: str = "hermes") -> str:
    """A finished reply's text less a tool call that was cut off or refused: the text its stream
    sent (the call itself went out as call pieces, or not at all). When the reply hit its
    length limit, the text stops before the first tag left in it (or a trailing piece of one,
    such as ``<tool_call`` after complete calls); a Hermes call the parse did not take
    (:func:`unparsed_call_start`) is taken out with what follows it, whatever stopped the reply.
    vLLM's streamed replies send no such markup as content either.

    Args:
        text: the reply's text (past any thinking), or its parsed content.
        hit_length: the engine finished the reply at its length limit (its own finish reason:
            the turn's is ``tool_calls`` once a call is complete).
        tools_possible: tool calls were possible in the reply.
        call_format: the runtime's tool-call format.

    Returns:
        The text, cut before an unfinished or refused call.
    """
    if not tools_possible:
        return text
    if hit_length:
        text = text[: safe_text_len(text, True, call_format)]
    if call_format in ("hermes", "auto"):
        at = unparsed_call_start(text)
        if at is not None:
            text = text[:at]
    return text


class StreamedText:
    """What of a one-choice reply went out, streamed in pieces: its thinking (with a reasoning
    parser) and its content, each piece held back while it may be part of a character, a
    ``</think>`` or a tool call (:func:`safe_text_len`); at the end, what is still owed. Chat
    chunks (:class:`ChatChunks`) send both; the Responses and Messages routes, which stream
    calls as items of their own and do not return the thinking, send the content.

    Args:
        tools_possible: tool calls are possible in this reply (what may become one is held).
        call_format: the runtime's tool-call format.
        reasoning_parser: the reasoning parser that reads this reply (None: everything is
            content; see :func:`~agent_runtime.reasoning.reply_parser`).
    """

    def __init__(self, tools_possible: bool, call_format: str = "hermes", reasoning_parser: str | None = None) -> None:
        self.tools_possible = tools_possible
        self.call_format = call_format
        self.reasoning_parser = reasoning_parser
        #: the content sent so far
        self.sent = ""
        self.reasoning_sent = 0
        #: the reply's content so far (past its thinking), as the last :meth:`pieces` read it
        self.content = ""
        #: a Llama reply's calls, read as it grows (what of it is held)
        self.hold = Llama3JsonHold() if tools_possible and call_format == "llama3_json" else None

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(thinking that may go out, content)`` of the reply so far: the content is empty
        while the thinking block is open, and everything without a parser."""
        if self.reasoning_parser is None:
            return "", text
        reasoning, start = stream_split(text, self.reasoning_parser, final)
        return reasoning or "", "" if start is None else reply_content(text, start, self.reasoning_parser, final)

    def pieces(self, event: StreamEvent) -> tuple[str, str]:
        """``(thinking, content)`` of a running reply's ``event`` safe to send now and not sent
        yet (marked sent)."""
        reasoning, text = self.split(event.output.text, False)
        self.content = text
        thought = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        upto = safe_text_len(text, self.tools_possible, self.call_format, self.hold)
        if upto <= len(self.sent):
            return thought, ""
        piece, self.sent = text[len(self.sent) : upto], text[:upto]
        return thought, piece

    def piece(self, event: StreamEvent) -> str:
        """The content of ``event`` safe to send now and not sent yet (marked sent)."""
        return self.pieces(event)[1]

    def full(self, turn: AssistantTurn, final: StreamEvent) -> str:
        """The whole content of the finished reply: the text after any thinking as generated,
        or with tool calls the parsed content (the text before the first), its head as it was sent."""
        if turn.parsed.tool_calls:
            content = turn.parsed.content or ""
            # NOTE: the content is stripped; what went out before the first call may end in
            # the blank before its tag
            for head in (self.sent, self.sent.rstrip()):
                if content.startswith(head):
                    return self.sent + content[len(head) :]
            return self.sent
        return self.split(final.output.text, True)[1]

    def rest_without_cut_off_call(self, turn: AssistantTurn, final: StreamEvent) -> tuple[str, str]:
        """:meth:`rest`, less a tool call that was cut off (see :func:`without_cut_off_call`:
        the chat, Messages and Responses routes)."""
        before = self.sent
        thought, rest = self.rest(turn, final)
        kept = without_cut_off_call(before + rest, final.output.finish_reason == "length", self.tools_possible,
                                    self.call_format)
        rest = kept[len(before) :] if kept.startswith(before) else ""
        self.sent = before + rest
        return thought, rest

    def rest(self, turn: AssistantTurn, final: StreamEvent) -> tuple[str, str]:
        """``(thinking, content)`` the finished reply still owes (marked sent)."""
        reasoning = self.split(final.output.text, True)[0]
        thought, self.reasoning_sent = reasoning[self.reasoning_sent :], max(self.reasoning_sent, len(reasoning))
        full = self.full(turn, final)
        content, self.sent = full[len(self.sent) :] if full.startswith(self.sent) else "", full
        return thought, content


class FinishedReply(NamedTuple):
    """What a finished streamed reply still owes, on a route whose calls are blocks or items of
    their own (Messages, Responses).

    Attributes:
        turn: the finished turn.
        owed: the pieces of its calls still to send (:func:`final_pieces`).
        streamed: its calls went out as they were written (their text is not text too).
        thought: thinking still to send.
        text: text still to send (a call the length limit cut off taken out).
    """

    turn: AssistantTurn
    owed: list[CallPiece]
    streamed: bool
    thought: str
    text: str


def finished_reply(stream: RequestStream, final: StreamEvent, text: StreamedText,
                   calls: HermesCallStream | None) -> FinishedReply:
    """What the finished reply of ``stream`` still owes (marks it sent).

    Args:
        stream: the request's stream.
        final: its final event.
        text: what of its text went out.
        calls: its calls streamed as written, if they are.

    Returns:
        The reply's rest.
    """
    turn = build_turn(stream, final)
    owed = final_pieces(calls, text.split(final.output.text, True)[1], turn.parsed.tool_calls)
    thought, rest = text.rest_without_cut_off_call(turn, final)
    return FinishedReply(turn, owed, calls is not None and bool(calls.calls), thought, rest)


__all__ = ["FinishedReply", "StreamedText", "finished_reply", "safe_text_len", "unparsed_call_start", "without_cut_off_call"]
