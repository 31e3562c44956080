"""``vllm.general_plugins`` entry point: opt-in AsymCache scheduler without ``--scheduler-cls``.

Declared in ``pyproject.toml`` as::

    [project.entry-points."vllm.general_plugins"]
    asymcache = "asymcache_core.integrations.vllm.plugin:register"

vLLM calls :func:`register` in every process it starts, the engine-core process included,
before that process builds its scheduler. The plugin does nothing unless the environment
variable ``ASYMCACHE_VLLM_SCHEDULER`` is set: then a config that names no scheduler class gets
ours. ``1`` (or ``auto``, ``on``, ``true``, ``yes``) follows vLLM's ``async_scheduling``:
:class:`AsymCacheAsyncScheduler` when it is on (vLLM 0.32's default on CUDA),
:class:`AsymCacheScheduler` when it is off (the CPU platform forces it off); ``sync`` and
``async`` force one class. An explicit ``--scheduler-cls`` always wins.
"""

from __future__ import annotations

import logging
import os
from typing import Any

#: Environment variable that switches the plugin on.
ENV = "ASYMCACHE_VLLM_SCHEDULER"

logger = logging.getLogger("vllm.asymcache")


def chosen_scheduler(value: str | None, async_scheduling: bool | None) -> str | None:
    """The scheduler class path the plugin picks for an env value.

    Args:
        value: the value of ``$ASYMCACHE_VLLM_SCHEDULER`` (``None``/empty/``0``: off;
            ``sync``/``async``: that class; any other value: the class that matches
            ``async_scheduling``).
        async_scheduling: vLLM's ``scheduler_config.async_scheduling`` (``None``: not known
            yet, treated as off).

    Returns:
        A qualified class name, or ``None`` when the plugin is off.
    """
    from asymcache_core.integrations.vllm import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS

    choice = (value or "").strip().lower()
    if choice in ("", "0", "false", "off", "no"):
        return None
    if choice == "sync":
        return SCHEDULER_CLS
    # NOTE: with async scheduling on, vLLM's engine core keeps a batch queue two deep and
    # schedules step N+1 before step N's output is back; the synchronous class has nothing to
    # schedule then, so every other step is empty. Only ``sync`` forces it.
    if choice == "async" or async_scheduling:
        return ASYNC_SCHEDULER_CLS
    return SCHEDULER_CLS


def register() -> None:
    """Entry point: when switched on, default vLLM's scheduler class to AsymCache's.

    NOTE: vLLM resolves the class in ``SchedulerConfig.get_scheduler_cls`` inside the engine
    core; wrapping that method (only when ``scheduler_cls`` is unset) is the one hook that
    needs no flag. Safe to call more than once.
    """
    if chosen_scheduler(os.environ.get(ENV), None) is None:
        return
    from vllm.config.scheduler import SchedulerConfig
    from vllm.utils.import_utils import resolve_obj_by_qualname

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_asymcache", False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is None:
            name = chosen_scheduler(os.environ.get(ENV), self.async_scheduling)
            if name is not None:
                return resolve_obj_by_qualname(name)
        return original(self)

    get_scheduler_cls._asymcache = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
    logger.info("asymcache: plugin registered (%s=%s)", ENV, os.environ.get(ENV))
