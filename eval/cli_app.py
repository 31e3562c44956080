"""The ``asymcache`` command group and what its commands share: one-line errors, the engine's
options, version, option parsing. The commands themselves: :mod:`eval.cli_bench` (measuring)
and :mod:`eval.cli_serve` (serving and running the model); :mod:`eval.cli` puts them together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import sys
import tempfile
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import typer

try:  # NOTE: typer >= 0.24 ships its own copy of click; older releases use click itself.
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exceptions
from typer.core import TyperGroup

F = TypeVar("F", bound=Callable[..., Any])

#: Set to show the traceback of an unexpected error instead of its one line.
DEBUG_ENV = "ASYMCACHE_DEBUG"


def one_line(message: str) -> str:
    """A message on one line: its lines (list bullets dropped) joined by ``; ``, so that a list
    of problems stays readable (``3 problem(s): run: Field required; ...``)."""
    parts = [line.strip().removeprefix("- ").strip() for line in message.splitlines()]
    return "; ".join(part for part in parts if part).replace(":;", ":")


def _tidy_flags(command: Any, ctx: Any) -> None:
    """Flags show no ``<bool>`` type in the help (they take no value)."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


#: vLLM's options that take several values after one flag (argparse's ``nargs="+"``).
MULTI_VALUE_FLAGS = ("--served-model-name",)


def expand_multi_value_flags(args: list[str]) -> list[str]:
    """``--served-model-name a b`` as click takes several values: ``--served-model-name a
    --served-model-name b``.

    NOTE: vLLM's launch lines give such an option its values one after another; as argparse
    does, every word up to the next option is one of them.

    Args:
        args: the command line's words.

    Returns:
        The words, those flags repeated once per value.
    """
    out: list[str] = []
    flag: str | None = None
    for arg in args:
        if arg in MULTI_VALUE_FLAGS:
            flag = arg
            continue
        if flag is not None:
            if arg.startswith("-") and arg != "-":
                if out[-2:-1] != [flag]:
                    out.append(flag)  # no value: click reports it
                flag = None
            else:
                out += [flag, arg]
                continue
        out.append(arg)
    if flag is not None and out[-2:-1] != [flag]:
        out.append(flag)
    return out


class OneLineErrors(TyperGroup):
    """The command group: every usage error (unknown option, bad value, missing argument) is one
    ``error:`` line on stderr and exit code 2, never a box or a traceback."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        args = expand_multi_value_flags(list(sys.argv[1:] if args is None else args))
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(0)
        except click_exceptions.ClickException as exc:
            typer.echo(f"error: {one_line(exc.format_message())}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _tidy_flags(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _tidy_flags(self, ctx)
        super().format_help(ctx, formatter)


_CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    help="AsymCache: agent serving with hole-aware KV eviction, MSA and Continuum pinning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
    context_settings=_CONTEXT,
)
agent_app = typer.Typer(help="Run agents on the local model.", no_args_is_help=True, cls=OneLineErrors,
                        context_settings=_CONTEXT)
app.add_typer(agent_app, name="agent")


def version() -> str:
    """The installed package's version (:func:`asymcache_core.version.package_version`)."""
    from asymcache_core.version import package_version

    return package_version()


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"asymcache {version()}")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """AsymCache: agent serving with hole-aware KV eviction, MSA and Continuum pinning."""


