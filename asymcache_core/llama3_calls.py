"""Llama 3.1+'s native tool calls (vLLM 0.32's ``llama3_json`` parser,
``vllm/tool_parsers/llama_tool_parser.py``): bare ``{"name": ..., "parameters": {...}}`` objects,
read out of a finished reply (:func:`parse_llama3_json`), written back
(:func:`render_llama3_json_tool_calls`), and held back from a stream's content while they may
be one (:class:`Llama3JsonHold`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from asymcache_core.json_scan import ObjectScan
from asymcache_core.tool_parsing import ParsedMessage, ParsedToolCall, _tidy, new_call_id

PYTHON_TAG = "<|python_tag|>"
_BLANKS = re.compile(r"\s*")


def llama3_call_of(obj: Any) -> tuple[str, Any] | None:
    """A decoded JSON value as vLLM 0.32's ``llama3_json`` parser reads a call
    (``Llama3JsonToolParser.extract_tool_calls``): an object with a ``name`` string and an
    ``arguments`` key, else a ``parameters`` key, holding any JSON value.

    Args:
        obj: decoded JSON.

    Returns:
        ``(name, arguments value)``, or None when it is no call (which makes the whole reply
        text).
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    # NOTE: an empty name is no call here, as in the Hermes parse (vLLM's non-streamed parse
    # would take it; its streamed ones never announce it)
    if not isinstance(name, str) or not name or not ("arguments" in obj or "parameters" in obj):
        return None
    return name, obj["arguments"] if "arguments" in obj else obj["parameters"]


def llama3_content_end(text: str, at: int) -> int:
    """Where the text that leads a Llama reply's first call (its ``{`` at ``at``) ends: before
    the blanks, opening ``[`` and ``<|python_tag|>`` that precede it.

    Args:
        text: the reply.
        at: the index of the first call's ``{`` (or the end of the text so far).

    Returns:
        The index.
    """
    i, before = at, -1
    while i != before:
        before = i
        while i and text[i - 1].isspace():
            i -= 1
        if i and text[i - 1] == "[":
            i -= 1
        elif i >= len(PYTHON_TAG) and text.startswith(PYTHON_TAG, i - len(PYTHON_TAG)):
            i -= len(PYTHON_TAG)
    return i


def parse_llama3_json(text: str, make_id: Callable[[], str] = new_call_id) -> ParsedMessage:
    """Parse Llama 3.1+'s JSON calls as vLLM 0.32's ``llama3_json`` parser does
    (``Llama3JsonToolParser.extract_tool_calls``): every ``{`` outside a call opens a JSON object
    that must be a call (:func:`llama3_call_of`: ``{"name", "parameters"}`` or ``arguments``),
    anywhere in the reply; what lies between them (``;``, blanks, a ``[``, prose) is not read.
    A ``{`` that opens no JSON object, or an object that is no call, makes the whole reply text.

    Args:
        text: model output.
        make_id: id factory.

    Returns:
        With calls, the calls (their arguments' text is vLLM's, ``json.dumps`` of the value) and
        as content the text before the first (less a ``<|python_tag|>`` or ``[`` leading it);
        vLLM's content is then empty, but its stream sends that text as content before a call
        starts, and a stream here sends it too (:class:`~asymcache_core.tool_call_stream.Llama3JsonHold`).
        Without, no call and the text as written (vLLM's content).
    """
    decoder = json.JSONDecoder()
    found: list[tuple[str, Any]] = []
    pos = 0
    while (at := text.find("{", pos)) >= 0:
        try:
            obj, pos = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return ParsedMessage(text, [])
        call = llama3_call_of(obj)
        if call is None:
            return ParsedMessage(text, [])
        found.append(call)
        # NOTE: vLLM skips a "{" right at a call's end (its ``start_index <= end_index``): a
        # call written straight after another is read from its next "{" (its arguments: no call)
        pos += 1
    if not found:
        return ParsedMessage(text, [])
    calls = []
    for name, value in found:
        if isinstance(value, str):  # NOTE: the runtime's own use reads arguments sent as JSON text
            try:
                value_obj = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                value_obj = None
        else:
            value_obj = value
        args = value_obj if isinstance(value_obj, dict) else {}
        calls.append(ParsedToolCall(make_id(), name, args, json.dumps(value, ensure_ascii=False)))
    return ParsedMessage(_tidy([text[: llama3_content_end(text, text.find("{"))]]), calls)


def render_llama3_json_tool_calls(calls: Sequence[ParsedToolCall]) -> str:
    """Calls as Llama 3.1+ writes them (what :func:`parse_llama3_json` reads).

    Args:
        calls: the calls.

    Returns:
        ``{"name": ..., "parameters": {...}}`` objects joined by ``; ``.
    """
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)




class Llama3JsonHold:
    """How much of a growing ``llama3_json`` reply may go out as content, so that what a stream
    sends is the content :func:`parse_llama3_json` finds in the finished reply (one instance per
    reply; the text only grows, and each call reads only its new part).

    The text before the first ``{`` (or a ``<|python_tag|>``/``[`` leading it) goes out as it
    comes: vLLM's stream sends that text as content too, before it knows whether a call follows.
    From that ``{`` on, the text is held while the reply may still be calls; once a ``{`` opens
    no call (not JSON, or a complete object that is not a call) the reply is text whatever
    follows (the parse's rule), and all of it may go out. Held text that turns out to be calls
    is never content; the calls go out whole when the reply ends (a later ``{`` could still
    make the whole reply text).
    """

    def __init__(self) -> None:
        #: where the held text starts, once a ``{`` came
        self.first: int | None = None
        #: the reply is text: nothing is held any more
        self.plain = False
        self._search = 0  # where the next "{" is looked for
        self._value: int | None = None  # the "{" of the value being read
        self._scan = ObjectScan(0)

    def safe_len(self, text: str, end: int) -> int:
        """The length of the prefix of ``text`` that may be sent now.

        Args:
            text: the reply so far (past any thinking).
            end: read no further than this (a split character at the end is not read).

        Returns:
            The length.
        """
        while not self.plain:
            if self._value is None:
                at = text.find("{", self._search, end)
                if at < 0:
                    self._search = max(self._search, end)
                    break
                if self.first is None:
                    self.first = llama3_content_end(text, at)
                self._value, self._scan = at, ObjectScan(at)
            lead = _BLANKS.match(text, self._value + 1, end).end()  # type: ignore[union-attr]
            if lead < end and text[lead] not in '"}':
                self.plain = True  # NOTE: no JSON object opens so: the parse makes it text
                break
            close = self._scan.end(text, end)
            if close is None:
                break
            try:
                call = llama3_call_of(json.loads(text[self._value : close]))
            except (json.JSONDecodeError, RecursionError):
                call = None
            if call is None:
                self.plain = True
                break
            self._value, self._search = None, close + 1  # NOTE: as the parse reads on
        if self.plain:
            return end
        if self.first is not None:
            return min(end, self.first)
        # NOTE: a trailing piece that may still lead a call (blanks, "[", a python tag or a
        # piece of one) is held until the next text shows what it is
        k = next((k for k in range(min(len(PYTHON_TAG) - 1, end), 0, -1)
                  if PYTHON_TAG.startswith(text[end - k : end])), 0)
        return llama3_content_end(text, end - k)


__all__ = ["PYTHON_TAG", "Llama3JsonHold", "llama3_call_of", "llama3_content_end", "parse_llama3_json",
           "render_llama3_json_tool_calls"]
