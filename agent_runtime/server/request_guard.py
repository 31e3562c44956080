"""The ASGI layer every request of the server passes first (:class:`RequestGuard`).

It answers before any route runs, and before any body byte is parsed or tokenized: the API key
on the routes that need it (``/v1/*`` and the cache resets, vLLM's rule:
:func:`~agent_runtime.server.auth.needs_key`), the body size cap, and the bound on completions in flight. It
also turns an exception that escapes a route into a JSON 500 (instead of Starlette re-raising
it, which makes uvicorn drop the keep-alive connection without ``Connection: close``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from agent_runtime.request_stream import RequestConstraintsUnsatisfiable
from agent_runtime.server import anthropic_messages
from agent_runtime.server.auth import authorized, needs_key, route_path
from agent_runtime.server.errors import APIError, failed_request_error
from agent_runtime.server.request_fields import MAX_BATCH_SEQUENCES, MAX_CHOICES
from agent_runtime.server.state import AppState
from asymcache_core.errors import EngineDeadError

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Request bodies beyond this are a 413 (``--max-request-body-bytes``).
DEFAULT_MAX_BODY_BYTES = 8 << 20
#: Completions waiting beyond the engine's running batch before new ones are a 429.
DEFAULT_MAX_QUEUE_LEN = 256
COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})


class RequestGuard:
    """The ASGI layer in front of every route (see the module docstring).

    Args:
        app: the wrapped app.
        state: the app's state (its API key and metrics).
        max_body_bytes: the body size cap.
        max_queue_len: completions in flight beyond the engine's ``max_num_seqs`` at most
            (None: unbounded); a completion of ``n`` choices counts ``n`` (each is an engine
            request).
    """

    def __init__(self, app: ASGIApp, state: AppState, max_body_bytes: int, max_queue_len: int | None) -> None:
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes
        self.max_queue_len = max_queue_len
        self.in_flight = 0

    def _full(self, weight: int) -> bool:
        if self.max_queue_len is None:
            return False
        runtime = self.state.runtime
        running = runtime.engine.config.max_num_seqs if runtime is not None else 0
        # NOTE: background responses run on after their requests answered: they count too
        busy = self.in_flight + self.state.background.running
        # NOTE: one request is always let in, however many choices it asks for
        return busy > 0 and busy + weight > running + self.max_queue_len

    async def _reject(self, send: Send, path: str, error: APIError, close: bool = False,
                      headers: dict[str, str] | None = None) -> None:
        self.state.metrics.count(path, error.status)
        raw = [(b"content-type", b"application/json")]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if close:
            # NOTE: the body was not read to its end: the connection cannot carry another request.
            raw.append((b"connection", b"close"))
        payload = (anthropic_messages.anthropic_error_body(error.status, error.message)
                   if anthropic_messages.is_messages_path(path) else error.body().model_dump())
        body = json.dumps(payload).encode()
        raw.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": error.status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        headers = dict(scope.get("headers") or [])
        key = self.state.api_key
        if key is not None and needs_key(path) and not authorized(path, headers, key):
            await self._reject(send, path, APIError(
                401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key"))
            return
        too_big = APIError(413, f"The request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._reject(send, path, too_big, close=True)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(send, path, too_big, close=True)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        weight = _choices(body) if path in COMPLETION_PATHS else 0
        if path in COMPLETION_PATHS and self._full(weight):
            await self._reject(send, path, APIError(
                429, f"The server is at capacity ({self.in_flight + self.state.background.running} requests in "
                "flight); retry shortly",
                type="rate_limit_error", code="queue_full"), headers={"Retry-After": "1"})
            return
        await self._forward(scope, receive, send, body, path, weight)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, body: bytes, path: str, weight: int) -> None:
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the server's would

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        self.in_flight += weight
        try:
            await self.app(scope, replay, tracked_send)
        except EngineDeadError as exc:
            logger.error("request to %s failed: the engine is dead (%s)", path, exc)
            if not started:
                await self._reject(send, path, APIError(
                    503, f"The engine is not running: {exc}", type="server_error", code="engine_unavailable"))
        except RequestConstraintsUnsatisfiable as exc:
            if not started:
                await self._reject(send, path, failed_request_error(exc))
        except Exception as exc:  # noqa: BLE001 - one request's bug must not cost the connection
            logger.exception("request to %s failed", path)
            if not started:
                await self._reject(send, path, APIError(
                    500, f"Internal error: {type(exc).__name__}: {exc}", type="server_error"))
        finally:
            self.in_flight -= weight


def _choices(body: bytes) -> int:
    """The engine requests a completion body asks for: its ``n`` where it is a valid one (else
    1), times the prompts of a ``/v1/completions`` batch (a body that does not parse, or a batch
    over the bound, is rejected by its route, after this count)."""
    if b'"n"' not in body and b'"prompt"' not in body:
        return 1
    try:
        parsed = json.loads(body)
        n, prompt = parsed.get("n"), parsed.get("prompt")
    except (ValueError, AttributeError, RecursionError):
        return 1
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES else 1
    batch = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    return min(n * batch, MAX_BATCH_SEQUENCES)


__all__ = ["COMPLETION_PATHS", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_QUEUE_LEN", "RequestGuard"]
