"""Validation of a tool's OpenAI function schema, before any request uses it.

:func:`validate_tool_schema` checks a ``{"type": "function", "function": {...}}`` entry the
way a client's tools are checked on the server: the name a non-empty string (vLLM's rule), the
parameters an object schema whose every node has known JSON types and well-formed
``properties``, ``items``, combinators and definitions, and, where xgrammar is installed, that
it compiles to a grammar (constrained tool calls need that). Errors are ``ValueError`` naming
the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_runtime.constrained import check_schema_compiles

#: JSON-schema ``type`` values.
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})



def _check_schema_node(node: Any, where: str) -> None:
    """Structural check of one JSON-schema node (the subset tool schemas use).

    Args:
        node: the schema node.
        where: dotted path of the node, used in error messages.

    Raises:
        ValueError: naming the offending field.
    """
    if isinstance(node, bool):  # true/false are valid schemas
        return
    if not isinstance(node, Mapping):
        raise ValueError(f"{where}: a JSON schema must be an object, got {type(node).__name__}")
    typ = node.get("type")
    if typ is not None:
        types = typ if isinstance(typ, list) else [typ]
        for t in types:
            if t not in _JSON_TYPES:
                raise ValueError(f"{where}.type: unknown JSON type {t!r}")
    if "properties" in node:
        props = node["properties"]
        if not isinstance(props, Mapping):
            raise ValueError(f"{where}.properties: must be an object")
        for key, sub in props.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}.properties: property names must be strings")
            _check_schema_node(sub, f"{where}.properties.{key}")
    if "required" in node:
        req = node["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ValueError(f"{where}.required: must be a list of strings")
        props = node.get("properties")
        missing = [r for r in req if props is not None and r not in props]
        if missing:
            raise ValueError(f"{where}.required: {missing} not among the properties")
    if "items" in node:
        _check_schema_node(node["items"], f"{where}.items")
    if "additionalProperties" in node and not isinstance(node["additionalProperties"], bool):
        _check_schema_node(node["additionalProperties"], f"{where}.additionalProperties")
    for comb in ("anyOf", "oneOf", "allOf"):
        if comb in node:
            subs = node[comb]
            if not isinstance(subs, list) or not subs:
                raise ValueError(f"{where}.{comb}: must be a non-empty list of schemas")
            for i, sub in enumerate(subs):
                _check_schema_node(sub, f"{where}.{comb}[{i}]")
    if "enum" in node and not isinstance(node["enum"], list):
        raise ValueError(f"{where}.enum: must be a list")
    for defs_key in ("$defs", "definitions"):
        if defs_key in node:
            defs = node[defs_key]
            if not isinstance(defs, Mapping):
                raise ValueError(f"{where}.{defs_key}: must be an object")
            for key, sub in defs.items():
                _check_schema_node(sub, f"{where}.{defs_key}.{key}")


def validate_tool_schema(schema: Mapping[str, Any]) -> None:
    """Check an OpenAI tool schema ``{"type": "function", "function": {...}}``.

    Args:
        schema: the tool schema as sent in a chat-completions ``tools`` list.

    Raises:
        ValueError: with the dotted name of the first invalid field (e.g.
            ``function.parameters.properties.path.type``).
    """
    if not isinstance(schema, Mapping):
        raise ValueError("tool: must be an object")
    if schema.get("type") != "function":
        raise ValueError(f"type: must be 'function', got {schema.get('type')!r}")
    fn = schema.get("function")
    if not isinstance(fn, Mapping):
        raise ValueError("function: must be an object")
    name = fn.get("name")
    # NOTE: any non-empty string, as vLLM 0.32 takes it (its FunctionDefinition's and
    # AnthropicTool's name is a plain str; OpenAI's ^[A-Za-z0-9_-]{1,64}$ refused dotted MCP
    # names and longer ones that vLLM serves); an empty name could never be called (a call
    # without a name is none)
    if not isinstance(name, str) or not name:
        raise ValueError(f"function.name: must be a non-empty string, got {name!r}")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise ValueError("function.description: must be a string")
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise ValueError("function.strict: must be a boolean")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise ValueError("function.parameters: must be an object")
    if params.get("type", "object") != "object":
        raise ValueError(f"function.parameters.type: must be 'object', got {params.get('type')!r}")
    _check_schema_node(params, "function.parameters")
    check_schema_compiles(params, "function.parameters")
