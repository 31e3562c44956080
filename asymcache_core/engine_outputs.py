"""The engine's output path: a request's text from its tokens, stop strings, the
:class:`~asymcache_core.request.RequestOutput` a step returns for it, and the blocking
:meth:`Engine.generate <asymcache_core.engine.Engine.generate>` that collects them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from asymcache_core.detokenizer import detokenize_incrementally
from asymcache_core.engine_stats import CompletionOutput, GenerationOutput
from asymcache_core.logprobs import TokenLogprob
from asymcache_core.request import Request, RequestOutput, RequestStatus
from asymcache_core.sampling_params import SamplingParams, choice_params
from asymcache_core.scheduler_output import RequestUpdate

if TYPE_CHECKING:
    from asymcache_core.engine import Engine
    from asymcache_core.scheduler import Scheduler


def request_output(request: Request, new: list[int]) -> RequestOutput:
    """The output of ``request`` after a step that appended ``new`` tokens to it."""
    # NOTE: detokenize_step keeps request.text current (decoded incrementally, cut at a stop).
    reason = request.status.value if request.finished else None
    text = request.text
    params = request.params
    if params.stop and not request.finished and not params.include_stop_str_in_output:
        # NOTE: text that may be the start of a stop string is held back until the next tokens
        # tell: a stream must never show part of a stop string (vLLM's and OpenAI's rule)
        text = text[: len(text) - stop_prefix_length(text, params.stop)]
    return RequestOutput(
        request.request_id, new, list(request.output_token_ids), text, request.finished,
        reason, request.metrics, request.num_prompt_tokens, request.error,
        list(request.logprobs) if request.logprobs is not None else None,
        # NOTE: a tuple once every prompt entry is computed (a list before: not reported yet)
        request.prompt_logprobs if isinstance(request.prompt_logprobs, tuple) else None,
        _stop_reason(request),
    )


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops`` (0: none).

    The text before it can never be part of a stop string, whatever tokens come next, so
    what a stream shows grows only (a later stop string starts at or after it).
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _stop_reason(request: Request) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended ``request`` (None
    for an EOS: the scheduler records the token either way)."""
    if request.status is not RequestStatus.FINISHED_STOPPED:
        return None
    reason = request.stop_reason
    if isinstance(reason, int) and reason not in request.params.stop_token_ids:
        return None
    return reason


def attach_logprobs(
    updates: Sequence[RequestUpdate], entries: Mapping[str, TokenLogprob],
    after_drafts: Mapping[str, list[TokenLogprob]] | None = None,
) -> None:
    """Appends each update's tokens' log probabilities to its request (those that ask): its
    sampled token's, then those of the drafts its run kept (``after_drafts``: the rows after
    each draft, in order; speculative decoding).

    NOTE: only tokens that were appended get their entry (a token dropped because its request
    ended meanwhile drops its log probabilities too), so ``request.logprobs`` stays aligned
    with ``output_token_ids``.
    """
    if not entries:
        return
    for update in updates:
        rid = update.request.request_id
        entry = entries.get(rid)
        if entry is not None and update.request.logprobs is not None:
            update.request.logprobs.append(entry)
            kept = len(update.new_token_ids) - 1
            if kept and after_drafts and rid in after_drafts:
                update.request.logprobs.extend(after_drafts[rid][:kept])


def attach_prompt_logprobs(
    requests: Mapping[str, Request], parts: Mapping[str, list[tuple[int, list[TokenLogprob]]]]
) -> None:
    """Adds each request's computed prompt log probabilities (runs of ``(first position,
    entries)``, :meth:`ModelRunner.take_prompt_logprobs`) to it; a request that ended meanwhile
    is skipped."""
    for rid, runs in parts.items():
        request = requests.get(rid)
        if request is None:
            continue
        for start, entries in runs:
            request.add_prompt_logprobs(start, entries)


def detokenize_step(tokenizer: Any, request: Request, scheduler: Scheduler, now: float, new_tokens: int = 1) -> int:
    """Extends ``request.text`` by its new tokens; a stop string found in it ends the request.

    NOTE: the scheduler has already applied the token-level stops; a stop string (text) is
    found only here, so its request is freed after the step's other finished requests (as
    vLLM's output processor aborts it), and it overrides an EOS or length finish of the
    same token (the text is cut at the stop string either way).

    Args:
        tokenizer: the engine's tokenizer.
        request: a request the step gave tokens.
        scheduler: finishes the request a stop string ends.
        now: engine time.
        new_tokens: the tokens the step appended (several: a run of drafts kept).

    Returns:
        The new tokens dropped: those after the one whose text completed a stop string (a
        run is decoded one token at a time, as decoding without drafts would: the request
        ends on the same token, with the same text).
    """
    params = request.params
    ids = request.output_token_ids
    if new_tokens <= 1 or not params.stop:
        _detokenize(tokenizer, request, scheduler, now, _text_token_ids(request), len(ids), request.finished)
        return 0
    for n in range(len(ids) - new_tokens + 1, len(ids) + 1):
        last = n == len(ids)
        text_ids = _text_token_ids(request) if last else ids[:n]
        if _detokenize(tokenizer, request, scheduler, now, text_ids, n, last and request.finished) and not last:
            # NOTE: the tokens after the stop's were never sampled without drafts
            dropped = len(ids) - n
            del request.output_token_ids[n:]
            del request.all_token_ids[len(request.all_token_ids) - dropped :]
            del request.metrics.token_times[len(request.metrics.token_times) - dropped :]
            if request.logprobs is not None:
                del request.logprobs[n:]
            return dropped
    return 0


