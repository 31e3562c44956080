"""Job-affinity routing across engine replicas, as pure functions (no Ray here).

Each replica's engine keeps the KV of the jobs it served (prefix cache, Continuum pins), so a
job's next turn is cheapest where its last turn ran. The policy:

- **Key.** A request's routing key is its Continuum ``job_id`` when it sends one, else a hash
  of its conversation prefix (:func:`routing_key`: the first :data:`PREFIX_MESSAGES` chat
  messages, or the first :data:`PREFIX_CHARS` characters / :data:`PREFIX_TOKENS` token ids of
  a text prompt), so that the turns of one conversation share a key without the client naming
  the job. Requests without either (``/v1/models``, a body that is not JSON) have no key.
- **Affinity.** A key seen before goes to the replica that served it last
  (:class:`AffinityTable`, an LRU table of at most ``max_jobs`` keys, so it cannot grow
  without bound), unless that replica is gone (dead, or replaced) or **overloaded**: its queue
  (requests running and waiting) exceeds ``overload_factor`` times the least loaded replica's
  queue plus ``overload_margin`` (defaults 2x + 4, :class:`RoutingPolicy`). Then the job is
  routed as a new one and re-prefills on its new replica.
- **New keys** (and moved jobs) go to the replica with the shortest queue; ties go to the most
  free KV blocks, then to the fewest jobs already homed there, then to the replica id (so the
  order is deterministic).
- **Stored responses.** A Responses request that continues a stored response
  (``previous_response_id``) and names no job is keyed by the digest its response id carries
  (:func:`affinity_digest` of the key its chain started with), and it **needs its home**: the
  response is stored there, so it stays on that replica however loaded (:func:`needs_home`).
  The table is keyed by digest (the Ray router applies :func:`affinity_digest`), so a chain
  that began under a job key or a prefix key finds the same entry.

:func:`route` returns the replicas in the order to try them; the Ray Serve router
(:class:`~agent_runtime.server.replica_router.JobRequestRouter`) hands that order to Ray, which falls
through to the next replica when one refuses the request (it is at ``max_ongoing_requests``),
and records where the request actually went (:meth:`AffinityTable.assign`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: Chat messages that make a conversation's prefix key (the system prompt and the task).
PREFIX_MESSAGES = 2
#: Characters of a text prompt that make its prefix key.
PREFIX_CHARS = 2048
#: Token ids of a token prompt that make its prefix key.
PREFIX_TOKENS = 512
#: Keys the affinity table keeps by default (least recently used ones go first).
DEFAULT_MAX_JOBS = 65_536
#: Hex characters of an affinity digest (a prefix key's hash, and what response ids carry).
DIGEST_CHARS = 32
#: What a key derived from a stored response's id starts with.
RESPONSE_KEY = "response:"
_RESPONSE_ID = re.compile(rf"^resp_([0-9a-f]{{{DIGEST_CHARS}}})[0-9a-f]+$")

Reason = Literal["affinity", "new", "replica_gone", "overloaded", "no_replica"]


def routing_key(body: bytes | Mapping[str, Any]) -> str | None:
    """The affinity key of a completion request body.

    Args:
        body: the raw JSON body, or it parsed.

    Returns:
        ``job:<job_id>`` when the body names a job; else ``response:<digest>`` when it continues
        a stored response (the digest its id carries); else ``prefix:<sha256>`` of the
        conversation's first messages (chat; the instructions and first input items of a
        Responses request) or the prompt's head (text completions); None when the body is not
        a JSON object or has none of them.
    """
    if isinstance(body, bytes | bytearray):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    if not isinstance(body, Mapping):
        return None
    job = _job_of(body)
    if job is not None:
        return f"job:{job}"
    previous = response_digest(body.get("previous_response_id"))
    if previous is not None:
        return RESPONSE_KEY + previous
    messages = body.get("messages")
    prompt = body.get("prompt")
    items = body.get("input")  # the Responses API's
    head: Any
    if isinstance(messages, list) and messages:
        # NOTE: the system prompt (a Messages body's own field, or the first messages) and the
        # first user turn: a conversation's turns keep them, where its first messages, an
        # assistant reply among them from the second turn on, would move it
        head = [body.get("system"), *[_message_head(m) for m in _opening(messages)]]
    elif isinstance(items, list | str) and items:
        # NOTE: the instructions are the conversation's first message, as a chat's system one
        instructions = body.get("instructions")
        head = [instructions, items if isinstance(items, str) else [_message_head(m) for m in _opening(items)]]
    elif isinstance(prompt, str) and prompt:
        head = prompt[:PREFIX_CHARS]
    elif isinstance(prompt, list) and prompt:
        head = prompt[:PREFIX_TOKENS]
    else:
        return None
    text = json.dumps(head, sort_keys=True, ensure_ascii=False, default=str)
    return "prefix:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def affinity_digest(key: str) -> str:
    """The affinity table's form of a routing key: a prefix or response key's own digest, the
    hash of any other (a job key).

    Args:
        key: a routing key.

    Returns:
        :data:`DIGEST_CHARS` hex characters.
    """
    for kind in ("prefix:", RESPONSE_KEY):
        if key.startswith(kind) and len(key) == len(kind) + DIGEST_CHARS:
            return key[len(kind):]
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def response_digest(response_id: Any) -> str | None:
    """The affinity digest a stored response's id carries (None: not such an id)."""
    found = _RESPONSE_ID.match(response_id) if isinstance(response_id, str) else None
    return found.group(1) if found else None


