"""Compiled grammars and the request's logits processor: :class:`GrammarCache` (one per runtime,
owned by the caller) compiles the grammars :mod:`agent_runtime.constrained` builds, per
tokenizer; :func:`make_request_processor` gives a request the
:class:`~agent_runtime.grammar_processor.GrammarLogitsProcessor` of what it constrains (a forced
tool call, a JSON reply, ``structured_outputs``' regex, choice or grammar, or, with tools under
``"auto"``, either the reply or a call; a structural tag, whose text outside its triggers is free).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent_runtime.constrained import (
    TEXT_CONSTRAINTS,
    ToolChoice,
    args_key,
    json_or_tool_call_grammar,
    load_xgrammar,
    needs_constraint,
    response_json_schema,
    text_constraint_grammar,
    tool_call_grammar,
    tool_call_json_schema,
    tool_choice_name,
)
from agent_runtime.grammar_processor import GrammarLogitsProcessor
from agent_runtime.structural_tag import TYPE as STRUCTURAL_TAG
from agent_runtime.structural_tag import structural_tag_grammar

if TYPE_CHECKING:
    import xgrammar as xgr


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
        self, tokenizer: Any, vocab_size: int | None, kind: str, schema: Mapping[str, Any], call_format: str = "hermes",
        parallel: bool = False,
    ) -> xgr.CompiledGrammar:
        field = {"tool_call": "tool_choice", "text": "structured_outputs"}.get(kind, "response_format")
        entry = self._entry(tokenizer, vocab_size, field)
        # NOTE: keyed and compiled on the order-preserving text: xgrammar emits an object's
        # properties in the schema's order (as OpenAI and vLLM do), so two schemas differing
        # only in property order are different grammars.
        schema_key = json.dumps(schema)
        key = (id(tokenizer), vocab_size, f"{kind}:{call_format}:{'many' if parallel else 'one'}", schema_key)
        compiled = self._grammars.get(key)
        if compiled is None:
            if kind == "tool_call":
                compiled = entry.compiler.compile_grammar(tool_call_grammar(schema, call_format, parallel))
            elif kind == "json_or_tool_call":
                compiled = entry.compiler.compile_grammar(
                    json_or_tool_call_grammar(schema["json"], schema["tool_call"], call_format, parallel)
                )
            elif kind == "text":
                grammar = text_constraint_grammar(schema["reply"])
                if schema.get("tool_call") is not None:
                    grammar = load_xgrammar("structured_outputs").Grammar.union(
                        grammar, tool_call_grammar(schema["tool_call"], call_format, parallel))
                compiled = entry.compiler.compile_grammar(grammar)
            elif kind == STRUCTURAL_TAG:
                compiled = entry.compiler.compile_grammar(structural_tag_grammar(schema))
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
        parallel: bool = False,
    ) -> xgr.CompiledGrammar:
        """Compiled grammar forcing a call of the given tools, in the runtime's format: one, or
        with ``parallel`` under ``"required"`` one or more.

        Args:
            tokenizer: HF tokenizer.
            tools: OpenAI tool schemas.
            tool_choice: ``"required"`` or a named function.
            vocab_size: the model's vocabulary size.
            call_format: ``hermes`` (a tagged call) or ``llama3_json`` (a bare
                ``{"name", "parameters"}`` object).
            parallel: OpenAI's ``parallel_tool_calls``; a named function is called once.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        schema = tool_call_json_schema(tools, tool_choice, args_key(call_format))
        many = parallel and tool_choice_name(tool_choice) is None
        return self._compiled(tokenizer, vocab_size, "tool_call", schema, call_format, many)

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
        parallel: bool = False,
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of a JSON reply matching ``schema`` or calls of ``tools`` (one, or
        with ``parallel`` one or more).

        Args:
            tokenizer: HF tokenizer.
            schema: the reply's JSON schema.
            tools: OpenAI tool schemas (any of them may be called).
            vocab_size: the model's vocabulary size.
            call_format: the runtime's tool-call format.
            parallel: OpenAI's ``parallel_tool_calls``.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        both = {"json": dict(schema), "tool_call": tool_call_json_schema(tools, "required", args_key(call_format))}
        return self._compiled(tokenizer, vocab_size, "json_or_tool_call", both, call_format, parallel)

    def text_constraint_grammar(
        self,
        tokenizer: Any,
        constraint: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] = (),
        vocab_size: int | None = None,
        call_format: str = "hermes",
        parallel: bool = False,
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of a reply matching a regular expression, one of a list of strings
        or an EBNF grammar (see :func:`text_constraint_grammar`), or of calls of ``tools`` (one,
        or with ``parallel`` one or more).

        Args:
            tokenizer: HF tokenizer.
            constraint: the normalised ``structured_outputs`` constraint.
            tools: OpenAI tool schemas any of which may be called instead (none: the reply only).
            vocab_size: the model's vocabulary size.
            call_format: the runtime's tool-call format.
            parallel: OpenAI's ``parallel_tool_calls``.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: see :func:`tool_call_json_schema`; xgrammar is not installed.
        """
        call = tool_call_json_schema(tools, "required", args_key(call_format)) if tools else None
        return self._compiled(tokenizer, vocab_size, "text", {"reply": dict(constraint), "tool_call": call},
                              call_format, parallel)

    def structural_tag_grammar(
        self, tokenizer: Any, spec: Mapping[str, Any], vocab_size: int | None = None
    ) -> xgr.CompiledGrammar:
        """Compiled grammar of a structural tag (see :mod:`agent_runtime.structural_tag`).

        Args:
            tokenizer: HF tokenizer.
            spec: the normalised structural tag (``{"type": "structural_tag", ...}``).
            vocab_size: the model's vocabulary size.

        Returns:
            The compiled grammar (cached).

        Raises:
            ValueError: xgrammar is not installed, or cannot build the tag.
        """
        return self._compiled(tokenizer, vocab_size, STRUCTURAL_TAG, spec)

    def __len__(self) -> int:
        return len(self._grammars)


def make_tool_call_processor(
    cache: GrammarCache,
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: ToolChoice,
    vocab_size: int | None = None,
    call_format: str = "hermes",
    parallel: bool = False,
) -> GrammarLogitsProcessor | None:
    """A fresh processor forcing a tool call, or None when ``tool_choice`` does not force one.

    Args:
        cache: the caller's grammar cache.
        tokenizer: HF tokenizer.
        tools: OpenAI tool schemas.
        tool_choice: OpenAI ``tool_choice`` (``"auto"``/``"none"``/None -> None).
        vocab_size: the model's vocabulary size (logit row length).
        call_format: the runtime's tool-call format (``hermes`` or ``llama3_json``).
        parallel: OpenAI's ``parallel_tool_calls``: ``"required"`` makes one call or more
            (False: exactly one; a named function is called once).

    Returns:
        The processor, or None.

    Raises:
        ValueError: a forced call without tools, or of an unknown tool; xgrammar is not
            installed.
    """
    if not needs_constraint(tool_choice):
        return None
    try:
        compiled = cache.tool_call_grammar(tokenizer, tools, tool_choice, vocab_size, call_format, parallel)
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
    parallel: bool = False,
) -> GrammarLogitsProcessor | None:
    """A fresh processor for what a request constrains: a forced tool call, a reply (JSON, or
    ``structured_outputs``' regex, choice or grammar), or (tools offered under ``"auto"`` and a
    constrained reply) either of the two; or a structural tag, alone whatever the tools: as vLLM
    0.32's (its tool parser's ``adjust_request`` leaves a request with a structural tag as it is),
    the reply outside the tag's triggers is free text, a tool call included.

    Args:
        cache: the caller's grammar cache.
        tokenizer: HF tokenizer.
        tools: OpenAI tool schemas.
        tool_choice: OpenAI ``tool_choice`` (normalised).
        response_format: a normalised ``response_format`` or ``structured_outputs``
            constraint (:mod:`agent_runtime.structured_outputs`; None: free text).
        vocab_size: the model's vocabulary size (logit row length).
        call_format: the runtime's tool-call format (``hermes`` or ``llama3_json``).
        parallel: OpenAI's ``parallel_tool_calls``: calls may come several at a time (False:
            one).

    Returns:
        The processor, or None when nothing is constrained.

    Raises:
        ValueError: a forced call together with a JSON ``response_format``, a forced call without
            tools or of an unknown tool, a schema xgrammar cannot compile; xgrammar is not
            installed.
    """
    if response_format is None:
        return make_tool_call_processor(cache, tokenizer, tools, tool_choice, vocab_size, call_format, parallel)
    if response_format.get("type") == STRUCTURAL_TAG:
        if needs_constraint(tool_choice):
            # NOTE: vLLM 0.32 would let the tag alone constrain a reply it then parses as a forced
            # call; refused here as every other constrained reply is
            raise ValueError("response_format: a structural tag cannot be combined with a tool_choice that forces a "
                             "tool call")
        try:
            compiled = cache.structural_tag_grammar(tokenizer, response_format, vocab_size)
        except RuntimeError as exc:
            raise ValueError(f"response_format: constrained decoding cannot use this structural tag: "
                             f"{str(exc)[:300]}") from None
        return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)
    if response_format.get("type") in TEXT_CONSTRAINTS:
        if needs_constraint(tool_choice):
            raise ValueError("structured_outputs: a constrained reply cannot be combined with a tool_choice that "
                             "forces a tool call")
        callable_tools = tools if tools and tool_choice != "none" else ()
        try:
            compiled = cache.text_constraint_grammar(tokenizer, response_format, callable_tools, vocab_size,
                                                     call_format, parallel)
        except RuntimeError as exc:
            raise ValueError(f"structured_outputs: constrained decoding cannot use this constraint: "
                             f"{str(exc)[:300]}") from None
        return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)
    if needs_constraint(tool_choice):
        raise ValueError("response_format: a JSON reply cannot be combined with a tool_choice that forces a tool call")
    schema = response_json_schema(response_format)
    try:
        if tools and tool_choice != "none":
            compiled = cache.json_or_tool_call_grammar(tokenizer, schema, tools, vocab_size, call_format, parallel)
        else:
            compiled = cache.json_schema_grammar(tokenizer, schema, vocab_size)
    except RuntimeError as exc:
        # NOTE: xgrammar raises RuntimeError for schemas it cannot compile: a client error.
        raise ValueError(f"response_format: constrained decoding cannot use this schema: {str(exc)[:300]}") from None
    return GrammarLogitsProcessor(compiled, vocab_size=vocab_size)


__all__ = ["GrammarCache", "make_request_processor", "make_tool_call_processor"]
