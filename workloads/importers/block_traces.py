"""Request traces with hashed token blocks: Mooncake (single-turn) and Alibaba Bailian (chained
into multi-turn jobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workloads.importers.json_reading import (
    as_float,
    as_int,
    check_count,
    first_field,
    hash_id_list,
    read_jsonl_records,
    require_file,
)
from workloads.schema import ArrivalInfo, Job, Trace, TraceError, Turn


def _time_factor(unit: str) -> float:
    factors = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
    if unit not in factors:
        raise ValueError(f"timestamp_unit: must be one of {sorted(factors)}, got {unit!r}")
    return factors[unit]


def import_mooncake(
    path: str | Path,
    *,
    max_jobs: int | None = None,
    block_size: int = 512,
    timestamp_unit: str = "ms",
) -> Trace:
    """Import a Mooncake request trace: one single-turn job per request.

    Args:
        path: JSONL with ``timestamp``, ``input_length``, ``output_length``, ``hash_ids``.
        max_jobs: Keep the first this many requests (file order).
        block_size: Tokens per hash block (Mooncake: 512).
        timestamp_unit: "ms" (Mooncake), "s" or "us".

    Returns:
        A trace with ``arrival.kind == "trace"``; arrivals are relative to the earliest one.

    Raises:
        ValueError: naming the option: ``max_jobs`` below 0, ``block_size`` below 1, an unknown
            ``timestamp_unit``.
        TraceError: Unreadable file, malformed line, missing fields (``timestamp`` included),
            or ``hash_ids`` whose count is not ``input_length / block_size`` within one block
            (path:line).
    """
    check_count("max_jobs", max_jobs)
    check_count("block_size", block_size, 1)
    path = Path(path)
    require_file(path)
    factor = _time_factor(timestamp_unit)
    rows: list[tuple[float, int, Job]] = []
    # NOTE: jobs are numbered by record, not by line: a file that is one JSON array holds every
    # record on one line
    for index, (lineno, obj) in enumerate(read_jsonl_records(path), start=1):
        if max_jobs is not None and len(rows) >= max_jobs:
            break
        # NOTE: required: a missing one read as 0 moved the request to the trace's start
        ts = as_float(first_field(obj, ("timestamp", "ts"), path, lineno), "timestamp", path, lineno)
        inp = as_int(
            first_field(obj, ("input_length", "input_len", "prompt_tokens"), path, lineno),
            "input_length",
            path,
            lineno,
        )
        out = as_int(
            first_field(obj, ("output_length", "output_len", "completion_tokens"), path, lineno),
            "output_length",
            path,
            lineno,
        )
        if inp < 1:
            raise TraceError(f"{path}:{lineno}: input_length must be >= 1")
        hashes = hash_id_list(obj.get("hash_ids"), path, lineno)
        if hashes:
            # NOTE: each hash id is one block of the prompt; a count off by more than the last
            # (partial) block is another block size or a broken record, not this prompt's blocks
            blocks = -(-inp // block_size)
            if abs(len(hashes) - blocks) > 1:
                raise TraceError(
                    f"{path}:{lineno}: hash_ids holds {len(hashes)} blocks but input_length {inp} is "
                    f"{blocks} blocks of {block_size} tokens (block_size={block_size}?)"
                )
        job = Job(
            job_id=f"mooncake-{index}",
            turns=[Turn(input_tokens=inp, output_tokens=max(1, out))],
            kind="imported",
            block_hash_ids=hashes or None,
            block_hash_size=block_size if hashes else None,
            metadata={"source": "mooncake", "line": lineno},
        )
        rows.append((ts * factor, lineno, job))
    t0 = min((r[0] for r in rows), default=0.0)
    rows.sort(key=lambda r: (r[0], r[1]))
    jobs = [job.model_copy(update={"arrival_s": ts - t0}) for ts, _, job in rows]
    return Trace(
        name=path.stem,
        jobs=jobs,
        source=f"mooncake:{path}",
        arrival=ArrivalInfo(kind="trace"),
        params={"block_size": block_size},
    )


def _chat_id(value: Any) -> str:
    """A chat id as text, an integral float as its integer (a parent 1.0 is chat 1)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def import_bailian(
    path: str | Path,
    *,
    max_jobs: int | None = None,
    block_size: int = 16,
    timestamp_unit: str = "s",
) -> Trace:
    """Import an Alibaba Bailian-style trace, chaining requests into multi-turn jobs.

    Requests whose ``parent_chat_id`` is another request of the file continue that request's
    conversation; the others (parent -1, empty, or outside the file) start a job. A request
    continues at most one conversation line: two requests with the same parent (a branch) are
    an error. Turn ``k > 0`` adds
    ``input_length_k - (input_length_{k-1} + output_length_{k-1})`` new tokens (at least 1: the
    prompt grew by the previous answer plus the new message), and the pause after turn ``k-1``
    is the gap between the two requests' timestamps, recorded as think time (an upper bound: it
    also holds the previous answer's generation). The first request's ``hash_ids`` become the
    job's ``block_hash_ids``, so jobs with common leading blocks (system prompts) share them.

    Args:
        path: JSONL with ``chat_id, parent_chat_id, timestamp, input_length, output_length,
            type, turn, hash_ids``.
        max_jobs: Keep the first this many jobs (by arrival).
        block_size: Tokens per hash block (Bailian: 16).
        timestamp_unit: "s" (Bailian), "ms" or "us".

    Returns:
        A trace with ``arrival.kind == "trace"``, jobs ordered by arrival.

    Raises:
        ValueError: naming the option: ``max_jobs`` below 0, ``block_size`` below 1, an unknown
            ``timestamp_unit``.
        TraceError: Unreadable file, malformed line, missing fields (``timestamp`` included),
            duplicate chat ids, a branching conversation (two requests with one parent).
    """
    check_count("max_jobs", max_jobs)
    check_count("block_size", block_size, 1)
    path = Path(path)
    require_file(path)
    factor = _time_factor(timestamp_unit)
    recs: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for lineno, obj in read_jsonl_records(path):
        cid = _chat_id(first_field(obj, ("chat_id", "id"), path, lineno))
        if cid in recs:
            raise TraceError(f"{path}:{lineno}: duplicate chat_id {cid!r}")
        parent = obj.get("parent_chat_id")
        recs[cid] = {
            "line": lineno,
            "parent": None if parent in (None, "", -1, "-1") else _chat_id(parent),
            "ts": factor
            * as_float(first_field(obj, ("timestamp", "ts"), path, lineno), "timestamp", path, lineno),
            "in": as_int(
                first_field(obj, ("input_length", "input_len"), path, lineno),
                "input_length",
                path,
                lineno,
            ),
            "out": as_int(
                first_field(obj, ("output_length", "output_len"), path, lineno),
                "output_length",
                path,
                lineno,
            ),
            "type": obj.get("type"),
            "turn": obj.get("turn"),
            "hashes": hash_id_list(obj.get("hash_ids"), path, lineno),
        }
        order.append(cid)
    children: dict[str, list[str]] = {}
    roots: list[str] = []
    for cid in order:
        parent = recs[cid]["parent"]
        if parent is not None and parent in recs and parent != cid:
            children.setdefault(parent, []).append(cid)
        else:
            roots.append(cid)
    for parent, kids in children.items():
        kids.sort(key=lambda c: (recs[c]["ts"], recs[c]["line"]))
        if len(kids) > 1:
            # NOTE: a job is one linear conversation, each turn extending the one before; a
            # second child would be flattened after the first one's turns and its new tokens
            # counted against the wrong request
            first, other = kids[0], kids[1]
            raise TraceError(
                f"{path}:{recs[other]['line']}: chat_id {other!r} branches from chat_id {parent!r}, which chat_id "
                f"{first!r} (line {recs[first]['line']}) already continues; branching conversations are not supported"
            )
    # NOTE: records whose parent links loop never reach a root: they were dropped unseen
    reachable: set[str] = set()
    stack = list(roots)
    while stack:
        cid = stack.pop()
        if cid not in reachable:
            reachable.add(cid)
            stack.extend(children.get(cid, []))
    looped = next((cid for cid in order if cid not in reachable), None)
    if looped is not None:
        raise TraceError(f"{path}:{recs[looped]['line']}: chat_id {looped!r} is in a cycle of parent_chat_id links")
    roots.sort(key=lambda c: (recs[c]["ts"], recs[c]["line"]))
    t0 = recs[roots[0]]["ts"] if roots else 0.0
    jobs: list[Job] = []
    placed: set[str] = set()
    for root in roots:
        if max_jobs is not None and len(jobs) >= max_jobs:
            break
        chain: list[str] = []
        stack = [root]
        while stack:
            cid = stack.pop()
            if cid in placed:
                continue  # parent-link cycles cannot loop forever
            placed.add(cid)
            chain.append(cid)
            stack.extend(reversed(children.get(cid, [])))
        turns: list[Turn] = []
        for k, cid in enumerate(chain):
            r = recs[cid]
            if k == 0:
                new = r["in"]
            else:
                prev = recs[chain[k - 1]]
                new = max(1, r["in"] - prev["in"] - prev["out"])
                turns[-1] = turns[-1].model_copy(
                    update={"think_time_s": max(0.0, r["ts"] - prev["ts"])}
                )
            if new < 1:
                raise TraceError(f"{path}:{r['line']}: input_length must be >= 1")
            turns.append(Turn(input_tokens=new, output_tokens=max(1, r["out"])))
        first = recs[root]
        jobs.append(
            Job(
                job_id=f"bailian-{root}",
                arrival_s=max(0.0, first["ts"] - t0),
                turns=turns,
                kind="imported",
                block_hash_ids=first["hashes"] or None,
                block_hash_size=block_size if first["hashes"] else None,
                metadata={
                    "source": "bailian",
                    "line": first["line"],
                    "chat_ids": chain,
                    "types": [recs[c]["type"] for c in chain],
                },
            )
        )
    return Trace(
        name=path.stem,
        jobs=jobs,
        source=f"bailian:{path}",
        arrival=ArrivalInfo(kind="trace"),
        params={"block_size": block_size},
    )
