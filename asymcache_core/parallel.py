"""Tensor parallelism: how a Llama-family decoder is split over ranks, and the collectives.

Each rank holds a share of every attention head group, of the MLP's intermediate width and of
the vocabulary; the hidden width (norms, residual stream) is replicated. Per layer the
attention output projection and the MLP's down projection are row-parallel (each rank's partial
sum is all-reduced); the embedding and the logits are vocab-parallel.

Heads split by KV group, never inside one: a rank holds whole groups of query heads with their
KV head, so its attention is an ordinary GQA over its own heads and its KV cache holds only its
KV heads. Shares may be uneven (SmolLM2's 3 KV heads over 2 ranks: 2 and 1): the collectives do
not need equal shares of heads, and the vocab-parallel gather pads to the largest share. With
more ranks than KV heads each KV head is replicated over ``ranks / kv_heads`` ranks that split
its query heads, as vLLM does.

Nothing here is global: the model gets its :class:`TensorShard` and :class:`TensorParallelGroup`
at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asymcache_core.models.config import ModelConfig


def _even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, sizes differing by at most one
    (the larger ones first)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class TensorShard:
    """One rank's share of the model.

    Attributes:
        rank: this rank.
        size: the number of ranks.
        q_heads: ``[start, end)`` of the query heads it holds.
        kv_heads: ``[start, end)`` of the KV heads it holds (shared with other ranks when
            there are more ranks than KV heads).
        intermediate: ``[start, end)`` of the MLP's intermediate width.
        vocab: ``[start, end)`` of the vocabulary (embedding rows and logits).
        vocab_size: the whole vocabulary.
    """

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_size: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def max_vocab_share(self) -> int:
        """The widest vocab share of any rank (the padded gather's width)."""
        return -(-self.vocab_size // self.size)


def plan_tensor_shards(cfg: ModelConfig, size: int) -> list[TensorShard]:
    """Every rank's share of ``cfg`` over ``size`` ranks.

    Raises:
        ValueError: ``size`` below 1, or a split that would cut a KV group's heads unevenly
            (more ranks than KV heads where the ranks are not a multiple of the KV heads, or
            a group of query heads the replicas cannot split evenly).
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    group = heads // kv
    if size <= kv:
        kv_ranges = _even_ranges(kv, size)
        q_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        replicas = size // kv
        if size % kv or group % replicas:
            raise ValueError(
                f"tensor_parallel_size: {size} ranks cannot split {kv} KV heads of {group} query heads "
                f"each (use at most {kv} ranks, or a multiple of {kv} that divides {heads})"
            )
        kv_ranges, q_ranges = [], []
        per = group // replicas
        for rank in range(size):
            head = rank // replicas
            kv_ranges.append((head, head + 1))
            start = head * group + (rank % replicas) * per
            q_ranges.append((start, start + per))
    if size > cfg.intermediate_size or size > cfg.vocab_size:
        raise ValueError(f"tensor_parallel_size: {size} ranks exceed the model's widths")
    mlp = _even_ranges(cfg.intermediate_size, size)
    vocab = _even_ranges(cfg.vocab_size, size)
    return [TensorShard(r, size, q_ranges[r], kv_ranges[r], mlp[r], vocab[r], cfg.vocab_size) for r in range(size)]


def shard_parameter(name: str, full: torch.Tensor, cfg: ModelConfig, shard: TensorShard) -> torch.Tensor:
    """The slice of the full parameter ``name`` (the unsharded model's name and shape) that
    ``shard`` holds; the tensor itself where it is replicated.

    Args:
        name: a parameter name of :class:`~asymcache_core.models.llama.LlamaForCausalLM`.
        full: its full value.
        cfg: the model.
        shard: the rank's share.

    Returns:
        A view or copy of ``full``'s rows/columns for this rank.
    """
    d = cfg.head_dim
    q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    (i0, i1), (v0, v1) = shard.intermediate, shard.vocab
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        return torch.cat((
            full[q0 * d : q1 * d],
            full[q_size + k0 * d : q_size + k1 * d],
            full[q_size + kv_size + k0 * d : q_size + kv_size + k1 * d],
        ))
    if name.endswith("self_attn.o_proj.weight"):
        return full[:, q0 * d : q1 * d]
    if name.endswith("mlp.gate_up_proj.weight"):
        inter = cfg.intermediate_size
        return torch.cat((full[i0:i1], full[inter + i0 : inter + i1]))
    if name.endswith("mlp.down_proj.weight"):
        return full[:, i0:i1]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return full[v0:v1]
    return full


class TensorParallelGroup:
    """The collectives of one rank's model shard.

    Args:
        shard: this rank's share.
        process_group: the c10d backend of the model's ranks (``ProcessGroupNCCL`` on CUDA,
            ``ProcessGroupGloo`` on the CPU), whose ``allreduce`` / ``allgather`` are called
            directly (no default group).
        deterministic: reduce by gathering every rank's partial and summing them in rank
            order, whatever the message size. NOTE: a library all-reduce may pick its
            algorithm (ring, tree) by message size, so the same row would sum in a different
            order in a step of another size: the batch-invariant mode needs the fixed order.
    """

    def __init__(self, shard: TensorShard, process_group: Any, deterministic: bool = False) -> None:
        self.shard = shard
        self.process_group = process_group
        self.deterministic = deterministic

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (every rank gets it)."""
        if self.deterministic:
            parts = self._all_gather(x)
            out = parts[0]
            for part in parts[1:]:
                out = out + part
            return out
        x = x.contiguous()
        self.process_group.allreduce([x]).wait()
        return x

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        return parts

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids in its share, zeros elsewhere,
        and the sum over ranks is the full lookup (exact: one non-zero term per row)."""
        v0, v1 = self.shard.vocab
        inside = (input_ids >= v0) & (input_ids < v1)
        local = torch.where(inside, input_ids - v0, torch.zeros_like(input_ids))
        rows = torch.nn.functional.embedding(local, weight) * inside.unsqueeze(-1).to(weight.dtype)
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[T, V_local]`` logits of every rank -> ``[T, V]`` on every rank."""
        width = self.shard.max_vocab_share
        local = logits
        if local.shape[-1] < width:
            pad = local.new_full((local.shape[0], width - local.shape[-1]), 0)
            local = torch.cat((local, pad), dim=-1)
        parts = self._all_gather(local)
        vocab_sizes = [b - a for a, b in _even_ranges(self.shard.vocab_size, self.size)]
        return torch.cat([p[:, :n] for p, n in zip(parts, vocab_sizes, strict=True)], dim=-1)

