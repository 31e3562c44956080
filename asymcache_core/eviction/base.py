"""The eviction protocol and its registry.

A policy only ever sees *candidates*: blocks with ref count 0, no pin, and cached content.
The pool adds a block when it becomes a candidate, removes it when it is touched or pinned,
and asks for victims when an allocation runs out of uncached free blocks.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from asymcache_core.block_pool import KVBlock
    from asymcache_core.job_stats import JobStats


@dataclass
class PolicyContext:
    """What a policy may consult besides the block itself.

    Attributes:
        block_size: tokens per block.
        latency_model: step-latency model (``asymcache_core.latency_model``), or ``None``.
        job_stats: reuse statistics per job (:class:`~asymcache_core.job_stats.JobStats`), or ``None``.
    """

    block_size: int
    latency_model: Any = None
    job_stats: JobStats | None = None


class EvictionPolicy(ABC):
    """Chooses which candidate block loses its content next.

    Invariants: ``add``/``remove`` keep the candidate set equal to the pool's candidates;
    ``pop_victims`` returns distinct candidates and forgets them.

    Attributes:
        name: the registered name.
        hole_reuse: default of the cache manager's hole-aware lookup under this policy.
        job_admission: default of the engine's job-level admission under this policy
            (:mod:`asymcache_core.job_admission`); off for the policies that stand for vLLM and
            the other baselines, which admit every job.
    """

    name: ClassVar[str]
    hole_reuse: ClassVar[bool] = False
    job_admission: ClassVar[bool] = False

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def add(self, block: KVBlock, now: float) -> None:
        """``block`` became a candidate at time ``now``."""

    @abstractmethod
    def remove(self, block: KVBlock) -> None:
        """``block`` is no longer a candidate (touched or pinned)."""

    @abstractmethod
    def pop_victims(self, count: int, now: float) -> list[KVBlock]:
        """Removes and returns ``count`` candidates, cheapest to lose first."""

    @abstractmethod
    def candidates(self) -> Iterator[KVBlock]:
        """Iterates over the current candidates."""

    @abstractmethod
    def __len__(self) -> int: ...

    def worth_keeping(self, block: KVBlock, now: float) -> bool:
        """Whether ``block``'s content may still be used (a lower tier copies only those);
        every block by default, as a plain LRU offload does."""
        return True


class KeyedPolicy(EvictionPolicy):
    """A policy whose order is a key fixed when the block becomes a candidate.

    A heap with lazy deletion: ``remove`` only forgets the entry; stale heap rows are skipped.
    """

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._heap: list[tuple[Any, int, int]] = []
        self._live: dict[int, tuple[int, KVBlock]] = {}
        self._tick = itertools.count()

    @abstractmethod
    def key(self, block: KVBlock, now: float) -> Any:
        """Smaller keys are evicted first."""

    def add(self, block: KVBlock, now: float) -> None:
        tick = next(self._tick)
        self._live[block.block_id] = (tick, block)
        heapq.heappush(self._heap, (self.key(block, now), tick, block.block_id))

    def remove(self, block: KVBlock) -> None:
        del self._live[block.block_id]

    def pop_victims(self, count: int, now: float) -> list[KVBlock]:
        victims: list[KVBlock] = []
        while len(victims) < count:
            _, tick, block_id = heapq.heappop(self._heap)
            live = self._live.get(block_id)
            if live is None or live[0] != tick:
                continue
            del self._live[block_id]
            victims.append(live[1])
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()
        return victims

    def _compact(self) -> None:
        ticks = {tick for tick, _ in self._live.values()}
        self._heap = [row for row in self._heap if row[1] in ticks]
        heapq.heapify(self._heap)

    def candidates(self) -> Iterator[KVBlock]:
        return (block for _, block in self._live.values())

    def __len__(self) -> int:
        return len(self._live)


_Factory = Callable[[PolicyContext], EvictionPolicy]


def policy_registry() -> dict[str, type[EvictionPolicy]]:
    """Name -> policy class of every built-in policy (imported lazily, no global state)."""
    from asymcache_core.eviction.asymcache import AsymCachePolicy
    from asymcache_core.eviction.lru import LRUPolicy
    from asymcache_core.eviction.pensieve import PensievePolicy
    from asymcache_core.eviction.vllm_apc import VllmApcPolicy

    classes: list[type[EvictionPolicy]] = [VllmApcPolicy, LRUPolicy, PensievePolicy, AsymCachePolicy]
    return {cls.name: cls for cls in classes}


def registered_policies() -> list[str]:
    return list(policy_registry())


def create_policy(name: str, ctx: PolicyContext) -> EvictionPolicy:
    """Instantiates a registered policy.

    Raises:
        ValueError: unknown name.
    """
    registry = policy_registry()
    if name not in registry:
        raise ValueError(f"eviction_policy: unknown policy {name!r}; registered: {', '.join(registry)}")
    return registry[name](ctx)
