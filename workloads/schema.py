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

``job_token_stream`` turns a job into concrete token ids deterministically, so that an engine
fed token ids sees the prefix sharing the trace describes: jobs with the same
``shared_prefix_id`` get byte-identical shared prefixes, jobs with equal leading
``block_hash_ids`` (imported Mooncake / Bailian traces) get identical leading blocks, and
everything else is private to the job.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

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
        """Summary statistics: job and turn counts, tool durations, token lengths.

        Returns:
            A ``TraceStats``; means over an empty set are 0.
        """
        turns_per_job = np.array([len(j.turns) for j in self.jobs], dtype=np.float64)
        inputs: list[int] = []
        outputs: list[int] = []
        tool_durs: list[float] = []
        thinks: list[float] = []
        tools: dict[str, int] = {}
        for job in self.jobs:
            last = len(job.turns) - 1
            for i, turn in enumerate(job.turns):
                inputs.append(turn.input_tokens)
                outputs.append(turn.output_tokens)
                if turn.tool is not None:
                    tool_durs.append(turn.tool_duration_s)
                    tools[turn.tool] = tools.get(turn.tool, 0) + 1
                elif i < last:
                    thinks.append(turn.think_time_s)
        contexts = [j.total_tokens for j in self.jobs]
        arrivals = [j.arrival_s for j in self.jobs]
        total_in = int(sum(inputs)) + sum(
            j.shared_prefix_tokens + j.system_tokens for j in self.jobs
        )
        total_out = int(sum(outputs))

        def mean(xs: Sequence[float] | np.ndarray) -> float:
            return float(np.mean(xs)) if len(xs) else 0.0

        def pct(xs: Sequence[float] | np.ndarray, q: float) -> float:
            return float(np.percentile(xs, q)) if len(xs) else 0.0

        return TraceStats(
            jobs=len(self.jobs),
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
            mean_shared_prefix_tokens=mean([j.shared_prefix_tokens for j in self.jobs]),
            mean_system_tokens=mean([j.system_tokens for j in self.jobs]),
            mean_job_context_tokens=mean(contexts),
            max_job_context_tokens=max(contexts) if contexts else 0,
            total_input_tokens=total_in,
            total_output_tokens=total_out,
            total_tokens=total_in + total_out,
            shared_prefix_groups=len({j.shared_prefix_id for j in self.jobs if j.shared_prefix_id}),
            arrival_span_s=(max(arrivals) - min(arrivals)) if arrivals else 0.0,
            tools=dict(sorted(tools.items())),
        )

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


# -------------------------------------------------------------------- token materialisation


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from any printable parts, stable across processes and Python versions.

    Python's ``hash()`` of a str is salted per process, so it cannot seed reproducible tokens.

    Args:
        *parts: Values whose ``repr`` identifies the stream (seed, namespace, ids).

    Returns:
        A non-negative integer suitable for ``numpy.random.default_rng``.
    """
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _draw(n: int, low: int, high: int, *parts: object) -> list[int]:
    if n <= 0:
        return []
    rng = np.random.default_rng(stable_seed(*parts))
    return rng.integers(low, high, size=n, dtype=np.int64).tolist()


def job_token_stream(
    job: Job,
    vocab_size: int,
    seed: int = 0,
    *,
    reserved: int = 16,
    high: int | None = None,
) -> list[list[int]]:
    """Deterministic token ids of each turn's new input.

    The first list is the whole first prompt: shared prefix, then the job-private system
    prompt, then turn 0's input. Later lists are just each turn's new input (the engine's own
    outputs sit between them in the context). Shared-prefix tokens depend only on
    ``(seed, shared_prefix_id)`` so jobs with the same id see identical prefixes (a shorter
    prefix is a prefix of a longer one); system and turn tokens depend on ``(seed, job_id)``.
    When the job has ``block_hash_ids``, the first ``len(block_hash_ids) * block_hash_size``
    tokens of the first prompt are drawn per block from ``(seed, hash id, position in block)``,
    so jobs with equal leading hash ids share exactly those blocks. Explicit
    ``Turn.input_token_ids`` are used verbatim and win over everything else.

    Args:
        job: The job.
        vocab_size: Model vocabulary size; the default upper bound of the ids.
        seed: Seed of the materialisation (independent of the generator seed).
        reserved: Lowest id drawn: ids below it (special tokens: BOS/EOS/pad/chat markers) are
            never produced.
        high: Exclusive upper bound of drawn ids; defaults to ``vocab_size``.

    Returns:
        ``len(job.turns)`` lists of ids; list 0 has ``job.first_prompt_tokens`` ids and list
        ``k > 0`` has ``job.turns[k].input_tokens`` ids.

    Raises:
        ValueError: The id range ``[reserved, high)`` is empty or exceeds the vocabulary.
    """
    hi = vocab_size if high is None else high
    if not 0 <= reserved < hi <= vocab_size:
        raise ValueError(
            f"token id range [{reserved}, {hi}) is empty or outside vocab_size {vocab_size}"
        )
    shared = (
        _draw(job.shared_prefix_tokens, reserved, hi, seed, "shared", job.shared_prefix_id)
        if job.shared_prefix_id is not None
        else []
    )
    system = _draw(job.system_tokens, reserved, hi, seed, "system", job.job_id)
    streams: list[list[int]] = []
    for k, turn in enumerate(job.turns):
        if turn.input_token_ids is not None:
            ids = list(turn.input_token_ids)
        else:
            ids = _draw(turn.input_tokens, reserved, hi, seed, "turn", job.job_id, k)
        streams.append(ids)
    first = shared + system + streams[0]
    if job.block_hash_ids and job.block_hash_size:
        fixed_from = len(shared) + len(system) if job.turns[0].input_token_ids is not None else None
        bs = job.block_hash_size
        for b, hid in enumerate(job.block_hash_ids):
            start = b * bs
            if start >= len(first):
                break
            end = min(start + bs, len(first))
            if fixed_from is not None:
                end = min(end, fixed_from)
                if start >= end:
                    break
            first[start:end] = _draw(bs, reserved, hi, seed, "block", bs, hid)[: end - start]
    streams[0] = first
    return streams
