"""The choices of a completion's response: what each event of a request's stream adds to it.

:class:`ChatChunks` and :class:`CompletionChunks` turn a request's stream into the choices of
SSE chunks (text pieces held back while they may be part of a character or a ``<tool_call>``
tag, a Hermes tool call as it is written (:mod:`asymcache_core.tool_call_stream`), other calls at
the end, log probabilities with the chunk after their token) and into the
choice of the non-streamed body; one instance per choice (OpenAI's ``n``), carrying its index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from agent_runtime.output_processor import build_turn
from agent_runtime.request_stream import RequestStream
from agent_runtime.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from agent_runtime.server.responses import (
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    FunctionCallDelta,
    ToolCallDelta,
)
from agent_runtime.server.streamed_text import StreamedText, safe_text_len, without_cut_off_call
from agent_runtime.types import AssistantTurn, StreamEvent
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.sampling_params import SamplingParams, choice_params
from asymcache_core.tool_call_stream import CallPiece, HermesCallStream, final_pieces, merged_pieces


class Chunks(ABC):
    """An endpoint's choices for one request: the base keeps the stream, how much of its text
    went out and how many of its tokens' log probabilities; subclasses say what a choice holds.

    NOTE: a token's log probabilities go out with the first chunk sent after it was sampled
    (its text may be held back a while: part of a character, or of a ``<tool_call>`` tag).

    Args:
        stream: the choice's request.
        index: the choice's index.
        texts: the token decoder (``None`` when no log probabilities are asked for).
        report_logprobs: the request asked for the generated tokens' log probabilities.
        report_prompt_logprobs: it asked for vLLM's ``prompt_logprobs``.
    """

    def __init__(
        self, stream: RequestStream, index: int, texts: TokenTexts | None,
        report_logprobs: bool = True, report_prompt_logprobs: bool = False,
    ) -> None:
        self.stream = stream
        self.index = index
        self.texts = texts
        self.report_logprobs = report_logprobs and texts is not None
        self.report_prompt_logprobs = report_prompt_logprobs and texts is not None
        self.sent = 0
        self.logprobs_sent = 0

    def take_logprobs(self, event: StreamEvent) -> list[TokenLogprob]:
        """The entries of ``event`` not sent yet (none when the request asked for none)."""
        entries = event.output.logprobs
        if not self.report_logprobs or entries is None:
            return []
        new, self.logprobs_sent = entries[self.logprobs_sent :], len(entries)
        return new

    def prompt_logprobs_of(self, event: StreamEvent) -> Any:
        """vLLM's ``prompt_logprobs`` of the request, when it asked for them (else None)."""
        entries = event.output.prompt_logprobs
        if not self.report_prompt_logprobs or entries is None:
            return None
        assert self.texts is not None
        return prompt_logprobs(entries, self.texts)

    def response_fields(self, final: StreamEvent) -> dict[str, Any]:
        """Fields of the non-streamed body besides its choices (none by default)."""
        return {}

    def opening(self) -> list[Any]:
        """Choices sent before the first token (none by default)."""
        return []

    def opening_fields(self) -> dict[str, Any]:
        """Fields of the chunk that carries the choice's opening (none by default)."""
        return {}

    @abstractmethod
    def on_event(self, event: StreamEvent) -> list[Any]:
        """Choices for one event of the stream (the final one included)."""

    @abstractmethod
    def final_choice(self, final: StreamEvent) -> Any:
        """The choice of the non-streamed response."""


