"""``asymcache``: the command line (typer). ``asymcache --help`` lists every command.

The group and its shared options are in :mod:`eval.cli_app`; importing the command modules
registers their commands on it.
"""

from __future__ import annotations

import sys

from eval import cli_bench, cli_serve  # noqa: F401 - registers the commands
from eval.cli_app import DEBUG_ENV, app, clean_errors, engine_options, one_line, version
from eval.cli_bench import RUNS_DIR, no_empty_run_folders, print_capacity_table, print_results_table
from eval.cli_serve import StartupLine, startup_line, stream_answer

__all__ = [
    "DEBUG_ENV", "RUNS_DIR", "StartupLine", "app", "clean_errors", "engine_options", "main", "no_empty_run_folders",
    "one_line", "print_capacity_table", "print_results_table", "startup_line", "stream_answer", "version",
]


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
