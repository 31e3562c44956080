"""The app: :func:`create_app` wires the routes to one :class:`~agent_runtime.server.state.AppState`.
Every request passes :class:`~agent_runtime.server.request_guard.RequestGuard` first (the API
key, the body size cap, the bound on completions in flight, a JSON 500 for what escapes a
route). :func:`serve` runs the app with uvicorn, as its :class:`ServeOptions` say.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_runtime.reasoning import REASONING_PARSERS
from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import admin, anthropic_messages, openai_responses, serving
from agent_runtime.server.auth import route_path
from agent_runtime.server.errors import APIError
from agent_runtime.server.frontend import FrontendOptions, app_kwargs, apply_frontend
from agent_runtime.server.generation_defaults import (
    check_generation_config,
    check_generation_config_source,
)
from agent_runtime.server.openapi_doc import openapi_with_bodies
from agent_runtime.server.request_guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    RequestGuard,
)
from agent_runtime.server.response_store import DEFAULT_STORE_SIZE, ResponseStore
from agent_runtime.server.state import AppState, RuntimeSource, app_state
from asymcache_core.chat_template_options import check_template_kwargs, load_chat_template

logger = logging.getLogger(__name__)

#: Seconds SIGTERM waits for in-flight requests before aborting them (``--shutdown-timeout``).
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
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
    path = route_path(request.scope)
    app_state(request).metrics.count(path, exc.status)
    if anthropic_messages.is_messages_path(path):
        return anthropic_messages.error_response(exc)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no such route: 404, a route without this method: 405) in the
    error body of the route's API, as OpenAI answers an unknown URL."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method not allowed ({request.method} {request.url.path})"
    else:
        message = str(exc.detail)
    error = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
    response = (anthropic_messages.error_response(error) if anthropic_messages.is_messages_path(route_path(request.scope))
                else error.response())
    response.headers.update(exc.headers or {})  # 405's Allow
    return response


def served_names(names: str | Sequence[str], option: str = "model_name") -> tuple[str, ...]:
    """The served names: one, or several (vLLM's ``--served-model-name`` takes aliases; the
    first is the one responses and metrics report).

    Args:
        names: a name, or a list of names.
        option: the option's name, for the error.

    Returns:
        The names, duplicates left out, in their order.

    Raises:
        ValueError: none, or an empty or non-string name.
    """
    listed = [names] if isinstance(names, str) else list(names) if isinstance(names, Sequence) else [names]
    if not listed or any(not isinstance(n, str) or not n.strip() for n in listed):
        raise ValueError(f"{option}: must be one or more non-empty names, got {names!r}")
    return tuple(dict.fromkeys(listed))


def create_app(
    runtime_or_engine_factory: RuntimeSource,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    *,
    default_max_tokens: int | None = None,
    override_generation_config: str | Mapping[str, Any] | None = None,
    generation_config: str | None = "auto",
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
    trust_request_chat_template: bool = False,
    responses_store_size: int = DEFAULT_STORE_SIZE,
    frontend: FrontendOptions | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app.

    Args:
        runtime_or_engine_factory: an :class:`AgentRuntime` (used as is, never closed by the
            app), an ``Engine`` (wrapped in a runtime the app owns), or a zero-argument callable
            returning either (called at startup; what it builds is closed at shutdown).
        model_name: the served name, or several (vLLM's ``--served-model-name`` aliases):
            ``/v1/models`` lists each, a request may send any as ``model`` (or none), and
            responses report the first.
        api_key: when set, ``/v1/*`` and the cache resets require ``Authorization: Bearer <api_key>``
            (or ``x-api-key``); ``/health``, ``/metrics``, ``/version`` and the others answer without it
            (vLLM's rule, :func:`~agent_runtime.server.auth.needs_key`).
        default_max_tokens: ``max_tokens`` of a chat (or Responses) request that gives none,
            and the cap of a text completion's default (16). None: vLLM's defaults, the model's
            ``max_new_tokens`` if its generation config has one, else the rest of the context.
        override_generation_config: sampling defaults of requests that leave the fields out,
            over the generation config's (vLLM's ``--override-generation-config``: JSON text or a
            mapping of ``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties,
            ``max_new_tokens``). Fields in neither take vLLM's defaults (temperature 1).
        generation_config: vLLM's ``--generation-config``, under the override: ``auto`` (None:
            the model's ``generation_config.json``), ``vllm`` (none) or a folder holding one.
        max_request_body_bytes: bodies beyond this are a 413.
        max_queue_len: completions in flight beyond the engine's ``max_num_seqs`` before new
            ones are a 429 with ``Retry-After`` (None: unbounded).
        trust_request_chat_template: serve chats that bring their own ``chat_template`` (a
            template runs in Jinja's sandbox, but loops in it take the server's time; vLLM
            refuses them unless told to trust its clients).
        responses_store_size: Responses API responses kept for ``previous_response_id`` and
            ``GET /v1/responses/{id}`` (least recently used dropped first; 0: none stored).
        frontend: vLLM's frontend flags (CORS, ``root_path``, the docs routes, ``max_logprobs``,
            forced usage, request logging, the reply's role); None: vLLM's defaults.

    Returns:
        The FastAPI app; its :class:`AppState` is ``app.state.server``.

    Raises:
        TypeError: ``runtime_or_engine_factory`` is none of these.
        ValueError: a negative cap, no served name, a bad (override) generation config.
    """
    names = served_names(model_name)
    generation = check_generation_config(override_generation_config)
    source = check_generation_config_source(generation_config)
    if default_max_tokens is not None and (isinstance(default_max_tokens, bool) or not isinstance(
            default_max_tokens, int) or default_max_tokens < 1):
        raise ValueError(f"default_max_tokens: must be an integer >= 1, got {default_max_tokens!r}")
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes: must be >= 1, got {max_request_body_bytes!r}")
    if max_queue_len is not None and max_queue_len < 0:
        raise ValueError(f"max_queue_len: must be >= 0, got {max_queue_len!r}")
    state = AppState(names[0], api_key, default_max_tokens, aliases=names[1:], override_generation_config=generation,
                     generation_config=source)
    state.attach(runtime_or_engine_factory)
    state.trust_request_chat_template = bool(trust_request_chat_template)
    state.responses = ResponseStore(responses_store_size)
    state.frontend = frontend = frontend if frontend is not None else FrontendOptions()
    app = FastAPI(title="AsymCache OpenAI-compatible server", lifespan=_lifespan, **app_kwargs(frontend))
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/health", serving.health, methods=["GET"])
    # vLLM's (SageMaker's liveness route): the health check under another name
    # NOTE: one route a method, as vLLM registers them: a route of both methods gives both
    # OpenAPI operations one id (FastAPI warns of the duplicate)
    for method in ("GET", "POST"):
        app.add_api_route("/ping", serving.health, methods=[method], name="ping")
    app.add_api_route("/v1/models", serving.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", serving.model, methods=["GET"])
    app.add_api_route("/version", serving.version, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route(openai_responses.PATH, openai_responses.create_response, methods=["POST"])
    app.add_api_route(openai_responses.PATH + "/{response_id}", openai_responses.get_response, methods=["GET"])
    app.add_api_route(openai_responses.PATH + "/{response_id}/input_items", openai_responses.list_input_items,
                      methods=["GET"])
    app.add_api_route(openai_responses.PATH + "/{response_id}", openai_responses.delete_response, methods=["DELETE"])
    app.add_api_route(openai_responses.PATH + "/{response_id}/cancel", openai_responses.cancel_response,
                      methods=["POST"])
    app.add_api_route(anthropic_messages.PATH, anthropic_messages.create_message, methods=["POST"])
    app.add_api_route(anthropic_messages.COUNT_PATH, anthropic_messages.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"])
    for path in admin.RESET_PATHS:
        app.add_api_route(path, admin.reset_prefix_cache, methods=["POST"])
    app.add_middleware(
        RequestGuard, state=state, max_body_bytes=max_request_body_bytes, max_queue_len=max_queue_len
    )
    apply_frontend(app, frontend)
    app.openapi = openapi_with_bodies(app, names)  # type: ignore[method-assign]
    return app


#: vLLM's ``--tool-call-parser`` names this server serves.
SERVED_TOOL_CALL_PARSERS = ("hermes", "llama3_json")

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
        api_key: require this bearer key on ``/v1/*`` and the cache resets
            (:func:`~agent_runtime.server.auth.needs_key`).
        policy: serving preset (:mod:`agent_runtime.presets`: ``vllm-apc``, ``asymcache``,
            ``continuum``, ...).
        num_kv_blocks: KV pool size in blocks (None: from memory).
        max_model_len: context limit (None: the model's).
        served_model_name: the name clients send, or several (vLLM's ``--served-model-name``
            aliases: ``/v1/models`` lists each, a request may send any, responses report the
            first); None: ``model``.
        chat_template: a chat template (a Jinja file or its text) instead of the model's
            (vLLM's ``--chat-template``; read and checked here).
        default_chat_template_kwargs: template variables every chat gets unless it sets its
            own (vLLM's ``--default-chat-template-kwargs``).
        trust_request_chat_template: serve chats that bring their own template.
        tool_call_parser: how replies' tool calls are written and parsed (vLLM's
            ``--tool-call-parser``): ``hermes`` (tagged calls; Qwen and models without a tools
            template) or ``llama3_json`` (Llama 3.1+'s JSON, with its own template).
        reasoning_parser: split reasoning models' thinking off chat replies into
            ``reasoning_content`` (vLLM's ``--reasoning-parser``: ``deepseek_r1``, ``qwen3``).
        responses_store_size: Responses API responses kept for ``previous_response_id``
            (0: none).
        override_generation_config: sampling defaults of requests that leave the fields out,
            over the generation config's (vLLM's ``--override-generation-config``: JSON text or
            a mapping, checked here; e.g. ``{"temperature": 0}`` for greedy replies).
        generation_config: vLLM's ``--generation-config``: ``auto`` (the model's
            ``generation_config.json``), ``vllm`` (vLLM's defaults) or a folder holding a
            ``generation_config.json`` (checked here: read before the model loads).
        log_level: uvicorn's log level (vLLM's ``--uvicorn-log-level``).
        access_log: uvicorn's access-log line per request (off: vLLM's
            ``--disable-uvicorn-access-log``).
        max_request_body_bytes: request bodies beyond this are a 413.
        max_queue_len: completions waiting beyond the running batch before new ones are a 429
            (None: unbounded).
        shutdown_timeout: on SIGTERM, seconds in-flight requests may finish before they are
            aborted (their clients get the end of the stream; the engine frees their blocks).
        ssl_keyfile: TLS key file, passed to uvicorn (vLLM's ``--ssl-keyfile``).
        ssl_certfile: TLS certificate file, passed to uvicorn (vLLM's ``--ssl-certfile``).
        ssl_ca_certs: CA certificates that client certificates are checked against, passed to
            uvicorn (vLLM's ``--ssl-ca-certs``; needs TLS).
        ssl_cert_reqs: whether a client certificate is asked for, as the ``ssl`` module's
            ``CERT_NONE`` (0, the default), ``CERT_OPTIONAL`` (1) or ``CERT_REQUIRED`` (2),
            passed to uvicorn (vLLM's ``--ssl-cert-reqs``; other than 0, needs TLS).
        frontend: vLLM's frontend flags (:class:`~agent_runtime.server.frontend.FrontendOptions`;
            :meth:`from_kwargs` takes their names as keywords).
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
    policy: str = "asymcache+continuum"
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    served_model_name: str | tuple[str, ...] | None = None
    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    trust_request_chat_template: bool = False
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    responses_store_size: int = DEFAULT_STORE_SIZE
    override_generation_config: str | Mapping[str, Any] | None = None
    generation_config: str = "auto"
    log_level: str = "info"
    access_log: bool = True
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    frontend: FrontendOptions = field(default_factory=FrontendOptions)
    engine_settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError("host: must be a non-empty address")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key: must not be empty when given")
        if self.served_model_name is not None:
            names = served_names(self.served_model_name, "served_model_name")
            # NOTE: one name stays a string (as given); several are a tuple
            object.__setattr__(self, "served_model_name", names[0] if len(names) == 1 else names)
        object.__setattr__(self, "override_generation_config",
                           check_generation_config(self.override_generation_config) or None)
        object.__setattr__(self, "generation_config", check_generation_config_source(self.generation_config))
        if not isinstance(self.access_log, bool):
            raise ValueError(f"access_log: must be a bool, got {self.access_log!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        body = self.max_request_body_bytes
        if not isinstance(body, int) or isinstance(body, bool) or body < 1:
            raise ValueError(f"max_request_body_bytes: must be an integer >= 1, got {body!r}")
        queue = self.max_queue_len
        if queue is not None and (not isinstance(queue, int) or isinstance(queue, bool) or queue < 0):
            raise ValueError(f"max_queue_len: must be an integer >= 0, got {queue!r}")
        size = self.responses_store_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"responses_store_size: must be an integer >= 0, got {size!r}")
        if not isinstance(self.shutdown_timeout, int | float) or not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {self.shutdown_timeout!r}")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            _check_readable(name, getattr(self, name))
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            # NOTE: uvicorn asserts a certificate after the model has loaded; a certificate file
            # alone is enough (a PEM holding the key too)
            raise ValueError("ssl_keyfile: needs --ssl-certfile too (the server's certificate)")
        _check_client_certs(self.ssl_ca_certs, self.ssl_cert_reqs, self.ssl_keyfile or self.ssl_certfile)
        # NOTE: a file is read once, here, so that a bad path fails before the model loads
        object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))
        check_template_kwargs(self.default_chat_template_kwargs, "default_chat_template_kwargs")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in SERVED_TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: one of {', '.join(SERVED_TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ServeOptions:
        """The options named in ``kwargs``; every other name is an engine setting.

        Args:
            kwargs: keyword arguments (``port=8080, device="cuda"``).

        Returns:
            The options (checked).
        """
        own = {f.name for f in fields(cls)} - {"engine_settings"}
        frontend = FrontendOptions.names()
        return cls(
            **{k: v for k, v in kwargs.items() if k in own},
            **({"frontend": FrontendOptions(**{k: v for k, v in kwargs.items() if k in frontend})}
               if frontend & kwargs.keys() else {}),
            engine_settings={k: v for k, v in kwargs.items() if k not in own and k not in frontend},
        )

    def build_runtime(self) -> AgentRuntime:
        """Load the model and build the runtime these options describe (blocking).

        Returns:
            The runtime (it owns its engine).

        Raises:
            ValueError: bad policy or engine settings.
        """
        return AgentRuntime.from_model(
            self.model, self.policy, num_kv_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
            chat_template=self.chat_template, chat_template_kwargs=self.default_chat_template_kwargs,
            tool_call_format=self.tool_call_parser, reasoning_parser=self.reasoning_parser, **self.engine_settings,
        )

    def build_app(self, source: RuntimeSource) -> FastAPI:
        """The app these options describe, over ``source`` (see :func:`create_app`).

        Args:
            source: a runtime, an engine, or a factory of either.

        Returns:
            The app.
        """
        return create_app(
            source, self.served_model_name or self.model, self.api_key,
            override_generation_config=self.override_generation_config, generation_config=self.generation_config,
            max_request_body_bytes=self.max_request_body_bytes, max_queue_len=self.max_queue_len,
            trust_request_chat_template=self.trust_request_chat_template,
            responses_store_size=self.responses_store_size, frontend=self.frontend,
        )


def _check_readable(option: str, path: str | None) -> None:
    """A file option's path, checked before the model loads (uvicorn would fail after)."""
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"{option}: cannot read {path!r} ({e.strerror or e})") from None


def _check_client_certs(ca_certs: str | None, cert_reqs: int, tls: str | None) -> None:
    """vLLM's ``--ssl-cert-reqs`` (an ``ssl.VerifyMode``) and ``--ssl-ca-certs``, checked before
    the model loads (uvicorn would fail on a bad mode after it)."""
    modes = tuple(int(m) for m in ssl.VerifyMode)
    if isinstance(cert_reqs, bool) or not isinstance(cert_reqs, int) or cert_reqs not in modes:
        raise ValueError(f"ssl_cert_reqs: must be one of {', '.join(map(str, modes))} (ssl.CERT_NONE, "
                         f"CERT_OPTIONAL, CERT_REQUIRED), got {cert_reqs!r}")
    # NOTE: uvicorn (and so vLLM) ignores both without a certificate of the server's own: the
    # server would take plain HTTP from anyone while it was asked to check its clients
    if not tls and (ca_certs is not None or cert_reqs != ssl.CERT_NONE):
        raise ValueError(f"{'ssl_ca_certs' if ca_certs is not None else 'ssl_cert_reqs'}: client certificates "
                         "need TLS; give --ssl-keyfile and --ssl-certfile too")


def freeze_startup_heap() -> int:
    """Moves every object the garbage collector tracks now (the model, the tokenizer, the
    imported libraries: the server's start-up heap) out of its view; a server calls it once its
    runtime is built, and ``gc.unfreeze()`` once it is closed.

    NOTE: what vLLM's engine core does after start-up, for the same reason: a full collection
    walks every tracked object, and a server that has loaded torch, transformers and FastAPI
    tracks ~257k of them (SmolLM2 on this project's 2-core CPU, 2026-12-07,
    ``python scripts/bench_gc_freeze.py``): each full pass stalled every thread, the engine's
    steps included, for 120-136 ms; after the freeze, under 0.01 ms. Not in :class:`~asymcache_core.engine.Engine` itself: a process that builds many
    engines without closing them (tests, sweeps) would keep their reference cycles forever.

    Returns:
        The objects frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(options: ServeOptions) -> None:
    """Load the model, build the runtime for the options' preset and serve it with uvicorn
    (blocking).

    Args:
        options: what to serve, and where.

    Raises:
        ValueError: bad policy or engine settings (raised before the server starts).
    """
    import uvicorn

    runtime = options.build_runtime()
    app = options.build_app(lambda: runtime)
    freeze_startup_heap()
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level,
                    access_log=options.access_log, timeout_graceful_shutdown=float(options.shutdown_timeout),
                    ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile,
                    ssl_ca_certs=options.ssl_ca_certs, ssl_cert_reqs=options.ssl_cert_reqs)
    finally:
        runtime.close_sync()
        gc.unfreeze()


__all__ = ["LOG_LEVELS", "ServeOptions", "create_app", "freeze_startup_heap", "serve", "served_names"]
