"""Constrained decoding of tool calls and of JSON replies (``response_format``) with xgrammar.

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
:class:`GrammarLogitsProcessor` implements :class:`asymcache_core.sampling_params.LogitsProcessor`
for one request.

``response_format`` (OpenAI's ``json_object`` / ``json_schema``, normalised by
:func:`agent_runtime.protocol.normalize_response_format`) constrains the reply to bare JSON: any
object, or one matching the schema. When the request also offers tools under ``tool_choice``
``"auto"``, the reply may instead be a tool call: the grammar is the union of the JSON grammar
and the tool-call grammar, so neither the answer nor the tool call is ruled out. A forced
``tool_choice`` and a JSON ``response_format`` contradict each other (a 400).

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

import numpy as np
import torch

from asymcache_core.token_masks import clear_tokens, pack_keep, words_for

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
        field = "tool_choice" if kind == "tool_call" else "response_format"
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

    def __len__(self) -> int:
        return len(self._grammars)


class GrammarLogitsProcessor:
    """Masks one request's logits to a compiled grammar; then allows only EOS.

    Implements :class:`asymcache_core.sampling_params.LogitsProcessor`. Stateful: create one per
    request. It feeds the matcher the output tokens it has not seen; if the list shrank or
    changed (a preemption that dropped and recomputed the output), it resets the matcher and
    replays the list. A token the grammar rejects (another processor changed the choice, or the
    engine ignored the mask) leaves only EOS allowed, so the request ends instead of producing
    text the grammar cannot describe.

    Args:
        compiled: the compiled grammar.
        vocab_size: length of the logit rows (tokens past the grammar's vocabulary are masked).
        stop_token_ids: EOS ids (default: those xgrammar found in the tokenizer).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        xgr = load_xgrammar("tool_choice")
        self._compiled = compiled
        info = compiled.tokenizer_info
        self._grammar_vocab: int = info.vocab_size
        self.vocab_size: int = vocab_size if vocab_size is not None else info.vocab_size
        stops = list(stop_token_ids) if stop_token_ids is not None else list(info.stop_token_ids)
        if not stops:
            raise ValueError("stop_token_ids: none known for this tokenizer; pass them")
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self._bitmask = xgr.allocate_token_bitmask(1, self._grammar_vocab)
        self._seen: list[int] = []
        self._failed = False

    @property
    def failed(self) -> bool:
        """A token outside the grammar was seen."""
        return self._failed

    @property
    def is_terminated(self) -> bool:
        """The grammar was completed and EOS accepted (or it failed)."""
        return self._failed or self._matcher.is_terminated()

    def _reset(self) -> None:
        self._matcher.reset()
        self._seen = []
        self._failed = False

    def _accept(self, token_id: int) -> None:
        self._seen.append(token_id)
        if self._failed:
            return
        if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
            self._failed = True

    def _sync(self, output_token_ids: Sequence[int]) -> None:
        n = len(self._seen)
        # Cheap divergence check: a shorter list, or a different last common token. Outputs
        # only ever grow or are recomputed from scratch, so this catches every real case
        # without comparing whole lists on each step.
        if len(output_token_ids) < n or (n and output_token_ids[n - 1] != self._seen[-1]):
            self._reset()
            n = 0
        for tok in output_token_ids[n:]:
            self._accept(int(tok))

    def _only_stops(self, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        idx = torch.tensor(self.stop_token_ids, device=logits.device)
        keep[idx] = logits[idx]
        logits.copy_(keep)
        return logits

    def keep_words(self, output_token_ids: list[int], vocab: int) -> np.ndarray:
        """The tokens the grammar allows next, packed as a row of ``vocab`` logits
        (:mod:`asymcache_core.token_masks`: the sampler masks the row where it is)."""
        self._sync(output_token_ids)
        if self.is_terminated:
            keep = np.zeros(vocab, dtype=bool)
            stops = np.asarray(self.stop_token_ids, dtype=np.int64)
            keep[stops[(stops >= 0) & (stops < vocab)]] = True
            return pack_keep(keep)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        grammar = self._bitmask[0].numpy()
        words = np.zeros(words_for(vocab), dtype=np.int32)
        n = min(self._grammar_vocab, vocab)
        words[: words_for(n)] = grammar[: words_for(n)]
        # NOTE: tokens past the grammar's vocabulary stay masked, as __call__ masks them
        return clear_tokens(words, range(n, words_for(n) * 32))

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` (a ``[vocab]`` row) to the tokens the grammar allows next.

        Args:
            output_token_ids: all tokens generated so far for this request.
            logits: next-token logits, modified in place.

        Returns:
            ``logits``.
        """
        self._sync(output_token_ids)
        if self.is_terminated:
            return self._only_stops(logits)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        # Unpack the bit mask (int32 words, bit i of word w = token 32*w+i) with torch so it
        # works on any device and dtype without relying on xgrammar's kernels.
        words = self._bitmask[0].to(logits.device)
        bits = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((words.unsqueeze(1) >> bits) & 1).bool().flatten()
        n = min(self._grammar_vocab, logits.shape[-1])
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[:n] = allowed[:n]
        logits.masked_fill_(~mask, float("-inf"))
        return logits


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
    """A fresh processor for what a request constrains: a forced tool call, a JSON reply, or
    (tools offered under ``"auto"`` and a JSON ``response_format``) either of the two.

    Args:
        cache: the caller's grammar cache.
        tokenizer: HF tokenizer.
        tools: OpenAI tool schemas.
        tool_choice: OpenAI ``tool_choice`` (normalised).
        response_format: a normalised ``response_format`` (None: free text).
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
