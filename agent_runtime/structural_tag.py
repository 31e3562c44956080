"""vLLM's structural tags: a reply that is free text, except where it writes one of the
``triggers``; from there the structure that trigger starts (its ``begin`` text, then JSON
matching its ``schema``, then its ``end`` text) is enforced, after which the text is free again.

vLLM 0.32 takes a structural tag in three spellings, all served here:

* ``response_format: {"type": "structural_tag", "structures": [{"begin": "<function=f>",
  "schema": {...}, "end": "</function>"}], "triggers": ["<function="]}`` (the legacy form,
  vLLM's ``LegacyStructuralTagResponseFormat``);
* ``response_format: {"type": "structural_tag", "format": {...}}`` (xgrammar's structural-tag
  format: ``triggered_tags``, ``tag``, ``sequence``, ``const_string``, ``json_schema``, ...;
  vLLM's ``StructuralTagResponseFormat``);
* ``structured_outputs: {"structural_tag": "<JSON text>"}``, the JSON text of either of the two
  (vLLM's ``StructuredOutputsParams.structural_tag`` is a string).

Each normalises to one dict, ``{"type": "structural_tag", ...}`` with the spec's keys, which
:func:`structural_tag_grammar` turns into the grammar as vLLM's xgrammar backend does
(``vllm/v1/structured_output/backend_xgrammar.py``: ``compile_grammar`` reads ``"structures" in
s_tag`` as the legacy form, a list of ``xgr.StructuralTagItem`` and the triggers, and anything
else as the structural-tag JSON). The normalised form of a ``response_format`` is itself a valid
``response_format`` (normalising it again gives it back).

The grammar's JSON follows xgrammar's own rules for a structural tag (vLLM's grammar, whitespace
included), not the whitespace-free JSON of this server's other grammars.

Every error is a :class:`ValueError` whose text starts with the field
(``"response_format.triggers: ..."``, ``"structured_outputs.structural_tag: ..."``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agent_runtime.constrained import load_xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

TYPE = "structural_tag"
#: vLLM's nesting limit of a structural tag's JSON: a schema's 64 levels of objects and arrays
#: (``MAX_STRUCTURED_OUTPUT_JSON_NESTING``) and 16 of the tag around it
#: (``STRUCTURAL_TAG_WRAPPER_NESTING``; vllm/sampling_params.py ``check_json_nesting``).
MAX_NESTING = 64 + 16


def _nested_deeper_than(spec: Any, limit: int) -> bool:
    """Whether ``spec`` nests objects and arrays more than ``limit`` levels deep (iterative: a
    deep spec never reaches Python's recursion limit)."""
    level = [spec] if isinstance(spec, dict | list) else []
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, dict | list)]
        if not level:
            return False
    return bool(level)


def _check_nesting(spec: Any, field: str) -> None:
    """Reject a tag nested deeper than vLLM allows (:data:`MAX_NESTING`)."""
    if _nested_deeper_than(spec, MAX_NESTING):
        raise ValueError(f"{field}: nested too deeply: objects and arrays may nest at most {MAX_NESTING} levels")


def _check_strings(value: Any, field: str) -> list[str]:
    """``value`` if it is a list of strings, else a ``ValueError`` naming ``field``."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field}: must be a list of strings")
    return value


def _check_legacy(spec: Mapping[str, Any], field: str, schema_types: tuple[type, ...]) -> None:
    """The legacy form's shape: ``structures`` (each ``begin``, ``schema``, ``end``) and
    ``triggers``; xgrammar judges the rest (empty lists, a tag no trigger starts)."""
    structures = spec.get("structures")
    if not isinstance(structures, list):
        raise ValueError(f"{field}.structures: must be a list of {{begin, schema, end}} objects")
    for i, item in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}: must be an object with begin, schema and end")
        for key in ("begin", "end"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key}: must be a string")
        if not isinstance(item.get("schema"), schema_types):
            raise ValueError(f"{where}.schema: must be a JSON schema object")
    if "triggers" not in spec:
        raise ValueError(f"{field}.triggers: missing (the legacy form takes structures and triggers)")
    _check_strings(spec["triggers"], f"{field}.triggers")


def _first_line(exc: Exception) -> str:
    """An xgrammar (or pydantic) error's reason, on one line of 300 characters at most."""
    # NOTE: xgrammar prefixes "[time] /path/file.cc:line: " and pydantic spreads its reason
    # over lines; the client needs the reason, on one line
    text = " ".join(str(exc).split())
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text[:300] or type(exc).__name__


def _build(xgr_module: Any, text: str) -> xgr.Grammar:
    """The grammar of a structural tag's JSON text, as vLLM's xgrammar backend builds it
    (``compile_grammar``: the legacy form when the object has ``structures``).

    Raises:
        Exception: whatever xgrammar raises for a tag it cannot build (a missing key, a bad
            schema, a tag no trigger starts).
    """
    spec = json.loads(text)
    if "structures" in spec:
        items = [xgr_module.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in spec["structures"]]
        return xgr_module.Grammar.from_structural_tag(items, spec["triggers"])
    return xgr_module.Grammar.from_structural_tag(text)


