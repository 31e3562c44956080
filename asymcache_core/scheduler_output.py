"""What the scheduler hands the runner and the engine: the step's plan
(:class:`SchedulerOutput` of :class:`ScheduledRequest`) and, after the step ran, one
:class:`RequestUpdate` per sampled request. Plain typed records, no behaviour beyond derived
counts."""

from __future__ import annotations

from typing import NamedTuple

from asymcache_core.host_tier import KVTransfers
from asymcache_core.latency_model import segment_attn_pairs
from asymcache_core.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    Attributes:
        request: the request.
        segments: ``(start, end)`` absolute positions to compute, ascending.
        sample: whether the step reaches the end of its context (a token is sampled).
    """

    request: Request
    segments: list[tuple[int, int]]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.segments)

    @property
    def is_decode(self) -> bool:
        """One token, the request's last, sampled: a decode (one query over its whole KV)."""
        return self.sample and len(self.segments) == 1 and self.segments[0][1] - self.segments[0][0] == 1


class SchedulerOutput(NamedTuple):
    """A step's plan.

    Attributes:
        scheduled: requests with their segments, in batch order.
        preempted: requests preempted while planning this step.
        budget: the token budget the step was planned under.
        num_tokens: tokens scheduled in all.
        transfers: the host-tier block copies issued before the forward pass (``None``
            without a host tier).
    """

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    budget: int
    num_tokens: int
    transfers: KVTransfers | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode_only(self) -> bool:
        """Every scheduled request runs exactly one token, its last, and samples (a decode)."""
        # NOTE: each scheduled request runs >= 1 token, so one token per request means one
        # length-1 segment each; sampling means that token is the request's last.
        return bool(self.scheduled) and self.num_tokens == len(self.scheduled) and all(
            item.sample for item in self.scheduled
        )

    @property
    def attn_pairs(self) -> float:
        """Query-key pairs of the step: a segment ``[start, end)`` of ``n`` tokens attends over
        ``start`` earlier keys per query plus a causal triangle of its own (the ``A`` of the
        latency model)."""
        return sum(
            (segment_attn_pairs(end - start, start) for item in self.scheduled for start, end in item.segments), 0.0
        )

    @property
    def decode_kv_tokens(self) -> float:
        """Keys the step's decodes read: each decode's position plus one (the ``K`` of the
        latency model; memory-bound, see there)."""
        return float(sum(item.segments[0][0] + 1 for item in self.scheduled if item.is_decode))

    @property
    def num_hole_tokens(self) -> int:
        """Tokens that refill holes: positions below each request's last cache hit.

        NOTE: not "segments before the last one": a hole cut by the budget ends its step's last
        segment, and a leading hole is a request's first segment; both are refills."""
        total = 0
        for item in self.scheduled:
            hit_end = item.request.hit_end
            total += sum(max(0, min(end, hit_end) - start) for start, end in item.segments)
        return total


class RequestUpdate(NamedTuple):
    """What one step did to one request that sampled a token (:meth:`Scheduler.update_from_output`).

    Attributes:
        request: the request (its blocks are already freed when it finished).
        new_token_ids: the tokens appended in this step.
        finish_reason: the status it finished with; ``None`` while it runs on.
        stop_reason: the EOS or stop token id that ended it, else ``None``.
    """

    request: Request
    new_token_ids: list[int]
    finish_reason: RequestStatus | None
    stop_reason: int | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


__all__ = ["RequestUpdate", "ScheduledRequest", "SchedulerOutput"]
