"""The engine's checks: a request's input before it is queued, and the invariants between the
engine's parts (:meth:`Engine.check_integrity <asymcache_core.engine.Engine.check_integrity>`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asymcache_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asymcache_core.engine import Engine


def truncated_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt ids a request runs: the last ``params.truncate_prompt_tokens`` of ``ids``
    (vLLM's, before any length check; -1 keeps what leaves room for one generated token, where
    vLLM's ``max_model_len`` would fail that check), or all of them."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return ids
    return ids[-(max_model_len - 1 if keep == -1 else keep) :]


def check_id(name: str, value: object, *, optional: bool = False) -> None:
    """Rejects an id (a request's, a job's) that is not a non-empty string (``None`` too,
    unless ``optional``).

    Raises:
        ValueError: naming ``name``.
    """
    if (value is not None or not optional) and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}: a non-empty string{' or None' if optional else ''}, got {value!r}")


def check_seconds(name: str, value: object, *, allow_negative: bool = False) -> None:
    """Rejects a time that is not a finite number of seconds (or is negative, unless
    ``allow_negative``: an engine time may be).

    Raises:
        ValueError: naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}: a finite number of seconds, got {value!r}")
    if value < 0 and not allow_negative:
        raise ValueError(f"{name}: must be >= 0, got {value!r}")


def check_request_fields(
    prompt: object, request_id: object, job_id: object, is_last_step: object, priority: object,
    continues_job: object,
) -> None:
    """Rejects :meth:`Engine.add_request <asymcache_core.engine.Engine.add_request>`'s
    arguments of the wrong type before anything is queued (a priority that is no number would
    break the scheduler's sort of every later step, not this request alone).

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(prompt, str) and (
        not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray)
    ):
        raise ValueError(f"prompt: a string or a list of token ids, got {type(prompt).__name__}")
    for name, value in (("request_id", request_id), ("job_id", job_id), ("continues_job", continues_job)):
        check_id(name, value, optional=True)
    if not isinstance(is_last_step, bool):
        raise ValueError(f"is_last_step: True or False, got {is_last_step!r}")
    if isinstance(priority, bool) or not isinstance(priority, int | float) or not math.isfinite(priority):
        raise ValueError(f"priority: a finite number, got {priority!r}")


def validate_request(
    ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    """Rejects a request the engine could never run.

    Args:
        ids: the prompt's token ids.
        params: its sampling parameters.
        vocab_size: the model's vocabulary.
        max_model_len: the engine's context limit.
        block_size: tokens a KV block holds.
        num_blocks: blocks of the device pool.

    Raises:
        ValueError: naming the field: an empty prompt, ids out of vocabulary (in the prompt,
            ``logit_bias`` or ``stop_token_ids``), a prompt too long for ``max_model_len``, or
            a request that could outgrow the whole pool.
    """
    if not ids:
        raise ValueError("prompt: must contain at least one token")
    # NOTE: agent contexts run to ~100k ids a turn; the types, min and max are walked in C and
    # the Python scan that names the bad id runs only when one exists (a per-id generator was
    # ~5% of a simulated SWE run).
    kinds = set(map(type, ids))
    if bool in kinds or not all(issubclass(kind, int) for kind in kinds) or min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size)
        raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    for name, token_ids in (
        ("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = next((t for t in token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(ids)} tokens do not fit max_model_len={max_model_len} "
            "(at least one token must be generated)"
        )
    longest = min(len(ids) + params.max_tokens, max_model_len)
    blocks = -(-longest // block_size)
    if blocks > num_blocks:
        raise ValueError(
            f"num_kv_blocks: the request needs up to {blocks} KV blocks "
            f"(prompt {len(ids)} + max_tokens {params.max_tokens}) but the pool has {num_blocks}"
        )


def check_engine_integrity(engine: Engine) -> None:
    """Every part's own invariants, then: every block's ref count is the number of requests
    (and prefetches) that hold it, its pin count the number of pins that hold it, and the model
    runner's block-table rows match the requests' block lists.

    Raises:
        AssertionError: naming the first block or part that breaks an invariant.
    """
    engine.pool.check_integrity()
    if engine.host_tier is not None:
        engine.host_tier.check_integrity()
    if engine.continuum.ttft_target is not None:
        engine.continuum.ttft_target.check_integrity()
    if engine.job_admission is not None:
        engine.job_admission.check_integrity()
    if engine.implicit_jobs is not None:
        engine.implicit_jobs.check_integrity()
    requests = engine.scheduler.running + engine.scheduler.waiting
    table_rows = getattr(engine.runner, "block_table_rows", None)  # the model runner's, on a real backend
    if table_rows is not None:
        table_rows.check_integrity(requests)
    refs: dict[int, int] = {}
    for request in requests:
        for b in engine.kv.held_blocks(request):
            refs[b] = refs.get(b, 0) + 1
    for b in engine.kv.prefetch_held_blocks():
        refs[b] = refs.get(b, 0) + 1
    for block in engine.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {refs.get(block.block_id, 0)}"
        )
    pinned: dict[int, int] = {}
    for pin in engine.pins.pins.values():
        for b in pin.block_ids:
            pinned[b] = pinned.get(b, 0) + 1
    for block in engine.pool.blocks:
        assert block.pin_cnt == pinned.get(block.block_id, 0), f"block {block.block_id}: pin count"


__all__ = ["check_engine_integrity", "validate_request"]
