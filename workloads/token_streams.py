"""Concrete token ids for a job (:func:`job_token_stream`), drawn deterministically so that an
engine fed token ids sees the prefix sharing the trace describes: jobs with the same
``shared_prefix_id`` get byte-identical shared prefixes, jobs with equal leading
``block_hash_ids`` (imported Mooncake / Bailian traces) get identical leading blocks, and
everything else is private to the job.

NOTE: separate from :mod:`workloads.schema`: a trace only counts tokens; turning the counts into
ids is the backends' concern (the harness and the HTTP backend), seeded apart from the trace.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from workloads.schema import Job


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from any printable parts, stable across processes and Python versions.

    Python's ``hash()`` of a str is salted per process, so it cannot seed reproducible tokens.

    Args:
        *parts: Values whose ``repr`` identifies the stream (seed, namespace, ids).

    Returns:
        A non-negative integer suitable for ``numpy.random.default_rng``.
    """
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _draw(n: int, low: int, high: int, *parts: object) -> list[int]:
    if n <= 0:
        return []
    rng = np.random.default_rng(stable_seed(*parts))
    return rng.integers(low, high, size=n, dtype=np.int64).tolist()


def job_token_stream(
    job: Job,
    vocab_size: int,
    seed: int = 0,
    *,
    reserved: int = 16,
    high: int | None = None,
) -> list[list[int]]:
    """Deterministic token ids of each turn's new input.

    The first list is the whole first prompt: shared prefix, then the job-private system
    prompt, then turn 0's input. Later lists are just each turn's new input (the engine's own
    outputs sit between them in the context). Shared-prefix tokens depend only on
    ``(seed, shared_prefix_id)`` so jobs with the same id see identical prefixes (a shorter
    prefix is a prefix of a longer one); system and turn tokens depend on ``(seed, job_id)``.
    When the job has ``block_hash_ids``, the first ``len(block_hash_ids) * block_hash_size``
    tokens of the first prompt are drawn per block from ``(seed, hash id, position in block)``,
    so jobs with equal leading hash ids share exactly those blocks. Explicit
    ``Turn.input_token_ids`` are used verbatim and win over everything else.

    Args:
        job: The job.
        vocab_size: Model vocabulary size; the default upper bound of the ids.
        seed: Seed of the materialisation (independent of the generator seed).
        reserved: Lowest id drawn: ids below it (special tokens: BOS/EOS/pad/chat markers) are
            never produced.
        high: Exclusive upper bound of drawn ids; defaults to ``vocab_size``.

    Returns:
        ``len(job.turns)`` lists of ids; list 0 has ``job.first_prompt_tokens`` ids and list
        ``k > 0`` has ``job.turns[k].input_tokens`` ids.

    Raises:
        ValueError: The id range ``[reserved, high)`` is empty or exceeds the vocabulary.
    """
    hi = vocab_size if high is None else high
    if not 0 <= reserved < hi <= vocab_size:
        raise ValueError(
            f"token id range [{reserved}, {hi}) is empty or outside vocab_size {vocab_size}"
        )
    shared = (
        _draw(job.shared_prefix_tokens, reserved, hi, seed, "shared", job.shared_prefix_id)
        if job.shared_prefix_id is not None
        else []
    )
    system = _draw(job.system_tokens, reserved, hi, seed, "system", job.job_id)
    streams: list[list[int]] = []
    for k, turn in enumerate(job.turns):
        if turn.input_token_ids is not None:
            ids = list(turn.input_token_ids)
        else:
            ids = _draw(turn.input_tokens, reserved, hi, seed, "turn", job.job_id, k)
        streams.append(ids)
    first = shared + system + streams[0]
    if job.block_hash_ids and job.block_hash_size:
        fixed_from = len(shared) + len(system) if job.turns[0].input_token_ids is not None else None
        bs = job.block_hash_size
        for b, hid in enumerate(job.block_hash_ids):
            start = b * bs
            if start >= len(first):
                break
            end = min(start + bs, len(first))
            if fixed_from is not None:
                end = min(end, fixed_from)
                if start >= end:
                    break
            first[start:end] = _draw(bs, reserved, hi, seed, "block", bs, hid)[: end - start]
    streams[0] = first
    return streams
