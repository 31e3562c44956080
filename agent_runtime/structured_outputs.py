"""vLLM's ``structured_outputs``: a reply constrained to a JSON schema, a regular expression, one
of a list of strings, an EBNF grammar or a structural tag, validated the same way for the server
and the runtime.

vLLM's request field (``extra_body={"structured_outputs": {"choice": ["yes", "no"]}}``) takes
exactly one of ``json`` (a schema, as an object or as JSON text), ``regex``, ``choice``,
``grammar`` (xgrammar's EBNF, the GBNF dialect of llama.cpp: ``root ::= ...``),
``json_object: true`` and ``structural_tag`` (the JSON text of a structural tag: free text, with
a structure enforced where a trigger starts it; :mod:`agent_runtime.structural_tag`). Its older
top-level spellings ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``
(removed from vLLM, still in many clients) are read as the same (:func:`lift_guided_fields`).

:func:`normalize_structured_outputs` returns the constraint in the form
:func:`agent_runtime.protocol.normalize_response_format` gives a ``response_format`` (a JSON
schema is ``{"type": "json_schema", ...}``, any object ``{"type": "json_object"}``, a structural
tag ``{"type": "structural_tag", ...}``), or as ``{"type": "regex", "regex": ...}``,
``{"type": "choice", "choice": [...]}`` and ``{"type": "grammar", "grammar": ...}``;
:func:`agent_runtime.grammar_cache.make_request_processor` builds the grammar of each. The text
is checked to compile when xgrammar is installed, so a bad pattern is a client error before
anything runs.

vLLM's two JSON options are accepted as booleans: this server's JSON grammars already have no
free whitespace and no properties a schema does not name (xgrammar's strict mode), which is what
``disable_any_whitespace`` and ``disable_additional_properties`` ask for. Its
``whitespace_pattern`` is not served (a 400, never ignored).

Every error is a :class:`ValueError` whose text starts with the field
(``"structured_outputs.regex: ..."``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_runtime.constrained import check_compiles, check_schema_compiles, needs_constraint
from agent_runtime.structural_tag import normalize_structural_tag_text
from asymcache_core.config import json_object_text

FIELD = "structured_outputs"
#: The constraints: exactly one is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: Options that name no constraint: the JSON grammars already are what they ask for.
_BOOLEAN_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
#: vLLM's options this server does not serve (a 400 when set).
_UNSERVED_OPTIONS = ("whitespace_pattern",)
#: vLLM's older top-level fields, each one constraint of ``structured_outputs``.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
#: The largest regular expression or grammar text (characters).
MAX_PATTERN_CHARS = 65_536


def lift_guided_fields(body: Any) -> Any:
    """A request body with vLLM's older ``guided_*`` fields moved into ``structured_outputs``.

    Args:
        body: the decoded body (anything else than an object is returned as it is).

    Returns:
        The body, a new dict when a ``guided_*`` field was set.

    Raises:
        ValueError: a ``guided_*`` field together with ``structured_outputs`` or another one.
    """
    if not isinstance(body, Mapping):
        return body
    given = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if not given:
        return body
    if body.get(FIELD) is not None:
        raise ValueError(f"{given[0]}: set either {FIELD} or vLLM's older {given[0]}, not both")
    if len(given) > 1:
        raise ValueError(f"{given[1]}: one constraint at most; {given[0]} is set too")
    out = {k: v for k, v in body.items() if k not in GUIDED_FIELDS}
    out[FIELD] = {GUIDED_FIELDS[given[0]]: body[given[0]]}
    return out


def normalize_structured_outputs(value: Any, tool_choice: Any = None) -> dict[str, Any] | None:
    """Validate vLLM's ``structured_outputs`` and return the constraint it asks for.

    Args:
        value: the value given (None: no constraint).
        tool_choice: the request's ``tool_choice``; one that forces a tool call contradicts a
            constrained reply.

    Returns:
        None, or the normalised constraint (see the module docstring).

    Raises:
        ValueError: naming ``structured_outputs`` or the offending key below it.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{FIELD}: must be an object, got {type(value).__name__}")
    known = (*KINDS, *_BOOLEAN_OPTIONS, *_UNSERVED_OPTIONS)
    for key in value:
        if key not in known:
            raise ValueError(f"{FIELD}.{key}: unknown field (one of {', '.join(known)})")
    for key in _BOOLEAN_OPTIONS:
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise ValueError(f"{FIELD}.{key}: must be a boolean")
    for key in _UNSERVED_OPTIONS:
        if value.get(key) is not None:
            raise ValueError(f"{FIELD}.{key}: not supported by this server")
    set_kinds = [k for k in KINDS if value.get(k) is not None and (k != "json_object" or value[k] is not False)]
    if not set_kinds:
        raise ValueError(f"{FIELD}: set one of {', '.join(KINDS)}")
    if len(set_kinds) > 1:
        raise ValueError(f"{FIELD}: one constraint at most, got {' and '.join(set_kinds)}")
    if needs_constraint(tool_choice):
        raise ValueError(f"{FIELD}: a constrained reply cannot be combined with a tool_choice that forces a tool call")
    kind = set_kinds[0]
    return _NORMALIZERS[kind](value[kind], f"{FIELD}.{kind}")


def _json(schema: Any, field: str) -> dict[str, Any]:
    if isinstance(schema, str):
        schema = json_object_text(field, schema)
    if not isinstance(schema, Mapping):
        raise ValueError(f"{field}: must be a JSON schema object (or its JSON text)")
    check_schema_compiles(schema, field)
    return {"type": "json_schema", "json_schema": {"name": FIELD, "schema": dict(schema), "strict": True}}


def _json_object(flag: Any, field: str) -> dict[str, Any]:
    if flag is not True:
        raise ValueError(f"{field}: must be true (or left out)")
    return {"type": "json_object"}


def _pattern_text(text: Any, field: str) -> str:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{field}: must be a non-empty string")
    if len(text) > MAX_PATTERN_CHARS:
        raise ValueError(f"{field}: longer than {MAX_PATTERN_CHARS} characters")
    return text


def _regex(regex: Any, field: str) -> dict[str, Any]:
    regex = _pattern_text(regex, field)
    check_compiles("regex", regex, field)
    return {"type": "regex", "regex": regex}


def _grammar(grammar: Any, field: str) -> dict[str, Any]:
    grammar = _pattern_text(grammar, field)
    check_compiles("ebnf", grammar, field)
    return {"type": "grammar", "grammar": grammar}


def _choice(choices: Any, field: str) -> dict[str, Any]:
    if not isinstance(choices, list | tuple) or not choices:
        raise ValueError(f"{field}: must be a non-empty list of strings")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"{field}[{i}]: must be a non-empty string")
    if sum(len(c) for c in choices) > MAX_PATTERN_CHARS:
        raise ValueError(f"{field}: longer than {MAX_PATTERN_CHARS} characters in all")
    return {"type": "choice", "choice": list(dict.fromkeys(choices))}


_NORMALIZERS = {"json": _json, "json_object": _json_object, "regex": _regex, "choice": _choice, "grammar": _grammar,
                "structural_tag": normalize_structural_tag_text}


__all__ = [
    "FIELD",
    "GUIDED_FIELDS",
    "KINDS",
    "MAX_PATTERN_CHARS",
    "lift_guided_fields",
    "normalize_structured_outputs",
]
