"""A periodic summary line of the vLLM plugin's counters in vLLM's log.

NOTE: in a server the scheduler runs in vLLM's engine-core process, which the API server's
``/metrics`` does not reach, and ``asymcache_stats()`` is only callable in process; this line is
what an operator sees of the pins and evictions beside each pin's own line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

#: Seconds between summary lines (vLLM's own stats line comes every 10 s by default).
STATS_LOG_INTERVAL_S = 10.0


def log_pin_decision(log: logging.Logger, decision: Any, num_cached: int, capacity_blocks: int) -> None:
    """The line of a turn's pin: the blocks pinned, or why a TTL pinned none.

    Args:
        log: the plugin's logger.
        decision: the controller's :class:`~asymcache_core.continuum.controller.PinDecision`.
        num_cached: the cached blocks the turn left (every choice's, with ``n > 1``).
        capacity_blocks: the pins' cap.
    """
    if decision.ttl_s > 0 and decision.blocks_pinned > 0:
        log.info(
            "asymcache: pinned job %s: %d blocks for %.2f s",
            decision.job_id, decision.blocks_pinned, decision.ttl_s,
        )
    elif decision.ttl_s > 0:
        # NOTE: "pinned 0 blocks" read as a pin; say why there is none.
        log.info(
            "asymcache: job %s not pinned (TTL %.2f s): %s",
            decision.job_id,
            decision.ttl_s,
            "its request left no full cached block"
            if not num_cached
            else f"the pins' cap ({capacity_blocks} blocks: max_pinned_fraction) is full",
        )


def format_stats(stats: dict[str, Any]) -> str:
    """One line of :meth:`~.scheduler._AsymCacheMixin.asymcache_stats`'s counters.

    Args:
        stats: the scheduler's stats.

    Returns:
        The line, without the ``asymcache:`` prefix.
    """
    pins = stats["pins"]
    parts = [
        f"pins made {pins['pins']} (expired {pins['expired']}, taken by the next turn "
        f"{pins['released_next_request']}, released under pressure {pins['released_pressure']}, "
        f"other {pins['released_other']})",
        f"pinned now {len(stats['pinned_jobs'])} jobs / {stats['pinned_blocks']} blocks",
    ]
    queue = stats["queue"]
    if queue is not None:
        parts.append(
            f"evictions {queue['evicted_cached']}, forced orphans {queue['forced_orphans']}"
        )
    implicit = stats["implicit_jobs"]
    if implicit is not None:
        parts.append(f"implicit jobs matched {implicit['matched']} started {implicit['started']}")
    parts.append(f"jobs tracked {stats['tracked_jobs']}")
    return "; ".join(parts)


class StatsLog:
    """Logs :func:`format_stats` at most every ``interval_s``, and only when a counter moved.

    Args:
        logger: where the line goes (vLLM's ``vllm.asymcache`` logger).
        clock: seconds (monotonic).
        interval_s: the least time between two lines.
    """

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        interval_s: float = STATS_LOG_INTERVAL_S,
    ) -> None:
        self.logger = logger
        self.clock = clock
        self.interval_s = interval_s
        self._next = clock() + interval_s
        self._last = ""

    def maybe_log(self, stats: Callable[[], dict[str, Any]]) -> bool:
        """Logs the line when the interval has passed and it differs from the last one.

        Args:
            stats: called only when the interval has passed (the stats cost a sort).

        Returns:
            Whether a line was logged.
        """
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        line = format_stats(stats())
        if line == self._last:
            return False
        self._last = line
        self.logger.info("asymcache: %s", line)
        return True
