"""SWE-style built-in tools, confined to one working directory: ``bash``, ``read_file``,
``list_files``, ``write_file`` (:func:`make_builtin_tools`, :func:`builtin_registry`).

``bash`` runs ``bash -c`` in a subprocess of its own session
with rlimits (processes, CPU, address space, file size), an environment holding nothing but
``PATH``, the locale and ``HOME`` = the working directory, and a time limit that holds under an
output flood. Each call is a process tree that cannot outlive it: a reaper process kills what
the command leaves behind and a fallback sweep what escapes it
(:mod:`agent_runtime.bash_process`). Where bubblewrap (``bwrap``) is installed, the call also
runs in a private mount, PID and network namespace with a read-only root and only the working
directory writable; without it ``bash`` can read what the server's user can read, and the
runtime should run in a container when the model is untrusted (:func:`bash_sandbox` says
which holds). The file tools only touch files whose resolved path (symlinks followed) lies
inside the working directory. Nothing here ever ``eval``s or ``exec``s model text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from agent_runtime.bash_process import DRAIN_S, run_bash
from agent_runtime.tools import Tool, ToolRegistry, ToolResult, truncate_middle


class PathEscapeError(ValueError):
    """A path argument resolves outside the tool working directory."""


def resolve_in_workdir(workdir: Path, path: str) -> Path:
    """Resolve ``path`` against ``workdir`` and refuse anything outside it.

    Symlinks are followed before the check, so a link pointing out of the tree is refused too.

    Args:
        workdir: the confining directory.
        path: relative (or absolute) path given by the model.

    Returns:
        The resolved absolute path.

    Raises:
        PathEscapeError: the path lies outside ``workdir``.
    """
    root = workdir.resolve()
    if "\x00" in path:
        raise PathEscapeError("path contains a NUL byte")
    candidate = (root / path).resolve()
    if candidate != root and not candidate.is_relative_to(root):
        raise PathEscapeError(f"path {path!r} is outside the working directory")
    return candidate


@dataclass(frozen=True)
class BuiltinToolConfig:
    """Limits of the built-in tools.

    Attributes:
        workdir: directory all built-ins are confined to.
        bash_timeout_s: default time limit of one ``bash`` command.
        max_output_chars: cut of the captured stdout/stderr of ``bash`` and of file reads.
        max_list_entries: most entries ``list_files`` returns.
        max_bash_timeout_s: cap on a ``timeout_s`` the model asks for.
        max_processes: processes a ``bash`` call may add (``RLIMIT_NPROC`` above the user's
            current count).
        max_memory_bytes: address space of each process of a call (``RLIMIT_AS``).
        max_file_bytes: largest file a call may write (``RLIMIT_FSIZE``).
        sandbox: ``auto`` (bubblewrap when installed, else rlimits only), ``bwrap`` (required)
            or ``none``.
        network: keep the network inside the bubblewrap sandbox (off: a private, empty one).
    """

    workdir: Path
    bash_timeout_s: float = 30.0
    max_bash_timeout_s: float = 600.0
    max_output_chars: int = 10_000
    max_list_entries: int = 500
    max_processes: int = 256
    max_memory_bytes: int = 4 << 30
    max_file_bytes: int = 1 << 30
    sandbox: str = "auto"
    network: bool = False


#: Environment variables a ``bash`` call inherits (nothing else: no keys, tokens or proxies).
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ")


def bash_sandbox() -> str:
    """How ``bash`` calls are confined on this machine, in one line (for help texts).

    Returns:
        ``"bubblewrap (...)"`` when ``bwrap`` is installed, else the fallback.
    """
    if shutil.which("bwrap"):
        return "bubblewrap: read-only root, writable workdir, private /tmp, no network, own PID namespace"
    return ("not sandboxed (bubblewrap not installed): own session, rlimits, scrubbed environment, "
            "workdir as cwd only; run the runtime in a container for untrusted models")


def bash_env(workdir: Path, marker: str) -> dict[str, str]:
    """The whole environment of a ``bash`` call.

    Args:
        workdir: the call's working directory (also ``HOME``).
        marker: a value unique to the call, so its processes can be found and killed.

    Returns:
        The environment.
    """
    env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update({"HOME": str(workdir), "PWD": str(workdir), "TERM": "dumb", "SHELL": "/bin/bash",
                "ASYMCACHE_TOOL_CALL": marker})
    return env


def _user_tasks() -> int:
    """Tasks (processes and threads) of this user now: what ``RLIMIT_NPROC`` counts."""
    uid = str(os.getuid())
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            if line.split()[1].decode() == uid:
                                n += len(os.listdir(f"/proc/{entry.name}/task"))
                            break
            except OSError:
                continue
    return n


def bash_argv(command: str, config: BuiltinToolConfig, timeout_s: float, use_bwrap: bool) -> list[str]:
    """The argv of one ``bash`` call: the rlimits, then the command in a fresh bash.

    NOTE: limits are set by ``ulimit`` in the child shell (soft and hard together, so an
    unprivileged command cannot raise them), not by ``preexec_fn``, which can deadlock in a
    process with threads (the server's engine thread).

    Args:
        command: the model's command line.
        config: the limits.
        timeout_s: the call's time limit (the CPU limit is one second more).
        use_bwrap: wrap in bubblewrap.

    Returns:
        The argv.
    """
    cpu = max(1, int(timeout_s) + 1)
    nproc = _user_tasks() + config.max_processes
    limits = (f"ulimit -c 0 && ulimit -t {cpu} && ulimit -v {config.max_memory_bytes // 1024} "
              f"&& ulimit -f {max(1, config.max_file_bytes // 1024)} && ulimit -u {nproc} "
              "|| { echo 'could not set resource limits' >&2; exit 126; }")
    inner = ["bash", "-c", f'{limits}; exec bash -c "$1"', "bash", command]
    if not use_bwrap:
        return inner
    wd = str(Path(config.workdir).resolve())
    jail = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all"]
    if config.network:
        jail.append("--share-net")
    jail += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
             "--bind", wd, wd, "--chdir", wd]
    return jail + inner


def make_builtin_tools(config: BuiltinToolConfig) -> list[Tool]:
    """Build ``bash``, ``read_file``, ``list_files`` and ``write_file`` for one working dir.

    Args:
        config: working directory and limits.

    Returns:
        The four tools. Their own time limits are enforced inside (``bash`` kills its process
        group); the registry's timeout is set a little longer as a backstop.
    """
    workdir = Path(config.workdir)
    limit = config.max_output_chars

    if config.sandbox not in ("auto", "bwrap", "none"):
        raise ValueError(f"sandbox: one of auto, bwrap, none; got {config.sandbox!r}")
    use_bwrap = config.sandbox == "bwrap" or (config.sandbox == "auto" and shutil.which("bwrap") is not None)
    if config.sandbox == "bwrap" and shutil.which("bwrap") is None:
        raise ValueError("sandbox: 'bwrap' asked for but bubblewrap is not installed")

    async def bash(command: str, timeout_s: float | None = None) -> ToolResult:
        """Run a shell command with bash in the working directory.

        Args:
            command: the command line (bash syntax).
            timeout_s: time limit in seconds (default: the configured one).
        """
        tlimit = config.bash_timeout_s if timeout_s is None else timeout_s
        tlimit = max(0.0, min(tlimit, config.max_bash_timeout_s))
        marker = uuid.uuid4().hex
        argv = bash_argv(command, config, tlimit, use_bwrap)
        cancel = threading.Event()
        run = asyncio.to_thread(
            run_bash, argv, workdir, bash_env(workdir.resolve(), marker), tlimit, limit, marker, cancel
        )
        try:
            result = await asyncio.shield(task := asyncio.ensure_future(run))
        except asyncio.CancelledError:
            cancel.set()  # the thread kills the call and returns within the drain time
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=DRAIN_S + 10)
            raise
        if result.timed_out:
            return ToolResult(f"Error: command timed out after {tlimit:g} s", True)
        code = result.returncode if result.returncode is not None else -1
        stdout = truncate_middle(result.stdout.decode("utf-8", "replace"), limit)
        stderr = truncate_middle(result.stderr.decode("utf-8", "replace"), limit)
        text = f"exit_code: {code}\nstdout:\n{stdout}"
        if stderr:
            text += f"\nstderr:\n{stderr}"
        if result.leftovers:
            text += f"\n(killed {result.leftovers} background process(es) left running)"
        return ToolResult(text, code != 0)

    def read_file(path: str, start_line: int = 1, max_lines: int | None = None) -> str:
        """Read a text file inside the working directory.

        Args:
            path: file path relative to the working directory.
            start_line: first line to return (1-based).
            max_lines: number of lines to return (default: all).
        """
        p = resolve_in_workdir(workdir, path)
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        if p.stat().st_size > 64 * 1024 * 1024:
            raise ValueError(f"{path}: larger than 64 MiB; use bash (head, sed -n) instead")
        lines = p.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        first = max(1, start_line) - 1
        chosen = lines[first:] if max_lines is None else lines[first : first + max(0, max_lines)]
        return truncate_middle("".join(chosen), limit)

    def list_files(path: str = ".", recursive: bool = False) -> str:
        """List the entries of a directory inside the working directory.

        Args:
            path: directory relative to the working directory.
            recursive: walk subdirectories too (``.git`` is skipped).
        """
        root = workdir.resolve()
        p = resolve_in_workdir(workdir, path)
        if not p.is_dir():
            raise NotADirectoryError(f"{path}: not a directory")
        entries: list[str] = []
        it = p.rglob("*") if recursive else p.iterdir()
        for e in sorted(it):
            rel = e.relative_to(root)
            if ".git" in rel.parts:
                continue
            entries.append(f"{rel.as_posix()}/" if e.is_dir() else rel.as_posix())
            if len(entries) >= config.max_list_entries:
                entries.append(f"... (stopped after {config.max_list_entries} entries)")
                break
        return "\n".join(entries)

    def write_file(path: str, content: str) -> str:
        """Write a text file inside the working directory (parents created).

        Args:
            path: file path relative to the working directory.
            content: the full new content of the file.
        """
        p = resolve_in_workdir(workdir, path)
        if p == workdir.resolve() or p.is_dir():
            raise IsADirectoryError(f"{path}: is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        # The parent may only be created after the check; re-check in case a component was a
        # symlink created meanwhile.
        resolve_in_workdir(workdir, path)
        data = content.encode("utf-8")
        p.write_bytes(data)
        return f"wrote {len(data)} bytes to {p.relative_to(workdir.resolve()).as_posix()}"

    backstop = config.bash_timeout_s + 5.0
    return [
        Tool.from_function(bash, timeout_s=config.max_bash_timeout_s + 5.0),
        Tool.from_function(read_file, timeout_s=backstop),
        Tool.from_function(list_files, timeout_s=backstop),
        Tool.from_function(write_file, timeout_s=backstop),
    ]


def builtin_registry(
    workdir: str | os.PathLike[str],
    *,
    bash_timeout_s: float = 30.0,
    max_output_chars: int = 10_000,
) -> ToolRegistry:
    """A registry holding the four built-in tools for ``workdir``.

    Args:
        workdir: the confining directory (must exist).
        bash_timeout_s: default limit of one ``bash`` command.
        max_output_chars: output cut of the tools.

    Returns:
        The registry.

    Raises:
        ValueError: naming ``workdir``: it is not a directory.
    """
    wd = Path(workdir)
    if not wd.is_dir():
        raise ValueError(f"workdir: {str(wd)!r} is not a directory")
    cfg = BuiltinToolConfig(wd, bash_timeout_s=bash_timeout_s, max_output_chars=max_output_chars)
    # The registry cut is a little above the tools' own so it rarely cuts twice.
    reg = ToolRegistry(max_output_chars=2 * max_output_chars + 200)
    reg.register_all(make_builtin_tools(cfg))
    return reg
