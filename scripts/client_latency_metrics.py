"""The metrics of ``bench_client_latency.py``: client-observed TTFT and inter-token latency beside
the engine's, what the server adds, and the engine's step gaps. Pure functions of recorded
timestamps (no server, no model), unit-tested on synthetic ones."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClientRecord:
    """One streamed request as the client saw it.

    Attributes:
        bench_id: the id sent in ``X-Bench-Id`` (the engine request id).
        sent: when the client began the request.
        content_times: arrival time of each SSE chunk that carried content.
        status: the HTTP status.
        written: when the client's HTTP stack had written the whole request (None: not known).
    """

    bench_id: str
    sent: float
    content_times: list[float] = field(default_factory=list)
    status: int = 0
    written: float | None = None


@dataclass
class EngineRecord:
    """One request as the engine recorded it (engine clock).

    Attributes:
        arrival: when ``add_request`` took it.
        first_token: when its first token was sampled.
        token_times: when each token was sampled.
        received: when the server's ASGI app was called for it (None: not recorded).
        submitted: when the runtime's ``submit`` was called, the chat template rendered
            (None: not recorded); the prompt is tokenized and queued for the engine thread next.
        encoded: when the prompt's tokens came back from the tokenizer thread (None: not
            recorded); the command is queued for the engine thread right after.
    """

    arrival: float
    first_token: float | None
    token_times: list[float]
    received: float | None = None
    submitted: float | None = None
    encoded: float | None = None


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles (linear interpolation between closest ranks).

    Args:
        values: the samples (seconds).

    Returns:
        ``{"n", "mean", "p50", "p90", "p99"}``; NaN statistics for no samples.
    """
    xs = sorted(values)
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def compare(clients: Sequence[ClientRecord], engine: dict[str, EngineRecord]) -> dict[str, Any]:
    """Client-observed against engine-recorded latency for one load.

    Only requests answered 200 with at least one content chunk and an engine record count.

    Args:
        clients: the client's records.
        engine: the engine's records by request id.

    Returns:
        Summaries (:func:`summarize`) of ``client_ttft``, ``engine_ttft``, ``client_itl``,
        ``engine_itl``, ``before_engine`` (send -> arrival), ``first_delivery`` (first token
        sampled -> its chunk received) and ``token_delivery`` (every token of the requests
        whose content chunks pair one to one with their tokens), the parts of ``before_engine``
        when the server stamped them (``to_app``: send -> the ASGI app called; ``app_to_submit``:
        validation and the chat template; ``submit_to_arrival``: tokenizing and the wait for the
        engine thread, which takes commands between steps; split into ``tokenize`` and
        ``engine_queue`` when the encoder was stamped; ``client_write``: the client's own HTTP
        stack, ``written_to_app``), ``server_ttft`` (per request: the client's TTFT counted from
        the written request, less the engine's TTFT), plus ``requests``,
        ``paired_requests`` (those one-to-one requests) and ``unmatched`` (no engine record).
    """
    keys = ("client_ttft", "engine_ttft", "client_itl", "engine_itl", "before_engine", "first_delivery",
            "token_delivery", "to_app", "app_to_submit", "submit_to_arrival", "tokenize", "engine_queue",
            "client_write", "written_to_app", "server_ttft")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    used = paired = unmatched = 0
    for c in clients:
        e = engine.get(c.bench_id)
        if c.status != 200 or not c.content_times:
            continue
        if e is None or e.first_token is None or not e.token_times:
            unmatched += 1
            continue
        used += 1
        samples["client_ttft"].append(c.content_times[0] - c.sent)
        samples["engine_ttft"].append(e.first_token - e.arrival)
        samples["before_engine"].append(e.arrival - c.sent)
        if e.received is not None and e.submitted is not None:
            samples["to_app"].append(e.received - c.sent)
            if c.written is not None:
                samples["client_write"].append(c.written - c.sent)
                samples["written_to_app"].append(e.received - c.written)
            samples["app_to_submit"].append(e.submitted - e.received)
            samples["submit_to_arrival"].append(e.arrival - e.submitted)
            if e.encoded is not None:
                samples["tokenize"].append(e.encoded - e.submitted)
                samples["engine_queue"].append(e.arrival - e.encoded)
        samples["first_delivery"].append(c.content_times[0] - e.first_token)
        # what the server adds to this request's TTFT beyond the engine's own, from the moment
        # the client's HTTP stack had written it (the client's own overhead left out)
        start = c.written if c.written is not None else c.sent
        samples["server_ttft"].append((c.content_times[0] - start) - (e.first_token - e.arrival))
        samples["client_itl"].extend(b - a for a, b in zip(c.content_times, c.content_times[1:], strict=False))
        samples["engine_itl"].extend(b - a for a, b in zip(e.token_times, e.token_times[1:], strict=False))
        if len(c.content_times) == len(e.token_times):
            paired += 1
            samples["token_delivery"].extend(r - s for s, r in zip(e.token_times, c.content_times, strict=True))
    out: dict[str, Any] = {k: summarize(v) for k, v in samples.items()}
    out.update(requests=used, paired_requests=paired, unmatched=unmatched)
    return out


