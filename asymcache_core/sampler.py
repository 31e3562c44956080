"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds.

A row that raises (a logits processor, a degenerate distribution) fails only its own request:
:meth:`Sampler.sample` records it in :attr:`Sampler.failures` and the engine finishes that
request with the error while the batch's other rows keep their tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from asymcache_core.logprobs import TokenLogprob, token_logprobs
from asymcache_core.sampling_params import SamplingParams, processors_pass

logger = logging.getLogger(__name__)

#: The token of a row whose sampling failed (never handed to the scheduler).
FAILED = -1


def apply_penalties(
    row: torch.Tensor, params: SamplingParams, prompt: list[int] | None, output: list[int]
) -> torch.Tensor:
    """Logit bias, repetition, presence and frequency penalties on one ``[vocab]`` row.

    Args:
        row: float32 logits (a new tensor is returned; ``row`` is not modified).
        params: the request's parameters.
        prompt: its prompt ids (the repetition penalty covers them), or None.
        output: the tokens it generated so far.

    Returns:
        The rewritten row.
    """
    vocab = row.numel()
    row = row.clone()
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.long)
        vals = torch.tensor([v for t, v in params.logit_bias.items() if t < vocab], dtype=row.dtype)
        row.index_add_(0, ids, vals)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*(prompt or ()), *output) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = row[seen]
            p = params.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return row


class MinTokensMask:
    """A logits processor that bans the tokens that would end a request (EOS, its stop token
    ids) until it has generated ``min_tokens`` (vLLM's ``min_tokens``).

    Args:
        min_tokens: tokens to generate first.
        banned: the ids that end the request.
    """

    def __init__(self, min_tokens: int, banned: frozenset[int]) -> None:
        self.min_tokens = min_tokens
        self.banned = torch.tensor(sorted(banned), dtype=torch.long)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) < self.min_tokens and self.banned.numel():
            banned = self.banned[self.banned < logits.numel()]
            logits[banned] = float("-inf")
        return logits


class AllowedTokensMask:
    """A logits processor that leaves only ``allowed`` ids samplable (vLLM's
    ``allowed_token_ids``).

    Args:
        allowed: the ids that may be sampled (within the vocabulary).
    """

    def __init__(self, allowed: tuple[int, ...]) -> None:
        self.allowed = torch.tensor(sorted(set(allowed)), dtype=torch.long)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = self.allowed[self.allowed < logits.numel()]
        masked = torch.full_like(logits, float("-inf"))
        masked[keep] = logits[keep]
        return masked


class BadWordsMask:
    """A logits processor that never lets a bad word's token sequence complete (vLLM's
    ``bad_words``): each sequence's last token is banned where the output ends with the rest
    of it (a one-token word: always).

    Args:
        sequences: the words' token sequences (:func:`bad_word_sequences`).
    """

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for seq in self.sequences:
            head = len(seq) - 1
            if head <= len(output_token_ids) and (head == 0 or output_token_ids[-head:] == seq[:-1]):
                if seq[-1] < logits.numel():
                    logits[seq[-1]] = float("-inf")
        return logits


def bad_word_sequences(tokenizer: Any, words: tuple[str, ...]) -> list[list[int]]:
    """The token sequences of ``words`` as vLLM bans them: each word as written (its leading
    spaces removed) and with one leading space, the latter only where the space makes a token
    sequence of the same length that starts with another token (a word token of its own).

    Args:
        tokenizer: the model's tokenizer (``encode``).
        words: the bad words.

    Returns:
        The sequences, none empty.
    """
    out: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def with_engine_processors(
    params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any | None = None
) -> SamplingParams:
    """``params`` with the logits processors its own fields imply: a :class:`MinTokensMask`
    when it sets ``min_tokens``, an :class:`AllowedTokensMask` with ``allowed_token_ids``, a
    :class:`BadWordsMask` with ``bad_words`` (unchanged otherwise).

    NOTE: the ids that would end the request are banned until ``min_tokens``, so they never
    reach the scheduler's stop check; the processors run on the host sampling path.

    Args:
        params: the request's parameters.
        eos_token_ids: the model's end-of-sequence ids (banned unless ``ignore_eos``).
        tokenizer: the model's tokenizer (``bad_words`` needs one).

    Returns:
        The parameters to run.

    Raises:
        ValueError: ``bad_words`` without a tokenizer.
    """
    added: list[Any] = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer to encode them")
        added.append(BadWordsMask(bad_word_sequences(tokenizer, params.bad_words)))
    if params.allowed_token_ids is not None:
        added.append(AllowedTokensMask(params.allowed_token_ids))
    if params.min_tokens:
        banned = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        added.append(MinTokensMask(params.min_tokens, banned))
    if not added:
        return params
    return dataclasses.replace(params, logits_processors=(*params.logits_processors, *added))


