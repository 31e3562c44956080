"""ShareGPT conversations as multi-turn chat jobs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from workloads.importers.json_reading import (
    JsonStream,
    TokenCounter,
    check_count,
    estimate_tokens,
    require_file,
)
from workloads.schema import ArrivalInfo, Job, Trace, Turn

_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})


def _messages(conv: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    msgs = conv.get("conversations", conv.get("messages", conv.get("conversation")))
    if not isinstance(msgs, list):
        return None
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            return None
        role = str(m.get("from", m.get("role", ""))).lower()
        text = m.get("value", m.get("content", ""))
        out.append((role, text if isinstance(text, str) else json.dumps(text)))
    return out


def import_sharegpt(
    path: str | Path,
    *,
    max_jobs: int | None = None,
    tokenizer: TokenCounter | None = None,
    think_time_mean_s: float = 10.0,
    shared_prefix_tokens: int = 0,
    min_turns: int = 1,
    max_turns: int | None = None,
    keep_text: bool = False,
    seed: int = 0,
) -> Trace:
    """Import ShareGPT conversations as chat sessions (tolerates a truncated JSON array).

    Args:
        path: ShareGPT JSON array (possibly cut off) or JSONL.
        max_jobs: Stop after this many sessions.
        tokenizer: Token counter; default ``estimate_tokens`` (~4 chars/token).
        think_time_mean_s: Mean of the exponential think time between turns (seeded).
        shared_prefix_tokens: Length of a system prompt shared by every session (0: none).
        min_turns: Skip conversations with fewer turns.
        max_turns: Keep at most this many turns per conversation.
        keep_text: Store each turn's user text in ``Turn.input_text``.
        seed: Seed of the think times.

    Returns:
        A trace of kind "imported" jobs, all arriving at 0; ``params`` records ``truncated``
        and ``skipped`` (conversations without a complete user/assistant exchange).

    Raises:
        ValueError: naming the option: ``max_jobs``, ``min_turns`` or ``shared_prefix_tokens``
            below 0, ``max_turns`` below 1.
        TraceError: Unreadable file or malformed JSON (not a clean truncation).
    """
    for name, value, minimum in (("max_jobs", max_jobs, 0), ("max_turns", max_turns, 1), ("min_turns", min_turns, 0),
                                 ("shared_prefix_tokens", shared_prefix_tokens, 0)):
        check_count(name, value, minimum)
    path = Path(path)
    require_file(path)
    count = tokenizer or estimate_tokens
    stream = JsonStream(path)
    jobs: list[Job] = []
    skipped = 0
    for index, (lineno, conv) in enumerate(stream):
        if max_jobs is not None and len(jobs) >= max_jobs:
            break
        msgs = _messages(conv) if isinstance(conv, dict) else None
        if msgs is None:
            skipped += 1
            continue
        system = 0
        turns: list[dict[str, Any]] = []
        pending: list[str] = []
        for role, text in msgs:
            if role == "system":
                system += max(0, int(count(text)))
            elif role in _USER_ROLES:
                pending.append(text)
            elif role in _ASSISTANT_ROLES:
                if pending:
                    user = "\n".join(pending)
                    pending = []
                    turns.append(
                        {
                            "input_tokens": max(1, int(count(user))),
                            "input_text": user if keep_text else None,
                            "output_tokens": max(1, int(count(text))),
                        }
                    )
                elif turns:
                    # Consecutive answers: the model kept talking; extend the last output.
                    turns[-1]["output_tokens"] += max(1, int(count(text)))
                # A leading assistant message (a greeting) has no request: dropped.
        if max_turns is not None:
            turns = turns[:max_turns]
        if len(turns) < max(1, min_turns):
            skipped += 1
            continue
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0x5A6, index)))
        for turn in turns[:-1]:
            turn["think_time_s"] = (
                float(rng.exponential(think_time_mean_s)) if think_time_mean_s > 0 else 0.0
            )
        conv_id = conv.get("id")
        jobs.append(
            Job(
                job_id=f"sharegpt-{index:06d}",
                shared_prefix_id="sharegpt-system" if shared_prefix_tokens > 0 else None,
                shared_prefix_tokens=shared_prefix_tokens,
                system_tokens=system,
                turns=[Turn(**t) for t in turns],
                kind="imported",
                metadata={"source": "sharegpt", "id": conv_id, "line": lineno},
            )
        )
    return Trace(
        name=path.stem,
        jobs=jobs,
        source=f"sharegpt:{path}",
        arrival=ArrivalInfo(kind="none"),
        params={
            "truncated": stream.truncated,
            "skipped": skipped,
            "think_time_mean_s": think_time_mean_s,
            "seed": seed,
        },
    )
