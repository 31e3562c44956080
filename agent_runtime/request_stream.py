"""What the caller of :class:`~agent_runtime.engine_client.AsyncEngine` holds for one request:
its :class:`RequestStream` of events, the :class:`EventSink` the engine thread feeds it
through, and the errors the stream raises when the request fails on its own.

NOTE: separate from ``engine_client.py``, which is the engine thread's side (the command queue
and the loop); this module is the event loop's side, which the server and the runtime import.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from agent_runtime.types import StreamEvent

if TYPE_CHECKING:
    from agent_runtime.engine_client import AsyncEngine


class RequestFailed(RuntimeError):
    """One request failed on its own inside the engine (the others go on); raised by its stream."""


class RequestConstraintsUnsatisfiable(RequestFailed, ValueError):
    """A request failed because its own constraints allow no token at some point (the sampler's
    :data:`~asymcache_core.sampler.NOTHING_ALLOWED`): bad input, so also a ``ValueError``
    (the server answers it with a 400)."""


class EventSink:
    """Delivers events from the engine thread into one event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

    def put(self, item: StreamEvent | BaseException) -> None:
        """Hand ``item`` to the loop's queue (thread-safe; dropped once the loop is closed).

        Args:
            item: an event, or the error the stream raises.
        """
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's loop is closed: nobody is listening any more


class RequestStream:
    """Async iterator over one request's :class:`StreamEvent` s (ends after the final one).

    Attributes:
        request_id: the engine request id.
        prompt_token_ids: the encoded prompt.
        job_id: the request's job: the client's, or the one the engine gave it.
        final: the final event once seen.
        last: the latest event seen (what a request cut short had done).
    """

    def __init__(
        self,
        client: AsyncEngine,
        request_id: str,
        prompt_ids: list[int],
        sink: EventSink,
        job_id: str | None = None,
    ) -> None:
        self._client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.job_id = job_id
        self._sink = sink
        self.final: StreamEvent | None = None
        self.last: StreamEvent | None = None

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if self.final is not None:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.last = item
        if item.output.finished:
            self.final = item
        return item

    async def result(self) -> StreamEvent:
        """Consume the rest of the stream.

        Returns:
            The final event.
        """
        async for _ in self:
            pass
        assert self.final is not None
        return self.final

    def abort(self) -> None:
        """Abort the request (thread-safe, returns at once; a no-op once it finished)."""
        if self.final is None:
            self._client.abort_nowait(self.request_id)
