"""The bash tool's limits hold: timeouts under output floods, output caps, rlimits, a scrubbed
environment, and no process of a call outliving it."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from agent_runtime.builtin_tools import (
    BuiltinToolConfig,
    bash_argv,
    bash_sandbox,
    make_builtin_tools,
)


def _bash(tmp_path: Path, **cfg):
    tools = {t.name: t for t in make_builtin_tools(BuiltinToolConfig(tmp_path, sandbox="none", **cfg))}
    fn = tools["bash"].fn

    def call(command: str, timeout_s: float | None = None):
        return asyncio.run(asyncio.wait_for(fn(command=command, timeout_s=timeout_s), 60))

    return call


@pytest.mark.parametrize("command", ["yes", "yes | tee /dev/stderr", "cat /dev/zero", "yes & yes & wait"])
def test_timeout_holds_under_an_output_flood(tmp_path, command):
    bash = _bash(tmp_path, max_output_chars=2000)
    for _ in range(3):
        began = time.monotonic()
        result = bash(command, timeout_s=1.0)
        elapsed = time.monotonic() - began
        assert result.is_error and "timed out after 1 s" in result.content
        assert elapsed < 1.0 + 4.0, elapsed  # the limit plus the bounded drain, never the backstop


def test_output_is_capped(tmp_path):
    bash = _bash(tmp_path, max_output_chars=1000)
    result = bash("head -c 5000000 /dev/zero | tr '\\0' a; echo; echo END")
    assert not result.is_error and len(result.content) < 3000
    assert result.content.count("a") < 2500 and result.content.rstrip().endswith("END")


def test_environment_is_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    bash = _bash(tmp_path)
    out = bash("env; echo HOME=$HOME").content
    assert "secret" not in out
    assert f"HOME={tmp_path.resolve()}" in out
    names = {line.split("=", 1)[0] for line in out.split("stdout:\n", 1)[1].splitlines() if "=" in line}
    assert names <= {"PATH", "LANG", "LC_ALL", "TZ", "HOME", "PWD", "TERM", "SHELL", "ASYMCACHE_TOOL_CALL",
                     "SHLVL", "_", "OLDPWD"}


def test_resource_limits_are_set(tmp_path):
    bash = _bash(tmp_path, max_memory_bytes=1 << 30, max_file_bytes=1 << 20, max_processes=64)
    out = bash("ulimit -t; ulimit -v; ulimit -f; ulimit -c; ulimit -Hv", timeout_s=5).content
    lines = out.split("stdout:\n", 1)[1].split()
    assert lines[:5] == ["6", str((1 << 30) // 1024), str((1 << 20) // 1024), "0", str((1 << 30) // 1024)]
    big = bash("head -c 3000000 /dev/zero > big.bin; echo rc=$?")
    assert os.path.getsize(tmp_path / "big.bin") <= 1 << 20
    assert "rc=0" not in big.content
    # an unprivileged command cannot raise them back (root may: see RELIABILITY.md)
    if os.getuid() != 0:
        assert "rc=0" not in bash("ulimit -v unlimited; echo rc=$?").content


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_background_processes_do_not_outlive_the_call(tmp_path):
    bash = _bash(tmp_path)
    began = time.monotonic()
    result = bash("sleep 300 & echo $! > bg.pid; setsid sleep 301 & echo $! > setsid.pid; "
                  "(setsid bash -c 'sleep 302 & echo $! > nested.pid' &) ; sleep 0.5; echo started")
    assert "started" in result.content and time.monotonic() - began < 10
    time.sleep(0.2)
    for name in ("bg.pid", "setsid.pid", "nested.pid"):
        pid = int((tmp_path / name).read_text())
        assert not _alive(pid), name
    assert "killed" in result.content


def test_a_timed_out_call_leaves_nothing_behind(tmp_path):
    bash = _bash(tmp_path)
    result = bash("setsid sleep 303 & echo $! > x.pid; yes", timeout_s=1.0)
    assert result.is_error
    assert not _alive(int((tmp_path / "x.pid").read_text()))


def test_cancelled_call_kills_its_processes(tmp_path):
    tools = {t.name: t for t in make_builtin_tools(BuiltinToolConfig(tmp_path, sandbox="none"))}

    async def main():
        task = asyncio.ensure_future(tools["bash"].fn(command="echo $$ > me.pid; sleep 300", timeout_s=60))
        for _ in range(100):
            if (tmp_path / "me.pid").exists():
                break
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    began = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - began < 10
    time.sleep(0.2)
    assert not _alive(int((tmp_path / "me.pid").read_text()))


def test_sandbox_argv_and_description(tmp_path):
    cfg = BuiltinToolConfig(tmp_path)
    argv = bash_argv("echo hi", cfg, 5.0, use_bwrap=True)
    wd = str(tmp_path.resolve())
    assert argv[0] == "bwrap" and "--unshare-all" in argv and "--share-net" not in argv
    assert argv[argv.index("--bind") + 1 : argv.index("--bind") + 3] == [wd, wd]
    assert argv[argv.index("--ro-bind") + 1 : argv.index("--ro-bind") + 3] == ["/", "/"]
    assert argv[-1] == "echo hi" and bash_argv("echo hi", cfg, 5.0, use_bwrap=False)[0] == "bash"
    assert ("bubblewrap:" in bash_sandbox()) == (shutil.which("bwrap") is not None)
    assert "not sandboxed" in bash_sandbox() or shutil.which("bwrap")
    with pytest.raises(ValueError, match="sandbox"):
        make_builtin_tools(BuiltinToolConfig(tmp_path, sandbox="docker"))


#: Ways out of a call's process group and session; each escapee writes its own pid.
ESCAPES = {
    "background": "sleep 310 & echo $! > e.pid",
    "nohup": "nohup bash -c 'echo $$ > e.pid; exec sleep 311' >/dev/null 2>&1 &",
    "setsid": "setsid bash -c 'echo $$ > e.pid; exec sleep 312' &",
    "setsid --fork": "setsid -f bash -c 'echo $$ > e.pid; exec sleep 313'",
    "env -i setsid": "env -i setsid bash -c 'echo $$ > e.pid; exec sleep 314' &",
    "double fork, env -i": "(env -i setsid bash -c '(echo $BASHPID > e.pid; exec sleep 315) &' &)",
    "disown": "sleep 316 & echo $! > e.pid; disown",
    "closed pipes": "env -i setsid bash -c 'echo $$ > e.pid; exec sleep 317 </dev/null >/dev/null 2>&1' &",
}


def _escapee(tmp_path: Path) -> int:
    for _ in range(200):
        text = (tmp_path / "e.pid").read_text().strip() if (tmp_path / "e.pid").exists() else ""
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the escapee never wrote its pid")


@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_no_escapee_outlives_its_call(tmp_path, how):
    bash = _bash(tmp_path)
    result = bash(f"{ESCAPES[how]}\nsleep 0.3\necho started", timeout_s=20)
    assert "started" in result.content and "exit_code: 0" in result.content, result.content
    pid = _escapee(tmp_path)
    assert not _alive(pid), f"{how}: pid {pid} outlived the call"
    assert "killed 1 background process" in result.content


@pytest.mark.parametrize("how", ["env -i setsid", "double fork, env -i"])
def test_no_escapee_outlives_a_timed_out_or_cancelled_call(tmp_path, how):
    bash = _bash(tmp_path)
    result = bash(f"{ESCAPES[how]}\nsleep 300", timeout_s=1.0)
    assert result.is_error and "timed out" in result.content
    assert not _alive(_escapee(tmp_path))
    (tmp_path / "e.pid").unlink()
    tools = {t.name: t for t in make_builtin_tools(BuiltinToolConfig(tmp_path, sandbox="none"))}

    async def cancelled():
        task = asyncio.ensure_future(tools["bash"].fn(command=f"{ESCAPES[how]}\nsleep 300", timeout_s=60))
        while not (tmp_path / "e.pid").exists() or not (tmp_path / "e.pid").read_text().strip():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancelled(), 60))
    assert not _alive(_escapee(tmp_path))


def test_a_fork_loop_is_gone_after_its_timeout(tmp_path):
    bash = _bash(tmp_path, max_processes=200)
    result = bash("while :; do (env -i setsid sleep 320 &) ; done", timeout_s=1.0)
    assert result.is_error and "timed out" in result.content
    time.sleep(0.1)
    assert not [p for p in _processes_named("sleep 320")], "fork-loop children survived"


def _processes_named(text: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if f.read().replace(b"\0", b" ").strip() == text.encode() and _alive(int(entry.name)):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_exit_status_and_output_pass_through_the_reaper(tmp_path):
    bash = _bash(tmp_path)
    assert bash("echo out; echo err >&2; exit 7").content == "exit_code: 7\nstdout:\nout\n\nstderr:\nerr\n"
    assert bash("kill -9 $$").content.startswith("exit_code: 137")
    assert not bash("true").is_error
