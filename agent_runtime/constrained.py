"""Constrained decoding of tool calls, of JSON replies (``response_format``) and of replies
matching a regular expression, a list of strings or a grammar (vLLM's ``structured_outputs``)
with xgrammar.

For ``tool_choice="required"`` (some tool must be called) or a named function, the model's
output is forced into the shape the parser and the chat template use::

    <tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>

then EOS. The grammar is one xgrammar ``Grammar``: the literal opening tag, a JSON-schema
grammar, and the literal closing tag, concatenated (``Grammar.concat``, available in xgrammar
0.2.9). The JSON schema is ``{"name": const, "arguments": <the tool's parameters>}`` for a
named tool and an ``anyOf`` of those for "required", where (OpenAI's ``parallel_tool_calls``, on by
default) one call or more may be made, joined as :func:`~asymcache_core.tool_parsing.render_hermes_tool_calls`
joins them. JSON is generated without free whitespace
(``any_whitespace=False``: separators ``", "`` and ``": "``, exactly what ``json.dumps`` writes),
so a small model cannot wander into whitespace runs, and the text equals what
:func:`asymcache_core.tool_parsing.render_hermes_tool_calls` renders for the next turn.

This module builds the grammars (uncompiled) and checks a request's schemas and patterns;
:class:`~agent_runtime.grammar_cache.GrammarCache` (owned by the caller, e.g. the runtime)
compiles them, one ``TokenizerInfo`` and ``GrammarCompiler`` per tokenizer, and
:func:`~agent_runtime.grammar_cache.make_request_processor` gives a request its
:class:`~agent_runtime.grammar_processor.GrammarLogitsProcessor`
(:class:`asymcache_core.sampling_params.LogitsProcessor`).

``response_format`` (OpenAI's ``json_object`` / ``json_schema``, normalised by
:func:`agent_runtime.protocol.normalize_response_format`) constrains the reply to bare JSON: any
object, or one matching the schema. When the request also offers tools under ``tool_choice``
``"auto"``, the reply may instead be a tool call: the grammar is the union of the JSON grammar
and the tool-call grammar, so neither the answer nor the tool call is ruled out. A forced
``tool_choice`` and a JSON ``response_format`` contradict each other (a 400). vLLM's
``structured_outputs`` (:mod:`agent_runtime.structured_outputs`) normalises to the same JSON
formats, or to a ``regex``, ``choice`` or ``grammar`` constraint
(:func:`text_constraint_grammar`), under the same rules. A structural tag (``response_format``'s
or ``structured_outputs``' ``structural_tag``) is built by :mod:`agent_runtime.structural_tag`:
its text outside the triggers is free, so with tools under ``"auto"`` it stands alone.

xgrammar is the ``constrained`` extra: it is imported on the first grammar a request needs, so
the runtime and unconstrained requests work without it, and a constrained request without it
fails with a ``ValueError`` naming the extra (the server's 400).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
#: what joins Llama's parallel calls (:func:`asymcache_core.llama3_calls.render_llama3_json_tool_calls`)
LLAMA3_CALL_SEPARATOR = "; "

ToolChoice = str | Mapping[str, Any] | None

INSTALL_HINT = "pip install 'asymcache[constrained]'"


def load_xgrammar(field: str) -> ModuleType:
    """xgrammar, imported on first use.

    Args:
        field: the request field that asked for constrained decoding (names the error).

    Returns:
        The ``xgrammar`` module.

    Raises:
        ValueError: xgrammar is not installed.
    """
    try:
        return importlib.import_module("xgrammar")
    except ImportError:
        raise ValueError(
            f"{field}: constrained decoding needs xgrammar, which is not installed "
            f"({INSTALL_HINT})"
        ) from None


#: The xgrammar builders a request's text is checked with, and what each takes.
_BUILDERS = {"json_schema": "a schema", "regex": "a regular expression", "ebnf": "an EBNF grammar (root ::= ...)"}


@functools.lru_cache(maxsize=1024)
def _grammar_error(builder: str, text: str) -> str | None:
    xgr = importlib.import_module("xgrammar")
    try:
        if builder == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        else:
            getattr(xgr.Grammar, f"from_{builder}")(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar reports every parse problem as RuntimeError
        # NOTE: xgrammar prefixes "[time] /path/file.cc:line: "; the client needs the reason only.
        return str(exc).strip().splitlines()[0].split(": ", 1)[-1][:300]
    return None


def check_compiles(builder: str, text: str, field: str) -> None:
    """Reject what xgrammar cannot turn into a grammar: a JSON schema (``"pattern": "("``), a
    regular expression or an EBNF grammar.

    Checked when a request is validated, so text that would fail constrained decoding is a
    client error under every ``tool_choice``. Without xgrammar nothing is checked (constrained
    requests then fail with the install hint).

    Args:
        builder: ``json_schema``, ``regex`` or ``ebnf``.
        text: the schema's JSON, the expression or the grammar.
        field: the request field it came from (names the error).

    Raises:
        ValueError: ``field: ...`` with xgrammar's reason.
    """
    if importlib.util.find_spec("xgrammar") is None:
        return
    error = _grammar_error(builder, text)
    if error is not None:
        raise ValueError(f"{field}: not {_BUILDERS[builder]} constrained decoding can use: {error}")


def check_schema_compiles(schema: Mapping[str, Any], field: str) -> None:
    """:func:`check_compiles` of a JSON schema."""
    check_compiles("json_schema", json.dumps(schema, sort_keys=True), field)


def tool_choice_name(tool_choice: ToolChoice) -> str | None:
    """The forced function name of an OpenAI ``tool_choice``, if it names one.

    Args:
        tool_choice: ``"auto"``, ``"none"``, ``"required"``, None, or
            ``{"type": "function", "function": {"name": ...}}``.

    Returns:
        The name, or None when no single function is forced.
    """
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return fn["name"]
        if isinstance(tool_choice.get("name"), str):
            return tool_choice["name"]
    return None


def needs_constraint(tool_choice: ToolChoice) -> bool:
    """Does this ``tool_choice`` force a tool call (so decoding must be constrained)?

    Args:
        tool_choice: OpenAI ``tool_choice``.

    Returns:
        True for ``"required"`` or a named function.
    """
    return tool_choice == "required" or tool_choice_name(tool_choice) is not None


def response_json_schema(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema a normalised ``response_format`` asks the reply to match.

    Args:
        response_format: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
            {"name": ..., "schema": {...}}}`` (as :func:`agent_runtime.protocol.normalize_response_format`
            returns them).

    Returns:
        ``{"type": "object"}`` (any JSON object) for ``json_object``, else the given schema.

    Raises:
        ValueError: naming ``response_format`` for any other value.
    """
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, Mapping) and isinstance(spec.get("schema"), Mapping):
            return dict(spec["schema"])
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    raise ValueError(f"response_format.type: {kind!r} does not ask for JSON")


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """Point ``#/$defs/X`` references at ``#/$defs/<prefix>X`` (defs hoisted to the root).

    Args:
        node: schema node.
        prefix: name prefix of this tool's definitions.

    Returns:
        A rewritten copy.
    """
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if v.startswith(root):
                        # NOTE: a JSON pointer: a tool name may hold "/" or "~" (any name is served)
                        v = "#/$defs/" + prefix.replace("~", "~0").replace("/", "~1") + v[len(root) :]
                out[k] = v
            else:
                out[k] = _rewrite_refs(v, prefix)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    return node


