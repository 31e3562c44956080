"""Trace schema for agent workloads: jobs made of turns, stored as JSONL.

A *trace* is a list of *jobs*. A job is one agent program (a SWE agent solving one task, a
tool loop answering one request, one chat session) and is made of *turns*: one LLM call each.
Turn ``k`` of a job sends the whole context so far (shared prefix, job-private system prompt,
and every earlier turn's input and output) plus ``turns[k].input_tokens`` new tokens, and the
model generates ``turns[k].output_tokens`` tokens. After a non-last turn the job pauses: for
``turns[k].tool_duration_s`` seconds when the turn ended in a tool call (``tool`` is set), or
for ``turns[k].think_time_s`` seconds (a chat user thinking) when it did not. Then turn
``k + 1`` arrives.

On disk (``Trace.save_jsonl``) the first line is a header object ``{"trace": {...}}`` with the
trace-level fields (name, seed, source, arrival, schema_version) and every further line is one
``Job`` as JSON. ``Trace.load_jsonl`` also accepts files without a header (the trace is then
named after the file); blank lines are skipped. Any malformed line raises ``TraceError`` whose
message names the file and the 1-based line number.

Turning a job into concrete token ids is :mod:`workloads.token_streams`
(``job_token_stream``), and ``Trace.stats`` is computed by :mod:`workloads.trace_stats`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from workloads.trace_stats import TraceStats, trace_stats

SCHEMA_VERSION = 1
"""Version written into the JSONL header; bump on incompatible schema changes."""

JobKind = Literal["swe", "toolloop", "chat", "imported"]
ArrivalKind = Literal["none", "trace", "poisson", "burst", "closed_loop"]


class TraceError(ValueError):
    """A trace (or an imported data file) could not be read or is malformed.

    The message names the file and, where one applies, the 1-based line number.
    """


class Turn(BaseModel):
    """One LLM call of a job.

    Attributes:
        input_tokens: New tokens appended to the context this turn (user message, tool output,
            or for the first turn the task prompt). May be 0 only when the job's shared prefix
            and system prompt already form the first prompt.
        input_text: Optional text of the new input (imported traces keep it for real backends).
        input_token_ids: Optional explicit token ids of the new input; when given its length
            must equal ``input_tokens`` and ``job_token_stream`` uses it verbatim.
        output_tokens: Tokens the model generates this turn (the harness caps generation here).
        tool: Name of the tool called at the end of the turn; ``None`` when the turn ends without
            a tool call (always on the last turn of a job).
        tool_duration_s: How long the tool runs, i.e. the pause before the next turn.
        think_time_s: User think time before the next turn, used instead of the tool duration
            when ``tool`` is ``None`` and the turn is not the last one (chat sessions).
    """

    model_config = ConfigDict(extra="forbid")

    input_tokens: StrictInt = Field(ge=0)
    input_text: str | None = None
    input_token_ids: list[int] | None = None
    output_tokens: StrictInt = Field(ge=1)
    tool: str | None = None
    tool_duration_s: float = Field(default=0.0, ge=0.0)
    think_time_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _check_ids(self) -> Turn:
        if self.input_token_ids is not None and len(self.input_token_ids) != self.input_tokens:
            raise ValueError(
                f"input_token_ids has {len(self.input_token_ids)} ids but input_tokens is "
                f"{self.input_tokens}"
            )
        if not math.isfinite(self.tool_duration_s) or not math.isfinite(self.think_time_s):
            raise ValueError("tool_duration_s and think_time_s must be finite")
        return self


class Job(BaseModel):
    """One agent program: a sequence of turns that share a growing context.

    Attributes:
        job_id: Unique id within the trace; also seeds the job's private tokens.
        arrival_s: When the job's first turn arrives, seconds from the trace start. In a
            closed-loop trace (``Trace.arrival.kind == "closed_loop"``) it is 0 and the harness
            decides the real start (see ``workloads.arrivals.ClosedLoopDispatcher``).
        shared_prefix_id: Jobs with the same id start with the same ``shared_prefix_tokens``
            tokens (a system prompt shared across jobs); ``None`` for no shared prefix.
        shared_prefix_tokens: Length of that shared prefix.
        system_tokens: Job-private system/task prompt tokens placed after the shared prefix and
            before the first turn's input.
        turns: The job's LLM calls, at least one.
        kind: Workload family: "swe", "toolloop", "chat" or "imported".
        metadata: Free-form extra data (source line, tool mix, dataset id, ...).
        block_hash_ids: For imported block-hashed traces (Mooncake, Bailian): hash ids of
            consecutive ``block_hash_size``-token blocks covering the start of the first prompt
            (shared prefix + system + first input). Jobs with equal leading ids share those
            tokens exactly (a hash chains over all earlier tokens, so equal id => equal prefix).
        block_hash_size: Tokens per hashed block (512 for Mooncake, 16 for Bailian).
    """

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1)
    arrival_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    shared_prefix_id: str | None = None
    shared_prefix_tokens: StrictInt = Field(default=0, ge=0)
    system_tokens: StrictInt = Field(default=0, ge=0)
    turns: list[Turn] = Field(min_length=1)
    kind: JobKind = "imported"
    metadata: dict[str, Any] = Field(default_factory=dict)
    block_hash_ids: list[int] | None = None
    block_hash_size: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_job(self) -> Job:
        if self.turns[-1].tool is not None:
            raise ValueError("the last turn of a job must not call a tool (tool must be None)")
        if self.shared_prefix_tokens > 0 and self.shared_prefix_id is None:
            raise ValueError("shared_prefix_tokens > 0 needs a shared_prefix_id")
        if self.block_hash_ids is not None and self.block_hash_size is None:
            raise ValueError("block_hash_ids needs block_hash_size")
        if self.shared_prefix_tokens + self.system_tokens + self.turns[0].input_tokens == 0:
            raise ValueError("the first prompt of a job is empty")
        return self

    @property
    def num_turns(self) -> int:
        """Number of LLM calls in the job."""
        return len(self.turns)

    @property
    def first_prompt_tokens(self) -> int:
        """Length of the first turn's prompt: shared prefix + system + first input."""
        return self.shared_prefix_tokens + self.system_tokens + self.turns[0].input_tokens

    def pause_after(self, turn_index: int) -> float:
        """Seconds between the end of turn ``turn_index`` and the arrival of the next turn.

        Args:
            turn_index: 0-based turn index.

        Returns:
            The tool duration if the turn called a tool, else the think time; 0 for the last
            turn (the job is finished).
        """
        if turn_index >= len(self.turns) - 1:
            return 0.0
        turn = self.turns[turn_index]
        return turn.tool_duration_s if turn.tool is not None else turn.think_time_s

    def context_tokens_before(self, turn_index: int) -> int:
        """Prompt length of turn ``turn_index`` (everything the model sees before generating).

        Args:
            turn_index: 0-based turn index.

        Returns:
            Shared prefix + system + inputs of turns 0..turn_index + outputs of turns before it.
        """
        total = self.shared_prefix_tokens + self.system_tokens
        for i, turn in enumerate(self.turns[: turn_index + 1]):
            total += turn.input_tokens
            if i < turn_index:
                total += turn.output_tokens
        return total

    @property
    def total_tokens(self) -> int:
        """Context length at the end of the job (all inputs, outputs, prefix and system)."""
        return (
            self.shared_prefix_tokens
            + self.system_tokens
            + sum(t.input_tokens + t.output_tokens for t in self.turns)
        )


