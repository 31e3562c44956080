"""The gateway counts a job that moves because its replica is gone: a real
:class:`~agent_runtime.server.replica_router.JobRequestRouter` (Ray Serve's router, no cluster)
behind a real :class:`~agent_runtime.server.replica_gateway.Gateway`, whose handle is a stand-in
that routes each request through that router the way Ray Serve's handle does."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402
from starlette.requests import Request  # noqa: E402

from agent_runtime.server.replica_gateway import ENGINE_DEPLOYMENT, ForwardedRequest, Gateway  # noqa: E402
from agent_runtime.server.replica_router import JobRequestRouter  # noqa: E402

APP = "replica-gone-test"
REPLICA_HEADER = b"x-test-replica"


class _Replica:
    """What the router reads of a running replica."""

    def __init__(self, uid: str, queue_len: int = 0) -> None:
        self.replica_id = ReplicaID(uid, DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP))
        self.routing_stats = {"queue_len": queue_len, "free_kv_blocks": 100}
        self.multiplexed_model_ids: set[str] = set()
        self.node_id = "node"
        self.availability_zone = None
        self.max_ongoing_requests = 16

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return int(self.routing_stats["queue_len"])


class _Routed:
    """A streamed answer whose replica the router picks when its first message is awaited, as
    Ray Serve's handle does: the router's first rank that accepts (here: its first replica)."""

    def __init__(
        self,
        router: JobRequestRouter,
        forwarded: ForwardedRequest,
        routing: dict[str, Any],
        request_id: str,
    ) -> None:
        self.router = router
        self.forwarded = forwarded
        self.routing = routing
        self.request_id = request_id
        self.messages: list[dict[str, Any]] | None = None

    def __aiter__(self) -> _Routed:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.messages is None:
            self.messages = await self._answer()
        if not self.messages:
            raise StopAsyncIteration
        return self.messages.pop(0)

    async def _answer(self) -> list[dict[str, Any]]:
        metadata = RequestMetadata(request_id=self.request_id, internal_request_id=self.request_id)
        pending = PendingRequest(args=[self.forwarded], kwargs=self.routing, metadata=metadata)
        ranks = await self.router.choose_replicas(list(self.router.curr_replicas.values()), pending)
        replica = ranks[0][0]
        self.router.on_request_routed(pending, replica.replica_id, None)
        uid = replica.replica_id.unique_id
        if self.forwarded.path == "/metrics":
            body = b'# HELP up Up.\n# TYPE up gauge\nup{model="m"} 1.0\n'
        else:
            body = b'{"ok": true}'
        self.router.on_request_completed(replica.replica_id, self.request_id)
        return [
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(REPLICA_HEADER, uid.encode())],
            },
            {"type": "http.response.body", "body": body, "more_body": False},
        ]

    def cancel(self) -> None:
        self.messages = []


class _Handle:
    """The engine deployment's handle, routing through ``router``."""

    def __init__(self, router: JobRequestRouter) -> None:
        self.router = router
        self._ids = itertools.count()

    def options(self, **_: Any) -> _Handle:
        return self

    @property
    def forward(self) -> _Handle:
        return self

    def remote(self, forwarded: ForwardedRequest, **routing: Any) -> _Routed:
        return _Routed(self.router, forwarded, routing, f"req-{next(self._ids)}")


def _request(method: str, path: str, body: bytes = b"") -> Request:
    sent = [body]

    async def receive() -> dict[str, Any]:
        chunk = sent.pop(0) if sent else b""
        return {"type": "http.request", "body": chunk, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return Request(
        {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""},
        receive,
    )


def _decisions(text: str) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "asymcache_router_decisions_total"
    }


def _router(*replicas: _Replica) -> JobRequestRouter:
    router = JobRequestRouter(
        deployment_id=DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP),
        handle_source=DeploymentHandleSource.UNKNOWN,
    )
    router.initialize_state()
    router.update_replicas(list(replicas))
    return router


def test_a_job_whose_replica_is_gone_is_counted_once_and_lands_on_a_live_one():
    async def scenario() -> None:
        router = _router(_Replica("a"), _Replica("b", queue_len=3))
        gateway = Gateway(engine=_Handle(router), app_name=APP)  # type: ignore[arg-type]
        body = b'{"model": "m", "job_id": "job-x", "messages": [{"role": "user", "content": "hi"}]}'

        async def chat() -> str:
            response = await gateway(_request("POST", "/v1/chat/completions", body))
            assert response.status_code == 200
            return dict(response.raw_headers)[REPLICA_HEADER].decode()

        async def decisions() -> dict[str, float]:
            response = await gateway(_request("GET", "/metrics"))
            assert response.status_code == 200
            return _decisions(response.body.decode())

        assert await chat() == "a"  # the least loaded replica
        assert await chat() == "a"
        assert await decisions() == {
            "affinity": 1,
            "new": 1,
            "replica_gone": 0,
            "overloaded": 0,
            "overflow": 0,
        }
        router.on_replica_actor_died(
            ReplicaID("a", DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP))
        )
        assert await chat() == "b"  # moved to the live replica ...
        assert (await decisions())["replica_gone"] == 1  # ... counted as such
        assert await chat() == "b"  # and it stays there
        assert await decisions() == {
            "affinity": 2,
            "new": 1,
            "replica_gone": 1,
            "overloaded": 0,
            "overflow": 0,
        }
        assert router.table.jobs_on("a") == 0 and router.table.jobs_on("b") == 1

    asyncio.run(scenario())


def test_a_replaced_replica_s_jobs_are_counted_as_gone():
    async def scenario() -> None:
        a, b, c = _Replica("a"), _Replica("b", queue_len=3), _Replica("c", queue_len=1)
        router = _router(a, b)
        gateway = Gateway(engine=_Handle(router), app_name=APP)  # type: ignore[arg-type]
        body = b'{"model": "m", "job_id": "job-y", "prompt": "hello"}'
        await gateway(_request("POST", "/v1/completions", body))
        router.update_replicas([b, c])  # Ray Serve replaced "a" with "c"
        response = await gateway(_request("POST", "/v1/completions", body))
        assert dict(response.raw_headers)[REPLICA_HEADER] == b"c"
        assert router.decisions == {"new": 1, "replica_gone": 1}

    asyncio.run(scenario())


def test_a_moved_request_chosen_again_keeps_its_reason():
    # NOTE: when every rank refuses a request, Ray Serve asks the router again; the key was
    # claimed for the new replica on the first ask, which must not make the move "affinity"
    async def scenario() -> None:
        router = _router(_Replica("a"), _Replica("b", queue_len=3))
        handle = _Handle(router)
        forwarded = ForwardedRequest("POST", "/v1/completions")
        first = handle.remote(forwarded, routing_key="job:z")
        await first.__anext__()
        router.on_replica_actor_died(
            ReplicaID("a", DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP))
        )
        metadata = RequestMetadata(request_id="again", internal_request_id="again")
        pending = PendingRequest(
            args=[forwarded], kwargs={"routing_key": "job:z"}, metadata=metadata
        )
        replicas = list(router.curr_replicas.values())
        await router.choose_replicas(replicas, pending)  # every rank refused it ...
        ranks = await router.choose_replicas(replicas, pending)  # ... so it is asked again
        router.on_request_routed(pending, ranks[0][0].replica_id, None)
        assert router.decisions == {"new": 1, "replica_gone": 1}

    asyncio.run(scenario())
