"""The OpenAI request models and validators: every bad field is a RequestError naming it; the
response models dump OpenAI's wire shapes."""

from __future__ import annotations

import json

import pytest

from agent_runtime.protocol import (
    RequestError,
    chat_sampling_params,
    normalize_tool_choice,
    normalize_tools,
    validate_messages,
)
from agent_runtime.server.body_parsing import parse_json_body, parse_request
from agent_runtime.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompts,
)
from agent_runtime.server.responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ToolCallDelta,
    Usage,
)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 17}, "n"),
    ({"n": 2, "job_id": "j"}, "job_id"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": 3}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": None}, "ignore_eos"),
    ({"job_id": 7}, "job_id"),
    ({"job_id": ""}, "job_id"),
    ({"job_id": "j" * 257}, "job_id"),
    ({"is_last_step": "true"}, "is_last_step"),
    ({"stream": 1}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}, 3]}, "messages[1]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [TOOL, "f"]}, "tools[1]"),
])
def test_chat_field_errors_name_the_param(fields, param):
    with pytest.raises(RequestError) as info:
        _chat(**fields)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")
    assert info.value.code is None


def test_missing_fields():
    with pytest.raises(RequestError) as info:
        parse_request(ChatCompletionRequest, {"model": "m"})
    assert info.value.param == "messages" and "required" in str(info.value).lower()
    with pytest.raises(RequestError) as info:
        parse_request(CompletionRequest, {"model": "m"})
    assert info.value.param == "prompt"


def test_chat_defaults_and_sampling_params():
    req = _chat(user="someone", logprobs=False, presence_penalty=0.0)  # unknown fields are ignored
    assert (req.streaming, req.include_usage, req.last_step, req.job_id) == (False, False, False, None)
    p = req.sampling_params(512)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        512, 1.0, 1.0, 0, None, (), False)  # vLLM's defaults: temperature 1
    req = _chat(max_tokens=7, temperature=1, top_p=0.5, top_k=-1, seed=3, stop="END", ignore_eos=True,
                job_id="j", is_last_step=True, stream=True, stream_options={"include_usage": True},
                temperature_extra=None, n=None)
    p = req.sampling_params(512)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        7, 1.0, 0.5, -1, 3, ("END",), True)
    assert isinstance(p.temperature, float)
    assert (req.streaming, req.include_usage, req.last_step, req.job_id) == (True, True, True, "j")
    # nulls read as the defaults
    req = _chat(temperature=None, top_p=None, top_k=None, stop=None, is_last_step=None, stream=None,
                stream_options=None, max_tokens=None)
    assert req.sampling_params(9).max_tokens == 9 and not req.streaming and not req.last_step
    # OpenAI's newer name wins
    assert _chat(max_tokens=3, max_completion_tokens=5).sampling_params(512).max_tokens == 5
    assert _chat(stop=["a", "b"]).sampling_params(1).stop == ("a", "b")


