"""Fixtures shared by the eval tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bench run's report without its PNG plots (the tables, ``report.md`` and
    ``report.html`` are still written), for tests that never look at those plots.

    NOTE: a run's four plots take ~1.2 s on this project's 2-core machine, longer than a small
    sim run itself. The plots are still drawn and checked by the CLI tests that read them
    (test_harness.py's end-to-end bench) and by test_report.py; a sweep's own plots
    (``eval.sweep_report``) are not affected.
    """
    import eval.report

    monkeypatch.setattr(eval.report, "write_plots", lambda results, run_dir: ())
