"""The Ray Serve request router of the engine replicas: job affinity over live routing stats.

:class:`JobRequestRouter` applies :func:`~agent_runtime.server.job_router.route` (the pure rule)
to Ray Serve's replicas; :mod:`agent_runtime.server.replicas` configures it on the ``engine``
deployment, and its gateway reads the routers of its own process (:func:`routers_of`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from agent_runtime.server.job_router import (
    AffinityTable,
    ReplicaLoad,
    RoutingPolicy,
    affinity_digest,
    route,
)

#: Routing choices a router remembers for requests not yet routed (see ``choose_replicas``).
_MAX_CHOSEN = 8192

#: The job routers of this process (a gateway's handle builds one; the gateway reads its
#: replica set and counters). NOTE: weak, so that a router Ray drops is not kept alive here.
_ROUTERS: weakref.WeakSet[JobRequestRouter] = weakref.WeakSet()


def _registry() -> weakref.WeakSet[JobRequestRouter]:
    """This process's :data:`_ROUTERS`.

    NOTE: looked up through the imported module, not as a global of the caller: Ray may ship
    a deployment's class by value, with copies of its globals, and a copied set would be empty.
    """
    from agent_runtime.server import replica_router

    return replica_router._ROUTERS


class JobRequestRouter(RequestRouter):
    """Ray Serve's router for the engine replicas: :func:`~agent_runtime.server.job_router.route`
    over the replicas' routing stats.

    A request's ``routing_key`` keyword argument is its affinity key (the table holds its
    :func:`~agent_runtime.server.job_router.affinity_digest`), ``home_only=True`` keeps it on
    its key's replica (it reads a response stored there); a ``replica`` keyword
    argument sends it to that replica only (the gateway's per-replica ``/metrics``). A
    replica's load is the larger of the queue it reported (running plus waiting requests) and
    the requests this router has sent there and not seen finish, counting those it has just
    chosen a replica for (so that a burst of new jobs spreads before any stats come back).
    """

    def initialize_state(self, **kwargs: Any) -> None:
        """Set the policy (Ray Serve calls this with ``request_router_kwargs``).

        Args:
            **kwargs: :class:`RoutingPolicy` fields.
        """
        self.policy = RoutingPolicy(**kwargs)
        self.table = AffinityTable(self.policy.max_jobs)
        self.decisions: Counter[str] = Counter()
        self.live: tuple[str, ...] = ()
        #: request id -> (the replica chosen first, why), until it is routed or completed.
        self._chosen: dict[str, tuple[str, str]] = {}
        #: request id -> the replica it runs on, until it completes.
        self._routed: dict[str, str] = {}
        # NOTE: the table and counters are touched on the router's event loop only; the gateway
        # reads ``live`` (a tuple, replaced whole) and copies of the counters.
        _registry().add(self)

    @property
    def deployment(self) -> tuple[str, str]:
        """``(app name, deployment name)`` this router serves."""
        return (self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._refresh_live()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._refresh_live()

    def _refresh_live(self) -> None:
        self.live = tuple(sorted(r.unique_id for r in self.curr_replicas))
        self.table.forget_replicas(self.live)

    def _in_flight(self) -> Counter[str]:
        return Counter([*self._routed.values(), *(uid for uid, _ in self._chosen.values())])

    def load_of(self, replica: RunningReplica, in_flight: Counter[str] | None = None) -> ReplicaLoad:
        """What this router knows of one replica's load.

        Args:
            replica: the replica.
            in_flight: this router's requests per replica (default: counted now).

        Returns:
            Its load.
        """
        uid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        reported = stats.get("queue_len")
        mine = (in_flight if in_flight is not None else self._in_flight())[uid]
        queue = max(int(reported) if isinstance(reported, int) else 0, mine)
        free = stats.get("free_kv_blocks")
        return ReplicaLoad(uid, queue, int(free) if isinstance(free, int) else None)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replicas to try, in ranks (Ray Serve takes the first rank that accepts).

        Args:
            candidate_replicas: the live replicas.
            pending_request: the request.

        Returns:
            The ranks: the job's replica alone, then the rest; or every replica in its own rank,
            best first, for a new (or moved) job.
        """
        kwargs: dict[str, Any] = {}
        rid: str | None = None
        earlier: tuple[str, str] | None = None
        if pending_request is not None:
            # NOTE: after every rank refused, back off before asking again (no busy loop).
            pending_request.routing_context.should_backoff = True
            kwargs = pending_request.kwargs
            rid = pending_request.metadata.internal_request_id
            earlier = self._chosen.pop(rid, None)  # a retry: its earlier choice no longer counts
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = kwargs.get("replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        key = _table_key(kwargs)
        home_only = bool(kwargs.get("home_only"))
        in_flight = self._in_flight()
        decision = route(key, [self.load_of(r, in_flight) for r in candidate_replicas], self.table, self.policy,
                         home_only=home_only)
        if not decision.order:
            return []
        first = decision.order[0]
        reason: str = decision.reason
        if earlier is not None and reason == "affinity" and earlier[0] == first:
            # NOTE: the first ask claimed the key for this replica (below); that claim is what
            # makes this ask "affinity", so the request keeps the reason it moved for.
            reason = earlier[1]
        if rid is not None:
            self._chosen[rid] = (first, reason)
            if len(self._chosen) > _MAX_CHOSEN:
                # NOTE: a request cancelled while it was being routed is never completed;
                # the oldest choices go so that such leftovers cannot pile up.
                for stale in list(self._chosen)[: _MAX_CHOSEN // 2]:
                    del self._chosen[stale]
        if key is not None and decision.reason != "affinity":
            # NOTE: claimed now, so that the job's concurrent requests follow it here.
            self.table.assign(key, first)
        if decision.reason == "affinity":
            if home_only:
                return [[by_id[first]]]  # NOTE: only there is what it reads; it waits for room
            return [[by_id[first]], [by_id[r] for r in decision.order[1:]]]
        return [[by_id[r]] for r in decision.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Record where the request went: its key's replica, and one more in flight there."""
        uid = replica_id.unique_id
        rid = pending_request.metadata.internal_request_id
        first, reason = self._chosen.pop(rid, (uid, ""))
        if pending_request.kwargs.get("replica") is not None:
            return  # a targeted request (metrics) is neither load nor a job
        self._routed[rid] = uid
        if uid != first:
            reason = "overflow"  # the replica chosen first refused it (full): the job follows
        key = _table_key(pending_request.kwargs)
        if key is not None:
            self.table.assign(key, uid)
            self.decisions[reason or "new"] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """One fewer in flight on the replica."""
        self._routed.pop(internal_request_id, None)
        self._chosen.pop(internal_request_id, None)


def _table_key(kwargs: dict[str, Any]) -> str | None:
    """The affinity table's key of a request's ``routing_key`` (None: none)."""
    key = kwargs.get("routing_key")
    return affinity_digest(key) if isinstance(key, str) else None


def routers_of(app_name: str, deployment: str) -> list[JobRequestRouter]:
    """This process's routers of one deployment (the gateway reads their replica sets)."""
    return [r for r in list(_registry()) if hasattr(r, "live") and r.deployment == (app_name, deployment)]


__all__ = ["JobRequestRouter", "routers_of"]
