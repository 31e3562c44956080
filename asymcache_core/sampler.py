"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds.

A row that raises (a logits processor, a degenerate distribution) fails only its own request:
:meth:`Sampler.sample` records it in :attr:`Sampler.failures` and the engine finishes that
request with the error while the batch's other rows keep their tokens.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from asymcache_core.batched_penalties import prompt_ids, with_penalties
from asymcache_core.batched_sampling import RowSettings, SampledRows, sample_rows
from asymcache_core.logprobs import TokenLogprob, token_logprobs
from asymcache_core.request_masks import (  # noqa: F401 - re-exported: their home was here
    AllowedTokensMask,
    BadWordsMask,
    MinTokensMask,
    bad_word_sequences,
    with_engine_processors,
)
from asymcache_core.sampling_params import SamplingParams, processors_pass
from asymcache_core.token_masks import (
    apply_keep,
    keep_words,
    masks_only,
    stacked_keep,
)

logger = logging.getLogger(__name__)

#: The token of a row whose sampling failed (never handed to the scheduler).
FAILED = -1
#: The error of a row with nothing to draw (no logit above ``-inf``, NaNs aside).
NON_FINITE = "sampling failed: every token has a non-finite logit"
#: The error of such a row of a request whose constraints mask tokens: they exclude every one
#: (``allowed_token_ids`` outside a grammar's choices, ``min_tokens`` where a grammar allows
#: only the end): the request's fault, not the model's.
NOTHING_ALLOWED = (
    "sampling failed: the request's constraints allow no token here (allowed_token_ids, the "
    "structured output or tool-call grammar, min_tokens and bad_words exclude every token)"
)


