"""Constrained decoding of tool calls, of JSON replies (``response_format``) and of replies
matching a regular expression, a list of strings or a grammar (vLLM's ``structured_outputs``)
with xgrammar.

For ``tool_choice="required"`` (some tool must be called) or a named function, the model's
output is forced into the shape the parser and the chat template use::

    <tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>

then EOS. The grammar is one xgrammar ``Grammar``: the literal opening tag, a JSON-schema
grammar, and the literal closing tag, concatenated (``Grammar.concat``, available in xgrammar
0.2.9). The JSON schema is ``{"name": const, "arguments": <the tool's parameters>}`` for a
named tool and an ``anyOf`` of those for "required". JSON is generated without free whitespace
(``any_whitespace=False``: separators ``", "`` and ``": "``, exactly what ``json.dumps`` writes),
so a small model cannot wander into whitespace runs, and the text equals what
:func:`agent_runtime.tool_parsing.render_hermes_tool_calls` renders for the next turn.

:class:`GrammarCache` (owned by the caller, e.g. the runtime) holds one ``TokenizerInfo`` and
``GrammarCompiler`` per tokenizer and the compiled grammars per (tokenizer, schema).
:class:`~agent_runtime.grammar_processor.GrammarLogitsProcessor` (its own module, imported here) implements :class:`asymcache_core.sampling_params.LogitsProcessor`
for one request.

``response_format`` (OpenAI's ``json_object`` / ``json_schema``, normalised by
:func:`agent_runtime.protocol.normalize_response_format`) constrains the reply to bare JSON: any
object, or one matching the schema. When the request also offers tools under ``tool_choice``
``"auto"``, the reply may instead be a tool call: the grammar is the union of the JSON grammar
and the tool-call grammar, so neither the answer nor the tool call is ruled out. A forced
``tool_choice`` and a JSON ``response_format`` contradict each other (a 400). vLLM's
``structured_outputs`` (:mod:`agent_runtime.structured_outputs`) normalises to the same JSON
formats, or to a ``regex``, ``choice`` or ``grammar`` constraint
(:func:`text_constraint_grammar`), under the same rules.

xgrammar is the ``constrained`` extra: it is imported on the first grammar a request needs, so
the runtime and unconstrained requests work without it, and a constrained request without it
fails with a ``ValueError`` naming the extra (the server's 400).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from agent_runtime.grammar_processor import GrammarLogitsProcessor

if TYPE_CHECKING:
    import xgrammar as xgr

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"

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


@functools.lru_cache(maxsize=1024)
def _schema_error(schema_json: str) -> str | None:
    xgr = importlib.import_module("xgrammar")
    try:
        xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 - xgrammar reports every schema problem as RuntimeError
        # NOTE: xgrammar prefixes "[time] /path/file.cc:line: "; the client needs the reason only.
        return str(exc).strip().splitlines()[0].split(": ", 1)[-1][:300]
    return None


def check_schema_compiles(schema: Mapping[str, Any], field: str) -> None:
    """Reject a JSON schema that xgrammar cannot turn into a grammar (``"pattern": "("``).

    Checked when a request is validated, so a schema that would fail constrained decoding is a
    client error under every ``tool_choice``. Without xgrammar nothing is checked (constrained
    requests then fail with the install hint).

    Args:
        schema: the JSON schema.
        field: the request field it came from (names the error).

    Raises:
        ValueError: ``field: ...`` with xgrammar's reason.
    """
    if importlib.util.find_spec("xgrammar") is None:
        return
    error = _schema_error(json.dumps(schema, sort_keys=True))
    if error is not None:
        raise ValueError(f"{field}: not a schema constrained decoding can use: {error}")


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
                        v = "#/$defs/" + prefix + v[len(root) :]
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
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}].function.name: missing")
        by_name[fn["name"]] = fn
    if not by_name:
        raise ValueError("tools: at least one tool is needed to force a tool call")
    forced = tool_choice_name(tool_choice)
    if forced is not None:
        if forced not in by_name:
            raise ValueError(f"tool_choice.function.name: unknown tool {forced!r}")
        names = [forced]
    else:
        names = list(by_name)
    defs: dict[str, Any] = {}
    cases = []
    for name in names:
        params = dict(by_name[name].get("parameters") or {"type": "object", "properties": {}})
        prefix = f"{name}__"
        own_defs = {**params.pop("definitions", {}), **params.pop("$defs", {})}
        for k, v in own_defs.items():
            defs[prefix + k] = _rewrite_refs(v, prefix)
        params = _rewrite_refs(params, prefix)
        cases.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key],
            }
        )
    schema: dict[str, Any] = cases[0] if len(cases) == 1 else {"anyOf": cases}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def tool_call_grammar(schema: Mapping[str, Any], call_format: str = "hermes") -> xgr.Grammar:
    """Grammar of ``<tool_call>\\n{json matching schema}\\n</tool_call>`` (``hermes``), or of
    the bare call object (``llama3_json``: Llama writes its calls untagged).

    Args:
        schema: the call-object schema (see :func:`tool_call_json_schema`).
        call_format: the runtime's tool-call format.

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: xgrammar is not installed.
    """
    xgr = load_xgrammar("tool_choice")
    body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    if call_format == "llama3_json":
        return body
    return xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_OPEN)}"),
        body,
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_CLOSE)}"),
    )


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
    schema: Mapping[str, Any], call_schema: Mapping[str, Any], call_format: str = "hermes"
) -> xgr.Grammar:
    """Grammar of a JSON reply matching ``schema``, or of one tagged tool call.

    Args:
        schema: the reply's JSON schema.
        call_schema: the call-object schema (see :func:`tool_call_json_schema`).
        call_format: the runtime's tool-call format.

    Returns:
        The (uncompiled) grammar.

    Raises:
        ValueError: xgrammar is not installed.
    """
    xgr = load_xgrammar("response_format")
    return xgr.Grammar.union(_json_grammar(schema), tool_call_grammar(call_schema, call_format))


def _args_key(call_format: str) -> str:
    """The arguments' key of a call object in ``call_format`` (Llama's is ``parameters``)."""
    return "parameters" if call_format == "llama3_json" else "arguments"


@dataclass
class _TokenizerEntry:
    tokenizer: Any  # held so its id() cannot be reused while the entry lives
    info: xgr.TokenizerInfo
    compiler: xgr.GrammarCompiler


class GrammarCache:
    """Compiled grammars per (tokenizer, schema); one per runtime, owned by the caller.

    Args:
        max_threads: compiler threads (xgrammar compiles the token masks in parallel).
        max_grammars: compiled grammars kept (oldest dropped first).
    """

    def __init__(self, max_threads: int = 2, max_grammars: int = 256) -> None:
        self._max_threads = max_threads
        self._max_grammars = max_grammars
        self._tokenizers: dict[tuple[int, int | None], _TokenizerEntry] = {}
        self._grammars: dict[tuple[int, int | None, str, str], xgr.CompiledGrammar] = {}

    def _entry(self, tokenizer: Any, vocab_size: int | None, field: str) -> _TokenizerEntry:
        key = (id(tokenizer), vocab_size)
        entry = self._tokenizers.get(key)
        if entry is None:
            xgr = load_xgrammar(field)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            entry = _TokenizerEntry(tokenizer, info, compiler)
            self._tokenizers[key] = entry
        return entry

    def tokenizer_info(self, tokenizer: Any, vocab_size: int | None = None) -> xgr.TokenizerInfo:
        """xgrammar's view of a tokenizer.

        Args:
            tokenizer: HF tokenizer.
            vocab_size: the model's vocabulary size (logit row length; may exceed the
                tokenizer's, e.g. padded embeddings).

        Returns:
            The tokenizer info (cached).

        Raises:
            ValueError: xgrammar is not installed.
        """
        return self._entry(tokenizer, vocab_size, "tool_choice").info

    def _compiled(
        self, tokenizer: Any, vocab_size: int | None, kind: str, schema: Mapping[str, Any], call_format: str = "hermes"
    ) -> xgr.CompiledGrammar:
        field = {"tool_call": "tool_choice", "text": "structured_outputs"}.get(kind, "response_format")
        entry = self._entry(tokenizer, vocab_size, field)
        schema_key = json.dumps(schema, sort_keys=True)
        key = (id(tokenizer), vocab_size, f"{kind}:{call_format}", schema_key)
        compiled = self._grammars.get(key)
        if compiled is None:
            if kind == "tool_call":
                compiled = entry.compiler.compile_grammar(tool_call_grammar(schema, call_format))
            elif kind == "json_or_tool_call":
                compiled = entry.compiler.compile_grammar(
                    json_or_tool_call_grammar(schema["json"], schema["tool_call"], call_format)
                )
            elif kind == "text":
                grammar = text_constraint_grammar(schema["reply"])
                if schema.get("tool_call") is not None:
                    grammar = load_xgrammar("structured_outputs").Grammar.union(
                        grammar, tool_call_grammar(schema["tool_call"], call_format))
                compiled = entry.compiler.compile_grammar(grammar)
            else:
                compiled = entry.compiler.compile_json_schema(schema_key, any_whitespace=False)
            if len(self._grammars) >= self._max_grammars:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = compiled
        return compiled

    def tool_call_grammar(
        self,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: ToolChoice = "required",
        vocab_size: int | None = None,
        call_format: str = "hermes",
    ) -> xgr.CompiledGrammar:
        """Compiled grammar forcing one call of the given tools, in the runtime's format.

        Args:
            tokenizer: HF tokenizer.
            tools: OpenAI tool schemas.
            tool_choice: ``"required"`` or a named function.
            vocab_size: the model's vocabulary size.
            call_format: ``hermes`` (a tagged call) or ``llama3_json`` (a bare
                ``{"name", "parameters"}`` object).

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        schema = tool_call_json_schema(tools, tool_choice, _args_key(call_format))
        return self._compiled(tokenizer, vocab_size, "tool_call", schema, call_format)

    def json_schema_grammar(
        self, tokenizer: Any, schema: Mapping[str, Any], vocab_size: int | None = None
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of bare JSON matching ``schema`` (``response_format``).

        Args:
            tokenizer: HF tokenizer.
            schema: JSON schema.
            vocab_size: the model's vocabulary size.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: xgrammar is not installed.
        """
        return self._compiled(tokenizer, vocab_size, "json", schema)

    def json_or_tool_call_grammar(
        self,
        tokenizer: Any,
        schema: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]],
        vocab_size: int | None = None,
        call_format: str = "hermes",
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of a JSON reply matching ``schema`` or one call of ``tools``.

        Args:
            tokenizer: HF tokenizer.
            schema: the reply's JSON schema.
            tools: OpenAI tool schemas (any of them may be called).
            vocab_size: the model's vocabulary size.
            call_format: the runtime's tool-call format.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        both = {"json": dict(schema), "tool_call": tool_call_json_schema(tools, "required", _args_key(call_format))}
        return self._compiled(tokenizer, vocab_size, "json_or_tool_call", both, call_format)

    def text_constraint_grammar(
        self,
        tokenizer: Any,
        constraint: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] = (),
        vocab_size: int | None = None,
        call_format: str = "hermes",
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of a reply matching a regular expression, one of a list of strings
        or an EBNF grammar (see :func:`text_constraint_grammar`), or of one call of ``tools``.

        Args:
            tokenizer: HF tokenizer.
            constraint: the normalised ``structured_outputs`` constraint.
            tools: OpenAI tool schemas any of which may be called instead (none: the reply only).
            vocab_size: the model's vocabulary size.
            call_format: the runtime's tool-call format.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        call = tool_call_json_schema(tools, "required", _args_key(call_format)) if tools else None
        return self._compiled(tokenizer, vocab_size, "text", {"reply": dict(constraint), "tool_call": call},
                              call_format)

    def __len__(self) -> int:
        return len(self._grammars)


def make_tool_call_processor(
    cache: GrammarCache,
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: ToolChoice,
    vocab_size: int | None = None,
    call_format: str = "hermes",
) -> GrammarLogitsProcessor | None:
    """A fresh processor forcing a tool call, or None when ``tool_choice`` does not force one.

    Args:
        cache: the caller's grammar cache.
        tokenizer: HF tokenizer.
        tools: OpenAI tool schemas.
        tool_choice: OpenAI ``tool_choice`` (``"auto"``/``"none"``/None -> None).
        vocab_size: the model's vocabulary size (logit row length).
        call_format: the runtime's tool-call format (``hermes`` or ``llama3_json``).

    Returns:
        The processor, or None.

    Raises:
        ValueError: a forced call without tools, or of an unknown tool; xgrammar is not
            installed.
    """
    if not needs_constraint(tool_choice):
        return None
    try:
        compiled = cache.tool_call_grammar(tokenizer, tools, tool_choice, vocab_size, call_format)
    except RuntimeError as exc:
        # NOTE: xgrammar raises RuntimeError for schemas it cannot compile: a client error.
        raise ValueError(f"tools: constrained decoding cannot use these schemas: {str(exc)[:300]}") from None
    return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)


def make_request_processor(
    cache: GrammarCache,
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: ToolChoice,
    response_format: Mapping[str, Any] | None,
    vocab_size: int | None = None,
    call_format: str = "hermes",
) -> GrammarLogitsProcessor | None:
    """A fresh processor for what a request constrains: a forced tool call, a reply (JSON, or
    ``structured_outputs``' regex, choice or grammar), or (tools offered under ``"auto"`` and a
    constrained reply) either of the two.

    Args:
        cache: the caller's grammar cache.
        tokenizer: HF tokenizer.
        tools: OpenAI tool schemas.
        tool_choice: OpenAI ``tool_choice`` (normalised).
        response_format: a normalised ``response_format`` or ``structured_outputs``
            constraint (:mod:`agent_runtime.structured_outputs`; None: free text).
        vocab_size: the model's vocabulary size (logit row length).
        call_format: the runtime's tool-call format (``hermes`` or ``llama3_json``).

    Returns:
        The processor, or None when nothing is constrained.

    Raises:
        ValueError: a forced call together with a JSON ``response_format``, a forced call without
            tools or of an unknown tool, a schema xgrammar cannot compile; xgrammar is not
            installed.
    """
    if response_format is None:
        return make_tool_call_processor(cache, tokenizer, tools, tool_choice, vocab_size, call_format)
    if response_format.get("type") in TEXT_CONSTRAINTS:
        if needs_constraint(tool_choice):
            raise ValueError("structured_outputs: a constrained reply cannot be combined with a tool_choice that "
                             "forces a tool call")
        callable_tools = tools if tools and tool_choice != "none" else ()
        try:
            compiled = cache.text_constraint_grammar(tokenizer, response_format, callable_tools, vocab_size,
                                                     call_format)
        except RuntimeError as exc:
            raise ValueError(f"structured_outputs: constrained decoding cannot use this constraint: "
                             f"{str(exc)[:300]}") from None
        return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)
    if needs_constraint(tool_choice):
        raise ValueError("response_format: a JSON reply cannot be combined with a tool_choice that forces a tool call")
    schema = response_json_schema(response_format)
    try:
        if tools and tool_choice != "none":
            compiled = cache.json_or_tool_call_grammar(tokenizer, schema, tools, vocab_size, call_format)
        else:
            compiled = cache.json_schema_grammar(tokenizer, schema, vocab_size)
    except RuntimeError as exc:
        # NOTE: xgrammar raises RuntimeError for schemas it cannot compile: a client error.
        raise ValueError(f"response_format: constrained decoding cannot use this schema: {str(exc)[:300]}") from None
    return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)
