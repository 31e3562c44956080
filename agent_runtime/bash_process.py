"""One ``bash`` call as a process tree that cannot outlive it (:func:`run_bash`).

The command runs under a small reaper process that is a child subreaper
(``PR_SET_CHILD_SUBREAPER``, no root needed), so whatever the command leaves behind (``&``,
``nohup``, ``setsid``, ``env -i``, double forks) is re-parented to the reaper rather than to
init; when the command ends or its time is up, the reaper kills its whole subtree, a fallback
sweep kills the call's session and anything carrying its marker variable
(:func:`kill_call`), and the pipes are closed after a bounded drain, so an output flood or a
background job holding a pipe cannot stretch the call. The argv (rlimits, bubblewrap) and the
environment come from :mod:`agent_runtime.builtin_tools`, whose ``bash`` tool runs here.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: How long the output of a finished or killed command is still read before the pipes close.
DRAIN_S = 2.0


#: The reaper every ``bash`` call runs under (``python -I -S -c``; argv: report fd, command...).
#: It makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, no root needed), so a process
#: the command leaves behind is re-parented to it whatever it did (``&``, ``nohup``, ``setsid``,
#: ``env -i``, a double fork), instead of to init. When the command's bash exits, or the reaper
#: gets SIGTERM (the call's time is up or it was cancelled), it kills its whole subtree until
#: none is left, writes how many it killed besides bash to the report fd, and exits with bash's
#: status (128 + the signal when bash was killed).
_REAPER_SOURCE = r"""
import ctypes, os, signal, sys, time

class Stop(Exception):
    pass

def on_term(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one Stop only: the sweep must not be cut
    raise Stop

def live_subtree(root):
    children, alive = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(name))
            if fields[0] not in (b"Z", b"X"):
                alive.add(int(name))
        except (OSError, ValueError, IndexError):
            continue
    found, stack = [], [root]
    while stack:
        for pid in children.get(stack.pop(), ()):
            found.append(pid)
            stack.append(pid)
    return [pid for pid in found if pid in alive]

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

def sweep(me):
    killed = set()
    for _ in range(1000):
        victims = live_subtree(me)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.002)
        reap()
    reap()
    return killed

report = int(sys.argv[1])
os.set_inheritable(report, False)
signal.signal(signal.SIGTERM, on_term)
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
code = 128 + signal.SIGKILL
try:
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
except (Stop, ChildProcessError):
    pass
killed = sweep(os.getpid())
killed.discard(child)
os.write(report, str(len(killed)).encode())
os._exit(code)
"""
#: Seconds the reaper gets to kill a call's processes and exit before the fallback kill.
_REAPER_GRACE_S = 3.0


def _call_processes(session: int, marker: bytes) -> list[int]:
    """Processes of one call: in its session, or carrying its marker (``setsid`` escapees)."""
    found = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            # NOTE: fields after the command name (which may hold spaces) are split from its ")".
            fields = stat[stat.rindex(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X"):
                continue  # already dead, waiting to be reaped
            if int(fields[3]) == session:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_call(pid: int, marker: str) -> int:
    """Kill every process of a ``bash`` call: its group, its session, its marked escapees.

    Args:
        pid: the call's bash (its session and group id).
        marker: the call's ``ASYMCACHE_TOOL_CALL`` value.

    Returns:
        Processes killed besides ``pid`` itself.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    tag = f"ASYMCACHE_TOOL_CALL={marker}".encode()
    killed: set[int] = set()
    for _ in range(3):  # a process may fork while the first sweep runs
        victims = [v for v in _call_processes(pid, tag) if v not in killed]
        if not victims:
            break
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
                killed.add(victim)
    killed.discard(pid)
    return len(killed)


class _Capped:
    """Keeps the first and last ``cap`` bytes of a stream."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.cap:
            take = self.cap - len(self.head)
            self.head += chunk[:take]
            chunk = chunk[take:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.cap:
                del self.tail[: len(self.tail) - self.cap]

    def value(self) -> bytes:
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped > 0:
            return bytes(self.head) + f"\n... [{dropped} bytes elided] ...\n".encode() + bytes(self.tail)
        return bytes(self.head + self.tail)


@dataclass
class BashRun:
    """What one ``bash`` call did.

    Attributes:
        returncode: the exit status (None if it had to be killed).
        stdout: captured output (capped).
        stderr: captured errors (capped).
        timed_out: the time limit ended it.
        leftovers: processes killed after it ended (background jobs, ``setsid`` escapees).
    """

    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    leftovers: int = 0


def run_bash(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float, cap: int, marker: str,
             cancel: threading.Event | None = None) -> BashRun:
    """Run one command to its end, its time limit, or ``cancel``; never longer.

    The pipes are polled in this thread (no reader that could be left blocked). When the
    command's bash exits or its time is up, every process of the call is killed
    (:func:`kill_call`), what is still buffered is read for at most two seconds, and the pipes
    are closed, so an output flood or a background job holding the pipe cannot stretch the call.

    Args:
        argv: see :func:`agent_runtime.builtin_tools.bash_argv`.
        cwd: working directory.
        env: the whole environment (see :func:`agent_runtime.builtin_tools.bash_env`).
        timeout_s: the time limit.
        cap: bytes kept at each end of stdout and of stderr.
        marker: the call's marker in ``env``.
        cancel: set from another thread to end the call early.

    Returns:
        The outcome.
    """
    report_r, report_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER_SOURCE, str(report_w), *argv], cwd=str(cwd), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            close_fds=True, pass_fds=(report_w,),
        )
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    os.set_blocking(report_r, False)
    assert proc.stdout is not None and proc.stderr is not None

    def end_call() -> int:
        """Stops the call (its reaper kills the subtree), then sweeps what may be left."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_REAPER_GRACE_S)
        reaped = 0
        if proc.poll() is not None:
            # NOTE: non-blocking: a reaper that died before writing leaves nothing to wait for.
            with contextlib.suppress(OSError, ValueError):
                reaped = int(os.read(report_r, 32) or b"0")
        return reaped + kill_call(proc.pid, marker)
    buffers = {proc.stdout.fileno(): _Capped(cap), proc.stderr.fileno(): _Capped(cap)}
    out, err = buffers[proc.stdout.fileno()], buffers[proc.stderr.fileno()]
    poller = select.poll()
    for fd in buffers:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    open_fds = set(buffers)
    deadline = time.monotonic() + timeout_s
    ended_at: float | None = None
    timed_out = False
    leftovers = 0
    try:
        while open_fds:
            now = time.monotonic()
            if ended_at is None:
                expired = now >= deadline or (cancel is not None and cancel.is_set())
                if expired or proc.poll() is not None:
                    timed_out = expired and proc.poll() is None
                    leftovers = end_call()
                    ended_at = now
            elif now - ended_at >= DRAIN_S:
                break
            for fd, _ in poller.poll(100):
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    buffers[fd].add(chunk)
                else:
                    poller.unregister(fd)
                    open_fds.discard(fd)
        # The pipes closed first: the command itself still has its time (it may have closed them).
        while ended_at is None and proc.poll() is None:
            if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                timed_out = time.monotonic() >= deadline
                break
            time.sleep(0.02)
    finally:
        if ended_at is None:
            leftovers = end_call()
        os.close(report_r)
        proc.stdout.close()
        proc.stderr.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    code = None if timed_out else proc.returncode
    return BashRun(code, out.value(), err.value(), timed_out, leftovers)
