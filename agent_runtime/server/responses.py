"""The HTTP response bodies of the OpenAI-compatible server, as pydantic models.

OpenAI's field names and shapes (:class:`ChatCompletionResponse`, :class:`ChatCompletionChunk`,
:class:`CompletionResponse`, :class:`CompletionChunk`, :class:`ModelList`,
:class:`ErrorResponse`, :class:`Usage`, vLLM's :class:`TokenizeResponse`). ``model_dump()`` is
the wire JSON: fields OpenAI always sends are there even when null (``finish_reason``,
``logprobs``, an error's ``param``); the optional ones (a chunk's ``usage``, a delta's fields,
vLLM's ``token_ids``) are left out when unset.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

#: The headers of every event stream (chat, completions, Responses, Messages): no cache, and no
#: proxy buffering (nginx holds a response back otherwise, and the client sees no token until
#: the end).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# ----------------------------------------------------------------------------------------------
# HTTP response bodies
# ----------------------------------------------------------------------------------------------


def _omitted_when_none(value: Any) -> bool:
    return value is None


#: An optional field that is left out of the wire JSON while it is None (OpenAI omits it).
_OMIT = Field(default=None, exclude_if=_omitted_when_none)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Body):
    """``usage.prompt_tokens_details``: prompt tokens served from the KV cache, and (chat only,
    as vLLM's ``PromptTokenUsageInfo.created_cache_tokens``) those written to it."""

    cached_tokens: int
    created_cache_tokens: int | None = _OMIT


class CompletionTokensDetails(_Body):
    """``usage.completion_tokens_details`` (chat, with a reasoning parser: vLLM's
    ``CompletionTokenUsageInfo``): the generated tokens that were thinking."""

    reasoning_tokens: int


class Usage(_Body):
    """Token counts of one completion (``prompt_tokens_details`` left out only on a stream's
    running usage: :meth:`so_far`; ``completion_tokens_details`` only on the chat route of a
    server with a reasoning parser, as vLLM's ``_include_reasoning_tokens_details``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = _OMIT
    completion_tokens_details: CompletionTokensDetails | None = _OMIT

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int, created_cache_tokens: int | None = None,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        """The usage of a completion (``total_tokens`` is the sum).

        Args:
            prompt_tokens: its prompt's length.
            completion_tokens: tokens it generated.
            cached_tokens: prompt tokens that were cache hits.
            created_cache_tokens: prompt tokens written to the prefix cache; None: left out.
            reasoning_tokens: generated tokens that were thinking; None: left out.

        Returns:
            The usage.
        """
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached_tokens, created_cache_tokens=created_cache_tokens),
            completion_tokens_details=_details(reasoning_tokens),
        )

    @classmethod
    def so_far(cls, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> Usage:
        """A streamed choice's running usage (``continuous_usage_stats``): the counts only, as
        vLLM 0.32's chat and completions chunks carry it; the cache's share is reported by the
        final usage chunk (vLLM's ``chat_completion_stream_generator`` and
        ``completion_stream_generator`` set ``prompt_tokens_details`` there only).

        Args:
            prompt_tokens: the choice's prompt's length.
            completion_tokens: tokens it has generated so far.
            reasoning_tokens: of them, those that were thinking; None: left out.

        Returns:
            The usage.
        """
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=_details(reasoning_tokens))


def _details(reasoning_tokens: int | None) -> CompletionTokensDetails | None:
    return None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)


class FunctionCall(_Body):
    """A called function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Body):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Body):
    """A streamed piece of a called function: its name on the call's first piece, then more of
    its arguments' JSON text."""

    name: str | None = _OMIT
    arguments: str


class ToolCallDelta(_Body):
    """A tool call in a streamed delta: its ``index``; its ``id`` and ``type`` on its first piece
    (OpenAI's and vLLM's shape: the pieces' arguments, joined, are the call's)."""

    index: int
    id: str | None = _OMIT
    type: Literal["function"] | None = _OMIT
    function: FunctionCallDelta


