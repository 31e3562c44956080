"""The OpenAPI document of the app: FastAPI's, plus the request bodies the completion routes
parse themselves (:func:`openapi_with_bodies`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from agent_runtime.server import anthropic_messages, openai_responses
from agent_runtime.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

#: What a chat message looks like, for the OpenAPI document (the runtime checks it in depth).
_TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["function"]},
        # NOTE: ``arguments`` is JSON text of an object, which a schema can only call a string
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}
#: A chat message as :func:`~agent_runtime.protocol.validate_messages` takes it: content is
#: required but on an assistant turn, which alone makes tool calls.
_MESSAGE_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "tool"]},
                "content": {"type": "string"},
                "tool_call_id": {"type": "string"},
                "name": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": ["assistant"]},
                "content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "tool_calls": {"type": "array", "items": _TOOL_CALL_SCHEMA},
                "name": {"type": "string"},
            },
        },
    ],
}


def openapi_with_bodies(app: FastAPI, model_names: Sequence[str]) -> Callable[[], dict[str, Any]]:
    """FastAPI's OpenAPI document plus the completion routes' request bodies.

    NOTE: the routes parse their bodies themselves (a bad body is an OpenAI-style 400, not
    FastAPI's 422), so FastAPI cannot see them; the document names the request models so that
    clients and schema fuzzers (schemathesis) know what to send: ``model`` is one of the served
    names (optional but on the Messages routes, as in vLLM: left out it is the served model), and
    chat messages have a role.
    """
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = default()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        routes: tuple[tuple[str, type[BaseModel]], ...] = (
            ("/v1/chat/completions", ChatCompletionRequest),
            ("/v1/completions", CompletionRequest),
            (openai_responses.PATH, openai_responses.ResponsesRequest),
            (anthropic_messages.PATH, anthropic_messages.MessagesRequest),
            (anthropic_messages.COUNT_PATH, anthropic_messages.CountTokensRequest),
            ("/tokenize", TokenizeRequest),
            ("/detokenize", DetokenizeRequest),
        )
        for path, model in routes:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            # NOTE: required where the body model requires it (Anthropic's Messages route)
            body["properties"]["model"] = {"type": "string", "enum": list(model_names)}
            if "messages" in body["properties"]:
                body["properties"]["messages"] = {"type": "array", "minItems": 1, "items": _MESSAGE_SCHEMA}
            schemas[model.__name__] = body
            spec["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        return spec

    return openapi


__all__ = ["openapi_with_bodies"]
