"""A request whose ``tools`` name a function twice, as vLLM 0.32 takes it: accepted (no check in
``ChatCompletionRequest``), and a named ``tool_choice`` forces the last definition
(``vllm/tool_parsers/utils.py``: ``get_json_schema_from_tools``), as ours does
(:func:`agent_runtime.constrained.tool_call_json_schema`). No model is loaded."""

from __future__ import annotations

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.utils import get_json_schema_from_tools

from agent_runtime.constrained import tool_call_json_schema
from agent_runtime.protocol import normalize_tool_choice, normalize_tools


def _tool(prop: str) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {prop: {"type": "string"}}, "required": [prop]}}}


def test_a_name_given_twice_is_served_and_its_last_definition_forced() -> None:
    tools = [_tool("first"), _tool("last")]
    named = {"type": "function", "function": {"name": "f"}}
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": named})
    theirs = get_json_schema_from_tools(request.tool_choice, request.tools)
    assert isinstance(theirs, dict) and theirs["required"] == ["last"]
    ours = tool_call_json_schema(normalize_tools(tools), normalize_tool_choice(named, tools))
    assert ours["properties"]["arguments"] == theirs
    # "required": any definition (vLLM's anyOf over the list)
    required = get_json_schema_from_tools("required", request.tools)
    assert isinstance(required, dict)
    assert [c["properties"]["parameters"]["required"] for c in required["items"]["anyOf"]] == [["first"], ["last"]]
    assert [c["properties"]["arguments"]["required"] for c in tool_call_json_schema(tools)["anyOf"]] == [
        ["first"], ["last"]]
