"""Background responses of OpenAI's Responses API (``background: true``): the request runs on
after ``POST /v1/responses`` has answered, its response stored as it goes (``queued``, then
``in_progress``, then ``completed`` / ``incomplete`` / ``failed``), read back with ``GET
/v1/responses/{id}`` and stopped with ``POST /v1/responses/{id}/cancel`` (status
``cancelled``, the engine request aborted: its KV blocks freed).

Streamed (``stream: true`` too), the run writes its typed events into a log that the request's
own stream reads, as does ``GET /v1/responses/{id}?stream=true&starting_after=N`` (OpenAI's
resumption of a background stream): a client that goes away leaves the run going.

The server's runs are its :class:`BackgroundRuns` (``AppState.background``); the app's shutdown
cancels the ones still going.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agent_runtime.request_stream import RequestStream
from agent_runtime.server.errors import APIError, failed_request_error
from agent_runtime.server.response_store import ResponseStore, StoredResponse

#: The statuses of a response whose run is still going.
RUNNING = ("queued", "in_progress")


class BackgroundRun:
    """One background response's run: its task, its engine request, and (streamed) its events.

    Args:
        response_id: the response's id.
        stream: its engine request.
    """

    def __init__(self, response_id: str, stream: RequestStream) -> None:
        self.response_id = response_id
        self.stream = stream
        self.task: asyncio.Task[None] | None = None
        self.events: list[str] = []  # the SSE frames written so far (streamed runs)
        self.finished = False
        self._changed = asyncio.Event()

    def write(self, frame: str) -> None:
        """Append an SSE frame to the log."""
        self.events.append(frame)
        self._changed.set()

    def end(self) -> None:
        """No more frames come."""
        self.finished = True
        self._changed.set()

    async def replay(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The run's frames whose ``sequence_number`` is above ``starting_after``, then the
        ones it writes until it ends (the reader leaving stops nothing but the reading)."""
        # NOTE: a run's frames are numbered from 0 in the order written: a frame's index in the
        # log is its sequence_number
        sent = max(starting_after + 1, 0)
        while True:
            while sent < len(self.events):
                sent += 1
                yield self.events[sent - 1]
            if self.finished:
                return
            self._changed.clear()
            await self._changed.wait()


class BackgroundRuns:
    """The background runs of one server, by response id (finished ones kept while their
    response is stored, for streamed reads)."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    @property
    def running(self) -> int:
        """The runs still going: completions in flight that no HTTP request holds open (the
        request guard's bound counts them)."""
        return sum(not r.finished for r in self._runs.values())

    def get(self, response_id: str) -> BackgroundRun | None:
        """The run of a response, if it had one."""
        return self._runs.get(response_id)

    def add(self, run: BackgroundRun, store: ResponseStore) -> None:
        """Keep ``run``, forgetting finished runs that nothing reads again: those not streamed,
        and those whose responses the store dropped."""
        for rid in [rid for rid, r in self._runs.items()
                    if r.finished and (not r.events or store.get(rid, touch=False) is None)]:
            del self._runs[rid]
        self._runs[run.response_id] = run

    async def cancel_all(self) -> None:
        """Cancel every run still going (the app's shutdown): their requests are aborted."""
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _with_status(stored: StoredResponse, status: str, **fields: Any) -> StoredResponse:
    return StoredResponse({**stored.body, "status": status, **fields}, stored.items, stored.job_id)


def start(
    store: ResponseStore, runs: BackgroundRuns, queued: StoredResponse, stream: RequestStream,
    work: Callable[[BackgroundRun, Callable[[dict[str, Any]], None]], Awaitable[None]],
    keep: Callable[[dict[str, Any]], None],
) -> BackgroundRun:
    """Store ``queued`` and run ``work`` in the background: it waits for the request and stores
    its finished body with the keep it is given (which stores nothing once the response was
    cancelled). A run that fails, or ends with its response still running, stores it
    ``failed``.

    Args:
        store: the server's stored responses.
        runs: the server's background runs.
        queued: the response as first stored (status ``queued``, no output).
        stream: its engine request (aborted if the run is cancelled or fails).
        work: the run, given itself and the guarded keep.
        keep: stores a finished body.

    Returns:
        The run.
    """
    run = BackgroundRun(queued.id, stream)
    store.put(queued)
    runs.add(run, store)

    def keep_unless_cancelled(body: dict[str, Any]) -> None:
        current = store.get(run.response_id, touch=False)
        # NOTE: one event loop: nothing runs between this check and the keep
        if current is None or current.body.get("status") != "cancelled":
            keep(body)

    def fail(code: str, message: str) -> None:
        current = store.get(run.response_id, touch=False)
        if current is not None and current.body.get("status") in RUNNING:
            store.put(_with_status(current, "failed", error={"code": code, "message": message}))

    async def go() -> None:
        try:
            current = store.get(run.response_id, touch=False)
            if current is not None and current.body.get("status") == "queued":
                store.put(_with_status(current, "in_progress"))
            await work(run, keep_unless_cancelled)
            fail("server_error", "the request ended without a response")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request failed: the stored response says so
            err = failed_request_error(exc)
            fail(err.code if err.status < 500 and err.code else "server_error", str(exc) or type(exc).__name__)
        finally:
            if stream.final is None:
                stream.abort()
            run.end()

    run.task = asyncio.get_running_loop().create_task(go(), name=f"background-{run.response_id}")
    return run


async def cancel(store: ResponseStore, runs: BackgroundRuns, response_id: str) -> dict[str, Any]:
    """``POST /v1/responses/{id}/cancel``: stop a background response's run.

    Args:
        store: the server's stored responses.
        runs: the server's background runs.
        response_id: the response.

    Returns:
        The response, status ``cancelled``.

    Raises:
        APIError: 404 when it is not stored; 400 naming ``response_id`` when it was not a
            background response or its run already ended.
    """
    found = store.require(response_id)
    status = found.body.get("status")
    if status == "cancelled":
        return dict(found.body)  # NOTE: OpenAI's cancel is idempotent
    if not found.body.get("background"):
        raise APIError(400, "response_id: only a response created with background: true can be cancelled",
                       param="response_id")
    if status not in RUNNING:
        raise APIError(400, f"response_id: cannot cancel a response that is already {status}",
                       param="response_id")
    cancelled = _with_status(found, "cancelled")
    store.put(cancelled)
    run = runs.get(response_id)
    if run is not None:
        run.stream.abort()
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
    return dict(cancelled.body)


def replay_or_404(store: ResponseStore, runs: BackgroundRuns, response_id: str, starting_after: str | None
                  ) -> AsyncIterator[str]:
    """``GET /v1/responses/{id}?stream=true``: a streamed background response's events after
    ``starting_after``.

    Raises:
        APIError: 404 when it is not stored; 400 naming ``stream`` when it was not streamed in
            the background, or ``starting_after`` when it is no integer.
    """
    store.require(response_id)
    run = runs.get(response_id)
    if run is None or not run.events:
        raise APIError(400, "stream: only a response created with background: true and stream: true can be "
                       "streamed again", param="stream")
    after = -1
    if starting_after is not None:
        try:
            after = int(starting_after)
        except ValueError:
            raise APIError(400, f"starting_after: must be an integer, got {starting_after!r}",
                           param="starting_after") from None
    return run.replay(after)


__all__ = ["RUNNING", "BackgroundRun", "BackgroundRuns", "cancel", "replay_or_404", "start"]
