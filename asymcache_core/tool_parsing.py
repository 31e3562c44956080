"""Parse tool calls out of model text, and convert them to and from OpenAI structures.

Formats:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen, and
  what :mod:`asymcache_core.chat_template` asks a model without native tool support to emit);
  several per message. A final unclosed ``<tool_call>`` (the model stopped on the closing tag
  or ran out of tokens right after the JSON) is accepted when its JSON is complete. A tag whose
  JSON does not parse, or lacks a name, is not a call. With calls, the content is the text
  before the first tag (vLLM's hermes parser: text between and after calls is dropped); with
  none, the reply as written.
* ``llama3_json``: Llama 3.1+'s native form (vLLM's ``llama3_json`` parser): call objects
  ``{"name": ..., "parameters": {...}}`` anywhere in the reply (usually the whole of it, after an
  optional ``<|python_tag|>``, several separated by ``;``); any other ``{`` makes it plain text.
* ``bash_block``: mini-swe-agent's convention, exactly one fenced block
  ````` ```bash ... ``` ````` per answer, which becomes a ``bash`` call with ``command``. Zero or
  several blocks are a format error (reported, never raised), as mini-swe-agent does.
* OpenAI ``tool_calls`` lists (``{"id", "type": "function", "function": {"name",
  "arguments": "<json>"}}``): :func:`from_openai_tool_calls` / :func:`to_openai_tool_calls`.

Nothing here raises on model text.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asymcache_core.json_scan import arguments_span

ToolCallFormat = Literal["hermes", "llama3_json", "bash_block", "auto"]
#: The formats a runtime parses replies with.
TOOL_CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3_json", "bash_block", "auto")

_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
_BLANKS = re.compile(r"\s*")
# mini-swe-agent's own pattern: ```bash, a newline, the command, a newline, ```.
_BASH_BLOCK_RE = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id.

    Returns:
        ``call_`` followed by 24 hex digits.
    """
    return f"call_{uuid.uuid4().hex[:24]}"


#: The head of a Hermes call object up to its arguments' opening brace (name first, as models
#: and the constrained grammar write it): group 1 is the name's JSON string body, any string
#: but the empty one (vLLM's parsers take any name, in the request's tools or not; a call
#: without a name is none, so a stream does not announce one the parse refuses).
CALL_HEADER_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def raw_arguments(payload: str, arguments: Mapping[str, Any]) -> str | None:
    """The arguments' JSON text as a call object ``{"name": ..., "arguments": {...}}`` wrote it,
    when it holds exactly ``arguments`` (keys after it, such as an ``id``, are the object's).

    Args:
        payload: the call object's text.
        arguments: its decoded arguments.

    Returns:
        The text, or None (another key order, not these arguments).
    """
    head = CALL_HEADER_RE.match(payload)
    if head is None:
        return None
    end = arguments_span(payload, head.end())
    if end is None:
        return None
    raw = payload[head.end() : end]
    try:
        return raw if json.loads(raw) == arguments else None
    except (json.JSONDecodeError, RecursionError):
        return None


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call.

    Attributes:
        id: call id (OpenAI ``tool_call_id`` that the tool message answers).
        name: function name.
        arguments: the arguments object.
        raw_arguments: the arguments' JSON text as the model wrote it, when it was read from a
            Hermes call (None: written out again): what the call's stream sent, so a reply and
            its stream carry the same string.
    """

    id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str | None = field(default=None, compare=False)

    def arguments_json(self) -> str:
        """The arguments as JSON text (OpenAI carries them as a string): as the model wrote them
        where known, else compact.

        Returns:
            The JSON text.
        """
        return self.raw_arguments if self.raw_arguments is not None else json.dumps(
            self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message split into text and tool calls.

    Attributes:
        content: the text without the calls (stripped; Hermes: the text before the first call).
        tool_calls: the calls, in order of appearance.
        format_error: why the text did not follow the expected format (e.g. mini-swe-agent's
            "exactly one bash block"), or None; the runtime may feed it back to the model.
        reasoning: a reasoning model's thinking, split off before the rest was parsed
            (:mod:`agent_runtime.reasoning`; None without a reasoning parser or thinking).
    """

    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    format_error: str | None = None
    reasoning: str | None = None

    def to_openai_message(self) -> dict[str, Any]:
        """The OpenAI assistant message for this output.

        Returns:
            ``{"role": "assistant", "content": ..., "tool_calls": [...]}``; content is None when
            empty and there are calls (as OpenAI returns it); ``tool_calls`` omitted if none.
        """
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning  # vLLM's field
            msg["content"] = self.content or None  # all thinking: no content (vLLM's null)
        if self.tool_calls:
            msg["content"] = self.content or None
            msg["tool_calls"] = to_openai_tool_calls(self.tool_calls)
        return msg


