"""A scripted :class:`~agent_runtime.request_stream.RequestStream` for reply-building tests that
load no model: it yields the events it was given, keeping ``last`` and ``final`` as the real
stream does."""

from __future__ import annotations

from collections.abc import AsyncIterator

from agent_runtime.types import StreamEvent


class ScriptedStream:
    """Yields ``events`` in order.

    Args:
        events: the stream's events, the last one finished.
        prompt_tokens: the length of its prompt (``prompt_token_ids`` is that many ones).
    """

    def __init__(self, events: list[StreamEvent], prompt_tokens: int) -> None:
        self.events, self.request_id, self.prompt_token_ids = events, "r", [1] * prompt_tokens
        self.final: StreamEvent | None = None
        self.last: StreamEvent | None = None

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._run()

    async def _run(self) -> AsyncIterator[StreamEvent]:
        for event in self.events:
            self.last = event
            if event.output.finished:
                self.final = event
            yield event