def _detokenize(
    tokenizer: Any, request: Request, scheduler: Scheduler, now: float, ids: list[int], count: int, final: bool
) -> bool:
    """Decodes ``ids`` (the text's tokens of the first ``count`` output tokens) past what the
    request's text holds; ends the request on a stop string (True)."""
    params = request.params
    detok = request.detok
    before = len(detok.text)
    new = detokenize_incrementally(tokenizer, ids, detok, final=final, skip_special_tokens=params.skip_special_tokens)
    request.text = detok.text
    if not (new and params.stop) or count < params.min_tokens:
        return False
    # NOTE: only text that can hold a stop string for the first time is searched: the new
    # piece and the longest stop string's length before it. The first stop string of the
    # list that occurs wins (vLLM's rule).
    start = max(0, before - max(len(stop) for stop in params.stop) + 1)
    for stop in params.stop:
        idx = detok.text.find(stop, start)
        if idx >= 0:
            request.text = detok.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
            scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, now, stop)
            return True
    return False


def flush_text(tokenizer: Any, request: Request) -> None:
    """Decodes what an unfinished character held back, for a request that ends early (abort)."""
    detokenize_incrementally(
        tokenizer, _text_token_ids(request), request.detok, final=True,
        skip_special_tokens=request.params.skip_special_tokens,
    )
    request.text = request.detok.text


def _text_token_ids(request: Request) -> list[int]:
    """The output tokens its text is decoded from.

    NOTE: the EOS or stop token id that ended the request is left out of the text, as vLLM's
    detokenizer leaves it (kept with ``include_stop_str_in_output``): with special tokens
    skipped an EOS has no text anyway, but a stop id may be a plain token, and with
    ``skip_special_tokens=False`` the EOS would read ``<|im_end|>``.
    """
    ids = request.output_token_ids
    if (
        request.status is RequestStatus.FINISHED_STOPPED and isinstance(request.stop_reason, int)
        and not request.params.include_stop_str_in_output
    ):
        return ids[:-1]
    return ids


def generate_blocking(
    engine: Engine,
    prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None,
    job_ids: Sequence[str | None] | None,
) -> list[GenerationOutput]:
    """:meth:`Engine.generate <asymcache_core.engine.Engine.generate>`: queues every prompt's
    choices (none if one is rejected), steps until all are finished, returns one output per
    prompt in order, its choices in ``outputs``."""
    if not isinstance(prompts, str | Sequence) or isinstance(prompts, bytes | bytearray):
        raise ValueError(f"prompts: a prompt (a string or token ids) or a list of them, got {type(prompts).__name__}")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item]
    prompts = list(prompts)  # type: ignore[arg-type]
    if params is None or isinstance(params, SamplingParams):
        params_list = [params or SamplingParams()] * len(prompts)
    else:
        params_list = list(params)
        if len(params_list) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or a single one")
    if job_ids is not None and (isinstance(job_ids, str) or len(job_ids) != len(prompts)):
        raise ValueError(f"job_ids: one job id (or None) per prompt: {len(prompts)}")
    for i, p in enumerate(params_list):
        if isinstance(p, SamplingParams) and p.n > 1 and job_ids is not None and job_ids[i] is not None:
            # NOTE: a job's turn is one sequence (its KV is pinned for the job's next turn,
            # which extends that one context): the server's rule for n with a job id
            raise ValueError(f"job_ids[{i}]: a job's turn has one choice; use n=1 or no job id for n={p.n}")
    choice_ids: list[list[str]] = []
    prompt_ids: dict[str, list[int]] = {}
    queued: list[str] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            job_id = job_ids[i] if job_ids else None
            ids: list[str] = []
            # NOTE: a prompt's choices are separate requests that share its prompt blocks
            # through the prefix cache once the first has computed them
            for child in choice_params(p) if isinstance(p, SamplingParams) else [p]:
                rid = engine.add_request(prompt, child, job_id=job_id, joins_conversation=len(ids) == 0)
                ids.append(rid)
                queued.append(rid)
            choice_ids.append(ids)
            # NOTE: the request's own ids: ``truncate_prompt_tokens`` may have cut the encoded ones
            prompt_ids[ids[0]] = engine.requests[ids[0]].prompt_token_ids
    except Exception as exc:
        # NOTE: none queued if one is rejected, whatever the error
        for rid in queued:
            engine.abort(rid, emit=False)
        if isinstance(exc, ValueError) and len(prompts) > 1 and str(exc).startswith("prompt:"):
            raise ValueError(f"prompts[{len(choice_ids)}]: {str(exc).removeprefix('prompt: ')}") from None
        raise
    finals: dict[str, RequestOutput] = {}
    while len(finals) < len(queued):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    results = []
    for ids in choice_ids:
        choices = tuple(_completion(index, finals[rid]) for index, rid in enumerate(ids))
        first = finals[ids[0]]
        results.append(
            GenerationOutput(
                ids[0], prompt_ids[ids[0]], first.token_ids, first.text, first.finish_reason, first.metrics,
                first.logprobs, first.prompt_logprobs, first.stop_reason, choices,
            )
        )
    return results


def _completion(index: int, out: RequestOutput) -> CompletionOutput:
    """Choice ``index`` of a prompt, from its request's final output."""
    cumulative = math.fsum(entry.logprob for entry in out.logprobs) if out.logprobs is not None else None
    return CompletionOutput(
        index, out.request_id, out.token_ids, out.text, out.finish_reason, out.stop_reason, out.logprobs,
        cumulative, out.metrics,
    )


__all__ = [
    "attach_logprobs", "attach_prompt_logprobs", "detokenize_step", "flush_text", "generate_blocking",
    "request_output", "stop_prefix_length",
]
