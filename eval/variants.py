"""Bench variants: a serving preset (:mod:`agent_runtime.presets`) plus ablation suffixes,
``PRESET[/SUFFIX...]`` (:class:`BenchVariant`), as ``asymcache bench --policies`` names them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent_runtime.presets import TTLRule, resolve_preset

DEFAULT_POLICIES = ("vllm-apc", "continuum", "asymcache", "asymcache+continuum")

SUFFIXES: dict[str, dict[str, Any]] = {
    "no-holes": {"hole_reuse": False},
    "job-admission": {"job_admission": True},
    "no-job-admission": {"job_admission": False},
    "no-implicit-jobs": {"implicit_jobs": False},
    "no-msa": {"attention_backend": "torch"},
    "unbounded": {},
    "reserve-prompt": {"admit_full_prompt": True},
    "least-work": {"least_work_first": True},
    "fcfs": {"priority": "fcfs"},
    "anonymous": {},
}
"""The plain ``PRESET/SUFFIX`` ablations: without hole reuse; ``job-admission`` /
``no-job-admission``, job-level admission on or off whatever the eviction policy's default
(``EngineConfig.job_admission``); ``no-implicit-jobs``, requests without a job id stay without
one (``EngineConfig.implicit_jobs``; with ``anonymous``, what the default did before); with the torch attention path
instead of the MSA kernel (one launch per segment on GPU); ``unbounded``, a pool that holds the
whole working set, so nothing is ever evicted (the ceiling any eviction policy can reach at that
load; see :attr:`BenchVariant.unbounded_pool`); ``reserve-prompt``, admission only when a
request's whole prompt fits (vLLM's default, ``EngineConfig.admit_full_prompt``); ``least-work``,
the requests with the fewest tokens left to compute first (``EngineConfig.least_work_first``);
``fcfs``, waiting requests in arrival order whatever the preset's order (``EngineConfig.priority``:
``asymcache+continuum/fcfs`` is the default without its eta-weighted program order);
``anonymous``, clients that send no job ids and never say a job's last step (most agent
frameworks): whatever the engine knows of jobs, it learns from the requests themselves (see
:attr:`BenchVariant.anonymous`).

Suffixes with a value, parsed by :meth:`BenchVariant.parse`: ``least-work:P``, the same with a
patience of P (``EngineConfig.least_work_patience``); ``adaptive`` turns on adaptive chunking
(``adaptive:slack`` its per-request TPOT variant) and ``fixed:N`` sets a fixed budget, for any
preset (chunking sweeps); ``adaptive/slo:MS`` gives that variant its own TPOT target instead of
the run's ``--tpot-slo-ms``, so one run can sweep targets side by side.
Suffixes combine: ``asymcache/reserve-prompt/adaptive:slack``."""

#: Every suffix as ``--policies`` spells it (``N``, ``P``, ``MS``: a number).
SUFFIX_SPELLINGS: tuple[str, ...] = (
    *SUFFIXES, "least-work:P", "adaptive", "adaptive:slack", "fixed:N", "slo:MS",
)


@dataclass(frozen=True)
class BenchVariant:
    """One entry of ``--policies``: a serving preset plus ablation suffixes, as the harness runs it.

    Attributes:
        name: the variant as written (``asymcache/reserve-prompt/adaptive:slack``); it labels
            the run in the results and the report.
        engine_overrides: :class:`asymcache_core.EngineConfig` fields the preset and the
            suffixes set, applied over the run's engine settings.
        pinning: the preset pins a job's KV across tool pauses (Continuum).
        ttl_rule: how the preset chooses a pin's TTL.
        unbounded_pool: the ``unbounded`` suffix: the pool holds the whole working set.
        anonymous: the ``anonymous`` suffix: requests carry no ``job_id`` and no
            ``is_last_step``; the Continuum hand-off (tool pauses) uses the job the engine
            assigned, if any, as the agent runtime does.
    """

    name: str
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    pinning: bool = False
    ttl_rule: TTLRule = "continuum"
    unbounded_pool: bool = False
    anonymous: bool = False

    @classmethod
    def parse(cls, name: str) -> BenchVariant:
        """Parses ``PRESET``, ``PRESET/SUFFIX`` or ``PRESET/SUFFIX/...`` (suffixes combine; at
        most one chunking suffix; ``slo:MS`` only beside an adaptive one).

        Every variant runs with the engine's fixed chunking unless a suffix asks for
        ``adaptive``, so that eviction policies are compared at equal chunking (adaptive
        chunking trades TTFT for TPOT, and on a device without a utilization knee it only adds
        steps).

        Args:
            name: the variant.

        Returns:
            The variant (a fresh ``engine_overrides`` dict).

        Raises:
            ValueError: unknown preset or suffix, or suffixes that do not combine (the message
            names ``policy``, the CLI option).
        """
        base, *suffixes = name.split("/")
        preset = resolve_preset(base)
        overrides = dict(preset.engine_overrides)
        if len(set(suffixes)) < len(suffixes):
            raise ValueError(f"policy: a suffix repeats in {name!r}")
        for suffix in suffixes:
            if suffix.startswith("fixed:") or suffix in ("adaptive", "adaptive:slack"):
                if "chunking" in overrides:
                    raise ValueError(f"policy: more than one chunking suffix in {name!r}")
                overrides["chunking"] = suffix
            elif suffix.startswith("slo:"):
                overrides["tpot_slo_ms"] = _suffix_number(suffix, name)
            elif suffix.startswith("least-work:"):
                overrides.update(least_work_first=True, least_work_patience=_suffix_number(suffix, name))
            elif suffix in SUFFIXES:
                for key, value in SUFFIXES[suffix].items():
                    # NOTE: a suffix that undoes another (job-admission/no-job-admission) is a
                    # contradiction, not "the last one wins"
                    if key in overrides and overrides[key] != value and key not in preset.engine_overrides:
                        raise ValueError(f"policy: {suffix!r} contradicts another suffix in {name!r}")
                    overrides[key] = value
            else:
                raise ValueError(f"policy: unknown ablation {suffix!r} in {name!r}; known: {', '.join(SUFFIX_SPELLINGS)}")
        if "tpot_slo_ms" in overrides and not overrides.get("chunking", "").startswith("adaptive"):
            # NOTE: only adaptive chunking reads the target; accepting it elsewhere would label a
            # fixed-budget run with a target it never used.
            raise ValueError(f"policy: slo:MS needs /adaptive or /adaptive:slack in {name!r}")
        return cls(name, overrides, preset.pinning, preset.ttl_rule, unbounded_pool="unbounded" in suffixes,
                   anonymous="anonymous" in suffixes)

    @classmethod
    def label(cls, name: str) -> BenchVariant:
        """A variant that only names a run (the ``http`` backend: the server runs its own
        configuration, so the name is not parsed, but for a last ``/anonymous``: its clients
        send no job ids).

        Args:
            name: the label.

        Returns:
            The variant, without overrides or pinning.
        """
        return cls(name, anonymous=name.endswith("/anonymous"))


def _suffix_number(suffix: str, name: str) -> float:
    """The number of a ``KEY:VALUE`` suffix (``slo:MS``, ``least-work:P``): positive and finite."""
    try:
        value = float(suffix.split(":", 1)[1])
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"policy: {suffix.split(':', 1)[0]}:N needs a positive number, got {suffix!r} in {name!r}")
    return value
