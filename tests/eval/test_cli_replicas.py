"""``asymcache serve --replicas``: one replica is the single server; more go to Ray Serve; bad
counts, and more than one without Ray installed, are one ``error:`` line and exit code 2."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from typer.testing import CliRunner

from eval.cli import app

runner = CliRunner()


def _one_error_line(argv: list[str]) -> str:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_one_replica_is_the_single_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent_runtime.server as server

    calls: list[Any] = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    assert runner.invoke(app, ["serve", "--replicas", "1"]).exit_code == 0
    assert len(calls) == 1 and calls[0].port == 8000


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bad_replica_counts_are_one_line(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent_runtime.server as server

    monkeypatch.setattr(server, "serve", lambda options: pytest.fail("served"))
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    line = _one_error_line(["serve", "--replicas", value])
    assert line == f"error: replicas: must be an integer >= 1, got {value}"
    assert _one_error_line(["serve", "--replicas", "two"]).startswith("error: Invalid value for '--replicas'")


def test_replicas_without_ray_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "ray" else real(name, *a))
    line = _one_error_line(["serve", "--replicas", "2"])
    assert "ray extra" in line and "asymcache[ray]" in line and line.startswith("error: replicas:")


def test_replicas_go_to_ray_serve_with_the_same_options(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    import agent_runtime.server.replicas as replicas

    calls: list[tuple[Any, int]] = []
    monkeypatch.setattr(replicas, "serve_replicas", lambda options, n: calls.append((options, n)))
    result = runner.invoke(app, ["serve", "--replicas", "3", "--port", "9001", "--num-kv-blocks", "64",
                                 "--api-key", "k"])
    assert result.exit_code == 0, result.output
    options, n = calls[-1]
    assert n == 3 and (options.port, options.num_kv_blocks, options.api_key) == (9001, 64, "k")


def test_replicas_on_one_machine_refuse_kv_events() -> None:
    pytest.importorskip("ray")
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    line = _one_error_line(["serve", "--replicas", "2", "--kv-events-config", config])
    assert line.startswith("error: kv_events_config: not with more than one replica")
