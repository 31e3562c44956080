"""Reasoning models' thinking, split from the reply (vLLM's ``--reasoning-parser``).

Two parsers, as vLLM 0.32 names them:

* ``deepseek_r1``: everything before ``</think>`` is reasoning (a leading ``<think>`` is
  dropped; DeepSeek-R1's template opens the block in the prompt, so the model may write only
  the end). A reply that never closes the block (cut by the length limit) is all reasoning.
* ``qwen3`` (vLLM's ``Qwen3Parser`` state machine, ``vllm/parser/qwen3.py``): the reply
  starts in its thinking when the chat template's ``enable_thinking`` is on (the default:
  Qwen3-*-Thinking-2507 templates write ``<think>`` into the prompt, so the reply has only
  ``</think>``); every ``<think>`` inside the thinking is dropped; ``</think>`` ends it, and so
  does a ``<tool_call>`` (the call stays in the content, for the tool parser); a further
  ``</think>`` in the content is dropped. With ``enable_thinking`` off the whole reply is
  content, as generated (:func:`reply_parser` gives no parser then).

The content after the block is what tool calls are parsed from and what the chat returns as
``content``; the reasoning goes in ``reasoning_content``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

ReasoningParser = Literal["deepseek_r1", "qwen3"]
#: The parsers a runtime takes.
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: What ends a ``qwen3`` reply's thinking without ``</think>``: a tool call written straight away.
TOOL_OPEN = "<tool_call>"
_BLANKS = re.compile(r"\s*")
_QWEN3_TAGS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN)
#: What ends each parser's thinking: ``(tag, implicit)``, implicit when the tag is the content's
#: first text (a ``qwen3`` tool call), else the content starts after it (:func:`stream_split`'s
#: start: the first of them in the reply).
REASONING_ENDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "deepseek_r1": ((THINK_CLOSE, False),),
    "qwen3": ((THINK_CLOSE, False), (TOOL_OPEN, True)),
}


def reply_parser(parser: str | None, chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
    """The reasoning parser that reads one reply, given the chat template variables it was
    rendered with (the runtime's defaults under the request's own).

    NOTE: vLLM's ``Qwen3Parser`` reads ``chat_template_kwargs["enable_thinking"]`` (default
    on) per request: off, the reply is all content and none of it counts as reasoning, which
    is what no parser does here. ``deepseek_r1`` reads every reply the same.

    Args:
        parser: the runtime's reasoning parser (None: none).
        chat_template_kwargs: the template variables of the request.

    Returns:
        The parser to split this reply with (None: all content).
    """
    if parser == "qwen3" and not (chat_template_kwargs or {}).get("enable_thinking", True):
        return None
    return parser


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """A finished reply's ``(reasoning, content)``.

    Args:
        text: the reply as generated.
        parser: ``deepseek_r1`` or ``qwen3``.

    Returns:
        The reasoning (None when the reply has none) and the content after it.
    """
    reasoning, start = stream_split(text, parser, final=True)
    if parser == "qwen3":
        # NOTE: vLLM's engine returns no reasoning for an empty block (``raw_reasoning or None``)
        return reasoning or None, "" if start is None else reply_content(text, start, parser, final=True)
    if start is None:
        return reasoning, ""
    if start == 0:
        return None, text
    return reasoning, text[start:]


def reply_content(text: str, start: int, parser: str, final: bool) -> str:
    """The content of a reply whose content starts at ``start`` (:func:`stream_split`).

    Args:
        text: the reply so far.
        start: where its content starts.
        parser: ``deepseek_r1`` or ``qwen3``.
        final: the reply is finished.

    Returns:
        The text from ``start``; with ``qwen3`` less every ``</think>`` (vLLM's
        ``qwen3_config`` drops a duplicate one in the content) and, while not final, less a
        trailing piece that may become one.
    """
    if parser != "qwen3":
        return text[start:]
    # NOTE: held back on the text as generated: a tag taken out may join what is around it
    # into a new piece of one, which the stream must not send and take back
    end = len(text) if final else len(text) - _held(text, len(text), (THINK_CLOSE,))
    content = text[start:end]
    return content.replace(THINK_CLOSE, "") if THINK_CLOSE in content else content


def _held(text: str, end: int, tags: Sequence[str], begin: int = 0) -> int:
    """How many trailing characters of ``text[begin:end]`` may be the start of one of ``tags``."""
    for k in range(min(max(map(len, tags)) - 1, end - begin), 0, -1):
        tail = text[end - k : end]
        if any(tag.startswith(tail) for tag in tags):
            return k
    return 0


def _sendable_end(text: str, begin: int, tags: Sequence[str]) -> int:
    """Where the part of ``text[begin:]`` that may be streamed now ends: before a trailing
    undecoded byte (``\ufffd``) and a trailing piece that may become one of ``tags``."""
    end = len(text)
    while end > begin and text[end - 1] == "\ufffd":
        end -= 1
    return end - _held(text, end, tags, begin)


def _qwen3_split(text: str, final: bool) -> tuple[str, int | None]:
    """:func:`stream_split` for ``qwen3`` with thinking on: the reply starts in its thinking."""
    close, call = text.find(THINK_CLOSE), text.find(TOOL_OPEN)
    if close >= 0 and (call < 0 or close < call):
        end, start = close, close + len(THINK_CLOSE)
    elif call >= 0:
        end = start = call  # NOTE: the call is content, parsed as a call (vLLM: implicit end)
    else:
        end, start = (len(text) if final else _sendable_end(text, 0, _QWEN3_TAGS)), None
    reasoning = text[:end]
    if THINK_OPEN in reasoning:
        reasoning = reasoning.replace(THINK_OPEN, "")  # NOTE: vLLM absorbs <think> while reasoning
    return reasoning, start


def stream_split(text: str, parser: str, final: bool = False) -> tuple[str | None, int | None]:
    """What of a reply generated so far is reasoning, and where its content starts.

    Args:
        text: the reply so far.
        parser: ``deepseek_r1`` or ``qwen3`` (with thinking on: :func:`reply_parser`).
        final: the reply is finished (nothing is held back for the tokens to come).

    Returns:
        ``(reasoning, content_start)``: the reasoning that may be sent now (a trailing piece
        that may become ``</think>`` and a start that may become ``<think>`` are held back
        while not final; with ``qwen3`` also one that may become ``<think>`` or
        ``<tool_call>``, and every ``<think>`` is taken out), and the index where the content
        starts (None while the block is still open). The content is
        :func:`reply_content` from there.
    """
    # NOTE: called on every streamed event of the reply: no copy of the text (a long thinking
    # block would be copied once a token)
    if parser == "qwen3":
        return _qwen3_split(text, final)
    offset = _BLANKS.match(text).end()  # type: ignore[union-attr]
    opened = text.startswith(THINK_OPEN, offset)
    lead = text[offset : offset + len(THINK_OPEN)]
    if not opened and not final and len(text) - offset < len(THINK_OPEN) and THINK_OPEN.startswith(lead):
        return "", None  # may still become "<think>"
    begin = offset + len(THINK_OPEN) if opened else 0
    end = text.find(THINK_CLOSE, begin)
    if end >= 0:
        return text[begin:end], end + len(THINK_CLOSE)
    upto = len(text) if final else _sendable_end(text, begin, (THINK_CLOSE,))
    return text[begin:upto], None


class ReasoningCount:
    """How many of one reply's tokens are its thinking, as vLLM 0.32 reports them in
    ``completion_tokens_details.reasoning_tokens`` (chat) and
    ``output_tokens_details.reasoning_tokens`` (Responses): the tokens of the thinking block,
    its ``<think>`` and ``</think>`` tokens left out (vLLM's reasoning parsers'
    ``count_reasoning_tokens``: ``BaseThinkingReasoningParser``'s span counter, the qwen3
    parser engine's reasoning chunks). The block is the span :func:`stream_split` reads: with
    ``qwen3`` the reply's tokens from its first up to ``</think>`` or a ``<tool_call>``
    (none with thinking off: give the parser :func:`reply_parser` returns).

    NOTE: vLLM's ``deepseek_r1`` counter opens the block only on a generated ``<think>``, so a
    block opened by the chat template counts 0 there; here it counts as the split reads it
    (the fix of vllm-project/vllm#49743): the reasoning sent is the reasoning counted.

    NOTE: one per reply; it may be asked again as the reply grows (``continuous_usage_stats``
    chunks): the marker tokens are looked up once per token id and once the block is closed its
    count is kept.

    Args:
        parser: the reasoning parser (None: no thinking, 0).
        decode: the tokenizer's decode (None: unknown, 0).
        markers: a cache of which token ids are ``<think>`` or ``</think>``, shared by the
            replies of one tokenizer.
    """

    def __init__(self, parser: str | None, decode: Callable[[Sequence[int]], str] | None,
                 markers: dict[int, bool] | None = None) -> None:
        self._parser, self._decode = parser, decode
        self._markers: dict[int, bool] = {} if markers is None else markers
        self._scanned = 0  # leading tokens whose markers are counted in _marks
        self._marks = 0
        self._closed: int | None = None
        self._ids: Sequence[int] = ()

    def _is_marker(self, token_id: int) -> bool:
        known = self._markers.get(token_id)
        if known is None:
            known = self._markers[token_id] = self._decode([token_id]) in (THINK_OPEN, THINK_CLOSE)  # type: ignore[misc]
        return known

    def _marks_upto(self, n: int) -> int:
        if n < self._scanned:
            return sum(self._is_marker(t) for t in self._ids[:n])
        self._marks += sum(self._is_marker(t) for t in self._ids[self._scanned : n])
        self._scanned = n
        return self._marks

    def count(self, text: str, token_ids: Sequence[int]) -> int:
        """The reasoning tokens of the reply so far.

        Args:
            text: the reply so far, as generated.
            token_ids: its tokens.

        Returns:
            The tokens of its thinking block but the block's tags (all the reply's but the
            tags while the block is open; 0 without thinking).
        """
        if self._closed is not None:
            return self._closed
        if self._parser is None or self._decode is None or not token_ids:
            return 0
        reasoning, start = stream_split(text, self._parser, final=True)
        if reasoning is None:
            return 0
        self._ids = token_ids
        if start is None:
            return len(token_ids) - self._marks_upto(len(token_ids))
        # NOTE: a binary search for the fewest leading tokens whose text reaches the content's
        # start: the decoded prefix grows with the tokens it holds
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(token_ids[:mid])) >= start:
                hi = mid
            else:
                lo = mid + 1
        self._closed = lo - self._marks_upto(lo)
        return self._closed


def reasoning_tokens(text: str, token_ids: Sequence[int], parser: str | None,
                     decode: Callable[[Sequence[int]], str] | None) -> int:
    """A finished reply's reasoning tokens (:class:`ReasoningCount`).

    Args:
        text: the reply as generated.
        token_ids: its tokens.
        parser: the reasoning parser (None: no thinking).
        decode: the tokenizer's decode (None: unknown, 0).

    Returns:
        Its thinking block's tokens but the block's tags.
    """
    return ReasoningCount(parser, decode).count(text, token_ids)


__all__ = [
    "REASONING_ENDS", "REASONING_PARSERS", "THINK_CLOSE", "THINK_OPEN", "TOOL_OPEN", "ReasoningCount", "ReasoningParser", "reasoning_tokens",
    "reply_content", "reply_parser", "split_reasoning", "stream_split",
]
