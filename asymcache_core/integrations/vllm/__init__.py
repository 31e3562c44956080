"""AsymCache eviction and Continuum pins inside a stock vLLM V1 engine (tested on 0.32).

Start vLLM with ``--scheduler-cls asymcache_core.integrations.vllm.scheduler.AsymCacheScheduler``
(``docs/vllm.md``). The scheduler module imports vLLM; everything else here (the free-block
order, the cached-block forest, pins and job hints) is plain Python, testable without vLLM.
"""

from __future__ import annotations

from asymcache_core.integrations.vllm.forest import CachedForest, ForestOverlay
from asymcache_core.integrations.vllm.free_queue import ExpectedLatencyFreeQueue, QueueStats
from asymcache_core.integrations.vllm.pins import JobHints, PinSet, parse_job_hints
from asymcache_core.integrations.vllm.scoring import BlockInfo, BlockScorer

#: The ``--scheduler-cls`` value (synchronous scheduler).
SCHEDULER_CLS = "asymcache_core.integrations.vllm.scheduler.AsymCacheScheduler"
#: The ``--scheduler-cls`` value that keeps vLLM's async scheduling.
ASYNC_SCHEDULER_CLS = "asymcache_core.integrations.vllm.scheduler.AsymCacheAsyncScheduler"

__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "SCHEDULER_CLS",
    "BlockInfo",
    "BlockScorer",
    "CachedForest",
    "ExpectedLatencyFreeQueue",
    "ForestOverlay",
    "JobHints",
    "PinSet",
    "QueueStats",
    "parse_job_hints",
]