@functools.lru_cache(maxsize=256)
def _grammar_error(text: str) -> str | None:
    """Why xgrammar cannot build the tag of ``text`` (None: it can); cached per text."""
    try:
        _build(importlib.import_module("xgrammar"), text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, pydantic's and TypeError
        return _first_line(exc)
    return None


def _check_compiles(spec: Mapping[str, Any], field: str) -> None:
    """Reject a structural tag xgrammar cannot build (checked when xgrammar is installed, so a bad
    tag is a client error before anything runs, as vLLM's ``validate_structural_tag_payload``)."""
    if importlib.util.find_spec("xgrammar") is None:
        return
    error = _grammar_error(json.dumps(spec))
    if error is not None:
        raise ValueError(f"{field}: not a structural tag constrained decoding can use: {error}")


def normalize_structural_tag_format(response_format: Mapping[str, Any], field: str = "response_format") -> dict[str, Any]:
    """Validate a ``response_format`` of type ``structural_tag``, in either of vLLM's forms.

    As vLLM's ``validate_structural_tag_response_format``
    (vllm/entrypoints/generate/base/protocol.py): the legacy form (``structures`` and
    ``triggers``) when it has ``structures``, else xgrammar's (``format``); the whole value is then
    what xgrammar builds (other keys are kept, as vLLM's models keep them and xgrammar ignores
    them).

    Args:
        response_format: the value given (its ``type`` is ``structural_tag``).
        field: the request field it came from.

    Returns:
        The normalised form: a copy of the value.

    Raises:
        ValueError: naming ``field`` or the offending key below it.
    """
    if "structures" in response_format:
        # NOTE: vLLM reads a value with 'format' as its StructuralTagResponseFormat, whose other
        # keys it keeps: its backend then builds their legacy 'structures' as given (a boolean
        # schema too); without 'format', its LegacyStructuralTag takes an object schema only
        _check_legacy(response_format, field, (Mapping, bool) if "format" in response_format else (Mapping,))
    elif "format" not in response_format:
        raise ValueError(f"{field}: a structural_tag takes either 'format' (xgrammar's structural tag) or "
                         "'structures' and 'triggers'")
    spec = {**response_format, "type": TYPE}
    _check_nesting(spec, field)
    _check_compiles(spec, field)
    return spec


def normalize_structural_tag_text(text: Any, field: str = "structured_outputs.structural_tag") -> dict[str, Any]:
    """Validate ``structured_outputs.structural_tag``: the JSON text of a structural tag.

    As vLLM's ``validate_structured_outputs_structural_tag`` and its xgrammar backend read it:
    a non-empty string (vllm/sampling_params.py), whose JSON is an object; one with
    ``structures`` is the legacy form (its ``type`` is not read), any other xgrammar's
    structural tag (whose ``type``, if given, is ``structural_tag``).

    Args:
        text: the value given.
        field: the request field it came from.

    Returns:
        The normalised form (``{"type": "structural_tag", ...}``).

    Raises:
        ValueError: naming ``field`` (or a key below it).
    """
    if not isinstance(text, str):
        raise ValueError(f"{field}: must be the JSON text of a structural tag (a string), got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{field}: must not be empty")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: not valid JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise ValueError(f"{field}: nested too deeply: objects and arrays may nest at most {MAX_NESTING} "
                         "levels") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(spec).__name__}")
    _check_nesting(spec, field)
    if "structures" in spec:
        # NOTE: vLLM's backend reads the legacy form's items as given: a boolean schema is
        # one xgrammar takes
        _check_legacy(spec, field, (Mapping, bool))
        spec = {**spec, "type": TYPE}
    elif spec.get("type", TYPE) != TYPE:
        raise ValueError(f"{field}.type: must be {TYPE!r} (or left out), got {spec['type']!r}")
    else:
        spec = {**spec, "type": TYPE}
    _check_compiles(spec, field)
    return spec


def structural_tag_grammar(spec: Mapping[str, Any]) -> xgr.Grammar:
    """The grammar of a normalised structural tag, built as vLLM's xgrammar backend builds it.

    Args:
        spec: :func:`normalize_structural_tag_format`'s or :func:`normalize_structural_tag_text`'s
            result.

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: xgrammar is not installed, or cannot build it.
    """
    xgr_module = load_xgrammar("response_format")
    try:
        return _build(xgr_module, json.dumps(spec))
    except Exception as exc:  # noqa: BLE001 - see _grammar_error
        raise ValueError(f"response_format: not a structural tag constrained decoding can use: "
                         f"{_first_line(exc)}") from None


__all__ = ["MAX_NESTING", "TYPE", "normalize_structural_tag_format", "normalize_structural_tag_text",
           "structural_tag_grammar"]
