"""The project's pages link to files that exist: README, BENCHMARKS, docs/ and the superseded
tables in docs/history/ (moved there from BENCHMARKS.md, whose links are relative to the root:
a moved table must have its links rewritten relative to its new folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: ``[text](target)`` and ``[text](target#anchor)``, the target without spaces
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def pages() -> list[Path]:
    """The pages users read: the root's Markdown files, docs/ and docs/history/.

    NOTE: the reports archived under docs/results/ are a run's own output, kept without their
    plots (the PNGs are not committed), so their image links are left out on purpose.
    """
    return sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "history").glob("*.md")])


def broken_links(page: Path) -> list[str]:
    """The relative link targets of ``page`` that name no file or folder."""
    return [
        target
        for target in LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists()
    ]


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"README.md", "BENCHMARKS.md", "docs/architecture.md"} <= names
    assert any(name.startswith("docs/history/") for name in names)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_root_relative_link_in_a_moved_page_is_caught(tmp_path: Path) -> None:
    # the mistake this file guards against: a table moved from BENCHMARKS.md to docs/history/
    # with its links still relative to the root
    (tmp_path / "docs" / "history").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run").mkdir(parents=True)
    moved = tmp_path / "docs" / "history" / "old.md"
    moved.write_text("[run](docs/results/run/) and [ok](../results/run/#top) and [web](https://example.com)\n")
    assert broken_links(moved) == ["docs/results/run/"]
