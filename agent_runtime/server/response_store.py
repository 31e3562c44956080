"""Stored responses of OpenAI's Responses API: ``store``, ``previous_response_id``, and a
response retrieved or deleted by id.

A stored response keeps the input items of its whole chain and its own output items, so a
request that names it as ``previous_response_id`` is served exactly as if the client had sent
every item itself (the same prompt, so the chain's KV blocks are hits). A chain is one agent
job, kept with its responses for the requests that continue it: the ``job_id`` its first request
named, or its first response's id; or none, where the engine's implicit jobs follow it as they
follow chat clients that name no job (an answer without a tool call ends those: an id of the
server's own, which nothing ends, would hold the job gate's reservation until its idle timeout).

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
        job_id: the chain's job (None: the engine's implicit jobs follow it).
    """

    body: Mapping[str, Any]
    items: tuple[Mapping[str, Any], ...]
    job_id: str | None = None

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

    def get(self, response_id: str, touch: bool = True) -> StoredResponse | None:
        """The stored response (now the most recently used, unless ``touch`` is off), or None."""
        found = self._responses.get(response_id)
        if found is not None and touch:
            self._responses.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was stored."""
        return self._responses.pop(response_id, None) is not None

    def require(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """A stored response a request needs: the one it continues (``param`` is
        ``previous_response_id``), reads or deletes.

        Raises:
            APIError: naming ``param`` when it is not stored (never was, deleted, dropped for
                room, or kept by another server): OpenAI's 400 for a body's
                ``previous_response_id``, a 404 for the path's response.
        """
        found = self.get(response_id)
        if found is None:
            previous = param == "previous_response_id"
            what = "Previous response" if previous else "Response"
            raise APIError(400 if previous else 404, f"{what} with id {response_id!r} not found", param=param,
                           code=f"{param.removesuffix('_id')}_not_found")
        return found


#: The id prefix of each kind of input item (OpenAI's).
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_item_ids(items: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    """``items`` each with an ``id`` (the ones without get a new one; the others are the same
    objects), as they are stored: ``GET /v1/responses/{id}/input_items`` names them, and the
    responses that continue the chain share them, ids included.

    Args:
        items: input items.

    Returns:
        The items.
    """
    return tuple(item if isinstance(item.get("id"), str) else
                 {**item, "id": f"{_ITEM_ID_PREFIXES.get(str(item.get('type', 'message')), 'item')}_"
                                f"{uuid.uuid4().hex[:24]}"}
                 for item in items)


def _listed_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """An input item as the list returns it: a message with its type, status and content parts."""
    if item.get("type", "message") != "message":
        return dict(item)
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {**item, "type": "message", "status": item.get("status", "completed"), "content": content}


def input_items_page(stored: StoredResponse, limit: int = 20, order: str = "desc", after: str | None = None
                     ) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of the items a stored response stood for
    (its chain's, then its own input; not its output), OpenAI's list object.

    Args:
        stored: the response.
        limit: items per page, 1 to 100.
        order: ``desc`` (newest first, OpenAI's default) or ``asc``.
        after: the id of the item the page starts after (the previous page's ``last_id``).

    Returns:
        ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.

    Raises:
        APIError: 400 naming ``limit``, ``order`` or ``after``.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit!r}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be asc or desc, got {order!r}", param="order")
    items = list(stored.items[: len(stored.items) - len(stored.body.get("output", ()))])
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after")
        start = ids.index(after) + 1
    page = [_listed_item(item) for item in items[start : start + limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


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
    # NOTE: a streamed call the reply's parse refused (cut off, malformed: its arguments may not
    # be JSON) is stored incomplete; it is no call the conversation goes on from
    chain = [item for item in (previous.items if previous else ())
             if not (item.get("type") == "function_call" and item.get("status") == "incomplete")]
    return [*chain, *own]


__all__ = [
    "DEFAULT_STORE_SIZE", "ResponseStore", "StoredResponse", "chain_digest", "chain_items", "input_items_page",
    "new_response_id", "with_item_ids",
    "response_digest",
]
