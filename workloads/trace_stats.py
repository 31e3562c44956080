"""Summary statistics of a trace's jobs (:class:`TraceStats`, what ``Trace.stats`` returns):
counts, tool pauses, token lengths.

NOTE: separate from :mod:`workloads.schema`, which holds what a trace is and how it is stored;
this module only reads jobs to describe them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from workloads.schema import Job


class TraceStats(BaseModel):
    """Summary statistics of a trace (see ``Trace.stats``). Token means are per turn."""

    model_config = ConfigDict(frozen=True)

    jobs: int
    turns: int
    mean_turns: float
    p50_turns: float
    p95_turns: float
    max_turns: int
    tool_calls: int
    mean_tool_duration_s: float
    p95_tool_duration_s: float
    mean_think_time_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    mean_shared_prefix_tokens: float
    mean_system_tokens: float
    mean_job_context_tokens: float
    max_job_context_tokens: int
    total_input_tokens: int
    total_output_tokens: int
    total_tokens: int
    shared_prefix_groups: int
    arrival_span_s: float
    tools: dict[str, int]


def trace_stats(jobs: Sequence[Job]) -> TraceStats:
    """Summary statistics of ``jobs``: job and turn counts, tool durations, token lengths.

    Args:
        jobs: The trace's jobs.

    Returns:
        A ``TraceStats``; means over an empty set are 0.
    """
    turns_per_job = np.array([len(j.turns) for j in jobs], dtype=np.float64)
    inputs: list[int] = []
    outputs: list[int] = []
    tool_durs: list[float] = []
    thinks: list[float] = []
    tools: dict[str, int] = {}
    for job in jobs:
        last = len(job.turns) - 1
        for i, turn in enumerate(job.turns):
            inputs.append(turn.input_tokens)
            outputs.append(turn.output_tokens)
            if turn.tool is not None:
                tool_durs.append(turn.tool_duration_s)
                tools[turn.tool] = tools.get(turn.tool, 0) + 1
            elif i < last:
                thinks.append(turn.think_time_s)
    contexts = [j.total_tokens for j in jobs]
    arrivals = [j.arrival_s for j in jobs]
    total_in = int(sum(inputs)) + sum(j.shared_prefix_tokens + j.system_tokens for j in jobs)
    total_out = int(sum(outputs))

    def mean(xs: Sequence[float] | np.ndarray) -> float:
        return float(np.mean(xs)) if len(xs) else 0.0

    def pct(xs: Sequence[float] | np.ndarray, q: float) -> float:
        return float(np.percentile(xs, q)) if len(xs) else 0.0

    return TraceStats(
        jobs=len(jobs),
        turns=int(turns_per_job.sum()),
        mean_turns=mean(turns_per_job),
        p50_turns=pct(turns_per_job, 50),
        p95_turns=pct(turns_per_job, 95),
        max_turns=int(turns_per_job.max()) if len(turns_per_job) else 0,
        tool_calls=len(tool_durs),
        mean_tool_duration_s=mean(tool_durs),
        p95_tool_duration_s=pct(tool_durs, 95),
        mean_think_time_s=mean(thinks),
        mean_input_tokens=mean(inputs),
        mean_output_tokens=mean(outputs),
        mean_shared_prefix_tokens=mean([j.shared_prefix_tokens for j in jobs]),
        mean_system_tokens=mean([j.system_tokens for j in jobs]),
        mean_job_context_tokens=mean(contexts),
        max_job_context_tokens=max(contexts) if contexts else 0,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_tokens=total_in + total_out,
        shared_prefix_groups=len({j.shared_prefix_id for j in jobs if j.shared_prefix_id}),
        arrival_span_s=(max(arrivals) - min(arrivals)) if arrivals else 0.0,
        tools=dict(sorted(tools.items())),
    )