def clean_errors(fn: F) -> F:
    """Errors become one ``error:`` line on stderr and exit code 2, never a traceback.

    Bad input (``ValueError``, a file that cannot be read or written) says what was wrong; an
    unexpected exception names its type (``ASYMCACHE_DEBUG=1`` re-raises it with its traceback).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, click_exceptions.ClickException):
            raise
        except ValueError as exc:  # includes TraceError, BenchError, config errors
            message = one_line(str(exc)) or type(exc).__name__
        except OSError as exc:
            message = one_line(str(exc)) or type(exc).__name__
        except MemoryError:
            message = "out of memory: a size given (jobs, pool, tier, trace) is too large for this machine"
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            message = f"unexpected {type(exc).__name__}: {one_line(str(exc))} ({DEBUG_ENV}=1 shows the traceback)"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def engine_options(
    names: Collection[str] | None = None,
    *,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Gives a command one option per :class:`asymcache_core.EngineConfig` field, spelled as
    the field's ``cli`` metadata says (:func:`asymcache_core.config.cli_flags`: vLLM's names,
    older names as aliases), and hands their values to the command as one dict, ``engine_args``
    (field name -> value, ready for ``EngineConfig(**engine_args)``).

    NOTE: the options carry no typer range checks: ``EngineConfig`` validates the values, so a
    bad one is the config's one-line message naming the field (exit code 2 via
    :func:`clean_errors`), the same as from Python.

    Args:
        names: the fields to offer (default: every field with a flag); options follow the
            config's field order.
        exclude: fields to leave out.
        defaults: this command's defaults where they differ from the config's.
        helps: this command's help texts where the field's own would mislead.

    Returns:
        A decorator for a command function that takes ``engine_args: dict[str, Any]``.

    Raises:
        TypeError: a name that is not an engine field with a flag (a bug in this module).
    """
    from asymcache_core.config import EngineConfig, cli_flags

    flags = cli_flags()
    wanted = set(flags if names is None else names) - set(exclude)
    unknown = sorted((wanted | set(defaults or {}) | set(helps or {})) - set(flags))
    if unknown:
        raise TypeError(f"engine_options: {unknown[0]!r} is not an engine field with a flag")
    chosen = [name for name in flags if name in wanted]
    hints = typing.get_type_hints(EngineConfig)
    config_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    options = []
    for name in chosen:
        flag = flags[name]
        is_flag = hints[name] in (bool, bool | None)
        decls = (f"{flag.name}/--no-{flag.name[2:]}",) if is_flag else (flag.name, *flag.aliases)
        default = (defaults or {}).get(name, config_defaults[name])
        option = typer.Option(default, *decls, help=(helps or {}).get(name, flag.help))
        options.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=hints[name]))

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(fn, eval_str=True)
        params = [p for p in own.parameters.values() if p.name != "engine_args"] + options

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            engine_args = {name: kwargs.pop(name) for name in chosen}
            return fn(*args, engine_args=engine_args, **kwargs)

        # NOTE: typer reads a command's options off its signature and annotations: both list
        # the generated options in place of ``engine_args``.
        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params} | {"return": own.return_annotation}
        return command

    return decorate


def memory_sized_pool(ctx: typer.Context, engine_args: dict[str, Any]) -> None:
    """``--gpu-memory-utilization`` without ``--num-kv-blocks`` sizes the pool from memory: the
    command's own fixed pool default then gives way."""
    if engine_args.get("gpu_memory_utilization") is not None and not option_given(ctx, "num_kv_blocks"):
        engine_args["num_kv_blocks"] = None


def read_config_file(ctx: typer.Context, param: Any, value: str | None) -> str | None:
    """``--config FILE``'s callback (vLLM's option): the file's options become the command's
    defaults, so the command line still wins over it.

    The file is YAML (JSON is YAML too): a mapping of option names as the command line spells
    them, with or without the leading dashes, dashes or underscores (``max-num-seqs: 32``,
    ``enforce_eager: true``).

    Raises:
        typer.BadParameter: an unreadable file, one that is not a mapping, or an option the
            command does not have (the CLI prints it on one line, exit code 2).
    """
    if value is None or ctx.resilient_parsing:
        return value
    import yaml

    try:
        with open(value, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {value!r}: {exc}".replace("\n", " ")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value!r} must hold a mapping of option names to values")
    # NOTE: every spelling of an option (its aliases too), not its --no- form
    names = {
        opt.lstrip("-").replace("-", "_"): p.name
        for p in ctx.command.params if p.param_type_name == "option" and p.name != param.name
        for opt in p.opts
    }
    several = {p.name for p in ctx.command.params if getattr(p, "multiple", False)}
    defaults: dict[str, Any] = {}
    for key, item in data.items():
        name = names.get(str(key).lstrip("-").replace("-", "_"))
        if name is None:
            raise typer.BadParameter(f"{value!r}: {key!r} is not an option of this command")
        # NOTE: an option of several values (--served-model-name) may name one in the file
        defaults[name] = [item] if name in several and not isinstance(item, list) else item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was set by the user (the command line, its environment variable
    or a ``--config`` file), not left at its default.

    NOTE: compared by name: typer ships its own copy of click, whose ``ParameterSource`` is
    not ``click.core``'s.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "DEFAULT_MAP")


