"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def served(monkeypatch) -> list:
    """``asymcache serve`` without a server: the options each ``serve`` call got, in order."""
    import agent_runtime.server as server

    calls: list = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    return calls
