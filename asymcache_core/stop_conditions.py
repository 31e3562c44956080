"""The token-level stop conditions of a request, as the scheduler applies them after a step:
EOS and stop token ids, ``max_tokens``, ``max_model_len``.

Stop strings need text: the engine checks them while it detokenizes
(:meth:`asymcache_core.scheduler.Scheduler.finish_request`), as vLLM's output processor does.
"""

from __future__ import annotations

from collections.abc import Collection

from asymcache_core.request import Request, RequestStatus


def ends_on_length(request: Request, max_model_len: int | None) -> bool:
    """Whether the tokens in flight end ``request`` on length, whatever they are.

    Args:
        request: a running request with tokens in flight (async scheduling).
        max_model_len: the context limit, or ``None``.

    Returns:
        True when its output or its context reaches its limit once they land.
    """
    if len(request.output_token_ids) + request.num_pending >= request.params.max_tokens:
        return True
    return max_model_len is not None and request.num_planned_tokens >= max_model_len


def check_stop(
    request: Request, token: int, eos_token_ids: Collection[int], max_model_len: int | None
) -> RequestStatus | None:
    """The status that ``token``, just appended, ends ``request`` with, or ``None``.

    EOS (unless ignored) and the request's stop token ids stop it; otherwise reaching
    ``max_tokens`` output tokens or ``max_model_len`` context tokens ends it on length.

    Args:
        request: the request, ``token`` already appended.
        token: the token.
        eos_token_ids: the model's end-of-sequence tokens.
        max_model_len: the context limit, or ``None``.

    Returns:
        ``FINISHED_STOPPED``, ``FINISHED_LENGTH`` or ``None`` (it goes on).
    """
    params = request.params
    if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if max_model_len is not None and request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