class ArrivalInfo(BaseModel):
    """How the jobs of a trace arrive; set by ``workloads.arrivals``.

    Attributes:
        kind: "none" (generator output, all jobs at 0 and no process applied yet), "trace"
            (arrival times come from an imported trace), "poisson", "burst", or "closed_loop".
        rate: Jobs per second for "poisson".
        burst_size: Jobs per burst for "burst".
        burst_interval_s: Seconds between bursts for "burst".
        concurrency: Jobs kept in flight for "closed_loop": the harness starts the first
            ``concurrency`` jobs at time 0 and, each time a job completes, starts the next job
            in trace order; every ``arrival_s`` is 0 and must be ignored.
        seed: Seed of the arrival process (for reproducibility records).
    """

    model_config = ConfigDict(extra="forbid")

    kind: ArrivalKind = "none"
    rate: float | None = Field(default=None, gt=0.0)
    burst_size: int | None = Field(default=None, ge=1)
    burst_interval_s: float | None = Field(default=None, ge=0.0)
    concurrency: int | None = Field(default=None, ge=1)
    seed: int | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> ArrivalInfo:
        if self.kind == "poisson" and self.rate is None:
            raise ValueError("poisson arrivals need a rate")
        if self.kind == "burst" and (self.burst_size is None or self.burst_interval_s is None):
            raise ValueError("burst arrivals need burst_size and burst_interval_s")
        if self.kind == "closed_loop" and self.concurrency is None:
            raise ValueError("closed-loop arrivals need a concurrency")
        return self


