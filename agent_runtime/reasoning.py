"""Reasoning models' thinking, split from the reply (vLLM's ``--reasoning-parser``).

Two parsers, as vLLM names them:

* ``deepseek_r1``: everything before ``</think>`` is reasoning (a leading ``<think>`` is
  dropped; DeepSeek-R1's template opens the block in the prompt, so the model may write only
  the end). A reply that never closes the block (cut by the length limit) is all reasoning.
* ``qwen3``: reasoning only when the reply opens with ``<think>`` (Qwen3 writes the block
  itself, or the template writes an empty one when thinking is off); the rest as above.

The content after the block is what tool calls are parsed from and what the chat returns as
``content``; the reasoning goes in ``reasoning_content``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

ReasoningParser = Literal["deepseek_r1", "qwen3"]
#: The parsers a runtime takes.
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BLANKS = re.compile(r"\s*")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """A finished reply's ``(reasoning, content)``.

    Args:
        text: the reply as generated.
        parser: ``deepseek_r1`` or ``qwen3``.

    Returns:
        The reasoning (None when the reply has none) and the content after it.
    """
    reasoning, start = stream_split(text, parser, final=True)
    if start is None:
        return reasoning, ""
    if start == 0:
        return None, text
    return reasoning, text[start:]


def stream_split(text: str, parser: str, final: bool = False) -> tuple[str | None, int | None]:
    """What of a reply generated so far is reasoning, and where its content starts.

    Args:
        text: the reply so far.
        parser: ``deepseek_r1`` or ``qwen3``.
        final: the reply is finished (nothing is held back for the tokens to come).

    Returns:
        ``(reasoning, content_start)``: the reasoning that may be sent now (None: the reply has
        no reasoning; a trailing piece that may become ``</think>`` and a start that may become
        ``<think>`` are held back while not final), and the index where the content starts
        (None while the block is still open; 0 when there is no block).
    """
    # NOTE: called on every streamed event of the reply: no copy of the text (a long thinking
    # block would be copied once a token)
    offset = _BLANKS.match(text).end()  # type: ignore[union-attr]
    opened = text.startswith(THINK_OPEN, offset)
    lead = text[offset : offset + len(THINK_OPEN)]
    if not opened and not final and len(text) - offset < len(THINK_OPEN) and THINK_OPEN.startswith(lead):
        return "", None  # may still become "<think>"
    if parser == "qwen3" and not opened:
        return None, 0
    begin = offset + len(THINK_OPEN) if opened else 0
    end = text.find(THINK_CLOSE, begin)
    if end >= 0:
        return text[begin:end], end + len(THINK_CLOSE)
    upto = len(text)
    if not final:
        while upto > begin and text[upto - 1] == "\ufffd":
            upto -= 1
        for k in range(min(len(THINK_CLOSE) - 1, upto - begin), 0, -1):
            if THINK_CLOSE.startswith(text[upto - k : upto]):
                upto -= k
                break
    return text[begin:upto], None


class ReasoningCount:
    """How many of one reply's tokens are its thinking, as vLLM 0.32 reports them in
    ``completion_tokens_details.reasoning_tokens`` (chat) and
    ``output_tokens_details.reasoning_tokens`` (Responses): the tokens of the thinking block,
    its ``<think>`` and ``</think>`` tokens left out (vLLM's reasoning parsers'
    ``count_reasoning_tokens``: ``BaseThinkingReasoningParser``'s span counter, the qwen3
    parser engine's reasoning chunks).

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
    "REASONING_PARSERS", "THINK_CLOSE", "THINK_OPEN", "ReasoningCount", "ReasoningParser", "reasoning_tokens", "split_reasoning",
    "stream_split",
]
