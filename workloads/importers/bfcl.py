"""BFCL multi-turn entries as tool-calling jobs."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from workloads.importers.json_reading import (
    TokenCounter,
    check_count,
    estimate_tokens,
    first_field,
    read_jsonl_records,
    require_file,
)
from workloads.schema import ArrivalInfo, Job, Trace, TraceError, Turn

BFCL_FUNC_DOC_FILES: Mapping[str, str] = MappingProxyType(
    {
        # Copied from bfcl_eval/constants/executable_backend_config.py (bfcl-eval 2026.3.23).
        "GorillaFileSystem": "gorilla_file_system.json",
        "MathAPI": "math_api.json",
        "MessageAPI": "message_api.json",
        "TwitterAPI": "posting_api.json",
        "TicketAPI": "ticket_api.json",
        "TradingBot": "trading_bot.json",
        "TravelAPI": "travel_booking.json",
        "VehicleControlAPI": "vehicle_control.json",
        "WebSearchAPI": "web_search.json",
        "MemoryAPI_kv": "memory_kv.json",
        "MemoryAPI_vector": "memory_vector.json",
        "MemoryAPI_rec_sum": "memory_rec_sum.json",
    }
)
"""BFCL API class -> its function-doc file in ``bfcl_eval/data/multi_turn_func_doc``."""

_CALL_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


def _call_name(call: Any) -> str:
    if isinstance(call, str):
        m = _CALL_NAME.match(call)
        return m.group(1) if m else "call"
    if isinstance(call, dict) and call:
        name = call.get("name")
        return str(name) if isinstance(name, str) else str(next(iter(call)))
    return "call"


def _bfcl_question_text(q: Any) -> tuple[str, str]:
    """(user text, system text) of one BFCL user turn (a list of messages or one message)."""
    msgs = q if isinstance(q, list) else [q]
    user, system = [], []
    for m in msgs:
        if isinstance(m, dict):
            text = m.get("content", "")
            text = text if isinstance(text, str) else json.dumps(text)
            (system if m.get("role") == "system" else user).append(text)
        elif isinstance(m, str):
            user.append(m)
    return "\n".join(user), "\n".join(system)


def _clipped_lognormal(
    rng: np.random.Generator,
    median: float,
    sigma: float,
    lo: float,
    hi: float,
    rounded: bool = True,
) -> float:
    """Clipped lognormal draw (synthetic tool outputs and durations of imported BFCL jobs)."""
    x = float(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))
    return float(max(1, round(x))) if rounded else x


def _load_answers(path: Path) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for _, obj in read_jsonl_records(path):
        if "id" in obj and "ground_truth" in obj:
            answers[str(obj["id"])] = obj["ground_truth"]
    return answers


def import_bfcl(
    path: str | Path,
    *,
    answers_path: str | Path | None = None,
    func_doc_dir: str | Path | None = None,
    max_jobs: int | None = None,
    tokenizer: TokenCounter | None = None,
    default_doc_tokens_per_class: int = 700,
    tool_output_median: float = 40.0,
    answer_median: float = 40.0,
    think_time_mean_s: float = 2.0,
    keep_text: bool = False,
    seed: int = 0,
) -> Trace:
    """Import BFCL multi-turn entries as tool-loop jobs.

    Each user turn with ground-truth calls ``c_1..c_m`` becomes ``m`` LLM turns that each emit
    one call (input: the user message, then the previous tool's output) and one answering turn
    (input: the last tool output) whose pause before the next user turn is an exponential think
    time. Without ground truth, one call per user turn is assumed. Tool outputs (lognormal
    around ``tool_output_median`` tokens) and tool durations (10-300 ms, in-process APIs) are
    synthetic and seeded.

    Args:
        path: BFCL question file (JSONL; a JSON array is accepted too).
        answers_path: Ground-truth file; default ``<dir>/possible_answer/<file name>`` if present.
        func_doc_dir: Directory of function docs; default ``<dir>/multi_turn_func_doc``. Used to
            size the shared prefix of each set of involved classes.
        max_jobs: Stop after this many entries.
        tokenizer: Token counter; default ``estimate_tokens``.
        default_doc_tokens_per_class: Prefix tokens per class when its doc file is missing.
        tool_output_median: Median synthetic tool output (tokens).
        answer_median: Median synthetic final-answer length (tokens).
        think_time_mean_s: Mean user think time between user turns.
        keep_text: Store user texts in ``Turn.input_text``.
        seed: Seed of the synthetic parts.

    Returns:
        A trace of kind "imported" jobs, all arriving at 0.

    Raises:
        ValueError: ``max_jobs`` below 0 (naming it).
        TraceError: Unreadable or malformed files, or an id given twice (path and line in the
            message).
    """
    check_count("max_jobs", max_jobs)
    path = Path(path)
    require_file(path)
    count = tokenizer or estimate_tokens
    if answers_path is None:
        guess = path.parent / "possible_answer" / path.name
        answers = _load_answers(guess) if guess.is_file() else {}
    else:
        require_file(Path(answers_path))
        answers = _load_answers(Path(answers_path))
    doc_dir = (
        Path(func_doc_dir) if func_doc_dir is not None else path.parent / "multi_turn_func_doc"
    )
    doc_tokens: dict[str, int] = {}

    def class_tokens(cls: str) -> int:
        if cls not in doc_tokens:
            doc = doc_dir / BFCL_FUNC_DOC_FILES.get(cls, f"{cls}.json")
            try:
                doc_tokens[cls] = max(1, int(count(doc.read_text(encoding="utf-8"))))
            except OSError:
                doc_tokens[cls] = default_doc_tokens_per_class
        return doc_tokens[cls]

    jobs: list[Job] = []
    seen: dict[str, int] = {}  # entry id -> its line
    for index, (lineno, entry) in enumerate(read_jsonl_records(path)):
        if max_jobs is not None and len(jobs) >= max_jobs:
            break
        questions = first_field(entry, ("question", "questions", "turns"), path, lineno)
        if not isinstance(questions, list) or not questions:
            raise TraceError(f"{path}:{lineno}: 'question' must be a non-empty list")
        entry_id = str(entry.get("id", f"{path.stem}-{index}"))
        if entry_id in seen:
            # NOTE: ids name the jobs: a second one would fail the trace's check, far from its line
            raise TraceError(f"{path}:{lineno}: duplicate id {entry_id!r} (first on line {seen[entry_id]})")
        seen[entry_id] = lineno
        gt = entry.get("ground_truth", answers.get(entry_id))
        if gt is not None and (not isinstance(gt, list) or len(gt) != len(questions)):
            gt = None  # answers that do not line up with the questions are ignored
        classes_field, fallback_tool = entry.get("involved_classes") or [], entry.get("path") or []
        for name, value in (("involved_classes", classes_field), ("path", fallback_tool)):
            # NOTE: a string was read as its characters (7 classes of "MathAPI")
            if not isinstance(value, list):
                raise TraceError(f"{path}:{lineno}: {name!r} must be a list")
        classes = sorted(str(c) for c in classes_field)
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0xBFC1, index)))

        turns: list[Turn] = []
        system = 0
        for qi, q in enumerate(questions):
            user_text, sys_text = _bfcl_question_text(q)
            if sys_text:
                system += max(0, int(count(sys_text)))
            # An empty user turn (BFCL miss_func) means "functions were added, continue".
            user_tokens = max(1, int(count(user_text))) if user_text else 16
            if gt is not None:
                calls = gt[qi] if isinstance(gt[qi], list) else [gt[qi]]
            else:
                name = fallback_tool[qi] if qi < len(fallback_tool) else "call"
                calls = [f"{str(name).split('.')[-1]}()"]
            next_input = user_tokens
            text: str | None = user_text if keep_text else None
            for call in calls:
                call_text = call if isinstance(call, str) else json.dumps(call)
                turns.append(
                    Turn(
                        input_tokens=next_input,
                        input_text=text,
                        output_tokens=max(1, int(count(call_text))),
                        tool=_call_name(call),
                        tool_duration_s=_clipped_lognormal(rng, 0.06, 0.8, 0.01, 0.3, False),
                    )
                )
                next_input, text = (
                    int(_clipped_lognormal(rng, tool_output_median, 0.8, 5, 600)),
                    None,
                )
            last_q = qi == len(questions) - 1
            turns.append(
                Turn(
                    input_tokens=next_input,
                    input_text=text,
                    output_tokens=int(_clipped_lognormal(rng, answer_median, 0.5, 5, 300)),
                    think_time_s=0.0
                    if last_q or think_time_mean_s <= 0
                    else float(rng.exponential(think_time_mean_s)),
                )
            )
        jobs.append(
            Job(
                job_id=f"bfcl-{entry_id}",
                shared_prefix_id=("bfcl:" + "+".join(classes)) if classes else None,
                shared_prefix_tokens=sum(class_tokens(c) for c in classes),
                system_tokens=system,
                turns=turns,
                kind="imported",
                metadata={
                    "source": "bfcl",
                    "id": entry_id,
                    "line": lineno,
                    "user_turns": len(questions),
                    "ground_truth": gt is not None,
                },
            )
        )
    return Trace(
        name=path.stem,
        jobs=jobs,
        source=f"bfcl:{path}",
        arrival=ArrivalInfo(kind="none"),
        params={"answers": bool(answers), "seed": seed, "think_time_mean_s": think_time_mean_s},
    )