class Sampler:
    """Samples one token per row of logits.

    Greedy rows take ``argmax``. Random rows draw by the Gumbel-max race keyed by the row's
    seed (its request's ``seed``, or one derived from the engine seed and the request id) and
    the index of the token it samples (:mod:`asymcache_core.batched_sampling`): a request's
    tokens do not depend on what else shares its batch, nor on how often its KV was rebuilt.
    Rows without logits processors sample together where the logits are (on the device),
    penalties and bias applied there; so do rows whose processors only mask tokens (grammars,
    ``allowed_token_ids``, ``min_tokens``, ``bad_words``: :mod:`asymcache_core.token_masks`),
    their masks built on the host and applied there; the others are rewritten on the host
    first, then drawn the same way there.

    Attributes:
        failures: request id -> error text of rows that failed in the last :meth:`sample`
            calls (taken with :meth:`take_failures`).
        logprobs: request id -> the :class:`~asymcache_core.logprobs.TokenLogprob` of its
            token, for rows whose request asks for log probabilities (taken with
            :meth:`take_logprobs`).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._seeds: dict[str, int] = {}
        #: request id -> its distinct prompt ids on the device (the repetition penalty's)
        self._prompts: dict[str, torch.Tensor] = {}
        self.failures: dict[str, str] = {}
        self.logprobs: dict[str, TokenLogprob] = {}
        #: requests whose rows were masked or rewritten by their processors (until forgotten):
        #: a row of theirs with nothing to draw fails with :data:`NOTHING_ALLOWED`
        self._constrained: set[str] = set()

    @staticmethod
    def on_device(params: SamplingParams) -> bool:
        """Whether a row with ``params`` samples where its logits are without waiting for the
        step before: no logits processor (a processor must see the previous token; the engine
        turns ``min_tokens``, ``allowed_token_ids`` and ``bad_words`` into processors, and rows
        whose processors only mask are still masked and sampled there, in the synchronous
        :meth:`sample`); greedy or at random with temperature, top-k, top-p and min-p, a logit
        bias and the repetition, presence and frequency penalties. Its log probabilities, when
        asked for, are computed there too (from the model's logits)."""
        return not params.logits_processors

    def forget(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._constrained.discard(request_id)

    def _prompt_ids(self, request_id: str, prompt: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A request's distinct prompt ids on the logits' device, built at its first draw with
        a repetition penalty and kept until it is forgotten (a prompt does not change)."""
        ids = self._prompts.get(request_id)
        if ids is None or ids.device != logits.device:
            ids = self._prompts[request_id] = prompt_ids(prompt, logits.shape[-1], logits.device)
        return ids

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
            Request id -> the entry of the token it sampled.
        """
        out, self.logprobs = self.logprobs, {}
        return out

    def row_seed(self, request_id: str, params: SamplingParams) -> int:
        """The seed a request's random rows draw with, in ``[0, 2**64)``."""
        if params.seed is not None:
            # NOTE: int64 seeds are mapped onto [0, 2**64) (non-negative ones unchanged).
            return params.seed % (1 << 64)
        seed = self._seeds.get(request_id)
        if seed is None:
            digest = hashlib.blake2b(f"{self.seed}/{request_id}".encode(), digest_size=8).digest()
            seed = self._seeds[request_id] = int.from_bytes(digest, "little")
        return seed

    def sample_on_device(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        draws: list[int],
        outputs: list[list[int]] | None = None,
        prompts: list[list[int]] | None = None,
        pending: torch.Tensor | None = None,
        keep: tuple[list[int], np.ndarray] | None = None,
    ) -> SampledRows:
        """Samples every row where ``logits`` are, without copying them anywhere.

        Args:
            logits: ``[N, vocab]``; every row samples there (:meth:`on_device`).
            request_ids: the row's request.
            params: the row's sampling parameters.
            draws: the index of the output token each row samples.
            outputs: each row's generated tokens on the host (for penalties).
            prompts: each row's prompt ids (for the repetition penalty).
            pending: ``[N]`` int64 on the device, each row's token sampled by the step in
                flight and not on the host yet (``-1``: none; for penalties).
            keep: rows masked by their processors and their packed masks
                (:mod:`asymcache_core.token_masks`), applied after the penalties.

        Returns:
            The tokens and failure marks, on ``logits``' device (the caller reads them).
        """
        model_logits = logits
        logits = self._penalized(logits, request_ids, params, outputs, prompts, pending)
        masked_out = None
        if keep is not None:
            # NOTE: the model's logits stay as they are: log probabilities read them
            logits = apply_keep(logits.clone() if logits is model_logits else logits, *keep)
            self._constrained.update(request_ids[i] for i in keep[0])
            # NOTE: argmax of a row masked whole would pick token 0: such rows fail instead
            masked_out = torch.isneginf(logits.amax(dim=-1))
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            # NOTE: argmax cannot fail otherwise: no marks to compute or copy back
            return SampledRows(logits.argmax(dim=-1), masked_out)
        settings = RowSettings(
            [params[i] for i in rand], [self.row_seed(request_ids[i], params[i]) for i in rand], [draws[i] for i in rand]
        )
        if len(rand) == len(params):
            return sample_rows(logits, settings)
        index = torch.tensor(rand, dtype=torch.int64).to(logits.device, non_blocking=True)
        drawn = sample_rows(logits.index_select(0, index), settings)
        failed = torch.zeros(len(params), dtype=torch.bool, device=logits.device).index_copy(0, index, drawn.failed)
        if masked_out is not None:
            failed |= masked_out
        return SampledRows(logits.argmax(dim=-1).index_copy(0, index, drawn.tokens), failed)

    def _penalized(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]] | None,
        prompts: list[list[int]] | None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``logits`` with the rows' bias and penalties (:func:`with_penalties`), the prompt ids
        of the repetition penalty taken from :meth:`_prompt_ids`."""
        prompt_tensors = None
        if prompts is not None and any(p.repetition_penalty != 1.0 for p in params):
            prompt_tensors = [
                self._prompt_ids(rid, prompt, logits) if p.repetition_penalty != 1.0 else None
                for rid, prompt, p in zip(request_ids, prompts, params, strict=True)
            ]
        return with_penalties(logits, params, outputs, prompt_tensors, pending)

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]],
        prompts: list[list[int]] | None = None,
        draws: list[int] | None = None,
    ) -> list[int]:
        """Samples for each row.

        Args:
            logits: ``[N, vocab]`` float32.
            request_ids: the row's request.
            params: the row's sampling parameters.
            outputs: the row's generated tokens so far (for logits processors and penalties).
            prompts: the row's prompt ids (for the repetition penalty), if known.
            draws: the index of the output token each row samples (default: the length of
                its ``outputs``).

        Returns:
            One token id per row; :data:`FAILED` for a row that raised (see :attr:`failures`).
        """
        draws = draws if draws is not None else [len(out) for out in outputs]
        tokens = [FAILED] * len(params)
        # NOTE: a row whose processors all pass this token (a thinking budget before its limit)
        # samples where its logits are too: no copy of them to the host; so does a row whose
        # processors only mask (grammars, allowed ids, min_tokens, bad words), its mask built
        # here and applied there
        plain = [processors_pass(p.logits_processors, outputs[i]) for i, p in enumerate(params)]
        masks, unmasked = self.row_masks(logits.shape[-1], request_ids, params, outputs, plain)
        on_device = [i for i in range(len(params)) if plain[i] or i in masks]
        if on_device:
            keep = stacked_keep(masks, on_device)
            drawn = self.sample_on_device(
                logits if len(on_device) == len(params) else logits[on_device],
                [request_ids[i] for i in on_device], [params[i] for i in on_device], [draws[i] for i in on_device],
                [outputs[i] for i in on_device], [prompts[i] for i in on_device] if prompts else None, keep=keep,
            )
            self._take(on_device, drawn, request_ids, tokens)
        host = [
            i for i in range(len(params))
            if not plain[i] and i not in masks and i not in unmasked
        ]
        if host:
            self._sample_on_host(logits, host, request_ids, params, outputs, prompts, draws, tokens)
        want = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] != FAILED]
        if want:
            entries = token_logprobs(
                logits[want], [tokens[i] for i in want], [params[i].logprobs or 0 for i in want]
            )
            self.logprobs.update((request_ids[i], entry) for i, entry in zip(want, entries, strict=True))
        return tokens

    def row_masks(
        self,
        vocab: int,
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]],
        plain: list[bool],
    ) -> tuple[dict[int, np.ndarray | None], set[int]]:
        """Row -> its packed mask (``None``: it keeps every token) for the rows not ``plain``
        whose processors only mask, and the rows whose processor raised (recorded: their
        requests fail alone). :meth:`sample` builds its masks here, and so does the model
        runner for rows sampled in async scheduling's pipeline."""
        out: dict[int, np.ndarray | None] = {}
        failed: set[int] = set()
        for i, p in enumerate(params):
            if plain[i] or not masks_only(p.logits_processors):
                continue
            try:
                out[i] = keep_words(p.logits_processors, outputs[i], vocab)
            except Exception as exc:  # noqa: BLE001 - the row's request fails, not the batch
                self.record_failure(request_ids[i], exc)
                failed.add(i)
        return out, failed

    def record_failure(self, request_id: str, exc: Exception) -> None:
        """Records a row whose processor raised: its request fails, not the batch."""
        logger.warning("sampling %s failed: %r", request_id, exc)
        self.failures[request_id] = f"sampling failed: {type(exc).__name__}: {exc}"

    def take_drawn(self, drawn_tokens: list[int], failed: list[bool] | None, request_ids: list[str]) -> dict[str, int]:
        """The tokens of a device draw read back on the host, failed rows recorded and left out
        (``failed`` ``None``: none can have failed).

        Returns:
            Request id -> token, for the rows that did not fail.
        """
        tokens = self._by_row(drawn_tokens, failed, request_ids)
        return {rid: t for rid, t in zip(request_ids, tokens, strict=True) if t != FAILED}

    def _by_row(self, drawn_tokens: list[int], failed: list[bool] | None, request_ids: list[str]) -> list[int]:
        """Each row's token (:data:`FAILED` where it failed, recorded under its request).

        NOTE: by row, not by request id: the rows after a request's drafts share its id.
        """
        for rid, bad in zip(request_ids, failed or (), strict=False):
            if bad:
                self.failures[rid] = NOTHING_ALLOWED if rid in self._constrained else NON_FINITE
        return drawn_tokens if failed is None else [FAILED if bad else t for t, bad in zip(drawn_tokens, failed, strict=True)]

    def _take(self, rows: list[int], drawn: SampledRows, request_ids: list[str], tokens: list[int]) -> None:
        failed = drawn.failed.tolist() if drawn.failed is not None else None
        for i, token in zip(rows, self._by_row(drawn.tokens.tolist(), failed, [request_ids[i] for i in rows]), strict=True):
            tokens[i] = token

    def _sample_on_host(
        self,
        logits: torch.Tensor,
        host: list[int],
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]],
        prompts: list[list[int]] | None,
        draws: list[int],
        tokens: list[int],
    ) -> None:
        """Copies the ``host`` rows to the host (one copy), applies their bias and penalties as
        the device does, runs their logits processors and samples them; a row that raises
        fails alone.

        NOTE: the rows are a copy, so processors may rewrite them in place while the log
        probabilities still read the model's logits (vLLM's ``raw_logprobs``).
        """
        ids, host_params = [request_ids[i] for i in host], [params[i] for i in host]
        rows = self._penalized(
            logits[host].float().cpu(), ids, host_params, [outputs[i] for i in host],
            [prompts[i] for i in host] if prompts else None,
        )
        rand: list[int] = []
        rewritten: list[torch.Tensor] = []
        for k, i in enumerate(host):
            p = params[i]
            try:
                row = rows[k]
                for processor in p.logits_processors:
                    row = processor(outputs[i], row)
            except Exception as exc:  # noqa: BLE001 - the row's request fails, not the batch
                self.record_failure(request_ids[i], exc)
                continue
            self._constrained.add(request_ids[i])
            if p.greedy:
                if bool(torch.isneginf(row.max())):
                    self.failures[request_ids[i]] = NOTHING_ALLOWED  # argmax would pick token 0
                    continue
                tokens[i] = int(row.argmax())
            else:
                rand.append(i)
                rewritten.append(row.float())
        if rand:
            drawn = sample_rows(torch.stack(rewritten), RowSettings(
                [params[i] for i in rand], [self.row_seed(request_ids[i], params[i]) for i in rand], [draws[i] for i in rand]
            ))
            self._take(rand, drawn, request_ids, tokens)
