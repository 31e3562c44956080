"""Which id names a completion, on the single server and behind the replica gateway: vLLM's
precedence (``_base_request_id``: the ``X-Request-Id`` header, else the body's ``request_id``,
else a fresh one). Behind the gateway, Ray Serve's proxy adds an ``x-request-id`` header to
every request that has none (its ``RequestIdMiddleware``, run here as the proxy runs it); that
header must not replace the client's own body ``request_id``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

from ray.serve._private.http_util import RequestIdMiddleware  # noqa: E402
from starlette.requests import Request  # noqa: E402

from agent_runtime.server.app import ServeOptions  # noqa: E402
from agent_runtime.server.replica_gateway import ForwardedRequest, Gateway  # noqa: E402
from agent_runtime.server.replicas import EngineReplica  # noqa: E402

MODEL = "dummy:tiny"
COMPLETION = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class _Forwarded:
    """A replica's answer as the handle streams it (``cancel`` lets go of it)."""

    def __init__(self, messages: Any) -> None:
        self.messages = messages

    def __aiter__(self) -> _Forwarded:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self.messages.__anext__()

    def cancel(self) -> None:
        pass


class _OneReplica:
    """The engine deployment's handle over one in-process :class:`EngineReplica`."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.forwarded: list[ForwardedRequest] = []

    def options(self, **_: Any) -> _OneReplica:
        return self

    @property
    def forward(self) -> _OneReplica:
        return self

    def remote(self, forwarded: ForwardedRequest, **routing: Any) -> _Forwarded:
        self.forwarded.append(forwarded)
        return _Forwarded(self.replica.forward(forwarded, **routing))


@pytest.fixture(scope="module")
def replica() -> Iterator[EngineReplica]:
    options = ServeOptions(model=MODEL, num_kv_blocks=64, max_model_len=256)
    one = EngineReplica.__new__(EngineReplica)  # NOTE: its constructor asks Ray for its id
    one.runtime = options.build_runtime()
    one.app = options.build_app(one.runtime)
    one.replica_id = "r1"
    yield one
    one.runtime.close_sync(timeout=5.0)


def _proxied(gateway: Gateway) -> Any:
    """Ray Serve's HTTP proxy in front of the gateway deployment: its request id middleware,
    then the gateway's ``__call__`` on the request."""

    async def ingress(scope: Any, receive: Any, send: Any) -> None:
        response = await gateway(Request(scope, receive))
        await response(scope, receive, send)

    return RequestIdMiddleware(ingress)


async def _post(
    app: Any, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/completions", json=body, headers=headers or {})


def test_the_direct_server_follows_vllm(replica: EngineReplica):
    async def scenario() -> None:
        named = await _post(replica.app, {**COMPLETION, "request_id": "body-1"})
        assert named.json()["id"] == "cmpl-body-1"
        headed = await _post(
            replica.app, {**COMPLETION, "request_id": "body-2"}, {"X-Request-Id": "hdr-2"}
        )
        assert headed.json()["id"] == "cmpl-hdr-2"  # vLLM: the header over the body

    asyncio.run(scenario())


def test_behind_the_gateway_the_proxy_s_id_does_not_replace_the_body_s(replica: EngineReplica):
    async def scenario() -> None:
        handle = _OneReplica(replica)
        app = _proxied(Gateway(engine=handle, live_replicas=lambda: ("r1",)))  # type: ignore[arg-type]

        named = await _post(app, {**COMPLETION, "request_id": "body-1"})
        assert named.status_code == 200, named.text
        assert named.json()["id"] == "cmpl-body-1"  # the client's own id, not the proxy's
        # one X-Request-Id comes back: the proxy's (vLLM's middleware too sends the header's
        # id or a fresh one); the replica's copy is not relayed beside it
        proxy_id = named.headers.get_list("x-request-id")
        assert len(proxy_id) == 1 and UUID4.match(proxy_id[0]), named.headers

        headed = await _post(app, {**COMPLETION, "request_id": "body-2"}, {"X-Request-Id": "hdr-2"})
        assert headed.json()["id"] == "cmpl-hdr-2"  # a client's header still wins, as in vLLM
        assert headed.headers.get_list("x-request-id") == ["hdr-2"]

        # a client's own uuid, in the header the proxy would add: still the client's
        mine = "0b7c1a52-3f0e-4d2a-9c4e-7a1b2c3d4e5f"
        own = await _post(app, COMPLETION, {"X-Request-Id": mine})
        assert own.json()["id"] == f"cmpl-{mine}"

        # no id at all: the proxy's names the completion (one id for the client, the proxy's
        # logs and the replica's)
        bare = await _post(app, COMPLETION)
        (proxy_id,) = bare.headers.get_list("x-request-id")
        assert bare.json()["id"] == f"cmpl-{proxy_id}"

        # what reached the replica: the proxy's header only where it names the completion
        sent = [
            dict((k.lower(), v) for k, v in f.headers).get(b"x-request-id")
            for f in handle.forwarded
        ]
        assert sent[0] is None and sent[1] == b"hdr-2" and sent[2] == mine.encode()
        assert sent[3] == proxy_id.encode()

    asyncio.run(scenario())