class Sampler:
    """Samples one token per row of logits.

    Greedy rows take ``argmax``; random rows use a per-request ``torch.Generator`` (seeded from
    the request's seed, or from the engine seed and the request id) so that a request's tokens do
    not depend on what else shares its batch.

    Attributes:
        failures: request id -> error text of rows that failed in the last :meth:`sample`
            calls (taken with :meth:`take_failures`).
        logprobs: request id -> the :class:`~asymcache_core.logprobs.TokenLogprob` of its
            token, for rows whose request asks for log probabilities (taken with
            :meth:`take_logprobs`).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self.failures: dict[str, str] = {}
        self.logprobs: dict[str, TokenLogprob] = {}

    @staticmethod
    def on_device(params: SamplingParams) -> bool:
        """Whether a row with ``params`` is sampled by a plain argmax (on the device, with no
        host state: no generator, no penalties over the tokens so far). Its log probabilities,
        when asked for, are computed on the device too."""
        return params.greedy and not params.rewrites_logits

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def take_failures(self) -> dict[str, str]:
        """The failed rows since the last call (and forget them).

        Returns:
            Request id -> error text.
        """
        out, self.failures = self.failures, {}
        return out

    def take_logprobs(self) -> dict[str, TokenLogprob]:
        """The log probabilities of the rows sampled since the last call (and forget them).

        Returns:
            Request id -> its token's entry (only requests that ask for them).
        """
        out, self.logprobs = self.logprobs, {}
        return out

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            # NOTE: int64 seeds are mapped onto manual_seed's [0, 2**64) (non-negative ones unchanged).
            seed = params.seed % (1 << 64) if params.seed is not None else hash((self.seed, request_id)) & 0x7FFFFFFF
            gen = torch.Generator().manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]],
        prompts: list[list[int]] | None = None,
    ) -> list[int]:
        """Samples for each row.

        Args:
            logits: ``[N, vocab]`` float32.
            request_ids: the row's request.
            params: the row's sampling parameters.
            outputs: the row's generated tokens so far (for logits processors and penalties).
            prompts: the row's prompt ids (for the repetition penalty), if known.

        Returns:
            One token id per row; :data:`FAILED` for a row that raised (see :attr:`failures`).
        """
        tokens: list[int] = []
        # NOTE: a greedy row whose processors all pass this token (a thinking budget before its
        # limit) takes the device's argmax too: no copy of its logits to the host
        plain = [self.on_device(p) or (p.greedy and not p.rewrites_logits_otherwise
                                       and processors_pass(p.logits_processors, outputs[i]))
                 for i, p in enumerate(params)]
        argmax = logits.argmax(dim=-1).tolist() if any(plain) else []
        host = [i for i in range(len(params)) if not plain[i]]
        host_rows = self._host_rows(logits, host, params)
        for i, p in enumerate(params):
            if plain[i]:
                tokens.append(argmax[i])
                continue
            try:
                tokens.append(self._sample_row(host_rows[i], request_ids[i], p, outputs[i], prompts[i] if prompts else None))
            except Exception as exc:  # noqa: BLE001 - the row's request fails, not the batch
                logger.warning("sampling %s failed: %r", request_ids[i], exc)
                self.failures[request_ids[i]] = f"sampling failed: {type(exc).__name__}: {exc}"
                tokens.append(FAILED)
        want = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] != FAILED]
        if want:
            entries = token_logprobs(
                logits[want], [tokens[i] for i in want], [params[i].logprobs or 0 for i in want]
            )
            self.logprobs.update((request_ids[i], entry) for i, entry in zip(want, entries, strict=True))
        return tokens

    @staticmethod
    def _host_rows(logits: torch.Tensor, host: list[int], params: list[SamplingParams]) -> dict[int, torch.Tensor]:
        """The float32 host rows of ``host`` that processors may rewrite in place.

        NOTE: from a device, one copy of them all (one synchronization a step, not one a row).
        On the host, a row is used as it is, but for one whose log probabilities are asked
        for: that one is copied, so that they come from the logits the model gave (vLLM's
        ``raw_logprobs``), whatever its processors do to the row.
        """
        if not host:
            return {}
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return {i: logits[i].clone() if params[i].logprobs is not None else logits[i] for i in host}
        return dict(zip(host, logits[host].float().cpu(), strict=True))

    def _sample_row(
        self, logits: torch.Tensor, request_id: str, p: SamplingParams, output: list[int], prompt: list[int] | None
    ) -> int:
        row = logits.float().cpu()
        if p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            row = apply_penalties(row, p, prompt, output)
        for processor in p.logits_processors:
            row = processor(output, row)
        if p.greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
            # NOTE: the most likely token always stays (a tiny top_p rounds to 0 in float32).
            keep[0] = True
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            # NOTE: non-finite logits (every token masked, or an overflow): greedy on what is finite.
            finite = torch.nan_to_num(row, nan=float("-inf"))
            if not bool(torch.isfinite(finite).any()):
                raise ValueError("every token has a non-finite logit")
            return int(finite.argmax())
        gen = self._generator(request_id, p)
        return int(torch.multinomial(probs, 1, generator=gen))
