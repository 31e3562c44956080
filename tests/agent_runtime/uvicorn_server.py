"""A uvicorn server on a free local port, run in a thread, for the tests over real HTTP."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from agent_runtime.runtime import AgentRuntime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, app, runtime: AgentRuntime, shutdown_s: float | None = None) -> None:
        self.runtime = runtime
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=shutdown_s))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def engine(self, fn):
        return self.runtime.call_threadsafe(fn).result(timeout=30)

    def clean(self) -> None:
        """Nothing in flight, no block held, integrity holds, and a normal request is answered."""
        deadline = time.monotonic() + 30
        while self.engine(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        self.engine(lambda e: e.check_integrity())
        assert self.engine(lambda e: sum(b.ref_cnt for b in e.pool.blocks)) == 0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