def tool_call_json_schema(
    tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice = "required", args_key: str = "arguments"
) -> dict[str, Any]:
    """JSON schema of one ``{"name", "arguments"}`` call object (``{"name", "parameters"}``,
    Llama's, with ``args_key="parameters"``).

    The tools' ``$defs`` are hoisted to the root (prefixed by the tool name) because a
    parameters schema nested under ``arguments`` can no longer reach its own ``#/$defs``.

    Args:
        tools: OpenAI tool schemas.
        tool_choice: ``"required"`` (any of the tools) or a named function.
        args_key: the key of the arguments object.

    Returns:
        The schema.

    Raises:
        ValueError: no tools, an unknown forced name, or a ``tool_choice`` that does not force
            a call.
    """
    if not needs_constraint(tool_choice):
        raise ValueError(f"tool_choice: {tool_choice!r} does not force a tool call")
    fns: list[Mapping[str, Any]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}].function.name: missing")
        fns.append(fn)
    if not fns:
        raise ValueError("tools: at least one tool is needed to force a tool call")
    forced = tool_choice_name(tool_choice)
    if forced is not None:
        # NOTE: a name given twice is its last definition, as vLLM 0.32's structured output reads a
        # named tool_choice (vllm/tool_parsers/utils.py: get_json_schema_from_tools, a
        # {name: tool} dict over the list)
        chosen = [fn for fn in fns if fn["name"] == forced][-1:]
        if not chosen:
            raise ValueError(f"tool_choice.function.name: unknown tool {forced!r}")
    else:
        # NOTE: "required" is any of the tools, every definition of a name too (vLLM's anyOf over
        # the list: _get_json_schema_from_tools)
        chosen = fns
    twice = {name for name, n in Counter(fn["name"] for fn in chosen).items() if n > 1}
    defs: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    for k, fn in enumerate(chosen):
        name = fn["name"]
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        # NOTE: a name given twice: each definition's own $defs under a prefix of its own
        prefix = f"{name}__{k}__" if name in twice else f"{name}__"
        own_defs = {**params.pop("definitions", {}), **params.pop("$defs", {})}
        for key, v in own_defs.items():
            defs[prefix + key] = _rewrite_refs(v, prefix)
        params = _rewrite_refs(params, prefix)
        case = {"type": "object", "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key]}
        if case not in cases:  # NOTE: the same definition twice accepts nothing more
            cases.append(case)
    schema: dict[str, Any] = cases[0] if len(cases) == 1 else {"anyOf": cases}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def tool_call_grammar(schema: Mapping[str, Any], call_format: str = "hermes", parallel: bool = False) -> xgr.Grammar:
    """Grammar of ``<tool_call>\\n{json matching schema}\\n</tool_call>`` (``hermes``), or of
    the bare call object (``llama3_json``: Llama writes its calls untagged); with ``parallel``,
    of one or more such calls, joined as the parser reads them (a newline between Hermes tags,
    ``"; "`` between Llama's objects).

    Args:
        schema: the call-object schema (see :func:`tool_call_json_schema`).
        call_format: the runtime's tool-call format.
        parallel: one call or more (OpenAI's ``parallel_tool_calls`` under ``"required"``);
            False: exactly one.

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: xgrammar is not installed.
    """
    xgr = load_xgrammar("tool_choice")
    body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    if not parallel:
        if call_format == "llama3_json":
            return body
        return xgr.Grammar.concat(
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_OPEN)}"),
            body,
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_CLOSE)}"),
        )
    # NOTE: a structural tag repeats the call: xgrammar renames the JSON grammar's rules into
    # it, which a hand-joined EBNF text would have to do itself (rule names may also appear
    # inside the schema's string literals)
    call: dict[str, Any] = {"type": "grammar", "grammar": str(body)}
    if call_format != "llama3_json":
        call = {"type": "sequence", "elements": [
            {"type": "const_string", "value": TOOL_CALL_OPEN}, call,
            {"type": "const_string", "value": TOOL_CALL_CLOSE}]}
    separator = {"type": "const_string", "value": LLAMA3_CALL_SEPARATOR if call_format == "llama3_json" else "\n"}
    calls = {"type": "sequence", "elements": [
        call, {"type": "star", "content": {"type": "sequence", "elements": [separator, call]}}]}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": calls}))


