"""The live OpenAI-compatible server of the agent_runtime tests: uvicorn in a thread on a free
local port (:func:`serving`), the :class:`Live` handle its fixtures yield (``conftest.py``), the
model and tools the tests ask for, and the SSE helpers the tests share."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from agent_runtime.runtime import AgentRuntime

MODEL = "smollm2-135m"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the files of the project.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read one file of the project.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "enum": ["notes.txt", "todo.md"]}},
                "required": ["path"],
            },
        },
    },
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A running server and what the tests need to inspect it."""

    def __init__(self, base: str, runtime: AgentRuntime) -> None:
        self.base = base
        self.runtime = runtime

    def engine(self, fn):
        return self.runtime.call_threadsafe(fn).result(timeout=30)

    def check(self) -> None:
        """Integrity, and the server still answers."""
        self.engine(lambda e: e.check_integrity())
        assert httpx.get(f"{self.base}/health", timeout=10).json() == {"status": "ok"}


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serves ``app`` with uvicorn on a free local port, in a thread; yields its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)



def leave_stream_early(live: Live, path: str, body: dict, marker: str) -> None:
    """Opens a streamed request, leaves after the first line holding ``marker``, then checks
    that the server freed the request (its blocks back, nothing left running)."""
    with httpx.stream("POST", f"{live.base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if marker in line:
                break
    deadline = time.monotonic() + 10
    while live.engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.engine(lambda e: e.has_unfinished()) is False
    live.check()


def sse(live: Live, path: str, body: dict) -> list[dict]:
    """The events of a streamed request (``data:`` lines before ``[DONE]``), parsed."""
    with httpx.stream("POST", f"{live.base}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@contextlib.contextmanager
def failing_steps(server: Live, max_tokens: int) -> Iterator[None]:
    """While open, every step that schedules a request asking for ``max_tokens`` tokens fails (an
    injected forward-pass fault), so that request alone fails; the runner is restored after.

    Args:
        server: a running server (anything with ``runtime`` and ``engine(fn)``, as :class:`Live`).
        max_tokens: the ``max_tokens`` that marks the culprit request.
    """
    original = server.runtime.engine.runner.execute

    def flaky(plan):
        if any(item.request.params.max_tokens == max_tokens for item in plan.scheduled):
            raise RuntimeError("injected forward-pass fault")
        return original(plan)

    server.engine(lambda e: setattr(e.runner, "execute", flaky))
    try:
        yield
    finally:
        server.engine(lambda e: setattr(e.runner, "execute", original))
