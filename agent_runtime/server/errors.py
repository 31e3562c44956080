"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from fastapi.responses import JSONResponse

from agent_runtime.protocol import RequestError
from agent_runtime.request_stream import RequestConstraintsUnsatisfiable
from agent_runtime.server.responses import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status.
        message: human-readable message.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the offending request field, if any.
        code: a machine-readable code, if any.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        """The body.

        Returns:
            ``{"error": {"message", "type", "param", "code"}}``.
        """
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        """The error as a response.

        Returns:
            The JSON response.
        """
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def from_value_error(
    exc: ValueError, prompt_param: str, field_names: Sequence[tuple[re.Pattern[str], str]] = ()
) -> APIError:
    """The 400 of a client error raised by the protocol, the runtime, the engine or SamplingParams.

    A :class:`RequestError` carries its ``param`` and ``code``; any other ValueError is read as
    ``"field: message"`` (the convention of every layer below), with two renames: the engine's
    ``prompt`` is the request's ``prompt_param`` (``messages`` for chat), and a KV pool too small
    for the request is ``max_tokens`` / ``context_length_exceeded``.

    Args:
        exc: the error.
        prompt_param: the request field the engine's ``prompt`` stands for.
        field_names: the route's own names of the chat form's fields, ``(pattern of the chat
            form's name at the start, replacement)``; the first that matches renames the field.

    Returns:
        The API error.
    """
    text = str(exc)
    for pattern, name in field_names:
        renamed = pattern.sub(name, text, count=1)
        if renamed != text:
            text = renamed
            break
    if isinstance(exc, RequestError):
        return APIError(400, text, param=exc.param, code=exc.code)
    head = text.split(":", 1)[0].strip() if ":" in text else ""
    param: str | None = head if head and " " not in head else None
    code: str | None = None
    if param == "prompt":
        param = prompt_param
        if "max_model_len" in text:
            code = "context_length_exceeded"
    elif param == "num_kv_blocks":
        param, code = "max_tokens", "context_length_exceeded"
    return APIError(400, text, param=param, code=code)


def failed_request_error(exc: BaseException) -> APIError:
    """The API error of a request that failed while it ran: a 400 where its own constraints
    allow no token (:class:`~agent_runtime.request_stream.RequestConstraintsUnsatisfiable`),
    else a 500.

    Args:
        exc: what ended the request.

    Returns:
        The API error.
    """
    if isinstance(exc, RequestConstraintsUnsatisfiable):
        return APIError(400, str(exc), code="constraints_unsatisfiable")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="request_failed")


def stream_error_frame(exc: BaseException) -> str:
    """The SSE frame that tells a streaming client its request failed (``[DONE]`` follows).

    Args:
        exc: what ended the stream.

    Returns:
        ``data: {"error": {...}}`` with a blank line.
    """
    err = failed_request_error(exc)
    return f"data: {json.dumps(err.body().model_dump(), ensure_ascii=False)}\n\n"


__all__ = ["APIError", "failed_request_error", "from_value_error", "stream_error_frame"]
