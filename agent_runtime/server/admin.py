"""The cache-reset endpoint: ``POST /reset_prefix_cache`` (vLLM's) and ``POST /flush_cache``
(SGLang's name for the same).

A benchmark that compares cold and warm caches, or a deployment that changed what its cached
prefixes mean, drops the engine's prefix cache without restarting the server. The reset runs
on the engine thread between steps (:meth:`~asymcache_core.engine.Engine.reset_prefix_cache`):
every cached block that no request holds and no pin protects is evicted, and with
``reset_external=true`` the host tier's copies go too. Running requests keep their blocks and
go on; vLLM's ``reset_running_requests=true``, which preempts them first, is refused with a
400 that says so. With an API key the route needs it, as ``/v1/*`` does
(:func:`~agent_runtime.server.auth.needs_key`).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from agent_runtime.server.errors import APIError
from agent_runtime.server.state import app_state

#: The routes of the reset (vLLM's, SGLang's).
RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")

_TRUE = frozenset({"true", "1"})
_FALSE = frozenset({"false", "0"})


def query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter (``true``/``false``/``1``/``0``, any case; absent: false).

    Raises:
        APIError: 400 naming the parameter for any other value.
    """
    raw = request.query_params.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise APIError(400, f"{name}: must be true or false, got {raw!r}", param=name)


async def reset_prefix_cache(request: Request) -> JSONResponse:
    """``POST /reset_prefix_cache`` (and ``/flush_cache``): evicts the unheld cached blocks.

    Query parameters: ``reset_external`` (also drop the host tier's copies) and
    ``reset_running_requests`` (only ``false``).

    Returns:
        ``{"success": true, "device_blocks": N, "host_blocks": M}``: what was dropped.
    """
    state = app_state(request)
    path = request.url.path
    host_tier = query_flag(request, "reset_external")
    if query_flag(request, "reset_running_requests"):
        raise APIError(400, "reset_running_requests: not supported; running requests keep their blocks until "
                       "they finish, and the reset evicts every cached block no request holds",
                       param="reset_running_requests")
    reset = await state.require_runtime().call(lambda engine: engine.reset_prefix_cache(host_tier=host_tier))
    state.metrics.count(path, 200)
    return JSONResponse({"success": True, "device_blocks": reset.device_blocks, "host_blocks": reset.host_blocks})


__all__ = ["RESET_PATHS", "query_flag", "reset_prefix_cache"]
