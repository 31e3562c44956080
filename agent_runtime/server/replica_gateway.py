"""The gateway of the engine replicas (:mod:`agent_runtime.server.replicas`): the HTTP
ingress that forwards each request to a replica through a streaming Ray Serve handle, relays
its answer, sends it again to another replica when the one chosen dies before answering, and
answers ``/metrics`` and the cache resets with every live replica's answer combined.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent_runtime.server import admin, anthropic_messages, openai_responses
from agent_runtime.server.errors import APIError, stream_error_frame
from agent_runtime.server.job_router import needs_home, routing_key
from agent_runtime.server.metrics import CONTENT_TYPE, merge_expositions
from agent_runtime.server.replica_router import JobRequestRouter, routers_of
from agent_runtime.server.request_guard import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]

#: The Ray Serve application's name (and the deployments').
APP_NAME = "asymcache"
ENGINE_DEPLOYMENT = "engine"
#: Paths answered with the gateway's aggregation rather than by one replica (and the resets').
_METRICS_PATH = "/metrics"
#: vLLM's request id header (names a completion over the body's ``request_id``), which Ray
#: Serve's HTTP proxy adds to every request that has none and to every response.
_REQUEST_ID_HEADER = b"x-request-id"
#: What the proxy's id looks like (``ray.serve._private.utils.generate_request_id``).
_PROXY_ID = re.compile(rb"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the gateway hands it to a replica.

    Attributes:
        method: the HTTP method.
        path: the path.
        query_string: the raw query.
        headers: the raw headers.
        body: the whole body.
    """

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    def scope(self) -> dict[str, Any]:
        """The ASGI scope of this request."""
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query_string, "root_path": "", "headers": list(self.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        }


