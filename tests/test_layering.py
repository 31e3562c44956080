"""Imports point down the stack only: kernels <- asymcache_core <- agent_runtime <- workloads <- eval.

Walks every module's syntax tree (imports inside functions and ``TYPE_CHECKING`` blocks count
too) rather than importing anything, so optional dependencies (vLLM, FastAPI) need not be
installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The packages of the stack, lowest first.
LAYERS = ("kernels", "asymcache_core", "agent_runtime", "workloads", "eval")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _edges() -> list[tuple[str, int, str, str]]:
    """``(module path, line, importer's package, imported package)`` within the stack."""
    edges = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, target in _imports(path):
                if target in LAYERS:
                    edges.append((str(path.relative_to(ROOT)), line, layer, target))
    return edges


def test_imports_point_down_the_stack() -> None:
    edges = _edges()
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{path}:{line} ({src} imports {dst})" for path, line, src, dst in edges if rank[dst] > rank[src]]
    assert upward == []
    # the walk sees the stack's real edges (so an empty list above means something)
    pairs = {(src, dst) for _, _, src, dst in edges}
    assert {("asymcache_core", "kernels"), ("agent_runtime", "asymcache_core"), ("eval", "agent_runtime")} <= pairs


def test_walker_sees_function_level_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from agent_runtime.tools import Tool\n    from . import sibling\n")
    assert _imports(module) == [(1, "os"), (4, "agent_runtime")]