def test_completion_prompt_forms():
    assert parse_request(CompletionRequest, {"prompt": "hi"}).prompt == "hi"
    assert parse_request(CompletionRequest, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_request(CompletionRequest, {"prompt": ["hi"]}).prompt == "hi"
    assert parse_request(CompletionRequest, {"prompt": [[4, 5]]}).prompt == [4, 5]
    assert parse_request(CompletionRequest, {"prompt": "hi"}).prompts == ["hi"]
    # a batch: texts (even ones that read as numbers), or token-id lists
    assert parse_request(CompletionRequest, {"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_request(CompletionRequest, {"prompt": ["1", "2"]}).prompts == ["1", "2"]
    assert parse_request(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert completion_prompts([[1], [2]]) == [[1], [2]]
    for bad, words in (("", "empty"), ([], "non-empty"), (["a", [1]], "one kind"), ({"x": 1}, "non-empty"),
                       ([1, True], "one kind"), (None, "non-empty"), ([1, "a"], "one kind")):
        with pytest.raises(RequestError) as info:
            parse_request(CompletionRequest, {"prompt": bad})
        assert info.value.param == "prompt" and words in str(info.value), bad
        # the message is not prefixed twice
        assert str(info.value).startswith("prompt: ") and not str(info.value).startswith("prompt: prompt")
    for bad, param in ((["a", ""], "prompt[1]"), ([[1], []], "prompt[1]"), ([[1], [True]], "prompt[1]")):
        with pytest.raises(RequestError) as info:
            parse_request(CompletionRequest, {"prompt": bad})
        assert info.value.param == param, bad
    req = parse_request(CompletionRequest, {"prompt": "x", "tool_name": "sleep", "return_token_ids": True})
    assert (req.tool_name, req.return_token_ids) == ("sleep", True)
    for bad, param in (({"tool_name": 3}, "tool_name"), ({"return_token_ids": "yes"}, "return_token_ids")):
        with pytest.raises(RequestError) as info:
            parse_request(CompletionRequest, {"prompt": "x", **bad})
        assert info.value.param == param


def test_parse_json_body():
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b'{"a": ', b"[1, 2]", b"\xff\xfe", b'"text"'):
        with pytest.raises(RequestError) as info:
            parse_json_body(raw)
        assert info.value.code == "invalid_json" and info.value.param is None


def test_conversation_validators():
    validate_messages(USER)
    validate_messages([*USER, {"role": "assistant", "content": None, "tool_calls": [  # an empty turn that calls a tool
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"}])
    for bad, prefix in (([], "messages:"), ("hi", "messages:"), ([1], "messages[0]:"),
                        ([{"role": "robot"}], "messages[0].role:"),
                        ([{"role": "user", "content": 3}], "messages[0].content:"),
                        ([{"role": "assistant", "tool_calls": {}}], "messages[0].tool_calls:"),
                        ([*USER, {"role": "user", "content": None}], "messages[1].content: a user message needs"),
                        ([{"role": "tool", "tool_call_id": 5, "content": "x"}], "messages[0].tool_call_id: must be a string"),
                        ([{"role": "user", "name": 5, "content": "x"}], "messages[0].name:"),
                        ([{"role": "assistant", "content": "x", "reasoning_content": 5}], "messages[0].reasoning_content:"),
                        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls: only an assistant"),
                        ([*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": 5, "function": {
                            "name": "f", "arguments": "{}"}}]}], "messages[1].tool_calls[0].id: must be a string"),
                        ([*USER, {"role": "assistant", "content": None, "tool_calls": [{"type": "custom", "function": {
                            "name": "f", "arguments": "{}"}}]}], "messages[1].tool_calls[0].type: must be 'function'")):
        with pytest.raises(ValueError) as info:
            validate_messages(bad)
        assert str(info.value).startswith(prefix), bad
    assert normalize_tools(None) == [] and normalize_tools([TOOL]) == [TOOL]
    assert normalize_tools([TOOL, TOOL]) == [TOOL, TOOL]  # a name given twice: vLLM does not check
    assert normalize_tool_choice(None, []) == "none" and normalize_tool_choice(None, [TOOL]) == "auto"
    assert normalize_tool_choice({"type": "function", "function": {"name": "f"}}, [TOOL]) == {
        "type": "function", "function": {"name": "f"}}
    with pytest.raises(ValueError, match=r"^tool_choice\.type:"):
        normalize_tool_choice({"type": "grammar"}, [TOOL])
    with pytest.raises(ValueError, match="^tool_choice: must be a string or an object"):
        normalize_tool_choice(3, [TOOL])  # type: ignore[arg-type]


def test_response_models_keep_nulls_openai_sends_and_omit_unset_extras():
    usage = Usage.of(10, 3, cached_tokens=8)
    assert usage.model_dump() == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = ChatCompletionResponse(
        id="chatcmpl-x", created=7, model="m", usage=usage,
        choices=[ChatCompletionChoice(
            message=ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}),
            finish_reason="tool_calls",
        )],
    )
    # key order is the wire's: the JSON text is what clients (and the tests) compare
    assert json.dumps(body.model_dump(), separators=(",", ":")) == (
        '{"id":"chatcmpl-x","object":"chat.completion","created":7,"model":"m","system_fingerprint":null,'
        '"choices":[{"index":0,'
        '"message":{"role":"assistant","content":null,"refusal":null,"tool_calls":[{"id":"call_1","type":"function",'
        '"function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls","logprobs":null,"stop_reason":null}],'
        '"usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,'
        '"prompt_tokens_details":{"cached_tokens":8}}}'
    )
    # OpenAI's refusal and vLLM's tool_calls are there when empty: clients read them as keys
    assert ChatMessage.model_validate({"role": "assistant", "content": "hi"}).model_dump() == {
        "role": "assistant", "content": "hi", "refusal": None, "tool_calls": [],
    }
    # chunks: unset delta fields and the usage are left out; finish_reason and logprobs stay null
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[
        ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content="")),
        ChatCompletionStreamChoice(delta=DeltaMessage(tool_calls=[ToolCallDelta(index=0, **call)])),
        ChatCompletionStreamChoice(delta=DeltaMessage(), finish_reason="stop"),
    ])
    assert chunk.model_dump() == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "system_fingerprint": None, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None,
         "stop_reason": None},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]}, "finish_reason": None, "logprobs": None,
         "stop_reason": None},
        {"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None, "stop_reason": None},
    ]}
    # a call's later pieces carry more of its arguments only (OpenAI's shape)
    piece = ToolCallDelta(index=1, function={"arguments": '{"a": '})
    assert piece.model_dump() == {"index": 1, "function": {"arguments": '{"a": '}}
    last = CompletionChunk(id="c", created=1, model="m", choices=[], usage=usage).model_dump()
    assert last["object"] == "text_completion" and last["choices"] == [] and last["usage"]["total_tokens"] == 13
    # vLLM's token ids: only when asked for, and an empty list is still sent
    assert "token_ids" not in CompletionChoice(text="a").model_dump()
    assert CompletionChoice(text="", finish_reason="length", token_ids=[]).model_dump() == {
        "index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": [],
    }
    assert ErrorResponse(error=ErrorInfo(message="bad", type="invalid_request_error")).model_dump() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None},
    }


def test_chat_sampling_params_defaults_and_unknown_keys():
    params = chat_sampling_params({})
    assert (params.max_tokens, params.temperature, params.seed, params.stop) == (256, 0.0, None, ())
    params = chat_sampling_params({"max_tokens": 3, "stop": ["x"], "seed": 1})
    assert (params.max_tokens, params.stop, params.seed) == (3, ("x",), 1)
    # one string is one stop string (it was split into its characters: "xe" stopped at "x")
    assert chat_sampling_params({"stop": "xe"}).stop == ("xe",)
    assert chat_sampling_params({"stop": None}).stop == ()
    with pytest.raises(ValueError, match="^stop: "):
        chat_sampling_params({"stop": 5})
    with pytest.raises(TypeError, match="'top_p'"):
        chat_sampling_params({"top_p": 0.5})  # type: ignore[typeddict-unknown-key]