def _call_from_obj(obj: Any, make_id: Callable[[], str]) -> ParsedToolCall | None:
    """Interpret a decoded JSON value as a call, or None if it is not one.

    Accepts ``{"name", "arguments"}``, Llama's ``{"name", "parameters"}``, an OpenAI-like
    ``{"function": {"name", "arguments"}}``, and arguments given as a JSON string.

    Args:
        obj: decoded JSON.
        make_id: id factory.

    Returns:
        The call, or None.
    """
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict) and "name" not in obj:
        inner = obj["function"]
        call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
        call = _call_from_obj(inner, make_id)
        if call is not None and call_id:
            call = ParsedToolCall(call_id, call.name, call.arguments)
        return call
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else make_id()
    return ParsedToolCall(call_id, name, args)


def _decode_calls(payload: str, make_id: Callable[[], str]) -> list[ParsedToolCall] | None:
    """Decode the JSON between one pair of tags.

    Args:
        payload: text between ``<tool_call>`` and ``</tool_call>``.
        make_id: id factory.

    Returns:
        The call(s) (a JSON list of calls is accepted too), or None when the payload is not a
        well-formed call.
    """
    try:
        obj = json.loads(payload.strip())
    except (json.JSONDecodeError, RecursionError):
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call_from_obj(o, make_id) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    found = [c for c in calls if c is not None]
    if len(found) == 1 and not isinstance(obj, list):
        raw = raw_arguments(payload, found[0].arguments)
        if raw is not None:
            found = [dataclasses.replace(found[0], raw_arguments=raw)]
    return found


def _tidy(parts: Sequence[str]) -> str:
    """Join the non-call pieces of a message into its content.

    Args:
        parts: text pieces.

    Returns:
        The pieces joined, blank-line runs collapsed, stripped.
    """
    text = "".join(parts)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def parse_hermes(text: str, make_id: Callable[[], str] = new_call_id) -> ParsedMessage:
    """Parse ``<tool_call>{json}</tool_call>`` calls.

    A call is the JSON value right after an opening tag (an object, or a list of them), read as
    JSON reads it (a tag inside one of its strings is text: arguments may hold the markup), then
    its closing tag; where the reply ends, the closing tag may be missing or cut (generation
    stopped at it), and before the next opening tag it may be missing (a model that left it
    out). :class:`~asymcache_core.tool_call_stream.HermesCallStream` reads a streamed reply's
    calls by the same rule (:func:`arguments_span`).

    Args:
        text: model output.
        make_id: id factory for calls without an ``id``.

    Returns:
        The message. With calls, its ``content`` is the text before the first ``<tool_call>``
        tag, as vLLM's hermes parser returns it (text between and after the calls is dropped; a
        stream sends none of it either); without, the text as written (a tag whose value is not
        a call, or is followed by anything else, is no call).
    """
    calls: list[ParsedToolCall] = []
    search = 0
    while (at := text.find(_OPEN_TAG, search)) >= 0:
        start = at + len(_OPEN_TAG)
        value = _BLANKS.match(text, start).end()  # type: ignore[union-attr]
        end = arguments_span(text, value) if text[value : value + 1] in ("{", "[") else None
        after = None if end is None else _BLANKS.match(text, end).end()  # type: ignore[union-attr]
        decoded = None
        if after is not None:
            tail = text[after:]
            if tail.startswith(_CLOSE_TAG):
                after += len(_CLOSE_TAG)
            elif _CLOSE_TAG.startswith(tail):
                after = len(text)  # the reply ends in the closing tag, cut (or without it)
            elif not tail.startswith(_OPEN_TAG):
                after = None  # something else follows the value: not a call
            if after is not None:
                decoded = _decode_calls(text[start:end], make_id)
        if decoded is None or after is None:
            search = start
            continue
        calls.extend(decoded)
        search = after
    # NOTE: a reply without a call is returned as written (vLLM's hermes parser does the
    # same), so a non-streamed reply equals its stream's text; with calls, the text before the
    # first tag (vLLM's content, and all a stream sends as content: it holds text from the
    # first tag on)
    return ParsedMessage(_tidy([text[: text.find(_OPEN_TAG)]]) if calls else text, calls)


