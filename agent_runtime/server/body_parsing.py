"""From raw bytes to a request model: the bounds a body must keep (size is the guard's, JSON
nesting here), the fields this server does not implement (a 400, never silently ignored), and
pydantic's errors as a :class:`~agent_runtime.protocol.RequestError` naming the offending field
the way OpenAI's ``param`` does (``messages[0].role``); and the shapes the request models read
before their fields: Continuum's hints in vLLM's ``vllm_xargs`` (:func:`lift_vllm_xargs`) and a
completion's prompt or batch of prompts (:func:`completion_prompts`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from agent_runtime.protocol import RequestError
from agent_runtime.server.errors import APIError

ModelT = TypeVar("ModelT", bound=BaseModel)

#: Nesting of the JSON body at most (a deeper body is a 400, never a RecursionError).
MAX_JSON_DEPTH = 64
#: OpenAI fields this server does not implement, with the value that means "off".
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # NOTE: vLLM's extensions that change what is generated or returned: a 400, not ignored.
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "watermarking": (None, False),
    "logprob_token_ids": (None, []),
    "truncation_side": (None, "left"),  # NOTE: truncate_prompt_tokens keeps the prompt's last tokens
    "priority": (None, 0),
    "repetition_detection": (None,),
    "return_prompt_text": (None, False),
    "return_token_offsets": (None, False),
    "routed_experts_prompt_start": (None, 0),
    "kv_transfer_params": (None,),
    "prompt_embeds": (None,),
    "logits_processors": (None, []),
    "ec_transfer_params": (None,),
    # NOTE: the options of vLLM's older ``guided_*`` fields (those are read as
    # ``structured_outputs``: agent_runtime.structured_outputs.lift_guided_fields)
    "guided_whitespace_pattern": (None,),
    "guided_decoding_backend": (None, "auto", "xgrammar"),
}


#: vLLM's request id header: names a completion (over the body's ``request_id``) and comes back
#: on its response.
REQUEST_ID_HEADER = "X-Request-Id"
_MAX_REQUEST_ID_CHARS = 256


def base_request_id(headers: Mapping[str, str], body_id: str | None) -> str:
    """A completion's base id: vLLM's ``X-Request-Id`` header, else the body's ``request_id``,
    else a random one.

    Raises:
        APIError: 400 for a header that is empty or over 256 characters.
    """
    header = headers.get(REQUEST_ID_HEADER)
    if header is None:
        return body_id or uuid.uuid4().hex[:24]
    if not 0 < len(header) <= _MAX_REQUEST_ID_CHARS:
        raise APIError(400, f"{REQUEST_ID_HEADER}: must be 1 to {_MAX_REQUEST_ID_CHARS} characters",
                       param=REQUEST_ID_HEADER)
    return header


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object.

    Args:
        raw: the body bytes.

    Returns:
        The object.

    Raises:
        RequestError: with code ``invalid_json``.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"Invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object", code="invalid_json")
    check_json_tree(body)
    return body


def check_json_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Reject bodies nested deeper than ``max_depth`` or holding text that is not Unicode.

    Iterative, so that no depth reaches Python's recursion limit; run before anything that
    recurses over the body (pydantic, the chat template, xgrammar). A lone surrogate
    (``"\\ud800"``, valid JSON but not encodable) would fail the tokenizer later.

    Args:
        body: the decoded JSON.
        max_depth: the deepest nesting allowed.

    Raises:
        RequestError: naming the offending field.
    """
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > max_depth:
            raise RequestError(f"{where or 'body'}: nested deeper than {max_depth}", param=where or None,
                               code="invalid_json")
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{where or 'body'}: not valid Unicode (a lone surrogate)",
                                   param=where or None, code="invalid_json") from None
        elif isinstance(node, dict):
            for key, value in node.items():
                stack.append((key, where, depth + 1))
                stack.append((value, f"{where}.{key}" if where else str(key), depth + 1))
        elif isinstance(node, list):
            stack.extend((value, f"{where}[{i}]", depth + 1) for i, value in enumerate(node))


def reject_unsupported(body: Mapping[str, Any], more: Mapping[str, tuple[Any, ...]] | None = None) -> None:
    """A 400 for OpenAI fields that are set but not implemented (never silently ignored).

    Args:
        body: the decoded request body.
        more: the endpoint's own such fields, with their "off" values.

    Raises:
        RequestError: naming the first such field.
    """
    for name, off in {**UNSUPPORTED_FIELDS, **(more or {})}.items():
        if name in body and body[name] not in off:
            raise RequestError(f"{name}: not supported by this server", param=name, code="unsupported_field")


def parse_request(model: type[ModelT], body: Mapping[str, Any]) -> ModelT:
    """Validate a decoded body against a request model.

    Args:
        model: :class:`ChatCompletionRequest` or :class:`CompletionRequest`.
        body: the decoded JSON object.

    Returns:
        The request.

    Raises:
        RequestError: for the first invalid field, with ``param`` naming it.
    """
    reject_unsupported(body, getattr(model, "unsupported_fields", None))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _request_error(exc) from None


