"""The app: :func:`create_app` wires the routes to one :class:`~agent_runtime.server.state.AppState`;
:func:`serve` runs it with uvicorn."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
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


def serve(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    policy: str = "vllm-apc",
    num_kv_blocks: int | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Load the model, build the runtime for ``policy`` and serve it with uvicorn (blocking).

    Args:
        model: model spec (see :class:`asymcache_core.EngineConfig`).
        host: bind address.
        port: TCP port.
        api_key: require this bearer key on ``/v1/*``.
        policy: serving policy name (:mod:`agent_runtime.presets`).
        num_kv_blocks: KV pool size (None: from memory).
        max_model_len: context limit (None: the model's).
        served_model_name: the name clients send (default: ``model``).
        log_level: uvicorn log level.
        **engine_kwargs: further engine settings.

    Raises:
        ValueError: bad policy or engine settings (raised before the server starts).
    """
    import uvicorn

    runtime = AgentRuntime.from_model(
        model, policy, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, **engine_kwargs
    )
    app = create_app(lambda: runtime, served_model_name or model, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        runtime.close_sync()


__all__ = ["create_app", "serve"]