def parse_bash_block(
    text: str, make_id: Callable[[], str] = new_call_id, tool_name: str = "bash"
) -> ParsedMessage:
    """Parse mini-swe-agent's single fenced bash block.

    Args:
        text: model output.
        make_id: id factory.
        tool_name: name of the produced call.

    Returns:
        Exactly one block: a ``bash`` call with ``{"command": ...}`` and the text around it as
        content. Zero or several blocks: no call, the full text as content and
        ``format_error`` set.
    """
    blocks = list(_BASH_BLOCK_RE.finditer(text))
    if len(blocks) != 1:
        err = (
            f"Expected exactly one ```bash code block, found {len(blocks)}. "
            "Answer with a THOUGHT and exactly one ```bash block."
        )
        return ParsedMessage(text.strip(), [], err)
    m = blocks[0]
    call = ParsedToolCall(make_id(), tool_name, {"command": m.group(1).strip()})
    return ParsedMessage(_tidy([text[: m.start()], text[m.end() :]]), [call])


def parse_tool_calls(
    text: str,
    fmt: ToolCallFormat = "hermes",
    make_id: Callable[[], str] = new_call_id,
) -> ParsedMessage:
    """Parse the tool calls of one assistant output.

    Args:
        text: model output.
        fmt: ``hermes``, ``llama3_json``, ``bash_block``, or ``auto`` (Hermes tags if any
            parse, else a single bash block if there is exactly one, else plain text with no
            error).
        make_id: id factory.

    Returns:
        The parsed message. Never raises.
    """
    if fmt == "bash_block":
        return parse_bash_block(text, make_id)
    if fmt == "llama3_json":
        from asymcache_core.llama3_calls import parse_llama3_json  # NOTE: it builds on this module

        return parse_llama3_json(text, make_id)
    hermes = parse_hermes(text, make_id)
    if fmt == "hermes" or hermes.tool_calls:
        return hermes
    bash = parse_bash_block(text, make_id)
    if bash.tool_calls:
        return bash
    return ParsedMessage(text.strip(), [])


def render_hermes_tool_calls(calls: Sequence[ParsedToolCall]) -> str:
    """Render calls as Hermes tags, the form the chat-template injection teaches the model.

    Args:
        calls: the calls.

    Returns:
        One ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` per call, joined by
        newlines.
    """
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in calls
    )


def to_openai_tool_calls(calls: Sequence[ParsedToolCall]) -> list[dict[str, Any]]:
    """Render calls as an OpenAI ``tool_calls`` list.

    Args:
        calls: the calls.

    Returns:
        ``[{"id", "type": "function", "function": {"name", "arguments": "<json text>"}}]``.
    """
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json()},
        }
        for c in calls
    ]


def from_openai_tool_calls(
    tool_calls: Sequence[Mapping[str, Any]], make_id: Callable[[], str] = new_call_id
) -> list[ParsedToolCall]:
    """Read an OpenAI ``tool_calls`` list (e.g. from a client's assistant message).

    Arguments that are not a JSON object (malformed JSON, a list, a number) read as an empty
    object, as vLLM 0.32 reads them: such a call is in the conversation's history (a call the
    length limit cut off was streamed as its partial arguments), and refusing it would refuse
    every later turn of the conversation too.

    Args:
        tool_calls: entries with ``function.name`` and ``function.arguments`` (JSON text or an
            object); a missing ``id`` gets a fresh one.
        make_id: id factory.

    Returns:
        The calls.

    Raises:
        ValueError: an entry that is not a function call or has no function name (naming the
            entry's index): this is client input, not model text.
    """
    out: list[ParsedToolCall] = []
    for i, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(tc, Mapping) and tc.get("type", "function") != "function":
            raise ValueError(f"tool_calls[{i}].type: must be 'function', got {tc.get('type')!r}")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{i}].function.name: missing")
        args: Any = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                args = {}
        call_id = tc.get("id") if isinstance(tc.get("id"), str) and tc.get("id") else make_id()
        out.append(ParsedToolCall(call_id, fn["name"], dict(args) if isinstance(args, Mapping) else {}))
    return out
