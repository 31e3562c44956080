"""Stored responses of OpenAI's Responses API: ``store``, ``previous_response_id``, and a
response retrieved or deleted by id.

A stored response keeps the input items of its whole chain and its own output items, so a
request that names it as ``previous_response_id`` is served exactly as if the client had sent
every item itself (the same prompt, so the chain's KV blocks are hits). The chain is one agent
job: a request that names no ``job_id`` takes its chain's (the first response's id), so
Continuum's pins hold its KV across the tool calls between its turns, as they do for chat
clients that send job ids.

The store is in memory, per server process, and bounded: the least recently used responses go
first (a chain's newest response is used, and kept, by the turn that continues it).

Response ids carry the affinity digest of the request that started their chain
(:func:`~agent_runtime.server.job_router.affinity_digest`): behind ``serve --replicas`` the
gateway routes a chain's requests, and reads of its responses, to the replica that stores them.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_runtime.server.errors import APIError
from agent_runtime.server.job_router import DIGEST_CHARS, affinity_digest, response_digest

#: Responses a server keeps by default (``serve --responses-store-size``).
DEFAULT_STORE_SIZE = 4096
_ID_PREFIX = "resp_"


def new_response_id(digest: str) -> str:
    """A fresh response id that carries ``digest`` (32 hex characters) for routing.

    Args:
        digest: the chain's affinity digest.

    Returns:
        ``resp_<digest><16 random hex>``.
    """
    if len(digest) != DIGEST_CHARS:
        raise AssertionError(f"a digest of {DIGEST_CHARS} characters, got {digest!r}")
    return f"{_ID_PREFIX}{digest}{uuid.uuid4().hex[:16]}"


def chain_digest(routing_key: str | None) -> str:
    """The affinity digest new response ids of a request carry (a random one without a key).

    Args:
        routing_key: the request's routing key (:func:`~agent_runtime.server.job_router.routing_key`).

    Returns:
        32 hex characters.
    """
    return affinity_digest(routing_key) if routing_key is not None else uuid.uuid4().hex[:DIGEST_CHARS]


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        body: the response object as it was returned.
        items: the input items of the whole chain through this response, its output items
            last (what a client keeping the conversation itself would send next).
        job_id: the chain's job.
    """

    body: Mapping[str, Any]
    items: tuple[Mapping[str, Any], ...]
    job_id: str

    @property
    def id(self) -> str:
        """The response's id."""
        return str(self.body["id"])


class ResponseStore:
    """Stored responses by id, the least recently used dropped past ``capacity``.

    Args:
        capacity: responses kept at most (0: nothing is stored; every response reports
            ``store: false``).

    Raises:
        ValueError: a negative or non-integer capacity.
    """

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"responses_store_size: must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    @property
    def enabled(self) -> bool:
        """Whether responses are stored at all."""
        return self.capacity > 0

    def put(self, response: StoredResponse) -> None:
        """Keep ``response`` (the most recently used), dropping the oldest past capacity."""
        if not self.enabled:
            return
        self._responses[response.id] = response
        self._responses.move_to_end(response.id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        found = self._responses.get(response_id)
        if found is not None:
            self._responses.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was stored."""
        return self._responses.pop(response_id, None) is not None

    def require(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """A stored response a request needs: the one it continues (``param`` is
        ``previous_response_id``), reads or deletes.

        Raises:
            APIError: 404 naming ``param`` when it is not stored (never was, deleted, dropped
                for room, or kept by another server).
        """
        found = self.get(response_id)
        if found is None:
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise APIError(404, f"{what} with id {response_id!r} not found", param=param,
                           code=f"{param.removesuffix('_id')}_not_found")
        return found


def chain_items(previous: StoredResponse | None, input_items: str | Sequence[Mapping[str, Any]]
                ) -> list[Mapping[str, Any]]:
    """The items a request stands for: its chain's, then its own input.

    Args:
        previous: the response it continues, if any.
        input_items: its ``input`` (a string is one user message).

    Returns:
        The items, as a client keeping the conversation would send them (the chain's are the
        stored objects themselves, shared by every response of the chain: nothing mutates them).
    """
    own = [{"type": "message", "role": "user", "content": input_items}] if isinstance(input_items, str) else list(
        input_items)
    return [*(previous.items if previous else ()), *own]


__all__ = [
    "DEFAULT_STORE_SIZE", "ResponseStore", "StoredResponse", "chain_digest", "chain_items", "new_response_id",
    "response_digest",
]
