"""Tools, the registry's error handling, and the confined built-in tools."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Literal

import pydantic
import pytest

from agent_runtime.builtin_tools import PathEscapeError, builtin_registry, resolve_in_workdir
from agent_runtime.tools import Tool, ToolRegistry, ToolResult, validate_tool_schema


def run(coro):  # noqa: ANN001, ANN201 - tiny helper
    return asyncio.run(coro)


def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
    """Current weather of a city.

    Args:
        city: the city name.
        unit: temperature unit.
    """
    return f"{city}: 21 {unit}"


async def slow_tool(seconds: float) -> str:
    """Sleep then answer."""
    await asyncio.sleep(seconds)
    return "done"


def failing_tool(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"boom {x}")


def test_schema_from_type_hints_and_docstring() -> None:
    tool = Tool.from_function(get_weather)
    s = tool.openai_schema()
    assert s["type"] == "function"
    fn = s["function"]
    assert fn["name"] == "get_weather"
    assert fn["description"] == "Current weather of a city."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["city"]
    assert params["properties"]["city"]["type"] == "string"
    assert params["properties"]["city"]["description"] == "the city name."
    assert params["properties"]["unit"]["enum"] == ["c", "f"]
    assert "title" not in params and "title" not in params["properties"]["city"]
    validate_tool_schema(s)


def test_explicit_args_model_and_name() -> None:
    class Args(pydantic.BaseModel):
        a: int = pydantic.Field(ge=0)
        b: int = 1

    tool = Tool.from_function(lambda a, b: a + b, name="add", description="Add.", args_model=Args)
    assert tool.openai_schema()["function"]["parameters"]["properties"]["a"]["minimum"] == 0
    reg = ToolRegistry()
    reg.register(tool)
    assert run(reg.call("add", {"a": 2, "b": 3})) == ToolResult("5", False, pytest.approx(0, abs=5))
    bad = run(reg.call("add", {"a": -1}))
    assert bad.is_error and "a:" in bad.content


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s.update(type="tool"), "type"),
        (lambda s: s["function"].update(name=""), "function.name"),
        (lambda s: s["function"].update(name=3), "function.name"),
        (lambda s: s["function"].update(description=3), "function.description"),
        (lambda s: s["function"].update(strict="x"), "function.strict"),
        (lambda s: s["function"].update(parameters={"type": "array"}), "function.parameters.type"),
        (
            lambda s: s["function"]["parameters"]["properties"].update(x={"type": "strin"}),
            "function.parameters.properties.x.type",
        ),
        (
            lambda s: s["function"]["parameters"].update(required="city"),
            "function.parameters.required",
        ),
        (
            lambda s: s["function"]["parameters"].update(properties=[]),
            "function.parameters.properties",
        ),
    ],
)
def test_invalid_schema_names_the_field(mutate, field: str) -> None:  # noqa: ANN001
    schema = Tool.from_function(get_weather).openai_schema()
    mutate(schema)
    with pytest.raises(ValueError) as exc:
        validate_tool_schema(schema)
    assert str(exc.value).startswith(field + ":")


def test_from_function_takes_any_name_and_rejects_varargs() -> None:
    # any non-empty name, as vLLM takes a client's tools (OpenAI's rule refused these)
    for name in ("has space", "mcp.server.tool", "ns/tool~1", "x" * 100):
        assert Tool.from_function(get_weather, name=name).openai_schema()["function"]["name"] == name

    def f(*args: int) -> None:
        return None

    with pytest.raises(ValueError, match="args"):
        Tool.from_function(f)


def test_registry_errors_never_raise() -> None:
    reg = ToolRegistry(default_timeout_s=0.2)
    reg.register_all([get_weather, slow_tool, failing_tool])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(get_weather)

    ok = run(reg.call("get_weather", '{"city": "Paris"}'))
    assert ok == ToolResult("Paris: 21 c", False, ok.duration_s)

    cases = {
        "unknown": run(reg.call("nope", {})),
        "bad_json": run(reg.call("get_weather", '{"city": ')),
        "not_object": run(reg.call("get_weather", "[1, 2]")),
        "missing": run(reg.call("get_weather", {})),
        "extra": run(reg.call("get_weather", {"city": "x", "zip": 1})),
        "enum": run(reg.call("get_weather", {"city": "x", "unit": "k"})),
        "exception": run(reg.call("failing_tool", {"x": 7})),
        "timeout": run(reg.call("slow_tool", {"seconds": 5})),
    }
    for key, res in cases.items():
        assert res.is_error, key
    assert "unknown tool 'nope'" in cases["unknown"].content
    assert "not valid JSON" in cases["bad_json"].content
    assert "city" in cases["missing"].content
    assert "zip" in cases["extra"].content
    assert "RuntimeError: boom 7" in cases["exception"].content
    assert "timed out" in cases["timeout"].content
    assert cases["timeout"].duration_s < 2.0


def test_sync_tool_timeout_and_per_tool_timeout() -> None:
    def blocking(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    reg = ToolRegistry(default_timeout_s=10)
    reg.register(Tool.from_function(blocking, timeout_s=0.1))
    res = run(reg.call("blocking", {"seconds": 0.6}))
    assert res.is_error and "timed out after 0.1 s" in res.content


def test_output_truncated_and_json_results() -> None:
    def big() -> str:
        """Big output."""
        return "a" * 500 + "TAIL"

    def structured() -> dict[str, int]:
        """Structured output."""
        return {"x": 1}

    reg = ToolRegistry(max_output_chars=100)
    reg.register_all([big, structured])
    out = run(reg.call("big", None)).content
    assert len(out) < 200 and out.endswith("TAIL") and "elided" in out
    assert json.loads(run(reg.call("structured", "")).content) == {"x": 1}


def test_duration_uses_injected_clock() -> None:
    ticks = iter([10.0, 12.5])
    reg = ToolRegistry(clock=lambda: next(ticks))
    reg.register(get_weather)
    assert run(reg.call("get_weather", {"city": "x"})).duration_s == 2.5


# ---------------------------------------------------------------------------------------------
# Built-ins
# ---------------------------------------------------------------------------------------------


def test_resolve_in_workdir_rejects_escapes(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    outside = tmp_path.parent / f"outside-{os.getpid()}"
    outside.mkdir(exist_ok=True)
    (tmp_path / "link").symlink_to(outside)
    assert resolve_in_workdir(tmp_path, "sub/../sub") == (tmp_path / "sub").resolve()
    assert resolve_in_workdir(tmp_path, ".") == tmp_path.resolve()
    for bad in ("..", "../x", "/etc/passwd", "sub/../../x", "link/file", "a\x00b"):
        with pytest.raises(PathEscapeError):
            resolve_in_workdir(tmp_path, bad)


def test_file_tools(tmp_path: Path) -> None:
    reg = builtin_registry(tmp_path)
    assert set(reg.names) == {"bash", "read_file", "list_files", "write_file"}
    w = run(reg.call("write_file", {"path": "pkg/mod.py", "content": "l1\nl2\nl3\n"}))
    assert not w.is_error and "9 bytes" in w.content
    assert (tmp_path / "pkg" / "mod.py").read_text() == "l1\nl2\nl3\n"
    r = run(reg.call("read_file", {"path": "pkg/mod.py", "start_line": 2, "max_lines": 1}))
    assert r == ToolResult("l2\n", False, r.duration_s)
    lst = run(reg.call("list_files", {"path": ".", "recursive": True}))
    assert lst.content.splitlines() == ["pkg/", "pkg/mod.py"]
    for name, args in [
        ("write_file", {"path": "../evil.txt", "content": "x"}),
        ("read_file", {"path": "/etc/hostname"}),
        ("list_files", {"path": ".."}),
        ("read_file", {"path": "missing.txt"}),
        ("write_file", {"path": "pkg", "content": "x"}),
    ]:
        res = run(reg.call(name, args))
        assert res.is_error, (name, args)
    assert not (tmp_path.parent / "evil.txt").exists()


def test_bash_tool(tmp_path: Path) -> None:
    reg = builtin_registry(tmp_path, bash_timeout_s=5, max_output_chars=200)
    res = run(reg.call("bash", {"command": "echo hi; pwd; echo err >&2"}))
    assert not res.is_error
    assert res.content.startswith("exit_code: 0\nstdout:\nhi\n")
    assert str(tmp_path.resolve()) in res.content and "stderr:\nerr" in res.content

    fail = run(reg.call("bash", {"command": "exit 3"}))
    assert fail.is_error and fail.content.startswith("exit_code: 3")

    # Model text is passed as one argv entry to bash: Python never evaluates it.
    quoted = run(reg.call("bash", {"command": "printf '%s' \"$((6*7))\""}))
    assert "42" in quoted.content

    big = run(reg.call("bash", {"command": "seq 1 5000"}))
    assert "elided" in big.content and big.content.rstrip().endswith("5000")

    t0 = time.monotonic()
    slow = run(reg.call("bash", {"command": "sleep 30 & sleep 30", "timeout_s": 0.3}))
    assert slow.is_error and "timed out" in slow.content
    assert time.monotonic() - t0 < 5


def test_bash_huge_output_is_capped(tmp_path: Path) -> None:
    reg = builtin_registry(tmp_path, bash_timeout_s=20, max_output_chars=100)
    res = run(reg.call("bash", {"command": "head -c 20000000 /dev/zero | tr '\\0' a; echo END"}))
    assert not res.is_error
    assert len(res.content) < 600 and "elided" in res.content
    assert res.content.rstrip().endswith("END")


def test_async_callable_object_and_required_check() -> None:
    class Pinger:
        __name__ = "ping"

        async def __call__(self, host: str) -> str:
            return f"pong {host}"

    class Args(pydantic.BaseModel):
        host: str

    reg = ToolRegistry()
    reg.register(Tool.from_function(Pinger(), name="ping", description="Ping.", args_model=Args))
    assert run(reg.call("ping", {"host": "h"})).content == "pong h"
    schema = Tool.from_function(get_weather).openai_schema()
    schema["function"]["parameters"]["required"] = ["city", "country"]
    with pytest.raises(ValueError, match=r"^function.parameters.required: \['country'\]"):
        validate_tool_schema(schema)


def test_the_builtins_are_importable_from_the_tools_module_as_before():
    import agent_runtime.builtin_tools as builtins
    import agent_runtime.tools as tools

    assert tools.builtin_registry is builtin_registry and tools.make_builtin_tools is builtins.make_builtin_tools
    with pytest.raises(AttributeError, match="no_such_tool"):
        tools.no_such_tool  # noqa: B018


def test_builtin_registry_names_a_workdir_that_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("")
    for workdir in (tmp_path / "nope", tmp_path / "f"):
        with pytest.raises(ValueError, match=r"^workdir: .* is not a directory"):
            builtin_registry(workdir)
