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
``async`` force one class; any other value is an error. An explicit ``--scheduler-cls`` always
wins.

Whether or not that variable is set, :func:`register` also checks the plugin's options before
vLLM starts its engine, whenever the scheduler class is ours (named by ``--scheduler-cls`` or
picked by the variable): a bad option is one ``error:`` line and exit code 2 on the command
line (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``), and a ``ValueError``
naming it from ``EngineArgs.create_engine_config`` (``LLM(...)``), instead of a traceback from
the engine-core process after the model has loaded.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

#: Environment variable that switches the plugin on.
ENV = "ASYMCACHE_VLLM_SCHEDULER"
#: The package of the schedulers (a ``--scheduler-cls`` under it is ours).
PACKAGE = "asymcache_core.integrations.vllm"

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

    Raises:
        ValueError: another value (naming the variable): ``asnyc`` must not quietly pick a class.
    """
    from asymcache_core.integrations.vllm import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS

    choice = (value or "").strip().lower()
    if choice in ("", "0", "false", "off", "no"):
        return None
    if choice not in ("1", "auto", "on", "true", "yes", "sync", "async"):
        raise ValueError(f"{ENV} must be 1 (or auto), sync, async or 0, got {value!r}")
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
    install_startup_checks()
    try:
        if chosen_scheduler(os.environ.get(ENV), None) is None:
            return
    except ValueError:
        return  # NOTE: the startup checks report it, as one line, before any engine starts
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


def uses_asymcache(scheduler_cls: Any) -> bool:
    """Whether vLLM will build one of our schedulers.

    Args:
        scheduler_cls: vLLM's ``scheduler_cls`` setting (a qualified name, a class, or
            ``None``: then ``$ASYMCACHE_VLLM_SCHEDULER`` decides).

    Returns:
        Whether the class is (a subclass of) ours.
    """
    if scheduler_cls is None or scheduler_cls == "":
        return chosen_scheduler(os.environ.get(ENV), None) is not None
    if isinstance(scheduler_cls, str):
        return scheduler_cls.startswith(PACKAGE + ".")
    if not isinstance(scheduler_cls, type):
        return False
    from asymcache_core.integrations.vllm.scheduler import _AsymCacheMixin

    return issubclass(scheduler_cls, _AsymCacheMixin)


def check_engine_settings(settings: Any) -> None:
    """Checks the plugin's options on vLLM's parsed flags or ``EngineArgs`` when the scheduler
    is ours (:func:`~asymcache_core.integrations.vllm.options.check_startup_options`).

    Args:
        settings: an object with vLLM's ``scheduler_cls``, ``additional_config`` and
            ``scheduling_policy`` attributes (an ``EngineArgs`` or a parsed ``Namespace``).

    Raises:
        ValueError: a bad option, named.
    """
    if not uses_asymcache(getattr(settings, "scheduler_cls", None)):
        return
    from asymcache_core.integrations.vllm.options import check_startup_options

    check_startup_options(
        getattr(settings, "additional_config", None), getattr(settings, "scheduling_policy", None)
    )


def install_startup_checks() -> None:
    """Checks the options before vLLM starts its engine (module docstring). Safe to call more
    than once.

    NOTE: vLLM calls the ``general_plugins`` entry point while it builds its argument parser
    (``AsyncEngineArgs.add_cli_args``) and in ``EngineArgs.__post_init__``, both in the front
    process and before ``create_engine_config``; without these wrappers a bad option fails in
    the engine core's scheduler, after the model has loaded, as a traceback.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    create = EngineArgs.create_engine_config
    if not getattr(create, "_asymcache", False):

        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            check_engine_settings(self)
            return create(self, *args, **kwargs)

        create_engine_config._asymcache = True  # type: ignore[attr-defined]
        EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    parse = FlexibleArgumentParser.parse_args
    if not getattr(parse, "_asymcache", False):

        def parse_args(self: Any, *args: Any, **kwargs: Any) -> Any:
            namespace = parse(self, *args, **kwargs)
            if hasattr(namespace, "scheduler_cls") and hasattr(namespace, "additional_config"):
                try:
                    check_engine_settings(namespace)
                except ValueError as exc:
                    # NOTE: argparse's way for a bad flag (exit code 2), without its usage
                    # text: vLLM's runs to hundreds of lines.
                    print(f"error: {exc}", file=sys.stderr)
                    raise SystemExit(2) from None
            return namespace

        parse_args._asymcache = True  # type: ignore[attr-defined]
        FlexibleArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