class ChatChunks(Chunks):
    """Chat payloads: a role delta, reasoning deltas (with a reasoning parser), content deltas,
    then tool calls or the rest, then the reason."""

    def __init__(
        self, stream: RequestStream, index: int, texts: TokenTexts | None, tools_possible: bool,
        report_logprobs: bool = True, report_prompt_logprobs: bool = False, raw_content: bool = False,
        call_format: str = "hermes", reasoning_parser: str | None = None, return_ids: bool = False,
        include_reasoning: bool = True, named_tool: bool = False, max_tool_calls: int | None = None,
        forced_tool: bool = False, role: str = "assistant",
    ) -> None:
        super().__init__(stream, index, texts, report_logprobs, report_prompt_logprobs)
        #: the reply's role (vLLM's --response-role, or the role of the message it continues)
        self.role = role
        #: Hermes calls streamed as they are written (their arguments piece by piece, vLLM's
        #: streaming tool parser); other formats send their calls whole at the end
        self.calls = HermesCallStream(max_tool_calls) if tools_possible and call_format == "hermes" else None
        #: a named ``tool_choice`` forced the call: its reason is ``stop``, as OpenAI's and
        #: vLLM's (``tool_calls`` is for calls the model chose to make)
        self.named_tool = named_tool
        #: ``tool_choice`` ``"required"`` or a named function: the grammar allows nothing but
        #: calls, so the reply's text is call markup and never content, even when the call does
        #: not parse (cut off by ``max_tokens`` or a stop string): vLLM streams no content then
        #: (its call pieces only) and its engine-based parsers drop the markup from the body
        self.forced_tool = forced_tool or named_tool
        #: what of the reply went out: its thinking (``reasoning_content``) and its content
        self.text = StreamedText(tools_possible, call_format, reasoning_parser)
        #: the body's content is the text as generated, not stripped: it continues a message
        #: (``continue_final_message``), whose next character may be a space
        self.raw_content = raw_content
        #: vLLM's ``return_token_ids``; ``ids_sent``: the reply's tokens already sent
        self.return_ids = return_ids
        self.ids_sent = 0
        #: vLLM's ``include_reasoning``: False leaves the thinking out of the reply
        self.include_reasoning = include_reasoning

    def _take_ids(self, event: StreamEvent) -> list[int] | None:
        """The reply's token ids not sent yet (None when not asked for).

        NOTE: like log probabilities, they go with the first chunk sent after their step (the
        text of a step may be held back: part of a character, or of a ``<tool_call>`` tag).
        """
        if not self.return_ids:
            return None
        ids = event.output.token_ids
        new, self.ids_sent = list(ids[self.ids_sent :]), len(ids)
        return new

    def opening_fields(self) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.stream.prompt_token_ids)} if self.return_ids else {}

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(entries, self.texts) if self.report_logprobs and self.texts is not None else None

    def response_fields(self, final: StreamEvent) -> dict[str, Any]:
        # NOTE: vLLM's chat body carries the prompt's log probabilities and token ids beside
        # its choices
        prompt = self.prompt_logprobs_of(final)
        fields: dict[str, Any] = {"prompt_logprobs": prompt} if prompt is not None else {}
        return fields | self.opening_fields()

    def opening(self) -> list[ChatCompletionStreamChoice]:
        return [ChatCompletionStreamChoice(index=self.index, delta=DeltaMessage(role=self.role, content=""))]

    def _deltas(self, reasoning: str, content: str, calls: list[CallPiece] | None = None) -> list[DeltaMessage]:
        return ([DeltaMessage(reasoning_content=reasoning)] if reasoning and self.include_reasoning else []) + (
            [DeltaMessage(content=content)] if content else []) + (
            [DeltaMessage(tool_calls=[_call_delta(c) for c in merged_pieces(calls)])] if calls else [])

    def on_event(self, event: StreamEvent) -> list[ChatCompletionStreamChoice]:
        if not event.output.finished:
            thought, piece = self.text.pieces(event)
            if self.forced_tool:
                piece = ""
            calls = None if self.calls is None else self.calls.feed(self.text.content)
            deltas = self._deltas(thought, piece, calls)
            if not deltas:
                return []
            out = [ChatCompletionStreamChoice(index=self.index, delta=d) for d in deltas]
            out[0] = out[0].model_copy(update={"logprobs": self._logprobs(self.take_logprobs(event)),
                                               **self._ids_update(event)})
            return out
        turn = build_turn(self.stream, event)
        calls = turn.parsed.tool_calls
        owed = final_pieces(self.calls, self.text.split(event.output.text, True)[1], calls)
        thought, content = self.text.rest_without_cut_off_call(turn, event)
        if (self.calls is not None and self.calls.calls and not calls) or self.forced_tool:
            # NOTE: a call cut off (or malformed) went out as tool-call pieces: its text is not
            # content too; under a forced call the text is all call markup
            content = ""
        deltas = self._deltas(thought, content, owed)
        out = [ChatCompletionStreamChoice(index=self.index, delta=d) for d in deltas]
        out.append(ChatCompletionStreamChoice(index=self.index, delta=DeltaMessage(), finish_reason=self._reason(turn),
                                              stop_reason=event.output.stop_reason))
        pending = self.take_logprobs(event)
        if pending:
            out[0] = out[0].model_copy(update={"logprobs": self._logprobs(pending)})
        out[0] = out[0].model_copy(update=self._ids_update(event))
        return out

    def _reason(self, turn: AssistantTurn) -> str:
        return "stop" if self.named_tool and turn.finish_reason == "tool_calls" else turn.finish_reason

    def _ids_update(self, event: StreamEvent) -> dict[str, Any]:
        ids = self._take_ids(event)
        return {} if ids is None else {"token_ids": ids}

    def final_choice(self, final: StreamEvent) -> ChatCompletionChoice:
        turn = build_turn(self.stream, final)
        message = dict(turn.message, role=self.role)
        if not self.include_reasoning:
            message.pop("reasoning_content", None)
        if self.raw_content and not turn.parsed.tool_calls:
            message["content"] = self.text.split(final.output.text, True)[1]
        if isinstance(message.get("content"), str):
            # NOTE: a call cut off (by max_tokens or a stop) is not content: its stream sent
            # no markup either (what went out of it were call pieces)
            kept = without_cut_off_call(message["content"], final.output.finish_reason == "length",
                                        self.text.tools_possible, self.text.call_format)
            if kept != message["content"]:
                message["content"] = (kept.rstrip() or None) if turn.parsed.tool_calls else kept
        if self.forced_tool and not turn.parsed.tool_calls:
            # NOTE: a forced call that did not parse (cut off): its markup is not content (vLLM's
            # body then has content "" and no calls)
            message["content"] = ""
        return ChatCompletionChoice(
            index=self.index, message=ChatMessage.model_validate(message), finish_reason=self._reason(turn),
            logprobs=self._logprobs(final.output.logprobs or []), stop_reason=final.output.stop_reason,
            **({"token_ids": list(final.output.token_ids)} if self.return_ids else {}),
        )


