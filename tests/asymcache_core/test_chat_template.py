"""Chat rendering with SmolLM2's real template (no tools section: our injected tool prompt) and
tiny tokenizers with tool-aware templates (transformers' ``apply_chat_template(tools=...)``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from asymcache_core.chat_template import (
    ChatRenderer,
    detect_tools_support,
    render_chat,
    tools_system_prompt,
)
from asymcache_core.tool_parsing import parse_hermes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# A small tool-aware template in the style of Qwen2.5's (reads ``tools``, knows the tool role).
TOOL_AWARE_TEMPLATE = (
    "{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|tool|>{{ m.content }}\n"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
    "{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(template: str | dict[str, str] | None) -> PreTrainedTokenizerFast:
    """A one-word tokenizer carrying ``template`` (a real HF tokenizer, not a stand-in)."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smol_tokenizer(hf_smollm_tokenizer: Any) -> Any:
    """transformers' tokenizer of the packaged SmolLM2 GGUF (the session's shared copy)."""
    return hf_smollm_tokenizer


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helper."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
    ]


def test_detect_tools_support(smol_tokenizer: Any) -> None:
    assert detect_tools_support(smol_tokenizer) is False
    assert ChatRenderer(smol_tokenizer).native_tools is False
    assert detect_tools_support(tiny_tokenizer(TOOL_AWARE_TEMPLATE)) is True
    assert detect_tools_support(smol_tokenizer, TOOL_AWARE_TEMPLATE) is True  # override
    assert detect_tools_support(tiny_tokenizer(None)) is False
    assert detect_tools_support(tiny_tokenizer("{% for %}")) is False  # does not parse
    # Mentioning the word in text is not rendering tools.
    assert detect_tools_support(tiny_tokenizer("no tools here {{ messages }}")) is False
    # Reading the variable without printing the tools is not a tool section either.
    guard = "{% if tools %}[tools given]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_tools_support(tiny_tokenizer(guard)) is False
    refuses = "{% if tools %}{{ raise_exception('no tools') }}{% endif %}{{ messages[0].content }}"
    assert detect_tools_support(tiny_tokenizer(refuses)) is False
    # Named templates: transformers renders the "tool_use" one when tools are given.
    named = {"default": "{{ messages[0].content }}", "tool_use": TOOL_AWARE_TEMPLATE}
    assert detect_tools_support(tiny_tokenizer(named)) is True


def test_plain_chat_matches_transformers(smol_tokenizer: Any) -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    for agp in (True, False):
        ours = render_chat(smol_tokenizer, msgs, add_generation_prompt=agp)
        ref = smol_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
        assert ours == ref
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_tools_injected_into_smollm2_prompt(smol_tokenizer: Any) -> None:
    prompt = render_chat(smol_tokenizer, conversation(), tools=[WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helper.\n\n# Tools")
    assert json.dumps(WEATHER) in system
    assert "<tool_call>" in system and "SmolLM" not in prompt
    # Assistant tool calls rendered as Hermes tags, parseable back to the same calls.
    assistant = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_hermes(assistant)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    # Both tool results share one user turn, wrapped in <tool_response>.
    assert prompt.count("<|im_start|>user\n") == 2
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
    ) in prompt
    assert "<|im_start|>tool" not in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tools_without_system_message_and_without_tools(smol_tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = render_chat(smol_tokenizer, msgs, tools=[WEATHER])
    assert with_tools.startswith("<|im_start|>system\n" + tools_system_prompt([WEATHER]))
    no_tools = render_chat(smol_tokenizer, msgs, tools=[])
    assert "# Tools" not in no_tools and "SmolLM" in no_tools


def test_prompt_prefix_stable_across_turns(smol_tokenizer: Any) -> None:
    """Turn k's prompt plus the generated call is a prefix of turn k+1's prompt (KV reuse)."""
    renderer = ChatRenderer(smol_tokenizer)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    p1 = renderer.render(msgs, [WEATHER])
    generated = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    call = parse_hermes(generated).to_openai_message()
    msgs += [call, {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    p2 = renderer.render(msgs, [WEATHER])
    assert p2.startswith(p1 + generated + "<|im_end|>\n")


def test_native_template_gets_tools_and_object_arguments() -> None:
    tok = tiny_tokenizer(TOOL_AWARE_TEMPLATE)
    out = render_chat(tok, conversation(), tools=[WEATHER])
    # trim_blocks (as in transformers) eats the newline after a block tag.
    assert out.startswith("<|system|>TOOLS:get_weather;<|system|>You are a helper.\n")
    assert 'get_weather({"city": "Paris"})get_weather({"city": "Rome"})<|tool|>' in out
    assert "<|tool|>sunny\n<|tool|>rain\n" in out
    assert out.endswith("<|assistant|>")


def test_native_named_templates_pick_tool_use_only_with_tools() -> None:
    named = {"default": "plain:{{ messages[0].content }}", "tool_use": TOOL_AWARE_TEMPLATE}
    renderer = ChatRenderer(tiny_tokenizer(named))
    assert renderer.native_tools is True
    msgs = [{"role": "user", "content": "hi"}]
    assert renderer.render(msgs, [WEATHER]) == "<|system|>TOOLS:get_weather;<|user|>hi\n<|assistant|>"
    assert renderer.render(msgs) == "plain:hi"


def test_injected_path_for_a_template_without_tool_section() -> None:
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
    renderer = ChatRenderer(tiny_tokenizer(template))
    assert renderer.native_tools is False
    out = renderer.render(conversation(), [WEATHER])
    assert out.startswith("[system]You are a helper.\n\n" + tools_system_prompt([WEATHER]))
    assert "[tool]" not in out
    assert "[user]<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>\n" in out


def test_no_template_is_an_error() -> None:
    with pytest.raises(ValueError, match="chat_template"):
        render_chat(tiny_tokenizer(None), [{"role": "user", "content": "x"}])
