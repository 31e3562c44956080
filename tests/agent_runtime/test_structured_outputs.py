"""vLLM's ``structured_outputs`` (and its older ``guided_*`` fields) on the real SmolLM2.

Each constraint (a list of choices, a regular expression, an EBNF grammar, a JSON schema, any
JSON object) shapes the greedy reply on both endpoints and through the Python API; a malformed
constraint is a 400 naming the key below ``structured_outputs``; an image part, which the
text-only model would never see, is refused rather than dropped.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

xgr = pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

from agent_runtime.grammar_cache import GrammarCache, make_request_processor  # noqa: E402
from agent_runtime.runtime import AgentRuntime  # noqa: E402
from agent_runtime.server import create_app  # noqa: E402
from agent_runtime.structured_outputs import lift_guided_fields, normalize_structured_outputs  # noqa: E402
from asymcache_core.sampling_params import SamplingParams  # noqa: E402
from tests.agent_runtime.test_response_format import _clean  # noqa: E402
from tests.conftest import make_engine  # noqa: E402

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SENTENCE = 'root ::= "The answer is " ("yes" | "no") "."'
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
TOOL = {"type": "function", "function": {"name": "get_color", "parameters": {
    "type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}}}


@pytest.fixture(scope="module")
def runtime(smollm) -> Iterator[AgentRuntime]:
    rt = AgentRuntime(make_engine(smollm, num_kv_blocks=64, max_model_len=512))
    try:
        yield rt
    finally:
        rt.close_sync()


@pytest.fixture(scope="module")
def client(runtime: AgentRuntime) -> Iterator[TestClient]:
    # NOTE: greedy defaults (vLLM's --override-generation-config): these tests compare replies
    with TestClient(create_app(runtime, MODEL, override_generation_config={"temperature": 0})) as c:
        yield c


def _chat(client: TestClient, max_tokens: int = 24, messages: Any = None, **extra: Any) -> dict[str, Any]:
    r = client.post(CHAT, json={"model": MODEL, "messages": messages or QUESTION, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_choice_and_its_older_spelling_give_one_of_the_choices(client: TestClient, runtime: AgentRuntime) -> None:
    choices = ["Yes, it is", "No way"]
    new = _chat(client, structured_outputs={"choice": choices})
    assert new["message"]["content"] in choices and new["finish_reason"] == "stop"
    old = _chat(client, guided_choice=choices)
    assert old["message"] == new["message"]
    _clean(runtime)


def test_regex_reply_matches_whole_and_streams_the_same(client: TestClient, runtime: AgentRuntime) -> None:
    ask = [{"role": "user", "content": "Give me a US phone number."}]
    choice = _chat(client, messages=ask, structured_outputs={"regex": PHONE})
    assert re.fullmatch(PHONE, choice["message"]["content"]), choice
    assert choice["finish_reason"] == "stop"
    body = {"model": MODEL, "messages": ask, "max_tokens": 24, "stream": True, "structured_outputs": {"regex": PHONE}}
    with client.stream("POST", CHAT, json=body) as r:
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == choice["message"]["content"]
    _clean(runtime)


def test_grammar_and_json_constraints(client: TestClient) -> None:
    said = _chat(client, structured_outputs={"grammar": SENTENCE})["message"]["content"]
    assert said in ("The answer is yes.", "The answer is no.")
    for schema in (SCHEMA, json.dumps(SCHEMA)):  # an object, or its JSON text (vLLM takes both)
        jsonschema.validate(json.loads(_chat(client, structured_outputs={"json": schema})["message"]["content"]),
                            SCHEMA)
    assert isinstance(json.loads(_chat(client, structured_outputs={"json_object": True})["message"]["content"]), dict)
    # the whitespace options ask for what the JSON grammars already are
    again = _chat(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True,
                                              "disable_additional_properties": True})
    assert json.loads(again["message"]["content"]) == json.loads(
        _chat(client, structured_outputs={"json": SCHEMA})["message"]["content"])


def test_completions_take_structured_outputs(client: TestClient, runtime: AgentRuntime) -> None:
    def complete(**extra: Any) -> str:
        r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 8, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert complete(prompt="The sky is", structured_outputs={"choice": [" green", " purple"]}) in (" green", " purple")
    assert re.fullmatch(r" [12][0-9]{3}", complete(prompt="The year it happened:", guided_regex=r" [12][0-9]{3}"))
    _clean(runtime)


def test_choices_with_quotes_and_non_ascii_are_exact_and_tools_stay_callable(smollm) -> None:
    cache = GrammarCache(max_threads=1)
    choices = ['say "yes"', "back\\slash", "été\n"]
    constraint = normalize_structured_outputs({"choice": choices})
    assert constraint is not None
    proc = make_request_processor(cache, smollm.tokenizer, [TOOL], "auto", constraint, vocab_size=49152)
    assert proc is not None
    matcher = xgr.GrammarMatcher(proc._compiled)
    call = '<tool_call>\n{"name": "get_color", "arguments": {"fruit": "kiwi"}}\n</tool_call>'
    for text, ok in [*((c, True) for c in choices), (call, True), ("say yes", False), ('say "yes" ', False),
                     ("ete\n", False), ("back", False)]:
        matcher.reset()
        assert (matcher.accept_string(text) and matcher.accept_token(proc.stop_token_ids[0])) is ok, text
    # under tool_choice none the call is out of reach
    only = make_request_processor(cache, smollm.tokenizer, [TOOL], "none", constraint, vocab_size=49152)
    assert only is not None
    assert not xgr.GrammarMatcher(only._compiled).accept_string("<tool_call>")


def test_the_python_api_takes_structured_outputs(runtime: AgentRuntime) -> None:
    async def run() -> tuple[str, str]:
        turn = await runtime.job("so-job").chat(QUESTION, max_tokens=12, structured_outputs={"choice": ["yes", "no"]},
                                                is_last_step=True)
        stream = await runtime.submit("The year:", SamplingParams(max_tokens=8),
                                      structured_outputs={"regex": r" [12][0-9]{3}"})
        return turn.text, (await stream.result()).output.text

    said, year = asyncio.run(run())
    assert said in ("yes", "no")
    assert re.fullmatch(r" [12][0-9]{3}", year)

    async def both() -> None:
        await runtime.chat(QUESTION, max_tokens=4, structured_outputs={"choice": ["a"]},
                           response_format={"type": "json_object"})

    with pytest.raises(ValueError, match=r"^structured_outputs: set either"):
        asyncio.run(both())

    async def forced() -> None:
        await runtime.chat(QUESTION, tools=[TOOL], tool_choice="required", max_tokens=4,
                           structured_outputs={"regex": "a+"})

    with pytest.raises(ValueError, match=r"^structured_outputs: .*forces a tool call"):
        asyncio.run(forced())

    async def image() -> None:
        await runtime.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                         {"type": "image_url", "image_url": {"url": "x.png"}}]}])

    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.type: 'image_url'"):
        asyncio.run(image())
    _clean(runtime)


def test_text_parts_of_every_kind_render_as_their_text(client: TestClient) -> None:
    """OpenAI's ``text`` parts, an assistant's ``refusal`` and the Responses API's
    ``input_text`` / ``output_text`` (which converting clients send in chat messages) are text:
    the reply is the one to the same chat written as strings, the parts joined by newlines
    (vLLM's join)."""
    as_strings = [{"role": "user", "content": "Say\nhi"}, {"role": "assistant", "content": "I can't."},
                  {"role": "user", "content": "Please\nsay hi"}]
    as_parts = [{"role": "user", "content": [{"type": "input_text", "text": "Say"}, {"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
                {"role": "user", "content": [{"type": "text", "text": "Please"}, "say hi"]}]
    assert _chat(client, 6, as_parts)["message"] == _chat(client, 6, as_strings)["message"]
    r = client.post("/tokenize", json={"model": MODEL, "messages": as_parts})
    assert r.json()["tokens"] == client.post("/tokenize", json={"model": MODEL, "messages": as_strings}).json()["tokens"]


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("regex", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ("regex-empty", {"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ("grammar-lark", {"structured_outputs": {"grammar": "start: 'a'"}}, "structured_outputs.grammar"),
    ("grammar-undefined", {"structured_outputs": {"grammar": "root ::= word"}}, "structured_outputs.grammar"),
    ("choice-empty", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("choice-int", {"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice[1]"),
    ("choice-str", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("json-text", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("json-schema", {"structured_outputs": {"json": {"type": "strng"}}}, "structured_outputs.json"),
    ("json-object-false", {"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("json-object-str", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ("none", {"structured_outputs": {}}, "structured_outputs"),
    ("two", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("unknown-key", {"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ("not-object", {"structured_outputs": ["a"]}, "structured_outputs"),
    ("whitespace", {"structured_outputs": {"json_object": True, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("structural-tag", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("option-type", {"structured_outputs": {"json_object": True, "disable_any_whitespace": "no"}},
     "structured_outputs.disable_any_whitespace"),
    ("with-response-format", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("guided-and-new", {"structured_outputs": {"regex": "a"}, "guided_choice": ["x"]}, "guided_choice"),
    ("two-guided", {"guided_regex": "a", "guided_choice": ["x"]}, "guided_choice"),
    ("guided-bad", {"guided_regex": "("}, "structured_outputs.regex"),
    ("guided-backend", {"guided_choice": ["x"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("forced-tool", {"structured_outputs": {"choice": ["a"]}, "tools": [TOOL], "tool_choice": "required"},
     "structured_outputs"),
    ("image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ("part-text", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("part-refusal", {"messages": [{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}]},
     "messages[0].content[0].refusal"),
    ("part-audio", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
]


@pytest.mark.parametrize("extra,param", [(e, p) for _, e, p in BAD], ids=[n for n, _, _ in BAD])
def test_bad_structured_outputs_are_a_400_naming_the_field(client: TestClient, extra: dict[str, Any],
                                                          param: str) -> None:
    r = client.post(CHAT, json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"].startswith(param + ":")


def test_normalized_forms_and_the_guided_lift() -> None:
    assert normalize_structured_outputs(None) is None
    assert normalize_structured_outputs({"choice": ["a", "b", "a"]}) == {"type": "choice", "choice": ["a", "b"]}
    assert normalize_structured_outputs({"regex": "a+", "json_object": False}) == {"type": "regex", "regex": "a+"}
    assert normalize_structured_outputs({"json_object": True}) == {"type": "json_object"}
    as_json = normalize_structured_outputs({"json": json.dumps(SCHEMA)})
    assert as_json is not None and as_json["json_schema"]["schema"] == SCHEMA
    body = {"model": MODEL, "guided_grammar": SENTENCE, "guided_json": None}
    assert lift_guided_fields(body) == {"model": MODEL, "structured_outputs": {"grammar": SENTENCE}}
    assert lift_guided_fields({"model": MODEL}) == {"model": MODEL}