def _call_delta(piece: CallPiece) -> ToolCallDelta:
    """A tool call's streamed piece as OpenAI's delta (its id, type and name on its first)."""
    if piece.id is None:
        return ToolCallDelta(index=piece.index, function=FunctionCallDelta(arguments=piece.arguments))
    return ToolCallDelta(index=piece.index, id=piece.id, type="function",
                         function=FunctionCallDelta(name=piece.name, arguments=piece.arguments))


class CompletionChunks(Chunks):
    """Text-completion payloads: text pieces (with their token ids on request), the last with the
    reason; with ``echo`` the prompt (and its tokens' log probabilities) comes first.

    Args:
        stream, index, texts, report_logprobs, report_prompt_logprobs: as :class:`Chunks`.
        num_top: the request's ``logprobs``.
        return_ids: vLLM's ``return_token_ids``.
        echo: the prompt's text to put first (``None``: no echo).
        echo_only: ``max_tokens: 0`` with echo: the token the engine sampled is left out.

    ``echo`` may be set after construction, before the first event is handled.
    """

    def __init__(
        self, stream: RequestStream, index: int, texts: TokenTexts | None, num_top: int, return_ids: bool,
        report_logprobs: bool = True, report_prompt_logprobs: bool = False, echo: str | None = None,
        echo_only: bool = False,
    ) -> None:
        super().__init__(stream, index, texts, report_logprobs, report_prompt_logprobs)
        self.num_top = num_top
        self.return_ids = return_ids
        self.echo = echo
        self.echo_only = echo_only
        #: ``text_offset`` of the next token whose log probabilities go out
        self.offset = 0
        self.started = False

    def _logprobs(self, entries: list[TokenLogprob | None]) -> CompletionLogprobs | None:
        if not self.report_logprobs or self.texts is None:
            return None
        first = self.stream.prompt_token_ids[0] if self.stream.prompt_token_ids else None
        logprobs = completion_logprobs(entries, self.texts, self.offset, self.num_top, first_token=first)
        self.offset += sum(len(token) for token in logprobs.tokens)
        return logprobs

    def _echoed(self, event: StreamEvent) -> tuple[str, list[TokenLogprob | None]]:
        """The prompt's text and log probability entries that go before the generated ones."""
        if self.echo is None:
            return "", []
        return self.echo, list(event.output.prompt_logprobs or ()) if self.report_logprobs else []

    def on_event(self, event: StreamEvent) -> list[CompletionChoice]:
        out = event.output
        text = out.text
        upto = len(text) if out.finished else safe_text_len(text, False)
        piece = text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        new_ids = list(out.new_token_ids) if self.return_ids else None
        entries: list[TokenLogprob | None] = list(self.take_logprobs(event))
        if self.echo_only:
            piece, new_ids, entries = "", [] if self.return_ids else None, []
        # NOTE: the echoed prompt and the prompt's log probabilities go with the first chunk
        first = not self.started and (self.echo is not None or self.report_prompt_logprobs)
        if first:
            echoed, prompt_entries = self._echoed(event)
            piece, entries = echoed + piece, prompt_entries + entries
        if not (out.finished or piece or new_ids or first):
            return []
        self.started = True
        return [CompletionChoice(
            index=self.index, text=piece, finish_reason=self._finish_reason(out) if out.finished else None,
            stop_reason=out.stop_reason, token_ids=new_ids, logprobs=self._logprobs(entries),
            prompt_logprobs=self.prompt_logprobs_of(event) if first else None,
        )]

    def _finish_reason(self, out: Any) -> str | None:
        # NOTE: nothing generated was asked for: the limit ended it, whatever the token was
        return "length" if self.echo_only and out.error is None else out.finish_reason

    def final_choice(self, final: StreamEvent) -> CompletionChoice:
        out = final.output
        text, entries = out.text, list(out.logprobs or [])
        token_ids = list(out.token_ids)
        if self.echo_only:
            text, entries, token_ids = "", [], []
        echoed, prompt_entries = self._echoed(final)
        return CompletionChoice(
            index=self.index,
            text=echoed + text,
            logprobs=self._logprobs(prompt_entries + entries),
            finish_reason=self._finish_reason(out),
            stop_reason=out.stop_reason,
            token_ids=token_ids if self.return_ids else None,
            prompt_token_ids=list(self.stream.prompt_token_ids) if self.return_ids else None,
            prompt_logprobs=self.prompt_logprobs_of(final),
        )


def choice_sampling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of a request's ``n`` choices (:func:`~asymcache_core.sampling_params.choice_params`:
    with a seed, choice ``i`` samples with ``seed + i``, vLLM's rule)."""
    return choice_params(params, n)


__all__ = ["ChatChunks", "Chunks", "CompletionChunks", "StreamedText", "choice_sampling_params", "safe_text_len"]
