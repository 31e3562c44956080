"""Progress written to a log: a line when a task starts, at most one every few seconds while it
runs, one when it is done (a fake clock drives it); bars only on a terminal."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from eval.cli import app
from eval.cli_progress import (
    LineProgress,
    LoaderLog,
    TerminalProgress,
    progress_for,
    showing_model_loads,
)
from tests.tiny_gguf import write_tiny_gguf

runner = CliRunner()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_start_every_interval_and_done_once() -> None:
    clock, lines = FakeClock(), []
    progress = LineProgress(lines.append, clock=clock, interval_s=5.0)
    task = progress.add_task("asymcache", total=64)
    assert lines == ["asymcache: started (0/64)"]
    for done in range(1, 10):  # many updates inside one interval: no line
        clock.now += 0.4
        progress.update(task, completed=done)
    assert len(lines) == 1
    clock.now = 105.0
    progress.update(task, completed=16)
    assert lines[-1] == "asymcache: 16/64 (25%), 5 s"
    clock.now = 107.0
    progress.advance(task, 1)  # 2 s after the last line: quiet
    assert len(lines) == 2
    clock.now = 110.5
    progress.update(task, completed=40)
    assert lines[-1] == "asymcache: 40/64 (62%), 10 s"
    clock.now = 112.25
    progress.update(task, completed=64)
    progress.update(task, completed=64)
    assert lines[-1] == "asymcache: done 64/64 in 12.2 s" and len(lines) == 4


def test_tasks_are_independent_and_a_total_may_be_unknown() -> None:
    clock, lines = FakeClock(), []
    progress = LineProgress(lines.append, clock=clock, interval_s=2.0)
    a = progress.add_task("a", total=2)
    b = progress.add_task("b")
    clock.now += 3
    progress.update(b, advance=7)
    progress.update(a, completed=2)
    assert lines == ["a: started (0/2)", "b: started", "b: 7, 3 s", "a: done 2/2 in 3.0 s"]


def test_progress_for_picks_bars_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_for(io.StringIO()), LineProgress)
    assert isinstance(progress_for(Tty()), TerminalProgress)


def test_terminal_bars_print_nothing_before_a_task(capsys: pytest.CaptureFixture[str]) -> None:
    with TerminalProgress():
        pass
    assert capsys.readouterr().err == ""


def test_loader_log_turns_progress_records_into_a_task() -> None:
    clock, lines, messages = FakeClock(), [], []
    handler = LoaderLog(LineProgress(lines.append, clock=clock, interval_s=5.0), messages.append)
    log = logging.getLogger("test.loader")

    def record(level: int, msg: str, **extra: Any) -> logging.LogRecord:
        return log.makeRecord(log.name, level, __file__, 1, msg, (), None, extra=extra)

    handler.handle(record(logging.INFO, "model: converting x.gguf"))
    handler.handle(record(logging.DEBUG, "detail nobody asked for"))
    for done in range(1, 11):
        clock.now += 1.0
        handler.handle(record(logging.DEBUG, "tensor", progress=("converting x.gguf", done, 10)))
    assert messages == ["model: converting x.gguf"]
    # the task starts with the first record (t=101)
    assert lines == ["converting x.gguf: started (0/10)", "converting x.gguf: 6/10 (60%), 5 s",
                     "converting x.gguf: done 10/10 in 9.0 s"]


def test_a_first_load_shows_its_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asymcache_core.loaders import load_model
    from asymcache_core.loaders.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    lines: list[str] = []
    with showing_model_loads(LineProgress(lines.append)) as handler:
        handler._write = lines.append
        load_model(str(tiny), torch.device("cpu"), torch.float32, seed=0)
        converted = list(lines)
        lines.clear()
        load_model(str(tiny), torch.device("cpu"), torch.float32, seed=0)
    assert converted[0].startswith("model: converting tiny.gguf (first use; cached in ")
    assert converted[1] == "converting tiny.gguf: started (0/20)"
    assert converted[-1].startswith("converting tiny.gguf: done 20/20 in ")
    assert lines == []  # a cached load has nothing to report
    assert logging.getLogger("asymcache_core.loaders").level == logging.NOTSET  # restored


@pytest.mark.parametrize("command", [["generate", "hello"], ["bench", "--backend", "sim", "--jobs", "2"]])
def test_bad_input_on_a_models_first_use_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """The first read of a GGUF's config (to check --max-model-len against it) once printed
    ``model: converting ...`` before the command's error line: the conversion is announced only
    where its weights are converted, once the command goes on."""
    from asymcache_core.loaders.cache import CACHE_ENV

    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = [*command, "--model", str(tiny), "--max-model-len", str(10**9), "--out", str(tmp_path / "run")]
    if command[0] == "generate":
        argv = argv[:-2]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("error: max_model_len: 1000000000 is past ") and result.stderr.count("\n") == 1, (
        result.stderr)
    assert list(cache.glob("gguf/*/meta")), "the config was read and cached on this first use"
    assert not list(cache.glob("gguf/*/weights-*"))  # no weights were converted


def test_bench_in_a_log_prints_lines_per_policy(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--backend", "sim", "--model", "dummy:tiny", "--jobs", "2",
                                 "--policies", "vllm-apc,asymcache", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "vllm-apc: started (0/2)" and lines[1].startswith("vllm-apc: done 2/2 in ")
    assert any(line.startswith("asymcache: done 2/2 in ") for line in lines)
    assert "━" not in result.stderr  # no bars


def test_bench_engine_reports_through_the_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    import eval.bench_engine as bench_engine

    seen: list[Any] = []
    monkeypatch.setattr(bench_engine, "run", lambda **kw: seen.append(kw))
    result = runner.invoke(app, ["bench-engine", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert isinstance(seen[0]["progress"], LineProgress)
    assert (seen[0]["prompt_len"], seen[0]["new_tokens"], seen[0]["repeats"]) == (8, 4, 2)
    assert seen[0]["sampling"] == "greedy"
    result = runner.invoke(app, ["bench-engine", "--sampling", "random", "--repeats", "1"])
    assert result.exit_code == 0 and seen[1]["sampling"] == "random"
    result = runner.invoke(app, ["bench-engine", "--sampling", "hot"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: --sampling: must be one of greedy, random, got 'hot'"
    ]