def _param(loc: Sequence[int | str]) -> str | None:
    """OpenAI's notation for a pydantic location: ``("messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _request_error(exc: ValidationError) -> RequestError:
    err = exc.errors(include_url=False)[0]
    param = _param(err["loc"])
    msg = str(err["msg"])
    if err["type"] == "value_error":
        # NOTE: our validators already write "field: message"; pydantic prefixes "Value error, ".
        msg = msg.removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if param is not None and (head == param or head.startswith((f"{param}.", f"{param}["))):
            # NOTE: a validator may name a key below its field (``response_format.json_schema.name``).
            return RequestError(msg, head)
        if param is None and ":" in msg and head and " " not in head:
            # NOTE: a model validator (no location) names the field it refused itself
            return RequestError(msg, head)
    elif err["type"] != "missing" and "input" in err:
        shown = repr(err["input"])
        msg = f"{msg}, got {shown if len(shown) <= 80 else shown[:77] + '...'}"
    return RequestError(f"{param}: {msg}" if param else msg, param)


#: Continuum's hints a body may carry in vLLM's ``vllm_xargs`` (the AsymCache plugin's form).
_XARGS_HINTS = ("job_id", "is_last_step", "tool_name")
_XARGS_TRUE, _XARGS_FALSE = {1, "1", "true", "yes", "on"}, {0, "0", "false", "no", "off"}


def lift_vllm_xargs(data: Any, hints: Sequence[str] = _XARGS_HINTS) -> Any:
    """A body with the Continuum hints of its ``vllm_xargs`` (what a client of a stock vLLM
    running the AsymCache plugin sends: values are strings or numbers there, so
    ``is_last_step`` is ``1``/``0`` or ``"true"``/``"false"``) as its own fields; the body's own
    fields win, and vLLM's ``session_id`` names the job when nothing else does.

    Args:
        data: the decoded body.
        hints: the hints the route reads.

    Returns:
        The body, lifted (unchanged when it carries none of them).

    Raises:
        ValueError: ``vllm_xargs.pin_ttl_s`` (an explicit TTL, not served here), an
            ``is_last_step`` that is no truth value, or a ``job_id`` neither a string nor an
            integer.
    """
    if not isinstance(data, Mapping):
        return data
    xargs = data.get("vllm_xargs")
    lifted: dict[str, Any] = {}
    if isinstance(xargs, Mapping):
        if xargs.get("pin_ttl_s") is not None:
            raise ValueError("vllm_xargs.pin_ttl_s: an explicit pin TTL is not served here (the controller sets it)")
        for key in hints:
            if key in xargs and data.get(key) is None:
                lifted[key] = xargs[key]
        if "is_last_step" in lifted:
            flag = lifted["is_last_step"]
            flag = flag.strip().lower() if isinstance(flag, str) else flag
            # NOTE: the type first: a list or an object cannot be looked up in the sets.
            if not isinstance(flag, str | int | float) or (flag not in _XARGS_TRUE and flag not in _XARGS_FALSE):
                raise ValueError(f"vllm_xargs.is_last_step: 1/0 or true/false, got {lifted['is_last_step']!r}")
            lifted["is_last_step"] = flag in _XARGS_TRUE
        if "job_id" in lifted and not isinstance(lifted["job_id"], str):
            if isinstance(lifted["job_id"], bool) or not isinstance(lifted["job_id"], int):
                raise ValueError(f"vllm_xargs.job_id: a string or an integer, got {lifted['job_id']!r}")
            lifted["job_id"] = str(lifted["job_id"])
    if "job_id" in hints and data.get("job_id") is None and "job_id" not in lifted \
            and isinstance(data.get("session_id"), str) and data["session_id"]:
        lifted["job_id"] = data["session_id"]
    return {**data, **lifted} if lifted else data


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a ``/v1/completions`` body: a string, token ids, or a batch of either (a
    list of strings, or a list of token-id lists), as OpenAI and vLLM take them.

    Args:
        prompt: the body's ``prompt``.

    Returns:
        Each prompt's text or token ids, in order.

    Raises:
        ValueError: naming ``prompt`` (or ``prompt[i]`` in a batch).
    """
    if _is_token_ids(prompt) or isinstance(prompt, str):
        return [_one_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if isinstance(prompt, list) and prompt:
        raise ValueError("prompt: a list holds token ids, or a batch of strings, or a batch of token-id lists: "
                         "one kind only")
    raise ValueError("prompt: must be a non-empty string, a list of token ids, or a batch of either")


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: must not be empty")
        return prompt
    if _is_token_ids(prompt):
        return list(prompt)
    raise ValueError(f"{where}: must be a non-empty string or a non-empty list of token ids")


__all__ = [
    "base_request_id",
    "REQUEST_ID_HEADER",
    "MAX_JSON_DEPTH", "UNSUPPORTED_FIELDS", "check_json_tree", "completion_prompts", "lift_vllm_xargs",
    "parse_json_body", "parse_request", "reject_unsupported",
]
