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
from agent_runtime.server.auth import authorized, needs_key, route_path
from agent_runtime.server.errors import APIError
from agent_runtime.server.frontend import FrontendOptions
from agent_runtime.server.generation_defaults import sampling_defaults
from agent_runtime.server.logprobs import TokenTexts
from agent_runtime.server.metrics import ServerMetrics
from agent_runtime.server.response_store import ResponseStore
from agent_runtime.server.responses_background import BackgroundRuns
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
        model_name: the served name responses report (vLLM's first ``--served-model-name``).
        aliases: further names clients may send as ``model`` (vLLM's further served names).
        api_key: the bearer key ``/v1/*`` requires (None: no auth).
        default_max_tokens: ``max_tokens`` of a chat request that gives none (None: vLLM's
            default, the model's ``max_new_tokens`` if its generation config has one, else the
            rest of the context).
        override_generation_config: sampling defaults stated by the operator (vLLM's
            ``--override-generation-config``, checked), laid over the generation config's.
        generation_config: which generation config gives the sampling defaults (vLLM's
            ``--generation-config``, checked): ``auto`` (the model's), ``vllm`` (none) or a
            folder's path.
        sampling_defaults: the sampling defaults in force (set once there is a runtime:
            :func:`~agent_runtime.server.generation_defaults.sampling_defaults`).
        metrics: the app's Prometheus series.
        runtime: the runtime once there is one.
        owned: the app built ``runtime`` and closes it at shutdown.
        factory: builds the runtime (or an engine) at startup, when none was given.
        created: the ``created`` time ``/v1/models`` reports.
        trust_request_chat_template: serve requests that bring a chat template of their own
            (vLLM's ``--trust-request-chat-template``; refused otherwise).
        responses: the Responses API's stored responses.
        background: the Responses API's background runs (``background: true``).
        frontend: vLLM's frontend flags the handlers read (``max_logprobs``, forced usage,
            request logging, the reply's role).
    """

    model_name: str
    api_key: str | None = None
    default_max_tokens: int | None = None
    aliases: tuple[str, ...] = ()
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    generation_config: str = "auto"
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics = field(init=False)
    runtime: AgentRuntime | None = None
    owned: bool = False
    factory: Callable[[], RuntimeOrEngine] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    trust_request_chat_template: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)
    background: BackgroundRuns = field(default_factory=BackgroundRuns)
    frontend: FrontendOptions = field(default_factory=FrontendOptions)
    _token_texts: TokenTexts | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

    @classmethod
    def build(
        cls, source: RuntimeSource, model_name: str, api_key: str | None = None, default_max_tokens: int | None = None
    ) -> AppState:
        """The state for a runtime, an engine, or a factory of either.

        Args:
            source: see :func:`~agent_runtime.server.app.create_app`.
            model_name: the served name.
            api_key: the bearer key, if any.
            default_max_tokens: ``max_tokens`` when a request gives none (None: vLLM's default).

        Returns:
            The state (a factory is called at :meth:`start`).

        Raises:
            TypeError: ``source`` is none of these.
        """
        state = cls(model_name, api_key, default_max_tokens)
        state.attach(source)
        return state

    def attach(self, source: RuntimeSource) -> None:
        """Serve ``source``: a runtime or an engine now, a factory's at :meth:`start`.

        Args:
            source: see :func:`~agent_runtime.server.app.create_app`.

        Raises:
            TypeError: ``source`` is none of these.
        """
        if isinstance(source, AgentRuntime) or _is_engine(source):
            self.runtime, self.owned = as_runtime(source)
            self.runtime_known()
        elif callable(source):
            self.factory = source
        else:
            raise TypeError("runtime_or_engine_factory: expected an AgentRuntime, an Engine, or a factory of one")

    async def start(self) -> None:
        """Build the runtime from the factory (off the event loop), if there is one to build."""
        if self.runtime is None and self.factory is not None:
            built = await asyncio.to_thread(self.factory)
            self.runtime, _ = as_runtime(built)
            self.owned = True  # whatever the factory built is ours to close
        self.runtime_known()

    def runtime_known(self) -> None:
        """What needs the runtime, once there is one (given, or built at startup): the
        sampling defaults, and the metrics whose buckets end at its context limit."""
        limit = getattr(self.runtime, "max_model_len", None)
        if isinstance(limit, int):
            self.metrics.set_context_limit(limit)
        self.set_sampling_defaults()

    def set_sampling_defaults(self) -> None:
        """Read the generation config :attr:`generation_config` names (the runtime's model's
        with ``auto``), with the operator's override over it, into :attr:`sampling_defaults`."""
        engine = getattr(self.runtime, "engine", None)
        model = getattr(getattr(engine, "config", None), "model", None)
        self.sampling_defaults = sampling_defaults(model if isinstance(model, str) else None,
                                                   self.override_generation_config, self.generation_config)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name clients may send as ``model``: :attr:`model_name` first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    def max_tokens_default(self) -> int:
        """``max_tokens`` of a chat (or Responses) request that gives none: the app's
        ``default_max_tokens``, else the generation config's ``max_new_tokens``, else the rest of
        the context (vLLM's; the request is submitted without ``strict_max_tokens``, so the
        engine stops it at ``max_model_len``)."""
        if self.default_max_tokens is not None:
            return self.default_max_tokens
        stated = self.sampling_defaults.get("max_tokens")
        if stated is not None:
            return int(stated)
        return int(self.require_runtime().max_model_len)

    async def stop(self) -> None:
        """Cancel the background responses still running (their requests aborted), then close
        the runtime, and its engine's KV event sockets, if the app owns it."""
        await self.background.cancel_all()
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
        path = route_path(request.scope)
        if self.api_key is None or not needs_key(path):
            return
        headers = {name.lower(): value for name, value in request.scope.get("headers", ())}
        if not authorized(path, headers, self.api_key):
            raise APIError(401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key")

    def check_model(self, model: Any) -> None:
        """The body's ``model`` must be one of the served names; left out (or null, or empty)
        it is the served model, as in vLLM (``_is_model_supported``).

        Args:
            model: the body's ``model``.

        Raises:
            APIError: 404 when another model.
        """
        if model is None or model == "" or model in self.served_names:
            return
        served = ", ".join(repr(n) for n in self.served_names)
        raise APIError(
            404, f"The model {model!r} does not exist (this server serves {served})",
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
