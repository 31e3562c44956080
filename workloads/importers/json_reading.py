"""What the importers share: the token counter, tolerant JSON reading (a cut array or last line
kept up to the cut) and field checks that name the file and line."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from workloads.schema import TraceError

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
        records = 0
        for lineno, line in enumerate(f, start=1):
            text = line.lstrip("\ufeff") if lineno == 1 else line
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except RecursionError:
                raise TraceError(f"{self.path}:{lineno}: JSON nested too deeply") from None
            except json.JSONDecodeError as e:
                # A bad *last* line is a cut download; anything after it makes it corruption.
                # NOTE: a bad first record is no cut download but a file that is not JSON
                # (it was once read as a file of no conversations).
                at_end = all(not rest.strip() for rest in f)
                if at_end and records and self.tolerate_truncation:
                    self.truncated = True
                    return
                raise TraceError(f"{self.path}:{lineno}: invalid JSON: {e.msg}") from e
            records += 1
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
            except RecursionError:
                raise TraceError(f"{self.path}: JSON nested too deeply") from None
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


def read_jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """JSONL objects of a trace file, strict except for a cut last line."""
    for lineno, obj in JsonStream(path, tolerate_truncation=False):
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, obj


def first_field(
    obj: Mapping[str, Any], names: tuple[str, ...], path: Path, lineno: int, default: Any = ...
) -> Any:
    """First present field among ``names``; TraceError naming the line when required and absent."""
    for name in names:
        if name in obj and obj[name] is not None:
            return obj[name]
    if default is ...:
        raise TraceError(f"{path}:{lineno}: missing field {names[0]!r}")
    return default


def as_int(value: Any, name: str, path: Path, lineno: int) -> int:
    """Field ``name`` as a non-negative integer; TraceError naming the line otherwise."""
    # NOTE: a count is an integer: not a bool (True is 1 to int()), not a fraction (5.9 was
    # cut to 5), not an infinity (an OverflowError)
    if isinstance(value, bool) or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
        raise TraceError(f"{path}:{lineno}: field {name!r} is not an integer: {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}:{lineno}: field {name!r} is not an integer: {value!r}") from e
    if out < 0:
        raise TraceError(f"{path}:{lineno}: field {name!r} is negative: {out}")
    return out


def as_float(value: Any, name: str, path: Path, lineno: int) -> float:
    """Field ``name`` as a finite number; TraceError naming the line otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}:{lineno}: field {name!r} is not a number: {value!r}") from e
    if not math.isfinite(out):
        raise TraceError(f"{path}:{lineno}: field {name!r} is not finite: {out}")
    return out


def hash_id_list(value: Any, path: Path, lineno: int) -> list[int] | None:
    """A ``hash_ids`` field as integers (``None`` when absent); TraceError naming the line."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceError(f"{path}:{lineno}: hash_ids must be a list")
    if any(isinstance(h, bool) or not isinstance(h, int) for h in value):
        raise TraceError(f"{path}:{lineno}: hash_ids must be integers")
    return list(value)


def check_count(name: str, value: object, minimum: int = 0) -> None:
    """Rejects a size option that is no integer >= ``minimum`` (``None``, "no limit", passes).

    NOTE: a negative count was read as a Python slice or an empty loop (``max_jobs=-1`` kept
    every job but the last, or none): a caller's mistake must not become another workload.

    Args:
        name: the option, named in the error.
        value: its value.
        minimum: the smallest valid value.

    Raises:
        ValueError: naming ``name``.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum} (or None), got {value!r}")


def require_file(path: Path) -> None:
    """TraceError unless ``path`` is a file."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
