"""The per-app state: the runtime (given or built at startup), settings, metrics, checks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from agent_runtime.presets import ServingPreset
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server.auth import authorized, needs_key
from agent_runtime.server.errors import APIError
from agent_runtime.server.logprobs import TokenTexts
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.response_store import ResponseStore
from asymcache_core import Engine

RuntimeOrEngine = AgentRuntime | Engine
RuntimeSource = RuntimeOrEngine | Callable[[], RuntimeOrEngine]


def _is_engine(obj: Any) -> bool:
    # NOTE: duck-typed so that engines built by the simulator (or test doubles) qualify too.
    return hasattr(obj, "add_request") and hasattr(obj, "step")


def as_runtime(obj: Any) -> tuple[AgentRuntime, bool]:
    """An AgentRuntime from a runtime or an engine.

    Args:
        obj: an :class:`AgentRuntime` (used as is) or an engine (wrapped).

    Returns:
        The runtime, and whether it was built here (then the app owns and closes it).

    Raises:
        TypeError: neither.
    """
    if isinstance(obj, AgentRuntime):
        return obj, False
    if _is_engine(obj):
        cfg = obj.config
        # A bare engine: pin across tool pauses exactly when it runs Continuum's program FCFS.
        pinning = cfg.priority == "program"
        spec = ServingPreset(
            cfg.eviction_policy + ("+continuum" if pinning else ""),
            {"eviction_policy": cfg.eviction_policy, "priority": cfg.priority},
            pinning,
        )
        return AgentRuntime(obj, policy=spec), True
    raise TypeError("runtime_or_engine_factory: expected an AgentRuntime, an Engine, or a factory of one")


@dataclass
class AppState:
    """Everything one app's handlers share (kept on ``app.state.server``).

    Attributes:
        model_name: the ``model`` clients must send.
        api_key: the bearer key ``/v1/*`` requires (None: no auth).
        default_max_tokens: ``max_tokens`` of a chat request that gives none.
        metrics: the app's Prometheus series.
        runtime: the runtime once there is one.
        owned: the app built ``runtime`` and closes it at shutdown.
        factory: builds the runtime (or an engine) at startup, when none was given.
        created: the ``created`` time ``/v1/models`` reports.
        trust_request_chat_template: serve requests that bring a chat template of their own
            (vLLM's ``--trust-request-chat-template``; refused otherwise).
        responses: the Responses API's stored responses.
    """

    model_name: str
    api_key: str | None = None
    default_max_tokens: int = 512
    metrics: ServerMetrics = field(init=False)
    runtime: AgentRuntime | None = None
    owned: bool = False
    factory: Callable[[], RuntimeOrEngine] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    trust_request_chat_template: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)
    _token_texts: TokenTexts | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

    @classmethod
    def build(
        cls, source: RuntimeSource, model_name: str, api_key: str | None = None, default_max_tokens: int = 512
    ) -> AppState:
        """The state for a runtime, an engine, or a factory of either.

        Args:
            source: see :func:`~agent_runtime.server.app.create_app`.
            model_name: the served name.
            api_key: the bearer key, if any.
            default_max_tokens: ``max_tokens`` when a request gives none.

        Returns:
            The state (a factory is called at :meth:`start`).

        Raises:
            TypeError: ``source`` is none of these.
        """
        state = cls(model_name, api_key, default_max_tokens)
        if isinstance(source, AgentRuntime) or _is_engine(source):
            state.runtime, state.owned = as_runtime(source)
        elif callable(source):
            state.factory = source
        else:
            raise TypeError("runtime_or_engine_factory: expected an AgentRuntime, an Engine, or a factory of one")
        return state

    async def start(self) -> None:
        """Build the runtime from the factory (off the event loop), if there is one to build."""
        if self.runtime is None and self.factory is not None:
            built = await asyncio.to_thread(self.factory)
            self.runtime, _ = as_runtime(built)
            self.owned = True  # whatever the factory built is ours to close

    async def stop(self) -> None:
        """Close the runtime, and its engine's KV event sockets, if the app owns it."""
        if self.runtime is not None and self.owned:
            await self.runtime.close()
            close = getattr(self.runtime.engine, "close", None)
            if close is not None:
                close()

    def token_texts(self) -> TokenTexts:
        """The decoder of log probabilities' tokens (built on first use, from the runtime's
        tokenizer)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(getattr(self.require_runtime().engine, "tokenizer", None))
        return self._token_texts

    def require_runtime(self) -> AgentRuntime:
        """The running runtime.

        Returns:
            It.

        Raises:
            APIError: 503 when there is none or it is closed.
        """
        rt = self.runtime
        if rt is None or rt.closed:
            raise APIError(503, "The engine is not running", type="server_error", code="engine_unavailable")
        return rt

    def check_auth(self, request: Request) -> None:
        """Require the API key when one is set and the route needs it
        (:func:`~agent_runtime.server.auth.needs_key`): ``Authorization: Bearer <api_key>``, or
        ``x-api-key`` (:func:`~agent_runtime.server.auth.authorized`).

        Args:
            request: the request.

        Raises:
            APIError: 401.
        """
        if self.api_key is None or not needs_key(request.url.path):
            return
        headers = {name.lower(): value for name, value in request.scope.get("headers", ())}
        if not authorized(request.url.path, headers, self.api_key):
            raise APIError(401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key")

    def check_model(self, model: Any) -> None:
        """The body's ``model`` must be the served one.

        Args:
            model: the body's ``model``.

        Raises:
            APIError: 400 when missing, 404 when another model.
        """
        if model is None:
            raise APIError(400, "model: required", param="model")
        if model != self.model_name:
            raise APIError(
                404, f"The model {model!r} does not exist (this server serves {self.model_name!r})",
                param="model", code="model_not_found",
            )


def app_state(request: Request) -> AppState:
    """The :class:`AppState` of the app serving ``request``.

    Args:
        request: the request.

    Returns:
        The state.
    """
    state: AppState = request.app.state.server
    return state


__all__ = ["AppState", "RuntimeSource", "app_state", "as_runtime"]
