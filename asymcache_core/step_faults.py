"""A step whose forward pass fails: isolate the requests that cause it, run the others.

When the runner raises, the step's requests are run again in smaller batches (bisected over
groups that must run together, :func:`step_groups`) until every request has either run or
failed on its own. A request that fails alone gets the error; one that read a block a failed
request was to write this step is preempted (recomputed later). Blocks a failed or preempted
request wrote this step stop being cache hits: their content is not trustworthy. A fault that
hits every request (the device is gone) fails them all, and the engine stays usable.

With async scheduling a launched step that fails runs again without the requests that stopped
running since it was planned (:func:`drop_stopped`): the blocks those were to write follow the
same rule, and so do the requests that read them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from asymcache_core.errors import EngineDeadError
from asymcache_core.request import RequestStatus
from asymcache_core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from asymcache_core.block_pool import BlockPool
    from asymcache_core.engine_setup import Runner
    from asymcache_core.kv_cache_manager import KVCacheManager
    from asymcache_core.request import Request

logger = logging.getLogger(__name__)


class StepResult(NamedTuple):
    """What a step ran.

    Attributes:
        ran: the plan of what ran (for ``update_from_output``); its ``preempted`` adds the
            requests that read a failed request's blocks.
        sampled: request id -> sampled token, for the requests that reached their end.
        faults: requests that failed on their own, with the error text (not finished yet).
    """

    ran: SchedulerOutput
    sampled: dict[str, int]
    faults: list[tuple[Request, str]]


def written_indices(item: ScheduledRequest, block_size: int) -> list[int]:
    """The logical block indices a scheduled request writes in its step (those under its
    segments), ascending."""
    return sorted(
        {idx for start, end in item.segments for idx in range(start // block_size, (end - 1) // block_size + 1)}
    )


def written_blocks(item: ScheduledRequest, block_size: int) -> list[int]:
    """The blocks a scheduled request writes in its step (those under its segments)."""
    table = item.request.block_ids
    return sorted({table[idx] for idx in written_indices(item, block_size)})


def step_groups(plan: SchedulerOutput, written: list[list[int]], kv: KVCacheManager) -> list[list[int]]:
    """Indices of the step's requests, grouped so that a request that reads a block another
    one writes in this step (a prefix cached at admission, computed in the same step) is in
    its writer's group; groups and their members in batch order."""
    writer = {block_id: i for i, blocks in enumerate(written) for block_id in blocks}
    parent = list(range(len(plan.scheduled)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, item in enumerate(plan.scheduled):
        for block_id in kv.held_blocks(item.request):
            j = writer.get(block_id)
            if j is not None and j != i:
                parent[max(root(i), root(j))] = min(root(i), root(j))
    groups: dict[int, list[int]] = {}
    for i in range(len(plan.scheduled)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def execute_isolating_faults(
    plan: SchedulerOutput,
    runner: Runner,
    kv: KVCacheManager,
    pool: BlockPool,
    scheduler: Scheduler,
    block_size: int,
) -> StepResult:
    """Runs the step; a fault of the forward pass fails only the requests that cause it.

    Raises:
        EngineDeadError: from the runner, as is: no request is the culprit.
    """
    try:
        return StepResult(plan, runner.execute(plan), [])
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - isolated below; the step goes on without the culprit
        logger.warning("a step of %d requests failed (%s: %s); isolating the fault",
                       len(plan.scheduled), type(exc).__name__, exc)
        first = exc
    items = plan.scheduled
    written = [written_blocks(item, block_size) for item in items]
    sampled: dict[str, int] = {}
    ok: set[int] = set()
    failed: dict[int, BaseException] = {}
    tainted: set[int] = set()

    def run(indices: list[int]) -> BaseException | None:
        sub = [items[i] for i in indices]
        try:
            sampled.update(runner.execute(SchedulerOutput(sub, [], plan.budget, sum(x.num_tokens for x in sub))))
        except Exception as exc:  # noqa: BLE001 - narrowed down by the caller
            return exc
        ok.update(indices)
        return None

    def bisect(groups: list[list[int]], error: BaseException) -> None:
        if len(groups) == 1:
            group = groups[0]
            if len(group) == 1:
                failed[group[0]] = error
                return
            # NOTE: members of a group read blocks that earlier members write this step, so
            # they run one at a time in batch order (a reader always follows its writer);
            # a reader of a failed member's blocks cannot run and is recomputed later.
            bad_blocks: set[int] = set()
            for i in group:
                if bad_blocks.intersection(kv.held_blocks(items[i].request)):
                    tainted.add(i)
                    bad_blocks.update(written[i])
                    continue
                member_error = run([i])
                if member_error is not None:
                    failed[i] = member_error
                    bad_blocks.update(written[i])
            return
        mid = len(groups) // 2
        for half in (groups[:mid], groups[mid:]):
            error = run([i for group in half for i in group])
            if error is not None:
                bisect(half, error)

    bisect(step_groups(plan, written, kv), first)
    for i in (*failed, *tainted):
        for block_id in written[i]:
            pool.uncache(block_id)
    if failed and len(failed) == len(items):
        logger.error("every request of the step failed: %s: %s", type(first).__name__, first)
    for i in sorted(tainted):
        scheduler.preempt(items[i].request)
    ran = [item for i, item in enumerate(items) if i in ok]
    faults = [
        (items[i].request, f"the model step failed: {type(error).__name__}: {error}")
        for i, error in sorted(failed.items())
    ]
    return StepResult(
        SchedulerOutput(ran, [*plan.preempted, *(items[i].request for i in sorted(tainted))],
                        plan.budget, sum(item.num_tokens for item in ran)),
        sampled,
        faults,
    )


def drop_stopped(
    plan: SchedulerOutput,
    kv: KVCacheManager,
    pool: BlockPool,
    scheduler: Scheduler,
    block_size: int,
) -> tuple[list[ScheduledRequest], list[Request]]:
    """The requests of a failed launched step (async scheduling) that run again: those still
    running. The others stopped since the step was planned (aborted, finished, preempted), so
    the blocks they were to write in it never get their content: as in
    :func:`execute_isolating_faults`, those blocks stop being cache hits (on the device and
    their host copies), and the running requests that hold one read it: they are preempted
    (recomputed later), and the blocks they were to write in this step go the same way.

    NOTE: by hash, not by block id: a stopped request's table is gone (its blocks are freed),
    and its block may have been evicted since (its content copied to the host tier). A block
    that another request computes anew under the same hash is dropped too (it is recomputed).

    Returns:
        The step's requests to run again, in batch order, and the requests preempted for
        reading a block the step was to write.
    """
    items = plan.scheduled
    index = {id(item.request): i for i, item in enumerate(items)}
    stopped = [i for i, item in enumerate(items) if item.request.status is not RequestStatus.RUNNING]
    if not stopped:
        return list(items), []
    host = kv.tier.pool if kv.tier is not None else None
    dropped: set[int] = set()
    bad: set[int] = set()
    preempted: list[Request] = []
    while stopped:
        for i in stopped:
            dropped.add(i)
            hashes = items[i].request.block_hashes
            for idx in written_indices(items[i], block_size):
                if idx >= len(hashes):
                    break  # not full, or its tokens are not known: never registered
                block_id = pool.lookup(hashes[idx])
                if block_id is not None:
                    bad.add(block_id)
                slot = host.lookup(hashes[idx]) if host is not None else None
                if slot is not None:
                    assert host is not None
                    host.uncache(slot)
        readers = [r for r in scheduler.running if not bad.isdisjoint(kv.held_blocks(r))]
        stopped = []
        for request in readers:
            scheduler.preempt(request)
            preempted.append(request)
            i = index.get(id(request))
            if i is not None and i not in dropped:
                stopped.append(i)
    for block_id in bad:
        pool.uncache(block_id)
    if preempted:
        logger.warning("a failed launched step: %d requests preempted for reading blocks it was to write",
                       len(preempted))
    return [item for i, item in enumerate(items) if i not in dropped], preempted