def number_list(name: str, text: str | None, kind: type) -> list[Any]:
    """A comma-separated list of numbers (``None``: empty), none repeated; a bad item is a
    ValueError naming the option.

    NOTE: every caller's list is of load points or seeds: a repeated value would run the same
    point twice under one key (``name_list`` refuses a repeated policy the same way).
    """
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",")]
    try:
        # NOTE: an empty item ("1,,2", ",") is a typo, not a list one shorter
        if not all(items):
            raise ValueError
        values = [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from None
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"{name}: every number must be finite, got {text!r}")
    repeated = next((items[i] for i, v in enumerate(values) if v in values[:i]), None)
    if repeated is not None:
        raise ValueError(f"{name}: {repeated} is listed twice, in {text!r}")
    return values


def name_list(name: str, text: str) -> list[str]:
    """A comma-separated list of names (workloads, policies), no item empty or repeated.

    Raises:
        ValueError: naming the option.
    """
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise ValueError(f"{name}: an empty item in {text!r}")
    repeated = next((t for i, t in enumerate(items) if t in items[:i]), None)
    if repeated is not None:
        raise ValueError(f"{name}: {repeated!r} is listed twice (use --repeats to run it again)")
    return items


def torch_device_type(device: str) -> str:
    return device.split(":", 1)[0]


def json_object(name: str, text: str | None) -> dict[str, Any] | None:
    """A JSON object given on the command line (None when not given).

    Raises:
        ValueError: not a JSON object (naming ``name``).
    """
    from asymcache_core.config import json_object_text

    return None if text is None else json_object_text(name, text)


def check_output_path(name: str, path: Path, *, folder: bool = False) -> None:
    """Refuses an output path that cannot be written, before the command does any work (a
    profile would otherwise run for minutes and then fail on its last line).

    The missing folders on the way are created, a file is created in the deepest and both are
    removed again: only trying tells (permissions, read-only mounts, ``/proc``, root).

    Args:
        name: the option (``out``), named in the message.
        path: the file (or, with ``folder``, the folder) the command will write.
        folder: ``path`` is a folder the command fills.

    Raises:
        ValueError: naming ``name``: the path is a folder where a file goes (or a file where a
            folder goes), or its folder cannot be created or written.
    """
    if folder and path.exists() and not path.is_dir():
        raise ValueError(f"{name}: {str(path)!r} is a file, not a folder")
    if not folder and path.is_dir():
        raise ValueError(f"{name}: {str(path)!r} is a folder; give a file path")
    target = path if folder else path.parent
    missing = []
    existing = target
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name}: cannot create {str(target)!r}: {str(existing)!r} is a file")
    created: list[Path] = []
    try:
        for parent in reversed(missing):
            parent.mkdir()
            created.append(parent)
        fd, probe = tempfile.mkstemp(dir=target, prefix=".asymcache-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{name}: cannot write in {str(target)!r}: {reason}") from None
    finally:
        for parent in reversed(created):
            with contextlib.suppress(OSError):
                parent.rmdir()