def proxy_request_id(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The ``x-request-id`` Ray Serve's HTTP proxy added to a request that came without one.

    NOTE: the proxy's ``RequestIdMiddleware`` appends it after the client's headers, as a fresh
    uuid4. A client's own header is taken for the proxy's only if it is a lone uuid4 sent last
    too; then, as vLLM's precedence goes, it still names the completion unless the body has a
    ``request_id`` of its own.

    Args:
        headers: the request's raw headers, in order.

    Returns:
        The id, or None when the request's ``x-request-id`` (if any) is the client's.
    """
    ids = [value for key, value in headers if key.lower() == _REQUEST_ID_HEADER]
    if len(ids) != 1 or headers[-1][0].lower() != _REQUEST_ID_HEADER:
        return None
    return ids[0] if _PROXY_ID.match(ids[0]) else None


def _json_body(body: bytes) -> Mapping[str, Any] | None:
    """The body as a JSON object, or None when it is not one."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return parsed if isinstance(parsed, Mapping) else None


def _no_replica() -> APIError:
    return APIError(503, "No engine replica is alive; retry shortly", type="server_error", code="no_replica")


def failed_stream_tail(path: str, exc: BaseException) -> str:
    """What ends a relayed stream whose replica died, in the route's own form: an OpenAI error
    frame and ``[DONE]``, the Responses API's ``error`` event, or Anthropic's.

    Args:
        path: the request's route.
        exc: what ended it.

    Returns:
        The SSE text.
    """
    if path == openai_responses.PATH:
        return openai_responses.error_event(exc)
    if anthropic_messages.is_messages_path(path):
        return anthropic_messages.error_event(exc)
    return stream_error_frame(exc) + "data: [DONE]\n\n"


class _Relay(Response):
    """Sends a replica's response as it comes: the start message already received, then the
    body messages of the stream (a stream that loses its replica ends with an error frame)."""

    def __init__(self, start: Message, rest: DeploymentResponseGenerator, path: str = "") -> None:
        # NOTE: Ray Serve's proxy adds its own x-request-id to the response (the client's, or
        # the one it made up); the replica's copy beside it would be a second, maybe other, id
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != _REQUEST_ID_HEADER]
        self.start = {**start, "headers": headers}
        self.rest = rest
        self.path = path
        self.status_code = int(start.get("status", 200))
        self.raw_headers = list(headers)
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(self.start)
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                  for k, v in self.start.get("headers", []))
        ended = False
        try:
            async for message in self.rest:
                await send(message)
                ended = message.get("type") == "http.response.body" and not message.get("more_body", False)
        except RayActorError as exc:
            logger.warning("replica died mid-response: %s", exc)
            if not ended:
                tail = failed_stream_tail(self.path, exc).encode() if sse else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        finally:
            self.rest.cancel()
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Gateway:
    """The HTTP ingress: one endpoint for every replica (see the module docstring).

    Args:
        engine: the engine deployment's handle.
        max_attempts: sends of one request before it is a 503.
        app_name: the application's name, to find this process's router of ``engine``
            (default: the one this replica runs in).
        live_replicas: the live replicas' ids (default: those the handle's router knows;
            None while it knows nothing yet).
        max_body_bytes: request bodies beyond this are a 413, refused before they are read
            whole (the replicas' own limit, ``serve --max-request-body-bytes``).
    """

    def __init__(self, engine: DeploymentHandle, max_attempts: int = 3, app_name: str | None = None,
                 live_replicas: Callable[[], tuple[str, ...] | None] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.max_attempts = max_attempts
        if app_name is None:
            with contextlib.suppress(RayServeException):
                app_name = serve.get_replica_context().app_name
        self.app_name = app_name or APP_NAME
        self._live = live_replicas or self._router_live
        #: requests sent again because their replica died before answering
        self.retries = 0

    def _routers(self) -> list[JobRequestRouter]:
        return routers_of(self.app_name, ENGINE_DEPLOYMENT)

    def _router_live(self) -> tuple[str, ...] | None:
        routers = self._routers()
        if not routers:
            return None
        return tuple(sorted({uid for r in routers for uid in r.live}))

    async def _read_body(self, request: Request) -> bytes | None:
        """The request's body, or None past :attr:`max_body_bytes` (read no further: the one
        gateway must not hold a client's gigabytes)."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP request."""
        body = await self._read_body(request)
        if body is None:
            error = APIError(413, f"The request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
            if anthropic_messages.is_messages_path(request.url.path):
                return anthropic_messages.error_response(error)
            return error.response()
        parsed = _json_body(body) if request.method == "POST" else None
        headers = tuple((bytes(k), bytes(v)) for k, v in request.scope.get("headers", []))
        body_names_it = parsed is not None and parsed.get("request_id") is not None
        if body_names_it and proxy_request_id(headers):
            # NOTE: the replica reads the header over the body's request_id (vLLM's order); the
            # proxy's made-up id must not replace the one the client named the completion with
            headers = tuple((k, v) for k, v in headers if k.lower() != _REQUEST_ID_HEADER)
        forwarded = ForwardedRequest(
            request.method, request.url.path, request.scope.get("query_string", b""), headers, body
        )
        if forwarded.path == _METRICS_PATH:
            return await self._metrics(forwarded)
        if forwarded.path in admin.RESET_PATHS:
            return await self._reset(forwarded)
        home = needs_home(request.method, forwarded.path, parsed)
        if home is not None:
            return await self._send(forwarded, routing_key=home, home_only=True)
        key = routing_key(parsed) if parsed is not None else None
        return await self._send(forwarded, routing_key=key)

    async def _send(self, forwarded: ForwardedRequest, **routing: Any) -> Response:
        """Forward to a replica; again to another when the one chosen dies before answering."""
        for attempt in range(1, self.max_attempts + 1):
            if self._live() == ():
                break
            gen: DeploymentResponseGenerator = self.engine.options(stream=True).forward.remote(forwarded, **routing)
            try:
                start = await self._first(gen)
            except RayActorError as exc:
                gen.cancel()
                self.retries += 1
                logger.warning("replica died before answering (attempt %d of %d): %s", attempt, self.max_attempts, exc)
                continue
            if start is None:
                gen.cancel()
                break
            return _Relay(start, gen, forwarded.path)
        return _no_replica().response()

    async def _first(self, gen: DeploymentResponseGenerator) -> Message | None:
        """The response's first message; None when no replica is alive while waiting for it."""
        first = asyncio.ensure_future(gen.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=0.5)
                if done:
                    return first.result()
                if self._live() == ():
                    return None
        finally:
            if not first.done():
                first.cancel()

    async def _each_replica(self, forwarded: ForwardedRequest) -> dict[str, bytes] | Response:
        """Every live replica's answer body to ``forwarded`` (a short one), or the first
        answer that is not a 200, or a 503 when none answered."""
        live = self._live()
        if live is None:
            # NOTE: the router exists once a request went through the handle; a health check
            # makes it, not ``forwarded`` itself (a reset sent there too would be counted once
            # for that replica and answer 0 the second time)
            warm = await self._send(ForwardedRequest("GET", "/health"))
            if isinstance(warm, _Relay):
                warm.rest.cancel()
            if warm.status_code != 200:
                return warm
            live = self._live() or ()
        bodies: dict[str, bytes] = {}
        for uid in live:
            gen = self.engine.options(stream=True).forward.remote(forwarded, replica=uid)
            try:
                messages = [m async for m in _bounded(gen, timeout=30.0)]
            except (TimeoutError, RayActorError):
                continue  # died or replaced meanwhile: the next call sees its successor
            start, chunks = messages[0], messages[1:]
            body = b"".join(m.get("body", b"") for m in chunks)
            if start.get("status") != 200:
                return Response(body, status_code=int(start["status"]), media_type="application/json")
            bodies[uid] = body
        return bodies or _no_replica().response()

    async def _metrics(self, forwarded: ForwardedRequest) -> Response:
        """Every live replica's ``/metrics`` with a ``replica`` label, plus the router's series."""
        bodies = await self._each_replica(forwarded)
        if isinstance(bodies, Response):
            return bodies
        texts = {uid: body.decode("utf-8") for uid, body in bodies.items()}
        return Response(merge_expositions(texts, self._router_families(len(texts))), media_type=CONTENT_TYPE)

    async def _reset(self, forwarded: ForwardedRequest) -> Response:
        """The cache reset on every live replica; what each dropped, summed."""
        bodies = await self._each_replica(forwarded)
        if isinstance(bodies, Response):
            return bodies
        answers = [json.loads(body) for body in bodies.values()]
        return JSONResponse({"success": True, "replicas": len(answers),
                             **{k: sum(a[k] for a in answers) for k in ("device_blocks", "host_blocks")}})

    def _router_families(self, alive: int) -> list[Metric]:
        replicas = GaugeMetricFamily("asymcache_replicas", "Engine replicas answering the scrape.", value=alive)
        decisions = Counter[str]()
        jobs = 0
        for router in self._routers():
            decisions.update(dict(router.decisions))
            jobs += len(router.table)
        table = GaugeMetricFamily(
            "asymcache_router_jobs",
            "Routing keys in the router's affinity table (a gone replica's too, until they move).",
            value=jobs,
        )
        routed = Metric("asymcache_router_decisions", "Requests with a routing key routed, by why they went where they did.", "counter")
        for reason in ("affinity", "new", "replica_gone", "overloaded", "overflow"):
            routed.add_sample("asymcache_router_decisions_total", {"reason": reason}, float(decisions[reason]))
        retried = Metric("asymcache_gateway_retries", "Requests sent again: their replica died before answering.",
                         "counter")
        retried.add_sample("asymcache_gateway_retries_total", {}, float(self.retries))
        return [replicas, table, routed, retried]


async def _bounded(gen: DeploymentResponseGenerator, timeout: float) -> AsyncIterator[Message]:
    """The messages of a short response, all within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                yield await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
    finally:
        gen.cancel()


__all__ = [
    "APP_NAME",
    "ENGINE_DEPLOYMENT",
    "ForwardedRequest",
    "Gateway",
    "Message",
    "failed_stream_tail",
    "proxy_request_id",
]
