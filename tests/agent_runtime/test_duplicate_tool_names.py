"""A request's ``tools`` naming a function twice, as vLLM 0.32 takes them: accepted (its
``ChatCompletionRequest`` does not check), a named ``tool_choice`` forcing the last definition
(``vllm/tool_parsers/utils.py``: ``get_json_schema_from_tools`` reads a ``{name: tool}`` dict
built over the list) and ``"required"`` any of them (its ``anyOf`` over the list). No model is
loaded (``tests/vllm/test_tool_choice_duplicates.py`` checks vLLM's own schema)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from agent_runtime.constrained import tool_call_grammar, tool_call_json_schema
from agent_runtime.protocol import normalize_tool_choice, normalize_tools

NAMED = {"type": "function", "function": {"name": "f"}}


def _tool(prop: str, defs: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": {prop: {"type": "string"}}, "required": [prop]}
    if defs:
        params = {"type": "object", "properties": {prop: {"$ref": "#/$defs/P"}}, "required": [prop],
                  "$defs": {"P": {"type": "integer" if prop == "first" else "string"}}}
    return {"type": "function", "function": {"name": "f", "parameters": params}}


def _valid(schema: dict[str, Any], arguments: dict[str, Any]) -> bool:
    try:
        jsonschema.validate({"name": "f", "arguments": arguments}, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_a_name_given_twice_is_accepted_in_order() -> None:
    tools = normalize_tools([_tool("first"), _tool("last")])
    assert [t["function"]["parameters"]["required"] for t in tools] == [["first"], ["last"]]
    assert normalize_tool_choice(NAMED, tools) == NAMED


@pytest.mark.parametrize("defs", [False, True])
def test_a_named_choice_forces_the_last_definition_and_required_any(defs: bool) -> None:
    tools = normalize_tools([_tool("first", defs), _tool("last", defs)])
    named = tool_call_json_schema(tools, NAMED)
    assert _valid(named, {"last": "x"}) and not _valid(named, {"first": 1 if defs else "x"})
    required = tool_call_json_schema(tools, "required")
    assert len(required["anyOf"]) == 2
    assert _valid(required, {"last": "x"}) and _valid(required, {"first": 1 if defs else "x"})
    if defs:  # each definition's own $defs: the first's P is an integer, the last's a string
        assert not _valid(required, {"first": "x"}) and not _valid(required, {"last": 1})
    for schema in (named, required):
        tool_call_grammar(schema)  # compiles: every reference resolves


def test_the_same_definition_twice_is_one_case() -> None:
    schema = tool_call_json_schema(normalize_tools([_tool("a"), _tool("a")]), "required")
    assert "anyOf" not in schema and schema["properties"]["arguments"]["required"] == ["a"]