class ChatMessage(_Body):
    """The assistant message of a chat completion (``content`` null when it is only calls)."""

    #: vLLM's --response-role (``assistant`` unless the server names another)
    role: str = "assistant"
    content: str | None
    #: OpenAI's (null: the model refused nothing); vLLM's ``tool_calls`` is a list, empty
    #: when the reply calls no tool
    refusal: str | None = None
    reasoning_content: str | None = _OMIT
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(_Body):
    """What a streamed chat chunk adds to the message; unset fields are left out."""

    role: str | None = _OMIT
    content: str | None = _OMIT
    reasoning_content: str | None = _OMIT
    tool_calls: list[ToolCallDelta] | None = _OMIT


class TopLogprob(_Body):
    """One of the most likely tokens at a position of a chat completion."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """A generated token's log probability, and its most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    """A chat choice's ``logprobs``: one entry per generated token (of this chunk, streamed)."""

    content: list[ChatTokenLogprob] | None


class PromptLogprob(_Body):
    """vLLM's entry of ``prompt_logprobs`` for one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: per prompt token, null for the first, else the prompt token's and
#: its likeliest alternatives' entries keyed by token id (a JSON string).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Body):
    """A text completion's legacy ``logprobs``: parallel lists, one item per generated token;
    ``top_logprobs`` maps the alternatives' texts to their log probabilities (null for 0)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatCompletionChoice(_Body):
    """The choice of a chat completion; vLLM's ``stop_reason``: the stop string or stop token id
    that ended it (null for an EOS or a length limit)."""

    index: int = 0
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None
    #: vLLM's ``return_token_ids``: the reply's token ids
    token_ids: list[int] | None = _OMIT


class ChatCompletionStreamChoice(_Body):
    """The choice of a streamed chat chunk."""

    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None
    #: vLLM's ``return_token_ids``: the tokens sampled since the choice's last chunk
    token_ids: list[int] | None = _OMIT


class CompletionChoice(_Body):
    """The choice of a text completion or of one of its chunks; ``token_ids`` and
    ``prompt_token_ids`` (vLLM's ``return_token_ids``) only when asked for."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _OMIT
    prompt_token_ids: list[int] | None = _OMIT
    prompt_logprobs: PromptLogprobs | None = _OMIT


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Envelope(_Body):
    """The fields every completion body and chunk starts with (``object`` names its kind)."""

    id: str
    object: str
    created: int
    model: str
    #: OpenAI's backend configuration id; null here, as vLLM's
    system_fingerprint: str | None = None


class _Completion(_Envelope, Generic[ChoiceT]):
    """A non-streamed completion body: its one choice and the usage."""

    choices: list[ChoiceT]
    usage: Usage


class _Chunk(_Envelope, Generic[ChoiceT]):
    """One SSE chunk: its choices, and ``usage`` only in the last one, when asked for."""

    choices: list[ChoiceT]
    usage: Usage | None = _OMIT


class ChatCompletionResponse(_Completion[ChatCompletionChoice]):
    """``POST /v1/chat/completions``, not streamed."""

    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = _OMIT
    #: vLLM's ``return_token_ids``: the rendered chat's token ids (its choices share them)
    prompt_token_ids: list[int] | None = _OMIT


class ChatCompletionChunk(_Chunk[ChatCompletionStreamChoice]):
    """One SSE chunk of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    #: vLLM's ``return_token_ids``: the prompt's ids, on a choice's first chunk
    prompt_token_ids: list[int] | None = _OMIT


class CompletionResponse(_Completion[CompletionChoice]):
    """``POST /v1/completions``, not streamed."""

    object: Literal["text_completion"] = "text_completion"


class CompletionChunk(_Chunk[CompletionChoice]):
    """One SSE chunk of a streamed text completion."""

    object: Literal["text_completion"] = "text_completion"


class TokenizeResponse(_Body):
    """``POST /tokenize``: the ids, their number and the context limit."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Body):
    """``POST /detokenize``: the text."""

    prompt: str


class ModelCard(_Body):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asymcache"
    #: vLLM's: the model the name serves, its base (null: none) and its context limit
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Body):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Body):
    """OpenAI's error object (``param`` and ``code`` are null when there is none)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Body):
    """Every error's body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


__all__ = [
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatLogprobs",
    "CompletionTokensDetails",
    "ChatMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionResponse",
    "DeltaMessage",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokensDetails",
    "TokenizeResponse",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
]
