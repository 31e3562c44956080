"""The choices of a completion's response: what each event of a request's stream adds to it.

:class:`ChatChunks` and :class:`CompletionChunks` turn a request's stream into the choices of
SSE chunks (text pieces held back while they may be part of a character or a ``<tool_call>``
tag, tool calls at the end, log probabilities with the chunk after their token) and into the
choice of the non-streamed body; one instance per choice (OpenAI's ``n``), carrying its index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from agent_runtime.engine_client import RequestStream
from agent_runtime.output_processor import build_turn
from agent_runtime.protocol import (
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    ToolCallDelta,
)
from agent_runtime.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from agent_runtime.tool_parsing import to_openai_tool_calls
from agent_runtime.types import StreamEvent
from asymcache_core.logprobs import TokenLogprob

_TOOL_OPEN = "<tool_call>"


class Chunks(ABC):
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


class ChatChunks(Chunks):
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


class CompletionChunks(Chunks):
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


__all__ = ["ChatChunks", "Chunks", "CompletionChunks", "safe_text_len"]
