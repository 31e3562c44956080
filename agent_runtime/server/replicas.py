"""Engine replicas on Ray Serve behind one OpenAI-compatible endpoint, with job-affinity routing.

The application has two deployments:

- ``engine`` (:class:`EngineReplica`, ``num_replicas`` copies): each runs its own
  :class:`~agent_runtime.runtime.AgentRuntime` (own engine, KV pool, Continuum pins and job
  FCFS) and the single server's app (:func:`~agent_runtime.server.app.create_app`) over it,
  called in-process as ASGI: every route, error body, API-key check and 429 is the single
  server's. It reports its queue length and free KV blocks as Ray Serve routing stats
  (``record_routing_stats``) and answers Ray Serve's health check (``check_health``).
- ``gateway`` (:class:`~agent_runtime.server.replica_gateway.Gateway`, one copy, the HTTP
  ingress): reads each request's body, takes
  its affinity key (:func:`~agent_runtime.server.job_router.routing_key`) and forwards the
  request through a streaming :class:`~ray.serve.handle.DeploymentHandle`. The handle's
  request router is :class:`~agent_runtime.server.replica_router.JobRequestRouter`, a Ray Serve
  custom ``RequestRouter`` that applies
  :func:`~agent_runtime.server.job_router.route` (the job's replica first, new jobs by queue
  length and free KV). ``/metrics`` is every replica's exposition with a ``replica`` label,
  plus the router's own series; a cache reset (``/reset_prefix_cache``) reaches every replica.

Faults: Ray Serve replaces a replica that dies or fails its health check. A request whose
replica dies before its response started (a non-streamed one until it finishes) is sent again,
to another replica, where its job re-prefills; a stream that loses its replica midway ends
with an error frame and ``[DONE]``. With no live replica the answer is a 503 with OpenAI's body.

Entry points: :func:`build_app` (the Ray Serve application, for ``serve.run`` on any Ray
cluster) and :func:`serve_replicas` (a local Ray cluster, as ``asymcache serve --replicas N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from agent_runtime.server.app import ServeOptions, freeze_startup_heap
from agent_runtime.server.job_router import RoutingPolicy
from agent_runtime.server.replica_gateway import (
    APP_NAME,
    ENGINE_DEPLOYMENT,
    ForwardedRequest,
    Gateway,
    Message,
    failed_stream_tail,
)
from agent_runtime.server.replica_router import JobRequestRouter

logger = logging.getLogger(__name__)

GATEWAY_DEPLOYMENT = "gateway"
#: The response header that names the replica that answered.
REPLICA_HEADER = "x-asymcache-replica"
#: Requests one engine replica takes from Ray Serve at once; the replica's own bound
#: (``max_queue_len`` beyond the running batch, a 429) answers before this one does.
MAX_ONGOING_REQUESTS = 4096


@dataclass(frozen=True)
class ReplicaSettings:
    """How the replicas are deployed and routed (the Ray side of ``serve --replicas``).

    Attributes:
        num_replicas: engine replicas.
        policy: the affinity and overload rule of the router.
        num_cpus: Ray CPUs each engine replica reserves.
        num_gpus: Ray GPUs each engine replica reserves (None: its ``tensor_parallel_size``,
            1 by default, when the engine's device is CUDA, else 0).
        routing_stats_period_s: how often each replica reports its load to the routers.
        health_check_period_s: how often Ray Serve checks each replica.
        health_check_timeout_s: a check unanswered this long fails (the replica is replaced).
        max_attempts: sends of one request before it is a 503 (replicas that die under it).

    Raises:
        ValueError: a bad count or period (one line naming it).
    """

    num_replicas: int = 2
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    num_cpus: float = 1.0
    num_gpus: float | None = None
    routing_stats_period_s: float = 1.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        check_replicas(self.num_replicas)
        for name in ("num_cpus", "routing_stats_period_s", "health_check_period_s", "health_check_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        if self.num_gpus is not None and not self.num_gpus >= 0:
            raise ValueError(f"num_gpus: must be >= 0, got {self.num_gpus!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be an integer >= 1, got {self.max_attempts!r}")


def check_replicas(value: Any) -> int:
    """A replica count, checked.

    Args:
        value: the ``--replicas`` value.

    Returns:
        It.

    Raises:
        ValueError: not an integer >= 1 (``replicas: ...``).
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"replicas: must be an integer >= 1, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The engine replica
# ----------------------------------------------------------------------------------------------


class EngineReplica:
    """One engine replica: an :class:`AgentRuntime` and the single server's app over it.

    Args:
        options: what to serve (the host and port are the gateway's).
    """

    def __init__(self, options: ServeOptions) -> None:
        self.runtime = options.build_runtime()
        # NOTE: the app is given the runtime, so it never closes it; :meth:`__del__` does.
        self.app = options.build_app(self.runtime)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # NOTE: the replica's actor process lives as long as its runtime: see freeze_startup_heap
        freeze_startup_heap()

    async def forward(self, request: ForwardedRequest, routing_key: str | None = None,
                      replica: str | None = None, home_only: bool = False) -> AsyncIterator[Message]:
        """Run one request through the app; yields its ASGI response messages.

        Args:
            request: the request.
            routing_key: its affinity key (read by the router, not here).
            replica: the replica it was sent to, if targeted (read by the router).
            home_only: it reads a response stored on its key's replica (read by the router).

        Yields:
            ``http.response.start`` (with the :data:`REPLICA_HEADER`), then the body messages.
        """
        queue: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # NOTE: the app learns of a disconnect when the gateway lets go
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), self.replica_id.encode()))
                message = {**message, "headers": headers}
            await queue.put(message)

        async def run() -> None:
            try:
                await self.app(request.scope(), receive, send)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await queue.get()) is not None:
                yield message
        finally:
            gone.set()
            if not task.done():
                # NOTE: the app aborts the request on the disconnect (its KV is freed); give it
                # a moment before cancelling outright.
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
                task.cancel()

    async def record_routing_stats(self) -> dict[str, Any]:
        """The load the router reads (Ray Serve calls this every ``routing_stats_period_s``).

        Returns:
            ``queue_len`` (running plus waiting), ``free_kv_blocks``, ``kv_blocks_total`` and
            ``cache_hit_tokens`` (prompt tokens served from the cache so far).
        """
        stats = await self.runtime.call(lambda engine: engine.stats())
        return {
            "queue_len": stats.requests_running + stats.requests_waiting,
            "free_kv_blocks": stats.kv_blocks_total - stats.kv_blocks_in_use,
            "kv_blocks_total": stats.kv_blocks_total,
            "cache_hit_tokens": stats.engine_cache_hit_tokens_total,
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine thread answers between steps.

        Raises:
            RuntimeError: the runtime is closed or the engine thread does not answer.
        """
        if self.runtime.closed:
            raise RuntimeError("the engine is not running")
        await asyncio.wait_for(self.runtime.call(lambda engine: None), timeout=20.0)

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close_sync(timeout=5.0)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def build_app(options: ServeOptions, settings: ReplicaSettings | None = None) -> serve.Application:
    """The Ray Serve application: ``settings.num_replicas`` engines behind one gateway.

    Deploy it on any Ray cluster with ``serve.run(build_app(options, settings), name="asymcache",
    route_prefix="/")``; the endpoint is Ray Serve's HTTP proxy (its ``http_options``: host and
    port), not ``options.host`` / ``options.port``.

    Args:
        options: what each replica serves (model, preset, pool, API key, caps).
        settings: the replicas and their routing (default: 2 replicas).

    Returns:
        The application (``serve.run`` it).
    """
    settings = settings or ReplicaSettings()
    device = str(options.engine_settings.get("device") or "cpu")
    # NOTE: a tensor-parallel replica's worker ranks are its own subprocesses: they inherit the
    # GPUs Ray gives the replica, one per rank.
    ranks = int(options.engine_settings.get("tensor_parallel_size") or 1)
    gpus = settings.num_gpus if settings.num_gpus is not None else (float(ranks) if device.startswith("cuda") else 0.0)
    policy = settings.policy
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=settings.num_replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": gpus},
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        graceful_shutdown_timeout_s=float(options.shutdown_timeout),
        request_router_config=RequestRouterConfig(
            request_router_class=JobRequestRouter,
            request_router_kwargs={"overload_factor": policy.overload_factor,
                                   "overload_margin": policy.overload_margin, "max_jobs": policy.max_jobs},
            request_routing_stats_period_s=settings.routing_stats_period_s,
            request_routing_stats_timeout_s=max(settings.routing_stats_period_s, 10.0),
        ),
    )
    gateway = serve.deployment(Gateway, name=GATEWAY_DEPLOYMENT).options(
        num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS * settings.num_replicas,
        ray_actor_options={"num_cpus": 0},
    )
    return gateway.bind(engine.bind(options), settings.max_attempts, max_body_bytes=options.max_request_body_bytes)


#: uvicorn's log levels -> Ray Serve's.
_SERVE_LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO",
                     "debug": "DEBUG", "trace": "DEBUG"}


def serve_replicas(options: ServeOptions, num_replicas: int, settings: ReplicaSettings | None = None) -> None:
    """Start a local Ray cluster and serve ``num_replicas`` engine replicas at
    ``options.host:options.port`` until interrupted (SIGINT or SIGTERM); blocking.

    Args:
        options: what to serve, and where.
        num_replicas: engine replicas (>= 1).
        settings: the rest of the replicas' settings (their count is ``num_replicas``).

    Raises:
        ValueError: a bad replica count.
    """
    check_replicas(num_replicas)
    if num_replicas > 1 and options.engine_settings.get("kv_events_config"):
        # NOTE: on one host every replica would bind the same ZMQ endpoints.
        raise ValueError("kv_events_config: not with more than one replica on a local cluster (the replicas "
                         "would bind the same endpoints); deploy build_app() with one endpoint per node instead")
    settings = dataclasses.replace(settings or ReplicaSettings(), num_replicas=num_replicas)
    if not ray.is_initialized():
        # NOTE: logical CPUs: enough for every replica even on a small machine.
        ray.init(num_cpus=max(os.cpu_count() or 1, int(num_replicas * settings.num_cpus) + 1),
                 include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(build_app(options, settings), name=APP_NAME, route_prefix="/",
                  logging_config={"log_level": _SERVE_LOG_LEVELS[options.log_level],
                                  "enable_access_log": options.access_log})
        logger.warning("serving %d replicas of %s at http://%s:%d", num_replicas, options.model,
                       options.host, options.port)
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(0.5):
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.shutdown()
        ray.shutdown()


__all__ = [
    "APP_NAME", "ENGINE_DEPLOYMENT", "REPLICA_HEADER", "EngineReplica", "ForwardedRequest", "Gateway", "ReplicaSettings",
    "build_app", "check_replicas", "failed_stream_tail", "serve_replicas",
]