def needs_home(method: str, path: str, body: bytes | Mapping[str, Any] | None) -> str | None:
    """The routing key of a request that must go to its key's replica, if it is one: a
    Responses request continuing a stored response, or a stored response read, deleted or
    cancelled.

    Args:
        method: the HTTP method.
        path: the request's path.
        body: its body (raw or parsed), if any.

    Returns:
        ``response:<digest>`` of the response's id, or None when the request may go anywhere
        its key's policy sends it.
    """
    stored = method in ("GET", "DELETE") or (method == "POST" and path.endswith("/cancel"))
    if path.startswith("/v1/responses/") and stored:
        digest = response_digest(path[len("/v1/responses/"):].split("/", 1)[0])
        return RESPONSE_KEY + digest if digest else None
    if method != "POST" or path != "/v1/responses" or body is None:
        return None
    if isinstance(body, bytes | bytearray):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    digest = response_digest(body.get("previous_response_id")) if isinstance(body, Mapping) else None
    return RESPONSE_KEY + digest if digest else None


def _job_of(body: Mapping[str, Any]) -> str | None:
    """The job a body names, as a replica reads it: its ``job_id``, else its ``vllm_xargs``'
    (a string or an integer), else vLLM's ``session_id``
    (:func:`~agent_runtime.server.body_parsing.lift_vllm_xargs`)."""
    job = body.get("job_id")
    if job is None and isinstance(body.get("vllm_xargs"), Mapping):
        job = body["vllm_xargs"].get("job_id")
        job = str(job) if isinstance(job, int) and not isinstance(job, bool) else job
    if job is None:
        job = body.get("session_id")
    return job if isinstance(job, str) and job else None


def _opening(messages: list[Any]) -> list[Any]:
    """A conversation's opening messages: its system (and developer) messages, then its first
    user message (at most :data:`PREFIX_MESSAGES` in all)."""
    head = []
    for message in messages:
        head.append(message)
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ("system", "developer") or len(head) >= PREFIX_MESSAGES:
            break
    return head


