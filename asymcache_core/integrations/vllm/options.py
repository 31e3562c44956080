"""Options of the vLLM integration (``AsymCacheOptions``) and the latency model they pick.

Read once at the scheduler's start from ``--additional-config '{"asymcache": {...}}'`` and the
environment variable ``ASYMCACHE_VLLM_OPTIONS`` (JSON); a bad value is a ``ValueError`` naming
the option. Plain Python: vLLM is imported only inside :func:`build_latency_model`, for the
platform's device type.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from asymcache_core.config import json_object_text
from asymcache_core.latency_model import LatencyModel
from asymcache_core.models.config import ModelConfig

# NOTE: a child of the "vllm" logger, so vLLM's handler and level apply to our lines.
logger = logging.getLogger("vllm.asymcache")

#: Environment variable with JSON options (merged over ``additional_config["asymcache"]``).
OPTIONS_ENV = "ASYMCACHE_VLLM_OPTIONS"


@dataclass(frozen=True)
class AsymCacheOptions:
    """Knobs of the vLLM integration.

    Attributes:
        eviction: ``asymcache`` (expected-latency order) or ``lru`` (vLLM's own queue kept;
            pins still work only with ``asymcache``).
        pinning: make Continuum pins for jobs that are not on their last step.
        max_pinned_fraction: the most of the pool that pins may hold together.
        ttl_rule: ``continuum`` (argmax TTL) or ``preview`` (2 s when the mean is <= 2 s).
        latency_profile: a JSON profile from ``asymcache profile`` (default: analytic model).
        prior_reuse: P(reuse) of blocks of requests without a job id.
        order: admission order of waiting requests: ``fcfs`` (vLLM's) or ``least-work``, the
            fewest tokens left to compute once the prefix cache's hits are counted first
            (the embedded engine's ``least_work_first``; needs vLLM's ``fcfs`` policy).
        least_work_patience: with ``order="least-work"``, a waiting request lets later,
            smaller ones go first for at most this many times its own estimated prefill time
            (the latency model's); ``None``: by work alone (the embedded engine's
            ``least_work_patience``).
        implicit_jobs: a request that names no job (no ``job_id`` in ``vllm_xargs``, no
            ``session_id``) joins the job of the conversation its prompt continues, as in the
            embedded engine (:class:`~asymcache_core.implicit_jobs.ImplicitJobs`): its blocks
            are scored with that job's reuse statistics, and once the conversation has come back
            at least once its pauses are pinned (a first turn is not: nothing says a plain
            request will be continued). Needs prefix caching (the keys are its block hashes).
    """

    eviction: str = "asymcache"
    pinning: bool = True
    max_pinned_fraction: float = 0.5
    ttl_rule: str = "continuum"
    latency_profile: str | None = None
    prior_reuse: float = 0.5
    order: str = "fcfs"
    least_work_patience: float | None = None
    implicit_jobs: bool = True

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AsymCacheOptions:
        """Reads ``additional_config["asymcache"]`` and then ``$ASYMCACHE_VLLM_OPTIONS``.

        Args:
            vllm_config: vLLM's ``VllmConfig``.

        Returns:
            The options.

        Raises:
            ValueError: unknown option names, JSON that is not an object, or a value of the
                wrong type or out of range (the message names the option).
        """
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))

    @classmethod
    def from_additional_config(cls, extra: Any) -> AsymCacheOptions:
        """Reads ``extra["asymcache"]`` (vLLM's ``additional_config``) and then
        ``$ASYMCACHE_VLLM_OPTIONS``.

        Args:
            extra: vLLM's ``additional_config`` (a dict, or ``None``).

        Returns:
            The options.

        Raises:
            ValueError: as :meth:`from_vllm_config`.
        """
        raw: dict[str, Any] = {}
        if isinstance(extra, dict) and "asymcache" in extra:
            if not isinstance(extra["asymcache"], dict):
                raise ValueError(
                    f"additional_config.asymcache: must be an object, got {extra['asymcache']!r}"
                )
            raw.update(extra["asymcache"])
        env = os.environ.get(OPTIONS_ENV)
        if env:
            raw.update(json_object_text(OPTIONS_ENV, env))
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"asymcache options: unknown {unknown}; known: {sorted(names)}")
        for name, value in raw.items():
            _check_option(name, value)
        opts = cls(**raw)
        if opts.least_work_patience is not None and opts.order != "least-work":
            raise ValueError("asymcache options: least_work_patience needs order least-work")
        return opts


def check_startup_options(extra: Any, scheduling_policy: Any) -> AsymCacheOptions:
    """Everything about the options that would fail the scheduler's start, checked before vLLM
    starts its engine (``plugin.py`` runs it on the parsed flags and in
    ``EngineArgs.create_engine_config``): the options themselves, ``order: least-work`` against
    vLLM's scheduling policy, and the latency profile's file.

    Args:
        extra: vLLM's ``additional_config``.
        scheduling_policy: vLLM's ``scheduling_policy`` (``"fcfs"``, ``"priority"``, an enum
            member with that ``value``, or ``None``).

    Returns:
        The options.

    Raises:
        ValueError: naming the option (``asymcache options: ...``).
    """
    opts = AsymCacheOptions.from_additional_config(extra)
    policy = getattr(scheduling_policy, "value", scheduling_policy)
    if opts.order == "least-work" and policy not in (None, "fcfs"):
        raise ValueError(least_work_policy_error(policy))
    if opts.latency_profile:
        try:
            LatencyModel.from_json(opts.latency_profile)
        except ValueError as exc:
            raise ValueError(f"asymcache options: {exc}") from None
    return opts


def least_work_policy_error(policy: Any) -> str:
    """The message of ``order: least-work`` under another policy than vLLM's ``fcfs``."""
    return f"asymcache options: order least-work needs vLLM's fcfs policy, got {policy!r}"


#: Allowed values of the options that name a choice.
_CHOICES: dict[str, tuple[str, ...]] = {
    "eviction": ("asymcache", "lru"),
    "ttl_rule": ("continuum", "preview"),
    "order": ("fcfs", "least-work"),
}


def _check_option(name: str, value: Any) -> None:
    """Type- and range-checks one option (a bad one must fail at startup, not at the first
    eviction: ``prior_reuse: "0.2"`` used to pass and crash the scheduler then).

    Args:
        name: the option's name (a field of :class:`AsymCacheOptions`).
        value: its value, as parsed from JSON.

    Raises:
        ValueError: naming the option, when the value is of the wrong type or out of range.
    """
    bad = f"asymcache options: {name}"
    if name in _CHOICES:
        if value not in _CHOICES[name] or not isinstance(value, str):
            raise ValueError(f"{bad} must be {' or '.join(_CHOICES[name])}, got {value!r}")
    elif name in ("pinning", "implicit_jobs"):
        if not isinstance(value, bool):
            raise ValueError(f"{bad} must be true or false, got {value!r}")
    elif name == "latency_profile":
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError(f"{bad} must be a file path or null, got {value!r}")
    elif name in ("max_pinned_fraction", "prior_reuse"):
        # NOTE: bool is an int subclass; JSON's true is no fraction.
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{bad} must be a number in [0, 1], got {value!r}")
    elif name == "least_work_patience":
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ValueError(f"{bad} must be a positive number, got {value!r}")


def build_latency_model(vllm_config: Any, opts: AsymCacheOptions) -> LatencyModel:
    """The latency model the score uses: a profile, else the analytic model of the served model.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        opts: the options.

    Returns:
        The model (a generic default for architectures ``ModelConfig`` does not know).
    """
    if opts.latency_profile:
        try:
            return LatencyModel.from_json(opts.latency_profile)
        except ValueError as exc:
            raise ValueError(f"asymcache options: {exc}") from None
    model_config = vllm_config.model_config
    try:
        cfg = ModelConfig.from_hf(model_config.hf_config.to_dict())
    except (ValueError, AttributeError, TypeError) as exc:
        logger.warning("asymcache: no analytic latency model (%s); using the default", exc)
        return LatencyModel(1e-3, 1e-5, 1e-9, 64, source="default")
    from vllm.platforms import current_platform

    device = "cuda" if current_platform.device_type == "cuda" else "cpu"
    dtype_bytes = int(getattr(model_config.dtype, "itemsize", 2))
    return LatencyModel.analytic(cfg, device, dtype_bytes, name=str(model_config.model))
