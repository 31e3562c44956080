"""Serving presets: the names ``--policy`` / ``--policies`` accept, shared by the runtime, the
server and the evaluation harness.

A *serving preset* is an engine configuration (the eviction policy, the admission priority) plus
whether the runtime pins a job's KV across tool pauses (Continuum). The table below is the single
place that maps a preset's name onto those pieces; new presets are new rows, never code. (The
harness's ablation suffixes on top of a preset are :class:`eval.bench.BenchVariant`.)

=========================  =============  ===========  =========
name                       eviction       priority     TTL pins
=========================  =============  ===========  =========
``vllm-apc``               vllm-apc       fcfs         no
``lru``                    lru            fcfs         no
``pensieve``               pensieve       fcfs         no
``asymcache``              asymcache      fcfs         no
``continuum``              vllm-apc       program      yes
``asymcache+continuum``    asymcache      adaptive     yes
``continuum-preview``      vllm-apc       program      yes (preview TTL rule: 2 s if mean <= 2 s)
``asymcache+continuum-preview``  asymcache  adaptive   yes (preview TTL rule)
=========================  =============  ===========  =========

The AsymCache presets with Continuum order their waiting requests by ``adaptive`` priority: by
their job's start as far as the jobs seen so far show memory (Continuum's eta, at the lower
bound of its 95% confidence interval, with running jobs counted as censored lengths), by
arrival as far as they do not, with running requests in arrival order. Continuum's program order favours
old jobs, which pays when an old job is near its end (fixed-length tasks such as BFCL's) and
costs when job lengths are memoryless (chat), where it also reordered the running requests
so that new turns preempted mid-decode ones (BENCHMARKS.md, "The default on chat, tool loops
and BFCL"). Program order makes the youngest jobs' turns wait, so its time-to-first-token tail
is longer than arrival order's; a stated target (``EngineConfig.ttft_slo_ms``) bounds it
(:class:`~asymcache_core.continuum.ttft_target.TTFTTarget`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from asymcache_core.continuum.ttl import TTLRule


@dataclass(frozen=True)
class ServingPreset:
    """One named serving preset.

    Attributes:
        name: the preset's name (a key of the table).
        engine_overrides: :class:`asymcache_core.EngineConfig` fields the preset sets
            (``eviction_policy``, ``priority``); a fresh dict per lookup, safe to mutate.
        pinning: the runtime pins a job's KV for a TTL when a turn ends in a tool call.
        ttl_rule: how the TTL is chosen (``continuum``: the tau* argmax; ``preview``: the public
            preview code's fixed 2 s rule).
        description: one line for help texts and reports.
    """

    name: str
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    pinning: bool = False
    ttl_rule: TTLRule = "continuum"
    description: str = ""


def _row(
    eviction: str, priority: str, pinning: bool, description: str, ttl_rule: TTLRule = "continuum"
) -> tuple[dict[str, Any], bool, TTLRule, str]:
    return ({"eviction_policy": eviction, "priority": priority}, pinning, ttl_rule, description)


# Read-only table: name -> (engine overrides, pinning, ttl rule, description).
_TABLE: Mapping[str, tuple[dict[str, Any], bool, TTLRule, str]] = MappingProxyType(
    {
        "vllm-apc": _row("vllm-apc", "fcfs", False, "vLLM automatic prefix caching (LRU, prefix-only reuse)"),
        "lru": _row("lru", "fcfs", False, "plain block LRU"),
        "pensieve": _row("pensieve", "fcfs", False, "Pensieve: cheapest leading blocks of idle sessions first"),
        "asymcache": _row("asymcache", "fcfs", False, "AsymCache expected-latency eviction with hole reuse"),
        "continuum": _row("vllm-apc", "program", True, "Continuum: TTL pins across tool pauses + program FCFS"),
        "asymcache+continuum": _row(
            "asymcache", "adaptive", True,
            "Continuum pins over AsymCache eviction (holes refilled), job admission, eta-weighted program order",
        ),
        "continuum-preview": _row(
            "vllm-apc", "program", True, "Continuum with the preview code's fixed 2 s TTL", "preview"
        ),
        "asymcache+continuum-preview": _row(
            "asymcache", "adaptive", True, "AsymCache + Continuum with the fixed 2 s TTL", "preview"
        ),
    }
)


def preset_names() -> list[str]:
    """Every preset name, in table order.

    Returns:
        The names.
    """
    return list(_TABLE)


def resolve_preset(name: str) -> ServingPreset:
    """Look a preset up by name.

    Args:
        name: a name from :func:`preset_names` (case-insensitive, surrounding blanks ignored).

    Returns:
        The preset (a fresh ``engine_overrides`` dict each call).

    Raises:
        ValueError: unknown name (the message names ``policy``, the CLI option that takes
        preset names, and lists the known ones).
    """
    key = name.strip().lower() if isinstance(name, str) else name
    row = _TABLE.get(key) if isinstance(key, str) else None
    if row is None:
        raise ValueError(f"policy: unknown policy {name!r}; known: {', '.join(_TABLE)}")
    overrides, pinning, ttl_rule, description = row
    return ServingPreset(key, dict(overrides), pinning, ttl_rule, description)


def preset_for_engine(config: Any) -> ServingPreset:
    """The preset an engine's config is built for: the first of the table whose engine settings
    all match it (``Engine()``'s default, the ``asymcache`` eviction policy in FCFS order, is
    ``asymcache``).

    Args:
        config: an :class:`asymcache_core.EngineConfig`.

    Returns:
        The preset.

    Raises:
        ValueError: no preset matches (names ``policy``).
    """
    for name in _TABLE:
        preset = resolve_preset(name)
        if all(getattr(config, k, None) == v for k, v in preset.engine_overrides.items()):
            return preset
    raise ValueError(
        f"policy: no preset has eviction_policy={config.eviction_policy!r} and priority={config.priority!r}; name one"
    )
