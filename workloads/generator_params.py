"""The parameters of the synthetic workloads: one frozen dataclass per workload family.

:class:`CommonParams` holds what every generator takes (job count, seed, token and time scales),
:class:`SweParams`, :class:`ToolLoopParams` and :class:`ChatParams` add each family's turn, length
and tool-time distributions, and :class:`ToolProfile` describes one tool of an agent
(``SWE_TOOLS`` and ``TOOLLOOP_TOOLS`` are the default mixes). Their defaults carry the
calibration described in :mod:`workloads.generators`, which draws the traces from them.
"""

from __future__ import annotations

from dataclasses import dataclass


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