def server_share(result: dict[str, Any]) -> dict[str, float]:
    """How much of what the client sees the server adds.

    Args:
        result: one load's :func:`compare` output.

    Returns:
        ``itl_mean_share``: (client ITL mean - engine ITL mean) / client ITL mean;
        ``delivery_share``: mean per-token delivery delay / client ITL mean;
        ``ttft_p99_delay``: client TTFT p99 - engine TTFT p99 (seconds);
        ``server_ttft_p99``: p99 of the per-request TTFT the server adds (``server_ttft``);
        ``step_s``: the engine's mean inter-token gap (about one step).
    """
    c_itl, e_itl = result["client_itl"]["mean"], result["engine_itl"]["mean"]
    return {
        "itl_mean_share": (c_itl - e_itl) / c_itl if c_itl else math.nan,
        "delivery_share": result["token_delivery"]["mean"] / c_itl if c_itl else math.nan,
        "ttft_p99_delay": result["client_ttft"]["p99"] - result["engine_ttft"]["p99"],
        "server_ttft_p99": result["server_ttft"]["p99"],
        "step_s": e_itl,
    }


def markdown_rows(clients: int, result: dict[str, Any]) -> list[str]:
    """Table rows (milliseconds) for one load.

    Args:
        clients: concurrent clients.
        result: :func:`compare` output.

    Returns:
        Markdown rows: ``| clients | metric | mean | p50 | p90 | p99 | n |``.
    """
    names = [("client_ttft", "TTFT, client"), ("engine_ttft", "TTFT, engine"),
             ("before_engine", "send -> engine arrival"), ("to_app", "  send -> ASGI app"),
             ("client_write", "    send -> written (client)"), ("written_to_app", "    written -> ASGI app"),
             ("app_to_submit", "  app -> submit (validate, render)"),
             ("submit_to_arrival", "  submit -> arrival"), ("tokenize", "    tokenize"),
             ("engine_queue", "    queued -> engine arrival"),
             ("first_delivery", "first token -> client"),
             ("server_ttft", "TTFT added by the server (from written)"),
             ("client_itl", "ITL, client"), ("engine_itl", "ITL, engine"),
             ("token_delivery", "token sampled -> client")]
    rows = []
    for key, label in names:
        s = result[key]
        cells = " | ".join(f"{1000 * s[q]:.1f}" for q in ("mean", "p50", "p90", "p99"))
        rows.append(f"| {clients} | {label} | {cells} | {s['n']} |")
    return rows


def step_summary(steps: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The engine's steps of one load: their durations, and the engine thread's time between them.

    Args:
        steps: ``[start, duration_s, num_tokens, num_seqs]`` per step, in order.

    Returns:
        ``duration`` and ``gap`` (the end of one step to the start of the next while requests
        were running: commands, output dispatch, waiting for the GIL) summaries, and ``steps``.
    """
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(steps, steps[1:], strict=False)]
    # NOTE: a gap longer than a second is the engine idling between requests, not overhead.
    return {"steps": len(steps), "duration": summarize([st[1] for st in steps]),
            "gap": summarize([g for g in gaps if g < 1.0])}
