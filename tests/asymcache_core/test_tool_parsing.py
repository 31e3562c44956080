"""Tool-call parsing: Hermes tags, mini-swe-agent bash blocks, OpenAI structures."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.llama3_calls import parse_llama3_json, render_llama3_json_tool_calls
from asymcache_core.tool_parsing import (
    ParsedMessage,
    ParsedToolCall,
    from_openai_tool_calls,
    parse_bash_block,
    parse_hermes,
    parse_tool_calls,
    render_hermes_tool_calls,
    to_openai_tool_calls,
)


def ids():  # noqa: ANN201 - deterministic id factory for exact comparisons
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_single_hermes_call_with_text() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msg = parse_hermes(text, ids())
    assert msg == ParsedMessage(
        "Let me check.", [ParsedToolCall("call_0", "get_weather", {"city": "Paris"})]
    )


def test_several_calls_and_variants() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        "middle\n"
        '<tool_call>{"name": "b", "parameters": {"y": [1, 2]}}</tool_call>'
        '<tool_call>{"name": "c", "arguments": "{\\"z\\": true}"}</tool_call>'
        '<tool_call>{"name": "d"}</tool_call>'
        '<tool_call>[{"name": "e", "arguments": {}}, {"name": "f", "arguments": {}}]</tool_call>'
    )
    msg = parse_hermes(text, ids())
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [1, 2]}),
        ("c", {"z": True}),
        ("d", {}),
        ("e", {}),
        ("f", {}),
    ]
    assert [c.id for c in msg.tool_calls] == [f"call_{i}" for i in range(6)]
    # vLLM's hermes parser: the content is the text before the first call, none between them
    assert msg.content == ""
    assert parse_hermes("Reading both.\n" + text + "\nDone.", ids()).content == "Reading both."


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',  # unbalanced
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # args not an object
        '<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>',
        '<tool_call>"just a string"</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",  # deep nesting
    ],
)
def test_malformed_json_is_not_a_call(bad: str) -> None:
    msg = parse_hermes(f"before {bad} after")
    assert msg.tool_calls == []
    assert msg.content == f"before {bad} after"


def test_malformed_tag_kept_next_to_good_call() -> None:
    text = (
        '<tool_call>{oops}</tool_call> then <tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    )
    msg = parse_hermes(text, ids())
    assert [c.name for c in msg.tool_calls] == ["ok"]
    # the content is the text before the first tag (vLLM's), malformed markup included
    assert msg.content == ""
    nested = parse_hermes('Hm. <tool_call>junk <tool_call>{"name": "ok"}</tool_call>', ids())
    assert [c.name for c in nested.tool_calls] == ["ok"]
    assert nested.content == "Hm."


def test_unclosed_final_tag() -> None:
    ok = parse_hermes('Sure <tool_call>\n{"name": "a", "arguments": {"k": "v"}}\n', ids())
    assert ok.tool_calls == [ParsedToolCall("call_0", "a", {"k": "v"})]
    assert ok.content == "Sure"
    cut = parse_hermes('Sure <tool_call>\n{"name": "a", "argu', ids())
    assert cut.tool_calls == [] and cut.content == 'Sure <tool_call>\n{"name": "a", "argu'


def test_bash_block() -> None:
    text = "THOUGHT: list files.\n\n```bash\nls -la\n```\n"
    msg = parse_bash_block(text, ids())
    assert msg == ParsedMessage(
        "THOUGHT: list files.", [ParsedToolCall("call_0", "bash", {"command": "ls -la"})]
    )
    multi = "```bash\ncd /x && \\\n  make test\n```"
    assert parse_bash_block(multi).tool_calls[0].arguments == {
        "command": "cd /x && \\\n  make test"
    }
    for bad in ("no block", "```bash\nls\n```\n```bash\npwd\n```", "```python\nprint(1)\n```"):
        res = parse_bash_block(bad)
        assert res.tool_calls == [] and res.format_error and res.content == bad.strip()


def test_parse_tool_calls_modes() -> None:
    hermes = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    bash = "```bash\nls\n```"
    assert parse_tool_calls(hermes, "auto").tool_calls[0].name == "a"
    assert parse_tool_calls(bash, "auto").tool_calls[0].name == "bash"
    assert parse_tool_calls(bash, "hermes").tool_calls == []
    plain = parse_tool_calls("just text", "auto")
    assert plain == ParsedMessage("just text", [], None)
    assert parse_tool_calls("just text", "bash_block").format_error


def test_openai_round_trip() -> None:
    calls = [ParsedToolCall("call_1", "f", {"a": 1, "s": "é"}), ParsedToolCall("call_2", "g", {})]
    oai = to_openai_tool_calls(calls)
    assert oai[0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1, "s": "é"}'},
    }
    assert from_openai_tool_calls(oai) == calls
    # Arguments as an object, missing id, empty string arguments.
    got = from_openai_tool_calls(
        [
            {"function": {"name": "h", "arguments": {"x": 2}}},
            {"function": {"name": "k", "arguments": ""}},
        ],
        ids(),
    )
    assert got == [ParsedToolCall("call_0", "h", {"x": 2}), ParsedToolCall("call_1", "k", {})]
    # arguments that are no JSON object read as {} (vLLM's: a cut-off call in the history)
    assert [c.arguments for c in from_openai_tool_calls([
        {"id": "x", "function": {"name": "f", "arguments": a}} for a in ("{bad", "[1]", 3)])] == [{}, {}, {}]
    with pytest.raises(ValueError, match=r"tool_calls\[0\].type"):
        from_openai_tool_calls([{"type": "custom", "function": {"name": "f"}}])
    with pytest.raises(ValueError, match=r"tool_calls\[1\].function.name"):
        from_openai_tool_calls([oai[0], {"function": {}}])


def test_to_openai_message() -> None:
    msg = ParsedMessage("", [ParsedToolCall("c", "f", {})])
    assert msg.to_openai_message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert ParsedMessage("hi").to_openai_message() == {"role": "assistant", "content": "hi"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True),
            st.dictionaries(st.text(max_size=6), json_values, max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
    prefix=st.text(max_size=20).filter(lambda s: "<tool_call>" not in s and "```" not in s),
)
def test_render_then_parse_round_trip(calls: list[tuple[str, dict]], prefix: str) -> None:
    parsed = [ParsedToolCall(f"id{i}", n, a) for i, (n, a) in enumerate(calls)]
    text = prefix + "\n" + render_hermes_tool_calls(parsed)
    msg = parse_hermes(text, ids())
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [(n, a) for n, a in calls]
    assert msg.content == prefix.strip() or "\n\n" in prefix


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":,tool_cal bash`\n\\')), max_size=80))
def test_parser_never_raises(text: str) -> None:
    for fmt in ("hermes", "llama3_json", "bash_block", "auto"):
        msg = parse_tool_calls(text, fmt)  # type: ignore[arg-type]
        assert isinstance(msg, ParsedMessage)
        for c in msg.tool_calls:
            json.dumps(c.arguments)


def test_llama3_json_calls_are_read_where_they_are() -> None:
    one = parse_llama3_json('{"name": "read_file", "parameters": {"path": "a.txt"}}', ids())
    assert one.content == "" and [(c.id, c.name, c.arguments) for c in one.tool_calls] == [
        ("call_0", "read_file", {"path": "a.txt"})]
    several = parse_llama3_json(' <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}\n',
                                ids())
    assert [(c.name, c.arguments) for c in several.tool_calls] == [("f", {}), ("g", {"x": 1})]
    assert [c.name for c in parse_llama3_json('[{"name": "f", "parameters": {}}]').tool_calls] == ["f"]
    # vLLM's llama3_json reads calls anywhere (text around them is not content but what leads them)
    around = parse_llama3_json('I will call {"name": "f", "parameters": {}} then more')
    assert [c.name for c in around.tool_calls] == ["f"] and around.content == "I will call"
    for text in ('{"answer": 4}', '{"name": "f"', '{"name": "f"}', "plain words ", ""):
        msg = parse_llama3_json(text)
        assert msg.tool_calls == [] and msg.content == text, text
    assert parse_tool_calls('{"name": "f", "parameters": {}}', "llama3_json").tool_calls[0].name == "f"
    # hermes does not read Llama's JSON; llama3_json reads a call object wherever it is (vLLM's)
    assert parse_tool_calls('{"name": "f", "parameters": {}}', "hermes").tool_calls == []
    tagged = parse_llama3_json('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert [c.name for c in tagged.tool_calls] == ["f"] and tagged.content == "<tool_call>"


@given(calls=st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True),
                                st.dictionaries(st.text(max_size=6), json_values, max_size=3)), min_size=1, max_size=3))
def test_llama3_json_render_then_parse_round_trip(calls: list[tuple[str, dict]]) -> None:
    parsed = [ParsedToolCall(f"id{i}", n, a) for i, (n, a) in enumerate(calls)]
    msg = parse_llama3_json(render_llama3_json_tool_calls(parsed), ids())
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [(n, a) for n, a in calls] and msg.content == ""
