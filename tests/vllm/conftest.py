"""Fixtures of the real-vLLM tests (``make test-vllm``: run with ``.venv-vllm``).

Without vLLM installed (the project venv) nothing here is collected, so the default suite
neither slows down nor reports skips for it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from real_vllm import run_scenario  # noqa: E402


def _has_vllm() -> bool:
    """Whether the real vLLM package is importable.

    NOTE: with ``tests/`` on ``sys.path`` this very folder is a namespace package named
    ``vllm``; only a spec with an ``__init__.py`` is the real thing.
    """
    spec = importlib.util.find_spec("vllm")
    return spec is not None and (spec.origin or "").endswith("__init__.py")


collect_ignore_glob: list[str] = [] if _has_vllm() else ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (head_dim 64) with SmolLM2's tokenizer, built once per session."""
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def slow_reload_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A latency profile where reloading a context costs seconds, so Continuum's TTL rule pins
    (the tiny model's analytic reload cost is milliseconds: no pin would pay for itself)."""
    from asymcache_core.latency_model import LatencyModel

    path = tmp_path_factory.mktemp("profile") / "profile.json"
    LatencyModel(0.01, 0.05, 1e-8, 16, source="test-profile").to_json(path)
    return path


@pytest.fixture(scope="session")
def agent_runs(tiny_model: Path, slow_reload_profile: Path) -> dict[str, dict[str, Any]]:
    """The ``agent`` scenario with the plugin and with stock vLLM."""
    return {
        "plugin": run_scenario("agent", tiny_model, "plugin", slow_reload_profile),
        "baseline": run_scenario("agent", tiny_model, "baseline"),
    }
