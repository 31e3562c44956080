"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from asymcache_core.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of logits.

    Greedy rows take ``argmax``; random rows use a per-request ``torch.Generator`` (seeded from
    the request's seed, or from the engine seed and the request id) so that a request's tokens do
    not depend on what else shares its batch.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed if params.seed is not None else hash((self.seed, request_id)) & 0x7FFFFFFF
            gen = torch.Generator().manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        outputs: list[list[int]],
    ) -> list[int]:
        """Samples for each row.

        Args:
            logits: ``[N, vocab]`` float32.
            request_ids: the row's request.
            params: the row's sampling parameters.
            outputs: the row's generated tokens so far (for logits processors).

        Returns:
            One token id per row.
        """
        tokens: list[int] = []
        greedy_rows = [i for i, p in enumerate(params) if p.greedy and not p.logits_processors]
        argmax = logits.argmax(dim=-1).tolist() if greedy_rows else []
        for i, p in enumerate(params):
            if p.greedy and not p.logits_processors:
                tokens.append(argmax[i])
                continue
            row = logits[i].float().cpu()
            for processor in p.logits_processors:
                row = processor(outputs[i], row)
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            row = row / p.temperature
            if p.top_k > 0:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
                sorted_probs = sorted_probs * keep
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            gen = self._generator(request_ids[i], p)
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
        return tokens
