"""The server's API key: which routes need it and which headers carry it (one rule for the
request guard in front of the app and the handlers' own check).

vLLM's rule: the key guards the API under ``/v1/``; ``/health``, ``/ping``, ``/metrics``,
``/version``, ``/tokenize``, ``/detokenize`` and the docs answer without it (load balancers,
Prometheus and the Gateway API's endpoint picker probe and scrape them with no key). The cache
resets need it too: they change what the server holds (vLLM serves its reset only in its
development mode).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

#: Anthropic's Messages routes: their clients send the key as ``x-api-key``.
MESSAGES_PATH = "/v1/messages"
MESSAGES_COUNT_PATH = "/v1/messages/count_tokens"
#: Every route under this prefix needs the key.
GUARDED_PREFIX = "/v1/"
#: The routes outside ``/v1/`` that need it: the cache resets (``agent_runtime.server.admin``).
GUARDED_PATHS = frozenset({"/reset_prefix_cache", "/flush_cache"})


def route_path(scope: Mapping[str, object]) -> str:
    """A request's path below the app's ``root_path`` (vLLM's ``--root-path``), as the routes see it.

    NOTE: behind a proxy that keeps the prefix, ``scope["path"]`` is ``/prefix/v1/...``; the key
    and the queue bound go by the route (vLLM's authentication strips ``root_path`` the same way),
    so a prefix cannot take a request past them.

    Args:
        scope: the ASGI scope.

    Returns:
        The path with a leading ``root_path`` removed (the path as is without one).
    """
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "") or "")
    if root and (path == root or path.startswith(root.rstrip("/") + "/")):
        return path[len(root.rstrip("/")):] or "/"
    return path


def needs_key(path: str) -> bool:
    """Whether a request to ``path`` must carry the API key (when the server has one).

    Args:
        path: the request's path.

    Returns:
        True for ``/v1`` and the routes under it, and for the cache resets.
    """
    return (
        path == GUARDED_PREFIX.rstrip("/")
        or path.startswith(GUARDED_PREFIX)
        or path in GUARDED_PATHS
    )


def key_matches(header: bytes | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant time).

    Compared as bytes, so a header that is not ASCII is a mismatch, not an error.

    Args:
        header: the raw header value, if any.
        api_key: the server's key.

    Returns:
        True on a match.
    """
    scheme, _, token = (header or b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode("utf-8"))


def authorized(path: str, headers: Mapping[bytes, bytes], api_key: str) -> bool:
    """``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``.

    NOTE: ``x-api-key`` is taken on every route, not only the Messages ones: Anthropic's
    clients (Claude Code, the TypeScript SDK) send only it, on ``/v1/models`` too.

    Args:
        path: the request's path (every route takes both headers).
        headers: its headers, lower-case names to raw values.
        api_key: the server's key.

    Returns:
        True when the request carries the key.
    """
    if key_matches(headers.get(b"authorization"), api_key):
        return True
    sent = headers.get(b"x-api-key")
    return sent is not None and hmac.compare_digest(sent, api_key.encode("utf-8"))


__all__ = [
    "GUARDED_PATHS",
    "GUARDED_PREFIX",
    "MESSAGES_COUNT_PATH",
    "MESSAGES_PATH",
    "authorized",
    "route_path",
    "key_matches",
    "needs_key",
]
