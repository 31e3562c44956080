"""The ``http`` backend: the same workloads against any OpenAI-compatible server.

Every turn is a streamed ``/v1/completions`` call whose prompt is the job's token ids so far
(servers that accept token-id prompts: ours and vLLM). The answer's token ids come back with
``return_token_ids`` (vLLM's extension, also ours); a server without it gets deterministic
stand-in ids appended instead, which keeps the prefix structure the cache sees. ``job_id`` and
``is_last_step`` travel in the request body for servers that pin (Continuum), except for a label
ending in ``/anonymous``: clients that send neither (most agent frameworks).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eval.outcomes import RequestRecord, RunOutcome
from workloads import Trace, job_token_stream

if TYPE_CHECKING:
    from eval.variants import BenchVariant


@dataclass
class _Streamed:
    """What one streamed completion gave: its tokens and when they came."""

    token_ids: list[int] = field(default_factory=list)
    first: float | None = None  # when its first token came
    last: float | None = None  # when its last token came
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int | None = None  # the server's usage count, when it sent one


def _stream_error(chunk: dict[str, Any]) -> str | None:
    """The message of an error chunk (``data: {"error": ...}``, vLLM's and OpenAI's in-stream
    error), or ``None`` for an ordinary chunk."""
    error = chunk.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def _one_call(client: Any, url: str, body: dict[str, Any], where: str) -> _Streamed:
    """Streams one completion.

    Args:
        client: an ``httpx.AsyncClient``.
        url: the completions endpoint.
        body: the request body (``prompt`` holds token ids).
        where: the job and turn, for error messages.

    Returns:
        The tokens and their times.

    Raises:
        ValueError: naming ``url``: an error status, an error chunk in the stream, or a stream
            that carried no token (a failed request must not count as a served one).
    """
    out = _Streamed(prompt_tokens=len(body["prompt"]))
    async with client.stream("POST", url, json=body) as response:
        if response.status_code >= 400:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise ValueError(f"url: server answered {response.status_code} for {where}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            error = _stream_error(chunk)
            if error is not None:
                raise ValueError(f"url: the server's stream for {where} ended in an error: {error[:300]}")
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
                if usage.get("completion_tokens") is not None:
                    out.completion_tokens = int(usage["completion_tokens"])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                if ids or choice.get("text"):
                    now = time.monotonic()
                    out.first = now if out.first is None else out.first
                    out.last = now
                if ids:
                    out.token_ids.extend(int(t) for t in ids)
    if out.first is None:
        raise ValueError(f"url: the server's stream for {where} carried no token")
    return out


def _tpot(streamed: _Streamed) -> float | None:
    """Time per output token after the first: the first token to the last over the tokens
    after the first (vLLM `bench serve`'s), not per chunk (a chunk may carry many tokens).

    Returns:
        Seconds, or ``None`` with fewer than two tokens (or no count of them).
    """
    tokens = streamed.completion_tokens if streamed.completion_tokens is not None else len(streamed.token_ids)
    if tokens < 2 or streamed.first is None or streamed.last is None:
        return None
    return (streamed.last - streamed.first) / (tokens - 1)


async def _run(cfg: Any, trace: Trace, label: str, model: str, vocab: int, anonymous: bool = False) -> RunOutcome:
    import httpx

    url = cfg.url.rstrip("/") + "/v1/completions"
    t0 = time.monotonic()
    records: list[RequestRecord] = []
    jct: dict[str, float] = {}
    limit = asyncio.Semaphore(cfg.concurrency if cfg.rate is None else len(trace.jobs))

    async def run_job(job: Any, client: Any) -> None:
        async with limit:
            if cfg.rate is not None:
                # NOTE: arrivals are seconds of the run (--rate is jobs/s); only pauses are scaled
                await asyncio.sleep(max(0.0, t0 + job.arrival_s - time.monotonic()))
            inputs = job_token_stream(job, vocab, cfg.seed)
            context: list[int] = []
            start = time.monotonic()
            for k, turn in enumerate(job.turns):
                context = context + inputs[k]
                last = k == len(job.turns) - 1
                body = {
                    "model": model, "prompt": context, "max_tokens": max(1, turn.output_tokens),
                    "temperature": 0.0, "stream": True, "ignore_eos": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                }
                if not anonymous:
                    # NOTE: vLLM reads per-request hints from ``vllm_xargs`` (strings/numbers only)
                    body.update({"job_id": job.job_id, "is_last_step": last,
                                 "vllm_xargs": {"job_id": job.job_id, "is_last_step": int(last)}})
                arrival = time.monotonic()
                streamed = await _one_call(client, url, body, f"job {job.job_id!r} turn {k}")
                end = time.monotonic()
                ids = streamed.token_ids
                if not ids:  # NOTE: stand-ins keep the prefix structure when ids are not returned
                    count = streamed.completion_tokens or turn.output_tokens
                    ids = [100 + ((len(context) + i) * 7919) % max(1, vocab - 200) for i in range(count)]
                    streamed.completion_tokens = count
                # NOTE: first_scheduled None: a client cannot see when the server first scheduled
                # the request, so queueing is unknown (n/a), not equal to the TTFT.
                first = streamed.first
                records.append(RequestRecord(
                    job.job_id, k, arrival, None, first, end, streamed.prompt_tokens, streamed.cached_tokens,
                    ids, None if first is None else first - arrival, _tpot(streamed),
                ))
                context = context + ids
                if not last:
                    await asyncio.sleep(job.pause_after(k) * cfg.time_scale)
            jct[job.job_id] = time.monotonic() - start

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(run_job(job, client) for job in trace.jobs))
    prompt = sum(r.prompt_tokens for r in records)
    hits = sum(r.cached_tokens for r in records)
    generated = sum(len(r.output) for r in records)
    stats = {
        "prompt_tokens": prompt, "hit_tokens": hits, "hole_tokens": 0, "suffix_recomputed_tokens": 0,
        "preempted_tokens": 0, "computed_tokens": prompt - hits, "generated_tokens": generated,
        "evictions": 0, "peak_blocks_in_use": 0, "num_preemptions": 0,
    }
    return RunOutcome(label, records, jct, time.monotonic() - t0, stats)


def _vocab_size(model: str) -> int:
    """Vocabulary of ``--model`` when it is a spec we can read; token ids stay below it."""
    from asymcache_core.loaders import resolve_hf_config

    try:
        return int(resolve_hf_config(model)[0]["vocab_size"])
    except (ValueError, KeyError):
        return 32000  # NOTE: every Llama-family vocabulary is at least this large


def run_http(cfg: Any, trace: Trace, variants: list[BenchVariant], progress: Any = None) -> dict[str, RunOutcome]:
    """Runs the workload once per label against ``cfg.url`` (the server decides its own
    configuration; the labels name the server configurations being compared, one run each)."""
    import httpx

    try:
        models = httpx.get(cfg.url.rstrip("/") + "/v1/models", timeout=10.0).json()
        model = models["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"url: no OpenAI-compatible server at {cfg.url} ({exc})") from None
    vocab = _vocab_size(cfg.model)
    outcomes = {}
    for variant in variants:
        outcomes[variant.name] = asyncio.run(_run(cfg, trace, variant.name, model, vocab, variant.anonymous))
    return outcomes