class Trace(BaseModel):
    """A named, seeded list of jobs plus how they arrive.

    Attributes:
        name: Workload name ("swe", "chat", a file stem, ...).
        seed: Seed the trace was generated with (None for imported traces).
        jobs: The jobs, in dispatch order (closed-loop harnesses start them in this order).
        source: Where it came from ("generator:swe", "sharegpt:/path", ...).
        arrival: The arrival process applied to ``jobs[*].arrival_s``.
        params: Generator parameters or importer options, for provenance.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    seed: int | None = None
    jobs: list[Job]
    source: str = ""
    arrival: ArrivalInfo = Field(default_factory=ArrivalInfo)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique_ids(self) -> Trace:
        seen: set[str] = set()
        for job in self.jobs:
            if job.job_id in seen:
                raise ValueError(f"duplicate job_id {job.job_id!r}")
            seen.add(job.job_id)
        return self

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def closed_loop_concurrency(self) -> int | None:
        """Concurrency of a closed-loop trace, or None when arrivals are open-loop."""
        return self.arrival.concurrency if self.arrival.kind == "closed_loop" else None

    def head(self, n: int) -> Trace:
        """A copy holding the first ``n`` jobs.

        Args:
            n: Number of jobs to keep.

        Returns:
            A new trace; the original is untouched.
        """
        return self.model_copy(update={"jobs": [j.model_copy(deep=True) for j in self.jobs[:n]]})

    def sorted_by_arrival(self) -> list[Job]:
        """Jobs ordered by arrival time (stable: ties keep trace order).

        Returns:
            A new list of the same job objects.
        """
        return sorted(self.jobs, key=lambda j: j.arrival_s)

    # ---------------------------------------------------------------- statistics

    def stats(self) -> TraceStats:
        """Summary statistics: job and turn counts, tool durations, token lengths
        (:func:`~workloads.trace_stats.trace_stats`).

        Returns:
            A ``TraceStats``; means over an empty set are 0.
        """
        return trace_stats(self.jobs)

    # ---------------------------------------------------------------- JSONL I/O

    def save_jsonl(self, path: str | Path) -> None:
        """Write the trace as JSONL: a header line, then one job per line.

        Args:
            path: Destination file; parent directories are created.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "trace": {
                "schema_version": SCHEMA_VERSION,
                **self.model_dump(mode="json", exclude={"jobs"}),
            }
        }
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(header, separators=(",", ":")) + "\n")
            for job in self.jobs:
                f.write(job.model_dump_json(exclude_defaults=True) + "\n")
        # Write-then-rename so a crashed writer never leaves a half trace under the real name.
        tmp.replace(path)

    @classmethod
    def load_jsonl(cls, path: str | Path) -> Trace:
        """Read a trace written by ``save_jsonl`` (the header line is optional).

        Args:
            path: JSONL file.

        Returns:
            The trace.

        Raises:
            TraceError: The file cannot be read, or a line is not valid JSON / not a valid job;
                the message names the file and the 1-based line number.
        """
        path = Path(path)
        header: dict[str, Any] | None = None
        jobs: list[Job] = []
        try:
            f = path.open("r", encoding="utf-8")
        except OSError as e:
            raise TraceError(f"{path}: cannot read trace: {e}") from e
        with f:
            try:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise TraceError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
                    if not isinstance(obj, dict):
                        raise TraceError(f"{path}:{lineno}: expected a JSON object")
                    if "trace" in obj and "job_id" not in obj:
                        if header is not None or jobs:
                            raise TraceError(f"{path}:{lineno}: trace header after the first line")
                        header = _parse_header(obj["trace"], path, lineno)
                        continue
                    try:
                        jobs.append(Job.model_validate(obj))
                    except ValidationError as e:
                        raise TraceError(f"{path}:{lineno}: invalid job: {_short(e)}") from e
            except UnicodeDecodeError as e:
                raise TraceError(f"{path}: not UTF-8 text: {e}") from e
        header = header or {"name": path.stem, "source": f"trace:{path}"}
        try:
            return cls.model_validate({**header, "jobs": jobs})
        except ValidationError as e:
            raise TraceError(f"{path}: invalid trace: {_short(e)}") from e


def _parse_header(obj: Any, path: Path, lineno: int) -> dict[str, Any]:
    """Validate a JSONL header object and return the trace-level fields."""
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{lineno}: trace header must be an object")
    fields = dict(obj)
    version = fields.pop("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise TraceError(f"{path}:{lineno}: unsupported schema_version {version!r}")
    try:
        # Validate the header alone so its errors point at its own line, not at the file.
        Trace.model_validate({**fields, "jobs": []})
    except ValidationError as e:
        raise TraceError(f"{path}:{lineno}: invalid trace header: {_short(e)}") from e
    return fields


def _short(e: ValidationError) -> str:
    """First few pydantic errors as one line."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = e.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