def _json_grammar(schema: Mapping[str, Any]) -> xgr.Grammar:
    xgr = load_xgrammar("response_format")
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


#: The reply constraints of ``structured_outputs`` that are not JSON
#: (:func:`agent_runtime.structured_outputs.normalize_structured_outputs`).
TEXT_CONSTRAINTS = ("regex", "choice", "grammar")


def choice_ebnf(choices: Sequence[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices``.

    Args:
        choices: the strings.

    Returns:
        ``root ::= "a" | "b"`` (each string a quoted literal).
    """
    # NOTE: a JSON string literal is an EBNF one: xgrammar reads the same escapes (\", \\, \n)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def text_constraint_grammar(constraint: Mapping[str, Any]) -> xgr.Grammar:
    """Grammar of a reply matching a regular expression, one of a list of strings, or an EBNF
    grammar (``structured_outputs``' ``regex``, ``choice`` and ``grammar``).

    Args:
        constraint: ``{"type": "regex", "regex": ...}``, ``{"type": "choice", "choice": [...]}``
            or ``{"type": "grammar", "grammar": ...}``.

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: another kind of constraint; xgrammar is not installed.
    """
    xgr = load_xgrammar("structured_outputs")
    kind = constraint.get("type")
    if kind == "regex":
        return xgr.Grammar.from_regex(constraint["regex"])
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(constraint["choice"]))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(constraint["grammar"])
    raise ValueError(f"structured_outputs: {kind!r} is not one of {', '.join(TEXT_CONSTRAINTS)}")


def json_or_tool_call_grammar(
    schema: Mapping[str, Any], call_schema: Mapping[str, Any], call_format: str = "hermes", parallel: bool = False
) -> xgr.Grammar:
    """Grammar of a JSON reply matching ``schema``, or of tagged tool calls.

    Args:
        schema: the reply's JSON schema.
        call_schema: the call-object schema (see :func:`tool_call_json_schema`).
        call_format: the runtime's tool-call format.
        parallel: one call or more may be made (False: one).

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: xgrammar is not installed.
    """
    xgr = load_xgrammar("response_format")
    return xgr.Grammar.union(_json_grammar(schema), tool_call_grammar(call_schema, call_format, parallel))


def args_key(call_format: str) -> str:
    """The arguments' key of a call object in ``call_format`` (Llama's is ``parameters``)."""
    return "parameters" if call_format == "llama3_json" else "arguments"


#: Names that moved to :mod:`agent_runtime.grammar_cache` (their old import path still works).
_MOVED_NAMES = frozenset({"GrammarCache", "make_request_processor", "make_tool_call_processor"})


def __getattr__(name: str) -> Any:
    # NOTE: lazily, as grammar_cache imports this module
    if name in _MOVED_NAMES:
        return getattr(importlib.import_module("agent_runtime.grammar_cache"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
