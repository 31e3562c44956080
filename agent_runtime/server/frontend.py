"""vLLM's frontend options (``vllm serve``'s ``FrontendArgs``) that shape the HTTP app rather
than the engine: CORS, ``root_path``, the docs routes, the log-probability cap, forced usage,
request logging and the chat reply's role.

:class:`FrontendOptions` holds and checks them; :func:`apply_frontend` sets the app up as vLLM's
``build_app`` and ``init_entrypoints_middleware`` do (vllm/entrypoints/launchers/app.py,
vllm/entrypoints/serve/middleware/register.py); the handlers read the rest from the app state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from agent_runtime.server.errors import APIError
from asymcache_core.config import json_text
from asymcache_core.logprobs import MAX_LOGPROBS

#: vLLM's request logger's name is ``vllm.entrypoints.serve.utils.request_logger``; ours:
request_logger = logging.getLogger("agent_runtime.server.requests_log")


def _names(value: Any, option: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{option}: must be a list of strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class FrontendOptions:
    """vLLM's frontend flags this server honours (each as ``vllm serve`` reads it).

    Attributes:
        allowed_origins: CORS origins (``--allowed-origins``; none: no cross-origin access).
        allowed_methods: CORS methods (``--allowed-methods``, default ``["*"]``).
        allowed_headers: CORS headers (``--allowed-headers``, default ``["*"]``).
        allow_credentials: CORS credentials (``--allow-credentials``).
        root_path: the app's ``root_path`` behind a path-based proxy (``--root-path``).
        disable_fastapi_docs: no ``/openapi.json``, ``/docs`` or ``/redoc``
            (``--disable-fastapi-docs``).
        max_logprobs: most log probabilities a request may ask for (``--max-logprobs``; at most
            :data:`~asymcache_core.logprobs.MAX_LOGPROBS`, vLLM's default).
        enable_force_include_usage: every streamed completion reports usage, as if it sent
            ``stream_options: {include_usage: true, continuous_usage_stats: true}``
            (``--enable-force-include-usage``; vLLM's ``should_include_usage``).
        enable_log_requests: log each received completion (``--enable-log-requests``).
        max_log_len: most characters of a request's body the DEBUG request log line prints
            (``--max-log-len``, vLLM's "max number of prompt characters ... printed in log";
            None: all of it).
        response_role: the chat reply's role when the prompt ends with the generation prompt
            (``--response-role``; vLLM's ``get_chat_request_role``).

    Raises:
        ValueError: a bad value (one line naming the option).
    """

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    disable_fastapi_docs: bool = False
    max_logprobs: int = MAX_LOGPROBS
    enable_force_include_usage: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    response_role: str = "assistant"

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, _names(getattr(self, name), name))
        for name in ("allow_credentials", "disable_fastapi_docs", "enable_force_include_usage",
                     "enable_log_requests"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        root = self.root_path
        if not isinstance(root, str) or (root and not root.startswith("/")):
            raise ValueError(f"root_path: must be a path starting with '/' (e.g. /api), got {root!r}")
        # NOTE: Starlette strips root_path from the path as given: "/api/" would leave routes
        # without their leading "/" (and "/" every route)
        object.__setattr__(self, "root_path", root.rstrip("/"))
        cap = self.max_logprobs
        # NOTE: vLLM takes any cap from -1 (the vocabulary) up; the sampler here reports at most
        # MAX_LOGPROBS alternatives a token, so a larger cap could not be honoured
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs: must be an integer in [0, {MAX_LOGPROBS}] (this server reports at "
                             f"most {MAX_LOGPROBS} log probabilities a token), got {cap!r}")
        length = self.max_log_len
        # NOTE: vLLM slices with any int; a negative one would cut from the end, not cap
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise ValueError(f"max_log_len: must be an integer >= 0 (characters), got {length!r}")
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ValueError(f"response_role: must be a non-empty role name, got {self.response_role!r}")

    @classmethod
    def names(cls) -> frozenset[str]:
        """The options' names (the keyword arguments :meth:`ServeOptions.from_kwargs` routes here)."""
        return frozenset(f.name for f in fields(cls))

    @property
    def serves_http_differently(self) -> bool:
        """Whether an option changes the HTTP app itself (CORS, ``root_path``, docs)."""
        default = FrontendOptions()
        return any(getattr(self, n) != getattr(default, n) for n in (
            "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "root_path",
            "disable_fastapi_docs"))


def json_list(option: str, text: str | None) -> list[str] | None:
    """A CORS flag's value as vLLM reads it: a JSON list of strings (``'["*"]'``).

    Args:
        option: the option's name, for the error.
        text: the flag's text (None: not given).

    Returns:
        The list, or None.

    Raises:
        ValueError: not a JSON list of strings (one line naming the option).
    """
    if text is None:
        return None
    value = json_text(option, text)
    if not isinstance(value, list):
        raise ValueError(f"{option}: must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return list(_names(value, option))


def app_kwargs(options: FrontendOptions) -> dict[str, Any]:
    """``FastAPI(...)``'s arguments for the options (vLLM's ``build_app``: the docs routes off
    with ``--disable-fastapi-docs``)."""
    return {"openapi_url": None, "docs_url": None, "redoc_url": None} if options.disable_fastapi_docs else {}


def apply_frontend(app: FastAPI, options: FrontendOptions) -> None:
    """Sets the app's ``root_path`` (as vLLM's ``build_app``: the attribute; FastAPI deprecates
    the constructor's argument) and adds vLLM's CORS middleware, outside every other (added
    last), so that a preflight is answered before the API key is asked for (vLLM's
    authentication lets ``OPTIONS`` through).

    Args:
        app: the app, its other middleware added.
        options: the options.
    """
    app.root_path = options.root_path
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_credentials=options.allow_credentials, allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers))


def check_logprobs(options: FrontendOptions, logprobs: int | None, prompt_logprobs: int | None,
                   field: str = "logprobs") -> None:
    """vLLM's cap on log probabilities (``SamplingParams._validate_logprobs``): a 400 naming the
    field.

    Args:
        options: the options (``max_logprobs``).
        logprobs: the sampled tokens' alternatives asked for (chat's ``top_logprobs``).
        prompt_logprobs: the prompt's.
        field: the request's name for ``logprobs`` (a chat's and a response's: ``top_logprobs``).

    Raises:
        APIError: 400 past the cap.
    """
    cap = options.max_logprobs
    if logprobs and logprobs > cap:
        raise APIError(400, f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {cap}",
                       param=field)
    if prompt_logprobs and prompt_logprobs > cap:
        raise APIError(400, f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max allowed: "
                       f"{cap}", param="prompt_logprobs")


def log_request(options: FrontendOptions, request_id: str, params: Any, body: Any = None) -> None:
    """vLLM's ``RequestLogger.log_inputs`` line, with ``--enable-log-requests``: the id and the
    sampling parameters at INFO; the body at DEBUG, its first ``max_log_len`` characters (vLLM's
    ``log_request_body``).

    Args:
        options: the options.
        request_id: the response's id.
        params: the request's sampling parameters.
        body: the parsed request (a pydantic model), for the DEBUG line.
    """
    if not options.enable_log_requests:
        return
    if body is not None and request_logger.isEnabledFor(logging.DEBUG):
        # NOTE: the body holds the prompt (vLLM's details line, which --max-log-len also cuts, is
        # not logged here: the prompt is rendered after this line, by the runtime)
        request_logger.debug("Request %s JSON body: %s", request_id,
                             body.model_dump_json(exclude_unset=True)[:options.max_log_len])
    request_logger.info("Received request %s: params: %s.", request_id, params)


__all__ = ["FrontendOptions", "app_kwargs", "apply_frontend", "check_logprobs", "json_list", "log_request",
           "request_logger"]
