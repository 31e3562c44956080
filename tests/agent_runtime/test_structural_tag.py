"""Structural tags (vLLM 0.32's ``response_format: {"type": "structural_tag", ...}`` in its legacy
and xgrammar forms, and ``structured_outputs: {"structural_tag": "<JSON text>"}``).

Validation needs no model: a malformed tag is a ``ValueError`` naming the field. The processor is
checked on SmolLM2's tokens (free text outside the trigger is not masked; after it only the
begin's rest and the schema's JSON are allowed; JSON against the schema is refused), then the
real model's greedy replies on both endpoints, streamed, with ``n`` > 1 and in Python: a
few-shot prompt makes the model write the trigger, and the schema's ``enum`` turns the city it
would write (Berlin) into one the schema allows.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

from agent_runtime.grammar_cache import GrammarCache, make_request_processor  # noqa: E402
from agent_runtime.protocol import normalize_response_format  # noqa: E402
from agent_runtime.runtime import AgentRuntime  # noqa: E402
from agent_runtime.structural_tag import MAX_NESTING  # noqa: E402
from agent_runtime.structured_outputs import normalize_structured_outputs  # noqa: E402
from tests.agent_runtime import test_response_format  # noqa: E402
from tests.agent_runtime.test_response_format import _clean  # noqa: E402

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"]}
BEGIN, END, TRIGGER = "<function=get_weather>", "</function>", "<function="
LEGACY: dict[str, Any] = {"type": "structural_tag", "structures": [{"begin": BEGIN, "schema": SCHEMA, "end": END}],
                          "triggers": [TRIGGER]}
FORMAT: dict[str, Any] = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": [TRIGGER],
    "tags": [{"begin": BEGIN, "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": END}]}}
CALL = re.compile(re.escape(BEGIN) + "(.*?)" + re.escape(END), re.S)
TOOL = {"type": "function", "function": {"name": "get_color", "parameters": {
    "type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}}}
FEW_SHOT = ('Q: What is the weather in Paris?\nA: <function=get_weather>{"city": "Paris"}</function>\n'
            'Q: What is the weather in Rome?\nA: <function=get_weather>{"city": "Rome"}</function>\n'
            'Q: What is the weather in Berlin?\nA:')
CHAT_SHOTS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": '<function=get_weather>{"city": "Paris"}</function>'},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": '<function=get_weather>{"city": "Rome"}</function>'},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


def _every_form() -> list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
    """(name, response_format, structured_outputs) of the same tag in each spelling."""
    return [("legacy", LEGACY, None), ("format", FORMAT, None),
            ("text-legacy", None, {"structural_tag": json.dumps(LEGACY)}),
            ("text-format", None, {"structural_tag": json.dumps(FORMAT)})]


def _normalized(response_format: Any, structured_outputs: Any, tool_choice: Any = None) -> dict[str, Any]:
    out = normalize_response_format(response_format, tool_choice) or normalize_structured_outputs(
        structured_outputs, tool_choice)
    assert out is not None
    return out


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return node


# ------------------------------------------------------------------------------------------------
# Validation (no model)
# ------------------------------------------------------------------------------------------------


def test_each_form_normalizes_and_a_normalized_format_normalizes_to_itself() -> None:
    for tag in (LEGACY, FORMAT):
        out = normalize_response_format(tag)
        assert out == tag and normalize_response_format(out) == out
        assert normalize_structured_outputs({"structural_tag": json.dumps(tag)}) == tag
    # the text's legacy form need not say its type (vLLM's backend reads "structures" alone)
    bare = {k: v for k, v in LEGACY.items() if k != "type"}
    assert normalize_structured_outputs({"structural_tag": json.dumps(bare)}) == LEGACY
    # keys vLLM passes on are kept (xgrammar ignores them)
    assert normalize_response_format({**FORMAT, "note": 1})["note"] == 1


PY_BAD: list[tuple[str, Any, Any, str]] = [
    ("text-not-json", None, {"structural_tag": "{not json"}, r"^structured_outputs\.structural_tag: not valid JSON"),
    ("text-empty", None, {"structural_tag": ""}, r"^structured_outputs\.structural_tag: must not be empty"),
    ("text-blank", None, {"structural_tag": "  \n"}, r"^structured_outputs\.structural_tag: must not be empty"),
    ("text-object", None, {"structural_tag": FORMAT}, r"^structured_outputs\.structural_tag: must be the JSON text"),
    ("text-list", None, {"structural_tag": "[1]"}, r"^structured_outputs\.structural_tag: must be a JSON object"),
    ("text-no-format", None, {"structural_tag": "{}"}, r"^structured_outputs\.structural_tag: not a structural tag"),
    ("text-type", None, {"structural_tag": json.dumps({**FORMAT, "type": "json"})},
     r"^structured_outputs\.structural_tag\.type: must be 'structural_tag'"),
    ("text-no-triggers", None, {"structural_tag": json.dumps({"structures": LEGACY["structures"]})},
     r"^structured_outputs\.structural_tag\.triggers: missing"),
    ("text-and-regex", None, {"structural_tag": json.dumps(FORMAT), "regex": "a"},
     r"^structured_outputs: one constraint at most"),
    ("no-triggers", {"type": "structural_tag", "structures": LEGACY["structures"]}, None,
     r"^response_format\.triggers: missing"),
    ("no-structures", {"type": "structural_tag", "triggers": [TRIGGER]}, None,
     r"^response_format: a structural_tag takes either 'format'"),
    ("structures-object", {**LEGACY, "structures": {"begin": BEGIN}}, None, r"^response_format\.structures: must be"),
    ("begin-int", {**LEGACY, "structures": [{"begin": 1, "schema": SCHEMA, "end": END}]}, None,
     r"^response_format\.structures\[0\]\.begin: must be a string"),
    ("schema-missing", {**LEGACY, "structures": [{"begin": BEGIN, "end": END}]}, None,
     r"^response_format\.structures\[0\]\.schema: must be a JSON schema object"),
    ("triggers-str", {**LEGACY, "triggers": TRIGGER}, None, r"^response_format\.triggers: must be a list of strings"),
    ("schema-refused", {**LEGACY, "structures": [{"begin": BEGIN, "schema": {"type": "strng"}, "end": END}]}, None,
     r"^response_format: not a structural tag constrained decoding can use"),
    ("no-matching-trigger", {**LEGACY, "triggers": ["<tool>"]}, None,
     r"^response_format: not a structural tag .*does not match any trigger"),
    ("empty-structures", {**LEGACY, "structures": []}, None, r"^response_format: not a structural tag"),
    ("format-bogus", {"type": "structural_tag", "format": {"type": "bogus"}}, None,
     r"^response_format: not a structural tag .*bogus"),
    ("format-schema-refused", {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "strng"}}}, None, r"^response_format: not a structural tag"),
    ("too-deep", {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": _deep(MAX_NESTING)}},
     None, r"^response_format: nested too deeply"),
    ("text-too-deep", None, {"structural_tag": "[" * 100_000}, r"^structured_outputs\.structural_tag: nested too"),
]


@pytest.mark.parametrize("response_format,structured_outputs,error", [c[1:] for c in PY_BAD],
                         ids=[c[0] for c in PY_BAD])
def test_a_malformed_tag_is_a_value_error_naming_the_field(response_format: Any, structured_outputs: Any,
                                                           error: str) -> None:
    with pytest.raises(ValueError, match=error):
        _normalized(response_format, structured_outputs)


def test_a_forced_tool_choice_is_refused_and_auto_leaves_tool_calls_free(smollm) -> None:
    for _, rf, so in _every_form():
        with pytest.raises(ValueError, match=r"^(response_format|structured_outputs): .*forces a tool call"):
            _normalized(rf, so, "required")
    cache = GrammarCache(max_threads=1)
    with pytest.raises(ValueError, match=r"^response_format: a structural tag .*forces a tool call"):
        make_request_processor(cache, smollm.tokenizer, [TOOL], "required", LEGACY, vocab_size=49152)
    # under auto the tag alone constrains (vLLM's): a tool call is free text outside its triggers
    proc = make_request_processor(cache, smollm.tokenizer, [TOOL], "auto", LEGACY, vocab_size=49152)
    assert proc is not None
    matcher = xgr.GrammarMatcher(proc._compiled)
    call = '<tool_call>\n{"name": "get_color", "arguments": {"fruit": "kiwi"}}\n</tool_call>'
    assert matcher.accept_string(call) and matcher.accept_token(proc.stop_token_ids[0])


# ------------------------------------------------------------------------------------------------
# The processor on SmolLM2's tokens
# ------------------------------------------------------------------------------------------------


def _allowed(proc: Any, seen: list[int]) -> list[int]:
    """The tokens the processor leaves unmasked after ``seen`` (its real masking path)."""
    logits = proc(list(seen), torch.zeros(proc.vocab_size))
    return torch.isfinite(logits).nonzero().flatten().tolist()


@pytest.mark.parametrize("response_format,structured_outputs", [c[1:] for c in _every_form()],
                         ids=[c[0] for c in _every_form()])
def test_the_processor_frees_text_outside_the_trigger_and_holds_the_structure_in_it(
        smollm, response_format: Any, structured_outputs: Any) -> None:
    tok = smollm.tokenizer
    cache = GrammarCache(max_threads=1)
    spec = _normalized(response_format, structured_outputs)

    def fresh() -> Any:
        proc = make_request_processor(cache, tok, [], "auto", spec, vocab_size=49152)
        assert proc is not None
        return proc

    # (a) free text: nearly every token is allowed, EOS too, and the text is taken as written
    proc = fresh()
    free = tok.encode("Sure, it is sunny in Berlin today.", add_special_tokens=False)
    assert len(_allowed(proc, [])) > 0.95 * 49152
    for i in range(len(free)):
        assert free[i] in _allowed(proc, free[:i])
    assert proc.stop_token_ids[0] in _allowed(proc, free) and not proc.failed

    # (b) once the trigger is written, only the begin's rest, then the schema's JSON, may follow
    proc = fresh()
    seen = tok.encode("Let me check. <function=", add_special_tokens=False)
    assert tok.decode(seen).endswith(TRIGGER)
    rest = BEGIN[len(TRIGGER):]
    allowed = [tok.decode([t]) for t in _allowed(proc, seen)]
    assert allowed and all(rest.startswith(s) or s.startswith(rest) for s in allowed), allowed[:20]
    seen = seen + tok.encode(rest, add_special_tokens=False)
    json_starts = [tok.decode([t]) for t in _allowed(proc, seen)]
    assert json_starts and all(s.startswith("{") for s in json_starts), json_starts[:20]
    seen = seen + tok.encode('{"city": "', add_special_tokens=False)
    cities = [tok.decode([t]) for t in _allowed(proc, seen)]
    assert cities and all("Paris".startswith(s) or "Rome".startswith(s) for s in cities), cities
    assert proc.stop_token_ids[0] not in _allowed(proc, seen)  # no EOS inside the structure

    # a JSON the schema allows completes the structure and the text is free again after it
    proc = fresh()
    good = tok.encode(f'Let me check. {BEGIN}{{"city": "Rome"}}{END} Done.', add_special_tokens=False)
    proc.keep_words(good, proc.vocab_size)
    assert not proc.failed and proc.stop_token_ids[0] in _allowed(proc, good)

    # (c) a JSON violating the schema is refused: the first token the schema does not allow (in
    # the city's value) is masked
    proc = fresh()
    bad = tok.encode(f'{BEGIN}{{"city": "Berlin"}}{END}', add_special_tokens=False)
    masked = [i for i in range(len(bad)) if bad[i] not in _allowed(proc, bad[:i])]
    assert masked
    assert '"city": "' in tok.decode(bad[: masked[0]]) and "Berlin" not in tok.decode(bad[: masked[0]])
    proc = fresh()
    proc.keep_words(bad, proc.vocab_size)
    assert proc.failed  # fed anyway, the processor gives up: only EOS is allowed
    assert _allowed(proc, bad) == sorted(proc.stop_token_ids)


# ------------------------------------------------------------------------------------------------
# The real model, over HTTP and in Python
# ------------------------------------------------------------------------------------------------

# NOTE: the greedy server of the response_format tests (module-scoped: one for this module)
runtime = test_response_format.runtime
client = test_response_format.client


def _calls(text: str) -> list[dict[str, Any]]:
    """The JSON of every structure in ``text``, each validated against the schema."""
    found = [json.loads(body) for body in CALL.findall(text)]
    for call in found:
        jsonschema.validate(call, SCHEMA)
    return found


def test_completions_hold_the_structure_where_the_model_triggers_it(client: TestClient, runtime: AgentRuntime) -> None:
    def complete(**extra: Any) -> list[dict[str, Any]]:
        body = {"model": MODEL, "prompt": FEW_SHOT, "max_tokens": 18, **extra}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    free = complete()[0]["text"]
    assert '<function=get_weather>{"city": "Berlin"}' in free  # what the model writes unconstrained
    legacy = complete(n=2, response_format=LEGACY)
    assert len(legacy) == 2 and legacy[0]["text"] == legacy[1]["text"]  # greedy: the same twice
    text = legacy[0]["text"]
    assert complete(structured_outputs={"structural_tag": json.dumps(FORMAT)})[0]["text"] == text
    assert text.startswith(" " + BEGIN) and _calls(text) == [{"city": "Paris"}]
    # after the end tag the text is free again: the model goes on as it would
    after, free_after = text.split(END, 1)[1], free.split(END, 1)[1]
    assert after.startswith("\nQ") and (after.startswith(free_after) or free_after.startswith(after))
    _clean(runtime)


def test_chat_holds_the_structure_streamed_and_not(client: TestClient, runtime: AgentRuntime) -> None:
    body = {"model": MODEL, "messages": CHAT_SHOTS, "max_tokens": 20}
    r = client.post(CHAT, json={**body, "response_format": FORMAT})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert BEGIN in content and _calls(content) == [{"city": "Paris"}]
    text_form = {"structured_outputs": {"structural_tag": json.dumps(LEGACY)}}
    with client.stream("POST", CHAT, json={**body, **text_form, "stream": True, "n": 2}) as s:
        frames = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    said = ["", ""]
    for frame in frames[:-1]:
        for c in json.loads(frame)["choices"]:
            said[c["index"]] += c["delta"].get("content") or ""
    assert said == [content, content]
    _clean(runtime)


def test_the_python_api_takes_both_fields(runtime: AgentRuntime) -> None:
    async def run() -> tuple[str, str]:
        one = await runtime.chat(CHAT_SHOTS, max_tokens=24, response_format=FORMAT)
        two = await runtime.chat(CHAT_SHOTS, max_tokens=24, structured_outputs={"structural_tag": json.dumps(LEGACY)})
        return one.text, two.text

    one, two = asyncio.run(run())
    assert one == two and _calls(one) == [{"city": "Paris"}]

    async def bad() -> None:
        await runtime.chat(CHAT_SHOTS, max_tokens=4, structured_outputs={"structural_tag": ""})

    with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag: must not be empty"):
        asyncio.run(bad())
    _clean(runtime)


HTTP_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("text-not-json", {"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag"),
    ("text-empty", {"structured_outputs": {"structural_tag": ""}}, "structured_outputs.structural_tag"),
    ("text-object", {"structured_outputs": {"structural_tag": FORMAT}}, "structured_outputs.structural_tag"),
    ("no-triggers", {"response_format": {"type": "structural_tag", "structures": LEGACY["structures"]}},
     "response_format.triggers"),
    ("no-structures", {"response_format": {"type": "structural_tag", "triggers": [TRIGGER]}}, "response_format"),
    ("schema-refused", {"response_format": {**LEGACY, "structures": [
        {"begin": BEGIN, "schema": {"type": "strng"}, "end": END}]}}, "response_format"),
    ("begin-int", {"response_format": {**LEGACY, "structures": [{"begin": 1, "schema": SCHEMA, "end": END}]}},
     "response_format.structures[0].begin"),
    ("forced-tool", {"response_format": LEGACY, "tools": [TOOL], "tool_choice": "required"}, "response_format"),
    ("forced-tool-text", {"structured_outputs": {"structural_tag": json.dumps(LEGACY)}, "tools": [TOOL],
                          "tool_choice": {"type": "function", "function": {"name": "get_color"}}}, "structured_outputs"),
    ("with-regex", {"structured_outputs": {"structural_tag": json.dumps(LEGACY), "regex": "a"}}, "structured_outputs"),
]


@pytest.mark.parametrize("extra,param", [c[1:] for c in HTTP_BAD], ids=[c[0] for c in HTTP_BAD])
def test_a_malformed_tag_is_a_400_naming_the_field(client: TestClient, extra: dict[str, Any], param: str) -> None:
    for path, body in ((CHAT, {"messages": CHAT_SHOTS}), ("/v1/completions", {"prompt": FEW_SHOT})):
        if "tools" in extra and path != CHAT:
            continue
        r = client.post(path, json={"model": MODEL, "max_tokens": 2, **body, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":"), error
