"""Tools that hang, crash or flood: the model gets an error message, the job goes on, and no
thread, process, block or pin is left behind (real SmolLM2, tool calls forced per turn)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from agent_runtime.builtin_tools import BuiltinToolConfig, make_builtin_tools
from agent_runtime.runtime import AgentRuntime
from agent_runtime.tools import Tool, ToolRegistry
from tests.conftest import make_engine

TIMEOUT_S = 0.3
CAP = 600


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _tool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asymcache-tool-")]


def _faulty_registry(workdir: Path, release: threading.Event) -> ToolRegistry:
    bash = {t.name: t for t in make_builtin_tools(BuiltinToolConfig(workdir, sandbox="none"))}["bash"].fn

    async def hang_async() -> str:
        """Wait forever."""
        await asyncio.sleep(1_000)
        return "never"

    def hang_sync() -> str:
        """Block until released."""
        release.wait(60)
        return "late"

    def crash() -> str:
        """Fail."""
        raise RuntimeError("tool exploded")

    def flood() -> str:
        """Return a lot."""
        return "x" * 5_000_000 + "END"

    async def flood_shell() -> object:
        """Run a shell command that floods its output."""
        return await bash(command="echo $$ > flood.pid; yes", timeout_s=TIMEOUT_S)

    reg = ToolRegistry(max_output_chars=CAP)
    for fn in (hang_async, hang_sync):
        reg.register(Tool.from_function(fn, timeout_s=TIMEOUT_S))
    reg.register_all([crash, flood, flood_shell])
    return reg


def test_a_job_whose_tools_hang_crash_and_flood_goes_on(smollm, tmp_path):
    engine = make_engine(smollm, num_kv_blocks=128)
    release = threading.Event()
    registry = _faulty_registry(tmp_path, release)
    names = ["hang_async", "hang_sync", "crash", "flood", "flood_shell"]

    async def main():
        runtime = AgentRuntime(engine)
        try:
            result = await runtime.job(tools=registry).run(
                "Use the tools.", max_turns=len(names) + 1,
                tool_choice=[*(_named(n) for n in names), "none"], max_tokens=40,
            )
            state = await runtime.call(lambda e: (e.check_integrity(), sum(b.ref_cnt for b in e.pool.blocks),
                                                  e.stats().pinned_blocks, e.has_unfinished()))
            return result, state
        finally:
            await runtime.close()

    began = time.monotonic()
    result, (_, refs, pinned, unfinished) = asyncio.run(main())
    elapsed = time.monotonic() - began
    calls = {rec.tool_calls[0].call.name: rec.tool_calls[0].result for rec in result.turns if rec.tool_calls}
    assert list(calls) == names and len(result.turns) == len(names) + 1
    assert calls["hang_async"].is_error and "timed out after 0.3 s" in calls["hang_async"].content
    assert calls["hang_sync"].is_error and "timed out after 0.3 s" in calls["hang_sync"].content
    assert calls["crash"].is_error and "RuntimeError: tool exploded" in calls["crash"].content
    assert not calls["flood"].is_error and len(calls["flood"].content) <= CAP + 200
    assert calls["flood"].content.endswith("END")
    assert calls["flood_shell"].is_error and "timed out" in calls["flood_shell"].content
    # the model read every error: each went back as a tool message
    tool_messages = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert [c.content for c in calls.values()] == tool_messages
    assert result.turns[-1].turn.parsed.tool_calls == [] or result.finish_reason == "max_turns"
    assert refs == 0 and pinned == 0 and not unfinished
    assert elapsed < 120  # nothing waited on a hung tool
    # nothing of the shell call is alive; the abandoned sync thread ends once its tool returns
    pid = int((tmp_path / "flood.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    release.set()
    deadline = time.monotonic() + 30
    while _tool_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _tool_threads()


def test_hung_sync_tools_do_not_starve_the_other_tools(tmp_path):
    release = threading.Event()
    registry = _faulty_registry(tmp_path, release)
    builtin = ToolRegistry()
    builtin.register_all(make_builtin_tools(BuiltinToolConfig(tmp_path, sandbox="none")))
    (tmp_path / "a.txt").write_text("hello\n")

    async def main():
        # NOTE: more hung calls than the loop's default executor has workers (min(32, cpus + 4)).
        hung = await asyncio.gather(*(registry.call("hang_sync", {}) for _ in range(40)))
        read = await asyncio.wait_for(builtin.call("read_file", {"path": "a.txt"}), 30)
        shell = await asyncio.wait_for(builtin.call("bash", {"command": "echo ok"}), 30)
        inline = await asyncio.wait_for(asyncio.to_thread(lambda: "executor free"), 30)
        return hung, read, shell, inline

    try:
        hung, read, shell, inline = asyncio.run(main())
    finally:
        release.set()
    assert all(r.is_error and "timed out" in r.content for r in hung)
    assert "hello" in read.content and not read.is_error
    assert "ok" in shell.content and not shell.is_error
    assert inline == "executor free"
    deadline = time.monotonic() + 30
    while _tool_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _tool_threads()


def test_a_sync_tool_result_after_its_timeout_is_dropped_quietly(tmp_path):
    started = threading.Event()

    def slow() -> str:
        """Answer late."""
        started.set()
        time.sleep(0.6)
        return "too late"

    reg = ToolRegistry()
    reg.register(Tool.from_function(slow, timeout_s=0.1))

    async def main():
        first = await reg.call("slow", {})
        await asyncio.sleep(0.8)  # the thread settles a future that already timed out
        return first

    assert "timed out" in asyncio.run(main()).content and started.is_set()
    deadline = time.monotonic() + 30
    while _tool_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _tool_threads()
