"""The app: :func:`create_app` wires the routes to one :class:`~agent_runtime.server.state.AppState`;
:func:`serve` runs it with uvicorn, as its :class:`ServeOptions` say."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import serving
from agent_runtime.server.errors import APIError
from agent_runtime.server.state import AppState, RuntimeSource, app_state


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: AppState = app.state.server
    await state.start()
    try:
        yield
    finally:
        await state.stop()


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    app_state(request).metrics.count(request.url.path, exc.status)
    return exc.response()


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    app_state(request).metrics.count(request.url.path, 500)
    return APIError(500, f"Internal error: {type(exc).__name__}: {exc}", type="server_error").response()


def create_app(
    runtime_or_engine_factory: RuntimeSource,
    model_name: str,
    api_key: str | None = None,
    *,
    default_max_tokens: int = 512,
) -> FastAPI:
    """Build the OpenAI-compatible app.

    Args:
        runtime_or_engine_factory: an :class:`AgentRuntime` (used as is, never closed by the
            app), an ``Engine`` (wrapped in a runtime the app owns), or a zero-argument callable
            returning either (called at startup; what it builds is closed at shutdown).
        model_name: the ``model`` clients must send (and ``/v1/models`` lists).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        default_max_tokens: ``max_tokens`` when a request gives none.

    Returns:
        The FastAPI app; its :class:`AppState` is ``app.state.server``.

    Raises:
        TypeError: ``runtime_or_engine_factory`` is none of these.
    """
    state = AppState.build(runtime_or_engine_factory, model_name, api_key, default_max_tokens)
    app = FastAPI(title="AsymCache OpenAI-compatible server", lifespan=_lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/v1/models", serving.models, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    return app


#: uvicorn's log levels.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeOptions:
    """What ``asymcache serve`` runs: the one list of the server's options.

    :func:`~agent_runtime.commands.run_serve` (the CLI's) builds it from keyword arguments
    (:meth:`from_kwargs`); :func:`serve` runs it.

    Attributes:
        model: model spec (``smollm2-135m``, an HF folder, a ``.gguf`` file, ``dummy:<config>``).
        host: bind address.
        port: TCP port (0-65535).
        api_key: require this bearer key on ``/v1/*``.
        policy: serving preset (:mod:`agent_runtime.presets`: ``vllm-apc``, ``asymcache``,
            ``continuum``, ...).
        num_kv_blocks: KV pool size in blocks (None: from memory).
        max_model_len: context limit (None: the model's).
        served_model_name: the name clients send (None: ``model``).
        log_level: uvicorn's log level.
        engine_settings: further ``EngineConfig`` fields (``device``, ``dtype``,
            ``max_num_batched_tokens``, ``chunking``, ``latency_profile``, ...), checked by
            :func:`~agent_runtime.commands.run_serve` before the model loads.

    Raises:
        ValueError: a bad host, port, key, name or log level (one line naming it).
    """

    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    policy: str = "vllm-apc"
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    engine_settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError("host: must be a non-empty address")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key: must not be empty when given")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name: must not be empty when given")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ServeOptions:
        """The options named in ``kwargs``; every other name is an engine setting.

        Args:
            kwargs: keyword arguments (``port=8080, device="cuda"``).

        Returns:
            The options (checked).
        """
        own = {f.name for f in fields(cls)} - {"engine_settings"}
        return cls(
            **{k: v for k, v in kwargs.items() if k in own},
            engine_settings={k: v for k, v in kwargs.items() if k not in own},
        )


def serve(options: ServeOptions) -> None:
    """Load the model, build the runtime for the options' preset and serve it with uvicorn
    (blocking).

    Args:
        options: what to serve, and where.

    Raises:
        ValueError: bad policy or engine settings (raised before the server starts).
    """
    import uvicorn

    runtime = AgentRuntime.from_model(
        options.model, options.policy, num_kv_blocks=options.num_kv_blocks,
        max_model_len=options.max_model_len, **options.engine_settings,
    )
    app = create_app(lambda: runtime, options.served_model_name or options.model, options.api_key)
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    finally:
        runtime.close_sync()


__all__ = ["LOG_LEVELS", "ServeOptions", "create_app", "serve"]