def _message_head(message: Any) -> Any:
    """What of a chat message the prefix key hashes: its role and content."""
    if isinstance(message, Mapping):
        return [message.get("role"), message.get("content")]
    return message


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load.

    Attributes:
        replica: the replica's id.
        queue_len: requests running and waiting on it.
        free_kv_blocks: KV blocks not in use (None: not reported yet).
    """

    replica: str
    queue_len: int = 0
    free_kv_blocks: int | None = None


@dataclass(frozen=True)
class RoutingPolicy:
    """When a job leaves its replica, and how many keys the router remembers.

    Attributes:
        overload_factor: a job's replica is overloaded when its queue exceeds this many times
            the least loaded replica's queue ...
        overload_margin: ... plus this many requests.
        max_jobs: keys the affinity table keeps (least recently used ones are forgotten).

    Raises:
        ValueError: a factor below 1, a negative margin, or a table of no keys.
    """

    overload_factor: float = 2.0
    overload_margin: int = 4
    max_jobs: int = DEFAULT_MAX_JOBS

    def __post_init__(self) -> None:
        if not isinstance(self.overload_factor, int | float) or not self.overload_factor >= 1:
            raise ValueError(f"overload_factor: must be >= 1, got {self.overload_factor!r}")
        if not isinstance(self.overload_margin, int) or self.overload_margin < 0:
            raise ValueError(f"overload_margin: must be an integer >= 0, got {self.overload_margin!r}")
        if not isinstance(self.max_jobs, int) or self.max_jobs < 1:
            raise ValueError(f"max_jobs: must be an integer >= 1, got {self.max_jobs!r}")

    def overloaded(self, home: ReplicaLoad, least: ReplicaLoad) -> bool:
        """Whether a job should leave ``home`` for ``least``.

        Args:
            home: the job's replica.
            least: the least loaded replica.

        Returns:
            True when ``home``'s queue exceeds ``overload_factor * least + overload_margin``.
        """
        return home.queue_len > self.overload_factor * least.queue_len + self.overload_margin


class AffinityTable:
    """Key -> the replica that served it last; at most ``max_jobs`` keys (LRU).

    Args:
        max_jobs: the cap.
    """

    def __init__(self, max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs: must be >= 1, got {max_jobs!r}")
        self.max_jobs = max_jobs
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._per_replica: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, key: str) -> str | None:
        """The key's replica, if known (the key becomes the most recently used).

        Args:
            key: a routing key.

        Returns:
            The replica id, or None.
        """
        home = self._homes.get(key)
        if home is not None:
            self._homes.move_to_end(key)
        return home

    def assign(self, key: str, replica: str) -> None:
        """Record that ``key`` was served by ``replica`` (forgetting the oldest key when full).

        Args:
            key: the routing key.
            replica: the replica id.
        """
        old = self._homes.pop(key, None)
        if old is not None:
            self._per_replica[old] -= 1
        self._homes[key] = replica
        self._per_replica[replica] += 1
        while len(self._homes) > self.max_jobs:
            _, gone = self._homes.popitem(last=False)
            self._per_replica[gone] -= 1
        # NOTE: drops replicas left with no keys, and the negative counts of gone replicas
        # (forget_replicas stopped counting their keys, which still leave them here)
        self._per_replica = +self._per_replica

    def forget_replicas(self, alive: Iterable[str]) -> None:
        """Stop counting the keys of replicas not in ``alive`` (dead or replaced ones) as theirs.

        The keys stay, homed on the gone replica, until their next request moves them (which
        :func:`route` then tells apart from a new key: ``replica_gone``) or the LRU bound drops
        them; :meth:`jobs_on` no longer counts them.

        Args:
            alive: the ids of the replicas that run.
        """
        keep = set(alive)
        # NOTE: dropping the keys here would route their next request as "new": a move forced
        # by a dead replica would never be counted as one.
        self._per_replica = Counter({r: n for r, n in self._per_replica.items() if r in keep})

    def jobs_on(self, replica: str) -> int:
        """How many keys are homed on ``replica``.

        Args:
            replica: the replica id.

        Returns:
            The count.
        """
        return self._per_replica.get(replica, 0)


@dataclass(frozen=True)
class RouteDecision:
    """Where to try a request, in order, and why.

    Attributes:
        order: replica ids, the preferred first.
        reason: ``affinity`` (the key's replica first), ``new`` (an unseen or key-less
            request), ``replica_gone`` / ``overloaded`` (the key moves), ``no_replica``.
    """

    order: tuple[str, ...]
    reason: Reason


def rank_for_new(loads: Sequence[ReplicaLoad], table: AffinityTable | None = None) -> list[str]:
    """Replicas for a new job, the best first: shortest queue, most free KV, fewest jobs, id.

    Args:
        loads: every live replica's load.
        table: the affinity table (its per-replica job counts break ties), if any.

    Returns:
        The replica ids, in order.
    """

    def key(load: ReplicaLoad) -> tuple[int, int, int, str]:
        free = load.free_kv_blocks if load.free_kv_blocks is not None else 0
        jobs = table.jobs_on(load.replica) if table is not None else 0
        return (load.queue_len, -free, jobs, load.replica)

    return [load.replica for load in sorted(loads, key=key)]


def route(
    key: str | None, loads: Sequence[ReplicaLoad], table: AffinityTable, policy: RoutingPolicy, home_only: bool = False
) -> RouteDecision:
    """The order in which to try the replicas for one request.

    Reads the table but does not change it: the caller records the replica the request went
    to with :meth:`AffinityTable.assign` (the first one may refuse it).

    Args:
        key: the request's routing key (None: no affinity).
        loads: every live replica's load.
        table: the affinity table.
        policy: the overload rule.
        home_only: the request needs its key's replica (it reads what is stored there): it
            stays there however loaded.

    Returns:
        The decision.
    """
    if not loads:
        return RouteDecision((), "no_replica")
    ranked = rank_for_new(loads, table)
    if key is None:
        return RouteDecision(tuple(ranked), "new")
    home = table.get(key)
    if home is None:
        return RouteDecision(tuple(ranked), "new")
    by_id = {load.replica: load for load in loads}
    if home not in by_id:
        return RouteDecision(tuple(ranked), "replica_gone")
    least = by_id[ranked[0]]
    if not home_only and home != least.replica and policy.overloaded(by_id[home], least):
        return RouteDecision(tuple(ranked), "overloaded")
    return RouteDecision((home, *(r for r in ranked if r != home)), "affinity")


__all__ = [
    "DEFAULT_MAX_JOBS", "DIGEST_CHARS", "PREFIX_CHARS", "PREFIX_MESSAGES", "PREFIX_TOKENS", "RESPONSE_KEY",
    "AffinityTable", "ReplicaLoad", "RouteDecision", "RoutingPolicy", "affinity_digest", "needs_home",
    "rank_for_new", "response_digest", "route", "routing_key",
]
