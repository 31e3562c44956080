"""The README's trace example runs as it is shown (on the simulator, which cuts and sizes the
jobs the same way): its trace is in the repository and its ``--max-model-len`` holds the jobs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eval.cli import app

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_trace_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text()
    # NOTE: the example spans two lines (a trailing backslash); its comment is not part of it
    match = re.search(r"^asymcache (bench --workload trace:\S+.*?\\\n.*?)(?:#|$)", readme, re.M)
    assert match, "the README has no trace example"
    argv = shlex.split(match.group(1).replace("\\\n", " "))
    trace = next(a for a in argv if a.startswith("trace:")).removeprefix("trace:")
    assert (ROOT / trace).is_file(), trace
    assert (
        "trace:PATH` (a JSONL trace" in readme and "(workloads/README.md#schema" in readme
    )  # the format
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    sim = ["--backend", "sim", "--model", "dummy:tiny", "--no-plots", "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, *sim])
    assert result.exit_code == 0, result.output
    assert (out / "results.json").is_file()
