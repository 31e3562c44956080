"""Our structural-tag validation accepts and refuses the specs vLLM 0.32 does, with the same
xgrammar (that of ``.venv-vllm``): ``response_format`` as vLLM's
``validate_structural_tag_response_format`` and its ``ChatCompletionRequest`` /
``CompletionRequest`` read it, ``structured_outputs.structural_tag`` as
``validate_structured_outputs_structural_tag`` (vllm/entrypoints/generate/base/protocol.py).
No model is loaded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm.entrypoints.generate.base.protocol import (
    validate_structural_tag_response_format,
    validate_structured_outputs_structural_tag,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from agent_runtime.protocol import normalize_response_format
from agent_runtime.structured_outputs import normalize_structured_outputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ITEM = {"begin": "<function=f>", "schema": SCHEMA, "end": "</function>"}
LEGACY = {"type": "structural_tag", "structures": [ITEM], "triggers": ["<function="]}
TAGS = {"type": "triggered_tags", "triggers": ["<function="],
        "tags": [{"begin": "<function=f>", "content": {"type": "json_schema", "json_schema": SCHEMA},
                  "end": "</function>"}]}
FORMAT = {"type": "structural_tag", "format": TAGS}


def _deep_format(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": node}}


RESPONSE_FORMATS: list[tuple[str, dict[str, Any]]] = [
    ("legacy", LEGACY),
    ("legacy-extra-keys", {**LEGACY, "note": 1, "structures": [{**ITEM, "note": 2}]}),
    ("legacy-two", {**LEGACY, "structures": [ITEM, {**ITEM, "begin": "<function=g>"}]}),
    ("format", FORMAT),
    ("format-extra-key", {**FORMAT, "note": 1}),
    ("format-const", {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}),
    ("format-null", {"type": "structural_tag", "format": None}),
    ("format-bogus", {"type": "structural_tag", "format": {"type": "bogus"}}),
    ("format-tag-without-trigger", {"type": "structural_tag", "format": {**TAGS, "triggers": ["<tool>"]}}),
    ("format-schema-refused", {"type": "structural_tag", "format": {"type": "json_schema",
                                                                      "json_schema": {"type": "strng"}}}),
    ("format-with-bad-structures", {**FORMAT, "structures": [{"begin": 1}]}),
    ("format-with-bool-schema-structures", {**FORMAT, **LEGACY, "structures": [{**ITEM, "schema": True}]}),
    ("neither", {"type": "structural_tag"}),
    ("no-triggers", {"type": "structural_tag", "structures": [ITEM]}),
    ("no-structures", {"type": "structural_tag", "triggers": ["<function="]}),
    ("structures-object", {**LEGACY, "structures": ITEM}),
    ("begin-int", {**LEGACY, "structures": [{**ITEM, "begin": 1}]}),
    ("end-missing", {**LEGACY, "structures": [{"begin": "<function=f>", "schema": SCHEMA}]}),
    ("schema-missing", {**LEGACY, "structures": [{"begin": "<function=f>", "end": "</function>"}]}),
    ("schema-null", {**LEGACY, "structures": [{**ITEM, "schema": None}]}),
    ("schema-bool", {**LEGACY, "structures": [{**ITEM, "schema": True}]}),
    ("schema-refused", {**LEGACY, "structures": [{**ITEM, "schema": {"type": "strng"}}]}),
    ("triggers-str", {**LEGACY, "triggers": "<function="}),
    ("triggers-int", {**LEGACY, "triggers": [1]}),
    ("triggers-empty", {**LEGACY, "triggers": []}),
    ("structures-empty", {**LEGACY, "structures": []}),
    ("no-matching-trigger", {**LEGACY, "triggers": ["<tool>"]}),
    # NOTE: _deep_format(n) nests 3 + 2n levels: vLLM's limit (80) lies between 38 and 39
    ("deep-38", _deep_format(38)),
    ("deep-39", _deep_format(39)),
]

TEXTS: list[tuple[str, Any]] = [
    ("legacy", json.dumps(LEGACY)),
    ("legacy-no-type", json.dumps({"structures": [ITEM], "triggers": ["<function="]})),
    ("legacy-other-type", json.dumps({**LEGACY, "type": "json"})),
    ("legacy-bool-schema", json.dumps({**LEGACY, "structures": [{**ITEM, "schema": True}]})),
    ("legacy-null-schema", json.dumps({**LEGACY, "structures": [{**ITEM, "schema": None}]})),
    ("legacy-no-schema", json.dumps({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>"}]})),
    ("legacy-no-triggers", json.dumps({"structures": [ITEM]})),
    ("legacy-item-str", json.dumps({**LEGACY, "structures": ["<f>"]})),
    ("format", json.dumps(FORMAT)),
    ("format-no-type", json.dumps({"format": TAGS})),
    ("format-other-type", json.dumps({**FORMAT, "type": "json"})),
    ("format-bogus", json.dumps({"type": "structural_tag", "format": {"type": "bogus"}})),
    ("format-indented", json.dumps(FORMAT, indent=2)),
    ("empty", ""),
    ("blank", "  \n"),
    ("not-json", "{"),
    ("list", "[]"),
    ("null", "null"),
    ("number", "1"),
    ("string-structures", json.dumps("structures")),
    ("object-empty", "{}"),
    ("not-a-string", FORMAT),
    ("deep-38", json.dumps(_deep_format(38))),
    ("deep-39", json.dumps(_deep_format(39))),
    ("nested-brackets", "[" * 100 + "]" * 100),
]


def _accepted(check: Any, *args: Any) -> bool:
    try:
        check(*args)
    except (ValueError, TypeError, VLLMValidationError):
        return False
    return True


@pytest.mark.parametrize("spec", [s for _, s in RESPONSE_FORMATS], ids=[n for n, _ in RESPONSE_FORMATS])
def test_response_format_is_accepted_as_vllm_accepts_it(spec: dict[str, Any]) -> None:
    theirs = _accepted(validate_structural_tag_response_format, spec)
    body = {"model": "m", "response_format": spec}
    assert _accepted(ChatCompletionRequest.model_validate,
                     {**body, "messages": [{"role": "user", "content": "hi"}]}) is theirs
    assert _accepted(CompletionRequest.model_validate, {**body, "prompt": "hi"}) is theirs
    assert _accepted(normalize_response_format, spec) is theirs


@pytest.mark.parametrize("text", [t for _, t in TEXTS], ids=[n for n, _ in TEXTS])
def test_structured_outputs_text_is_accepted_as_vllm_accepts_it(text: Any) -> None:
    theirs = _accepted(validate_structured_outputs_structural_tag, {"structural_tag": text})
    assert _accepted(normalize_structured_outputs, {"structural_tag": text}) is theirs


def test_the_list_holds_both_outcomes() -> None:
    """A list accepting or refusing everything would prove nothing."""
    outcomes = {_accepted(validate_structural_tag_response_format, s) for _, s in RESPONSE_FORMATS}
    texts = {_accepted(validate_structured_outputs_structural_tag, {"structural_tag": t}) for _, t in TEXTS}
    assert outcomes == texts == {True, False}
