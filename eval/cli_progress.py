"""Progress for the command line: rich bars on a terminal, plain lines in a log.

Both expose the subset of :class:`rich.progress.Progress` the harness calls (``add_task``,
``update``, ``advance``, used as a context manager), so the bench, ``bench-engine`` and model
loading report through one object whatever the output is. Written to a file or a pipe, a task
prints a line when it starts, at most one line every ``interval_s`` seconds while it runs, and
one when it completes: a run written to a log shows it is alive without a line per job.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

#: Seconds between two lines of a running task in a log.
LINE_INTERVAL_S = 5.0


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    started: float
    last_line: float
    done: bool = False


class LineProgress:
    """Progress as plain lines (see the module docstring).

    Args:
        write: receives each line (default: stderr, flushed).
        clock: time source (tests pass a fake one).
        interval_s: seconds between two lines of a running task.
    """

    def __init__(
        self,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = LINE_INTERVAL_S,
    ) -> None:
        self._write = write or _stderr_line
        self._clock = clock
        self.interval_s = interval_s
        self._tasks: dict[int, _Task] = {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **_: Any) -> int:
        now = self._clock()
        task_id = len(self._tasks)
        self._tasks[task_id] = _Task(description, total, completed, now, now)
        self._write(f"{description}: started" + (f" (0/{_count(total)})" if total is not None else ""))
        return task_id

    def update(self, task_id: int, *, completed: float | None = None, advance: float | None = None,
               total: float | None = None, description: str | None = None, **_: Any) -> None:
        task = self._tasks[task_id]
        if description is not None:
            task.description = description
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        now = self._clock()
        elapsed = now - task.started
        if task.total is not None and task.completed >= task.total:
            if not task.done:
                task.done = True
                self._write(f"{task.description}: done {_count(task.completed)}/{_count(task.total)} in {elapsed:.1f} s")
            return
        if now - task.last_line >= self.interval_s:
            task.last_line = now
            share = f" ({task.completed / task.total:.0%})" if task.total else ""
            total_text = f"/{_count(task.total)}" if task.total is not None else ""
            self._write(f"{task.description}: {_count(task.completed)}{total_text}{share}, {elapsed:.0f} s")

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)


class TerminalProgress:
    """rich bars, started on the first task (an error before it leaves the terminal alone)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._progress = Progress(*columns, console=Console(stderr=True), transient=False)
        self._started = False

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started:
            self._progress.stop()

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **kw: Any) -> int:
        if not self._started:
            self._progress.start()
            self._started = True
        return int(self._progress.add_task(description, total=total, completed=completed, **kw))

    def update(self, task_id: int, **kw: Any) -> None:
        self._progress.update(task_id, **kw)  # type: ignore[arg-type]

    def advance(self, task_id: int, advance: float = 1) -> None:
        self._progress.advance(task_id, advance)  # type: ignore[arg-type]


def progress_for(stream: TextIO | None = None) -> LineProgress | TerminalProgress:
    """Bars when ``stream`` (default: stderr, where progress goes) is a terminal, else lines."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return TerminalProgress() if isatty is not None and isatty() else LineProgress()


class LoaderLog(logging.Handler):
    """Shows the model loader's log: messages as lines, ``progress`` records as a task.

    The loader logs ``logger.debug(msg, extra={"progress": (label, done, total)})`` while it
    converts a checkpoint (DEBUG: a plain INFO log stays free of them); everything it logs at
    INFO and up is shown as it is.

    Args:
        progress: where the conversion's progress goes.
        write: receives the other messages (default: stderr).
    """

    def __init__(self, progress: LineProgress | TerminalProgress, write: Callable[[str], None] | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.progress = progress
        self._write = write or _stderr_line
        self._tasks: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if progress is None:
            if record.levelno >= logging.INFO:
                self._write(record.getMessage())
            return
        label, done, total = progress
        if label not in self._tasks:
            self._tasks[label] = self.progress.add_task(label, total=total)
        self.progress.update(self._tasks[label], completed=done)


H = TypeVar("H", bound=logging.Handler)


@contextmanager
def logging_to(logger: logging.Logger, handler: H, level: int) -> Iterator[H]:
    """Attaches ``handler`` to ``logger`` at ``level`` for the duration of the block; the
    logger's own level comes back after it."""
    saved = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


@contextmanager
def showing_model_loads(progress: LineProgress | TerminalProgress | None = None) -> Iterator[LoaderLog]:
    """Shows what the model loader logs (INFO and up, and its progress) for the duration of the
    block."""
    with logging_to(logging.getLogger("asymcache_core.loaders"), LoaderLog(progress or progress_for()),
                    logging.DEBUG) as handler:
        yield handler


def _count(value: float | None) -> str:
    if value is None:
        return "?"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _stderr_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
