"""From raw bytes to a request model: the bounds a body must keep (size is the guard's, JSON
nesting here), the fields this server does not implement (a 400, never silently ignored), and
pydantic's errors as a :class:`~agent_runtime.protocol.RequestError` naming the offending field
the way OpenAI's ``param`` does (``messages[0].role``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from agent_runtime.protocol import RequestError

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


__all__ = [
    "MAX_JSON_DEPTH", "UNSUPPORTED_FIELDS", "check_json_tree", "parse_json_body", "parse_request",
    "reject_unsupported",
]
