"""Llama-family decoder in plain PyTorch (Llama 2/3, Mistral, Qwen2, Qwen3; GQA; tied embeddings).

Attention goes through an explicit :class:`~kernels.dispatch.AttentionBackend` and
:class:`~kernels.metadata.MSAMetadata` passed to ``forward``: no global state. Linear layers and
norms go through the backend's :class:`~kernels.dispatch.DenseOps` (``backend.dense``): the
library kernels by default, the batch-invariant ones when the engine asks for them.
Projections are fused (``qkv_proj``, ``gate_up_proj``) because one matmul beats three on a CPU.
The elementwise steps between them (rotary + KV store, residual add + norm, SiLU-mul) go
through the backend too, so the Triton backend runs each group as one kernel
(:mod:`kernels.fused`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asymcache_core.models.config import ModelConfig
from asymcache_core.parallel import TensorParallelGroup, TensorShard
from kernels.dispatch import DEFAULT_DENSE_OPS, AttentionBackend, DenseOps
from kernels.metadata import MSAMetadata


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, through the backend's dense ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: DenseOps = DEFAULT_DENSE_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def _linear(layer: nn.Linear, x: torch.Tensor, ops: DenseOps) -> torch.Tensor:
    return ops.linear(x, layer.weight, layer.bias)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3 scaling when the config asks for it."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling: unsupported rope type {kind!r}")
    return inv.float()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (neox layout)."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        inv = rope_inv_freq(cfg)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` for a step, gathered once and shared by every layer.

        ``sin`` carries the sign of rotate-half in its first half, so that a rotation is
        ``x * cos + swap_halves(x) * sin``.
        """
        cos = self.cos[positions]
        sin = self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1).to(dtype), torch.cat((-sin, sin), -1).unsqueeze(1).to(dtype)


class Attention(nn.Module):
    """GQA attention of the heads one rank holds (all of them without tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads if shard is None else shard.num_q_heads
        self.num_kv_heads = cfg.num_key_value_heads if shard is None else shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # NOTE: Qwen3's per-head norms (vLLM 0.32 model_executor/models/qwen3.py,
        # Qwen3Attention.__init__): one weight of head_dim shared by every head, so replicated
        # on every tensor-parallel rank. Absent (None) for the other families.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
        ops: DenseOps = DEFAULT_DENSE_OPS,
    ) -> torch.Tensor:
        """Projects ``x [T, hidden]``, rotates q and k, stores k and v at ``slot_mapping``.

        Returns:
            ``q [T, HQ, D]``.
        """
        qkv = _linear(self.qkv_proj, x, ops)
        # NOTE: Qwen3's q/k norms (vLLM 0.32 Qwen3Attention.forward: q and k viewed by head,
        # normed over head_dim, before the rotary embedding) run inside the rotary + KV store:
        # one launch on the GPU (kernels.fused), the torch twin elsewhere; each head alone,
        # so the batch-invariant mode stays batch-invariant
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # NOTE: every new K/V of the step is stored before any query attends, so holes and
        # suffixes computed in the same step see each other at their absolute positions.
        return backend.rotate_and_store(
            qkv, *rope, kv_cache[0], kv_cache[1], slot_mapping, self.num_heads, self.num_kv_heads, qk_norm
        )


class MLP(nn.Module):
    """SwiGLU MLP over one rank's share of the intermediate width (a partial sum under TP)."""

    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None) -> None:
        super().__init__()
        a, b = (0, cfg.intermediate_size) if shard is None else shard.intermediate
        self.intermediate = b - a
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: DenseOps = DEFAULT_DENSE_OPS) -> torch.Tensor:
        return _linear(self.down_proj, ops.act(_linear(self.gate_up_proj, x, ops)), ops)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TensorShard | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)


class LlamaForCausalLM(nn.Module):
    """The model; ``forward`` runs a packed multi-segment step and returns selected logits.

    Args:
        cfg: the model's shape.
        max_len: longest position (sizes the rope tables).
        tensor_parallel: this rank's share and collectives (:mod:`asymcache_core.parallel`);
            ``None``: the whole model on one device.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, tensor_parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tensor_parallel = tensor_parallel
        shard = tensor_parallel.shard if tensor_parallel is not None else None
        vocab = cfg.vocab_size if shard is None else shard.vocab[1] - shard.vocab[0]
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, max_len)

    def linear_row_bounds(self, max_tokens: int, max_logits_rows: int) -> dict[tuple[int, int], int]:
        """``(N, K) -> the most rows`` of each distinct linear weight in a step: ``max_tokens``
        for the layers', ``max_logits_rows`` (one per sequence) for the vocabulary head's."""
        bounds: dict[tuple[int, int], int] = {}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                rows = max_logits_rows if module is self.lm_head else max_tokens
                shape = (module.out_features, module.in_features)
                bounds[shape] = max(bounds.get(shape, 0), rows)
        return bounds

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` embeddings of ``input_ids [T]`` (the full vocabulary's, under TP too)."""
        if self.tensor_parallel is None:
            return self.embed_tokens(input_ids)
        return self.tensor_parallel.embed(input_ids, self.embed_tokens.weight)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the row-parallel projections' partial sums; a no-op on one device.
        return x if self.tensor_parallel is None else self.tensor_parallel.all_reduce(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: MSAMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Runs one step.

        Args:
            input_ids: ``[T]`` packed tokens of every segment.
            positions: ``[T]`` their absolute positions.
            kv_caches: per layer ``(k_cache, v_cache)``.
            meta: the step's MSA metadata.
            backend: the attention backend.
            logits_indices: rows of the packed batch whose next-token logits are needed.

        Returns:
            ``[len(logits_indices), vocab]`` float32 logits.
        """
        h, residual = self.final_hidden(input_ids, positions, kv_caches, meta, backend, logits_indices)
        return self.compute_logits(h, residual, None, backend.dense)

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: MSAMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs one step up to the final norm: :meth:`forward` without the vocabulary head.

        Returns:
            ``(h, residual)`` of the rows ``logits_indices``, each ``[len(logits_indices),
            hidden]``: what :meth:`compute_logits` takes (with ``None`` indices).
        """
        h = self.embed(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        residual: torch.Tensor | None = None
        rows: torch.Tensor | None = logits_indices
        last = len(kv_caches) - 1
        for index, kv_cache in enumerate(kv_caches):
            q, residual = self.pre_attention(index, h, residual, rope, kv_cache, meta.slot_mapping, backend)
            o = backend.attend(q, kv_cache[0], kv_cache[1], meta, self.layers[index].self_attn.scale)
            if index == last and logits_indices.shape[0] < o.shape[0]:
                # NOTE: past the last attention only the rows whose logits are asked for
                # matter (no later layer reads the others' K/V): the last output projection
                # and MLP run on those alone, a prefill's last token instead of all of them.
                # (A decode step asks for every row: nothing to select, no gather.)
                o, residual, rows = o[logits_indices], residual[logits_indices], None
            h, residual = self.post_attention(index, o, residual, backend.dense)
        assert residual is not None
        if rows is not None:
            h, residual = h[rows], residual[rows]
        return h, residual

    # NOTE: the step is split at attention so that piecewise CUDA graphs
    # (asymcache_core.piecewise_graphs) can capture everything between two attention calls;
    # ``forward`` is the same pieces run eagerly, so both paths share one definition.
    def pre_attention(
        self,
        index: int,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` up to attention: adds ``h`` (the previous layer's output; the
        embeddings for layer 0, with ``residual=None``) to the residual stream, normalises,
        projects and stores this step's K/V.

        Returns:
            ``(q [T, HQ, D], residual [T, hidden])``.
        """
        layer = self.layers[index]
        ops = backend.dense
        norm = layer.input_layernorm
        normed, residual = ops.add_norm(h, residual, norm.weight, norm.eps)
        q = layer.self_attn.project(normed, rope, kv_cache, slot_mapping, backend, ops)
        return q, residual

    def post_attention(
        self, index: int, o: torch.Tensor, residual: torch.Tensor, ops: DenseOps = DEFAULT_DENSE_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` after attention: output projection, residual, MLP.

        Args:
            index: the layer.
            o: ``[T, HQ, D]`` or ``[T, HQ * D]`` attention output.
            residual: the residual stream from :meth:`pre_attention`.
            ops: the linear and norm ops (the backend's ``dense``).

        Returns:
            ``(h, residual)``: the MLP output (not yet added) and the residual stream.
        """
        layer = self.layers[index]
        attn = layer.self_attn
        norm = layer.post_attention_layernorm
        normed, residual = ops.add_norm(
            self._reduce(_linear(attn.o_proj, o.reshape(-1, attn.q_size), ops)), residual, norm.weight, norm.eps
        )
        return self._reduce(layer.mlp(normed, ops)), residual

    def compute_logits(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        logits_indices: torch.Tensor | None,
        ops: DenseOps = DEFAULT_DENSE_OPS,
    ) -> torch.Tensor:
        """``[len(logits_indices), vocab]`` float32 logits of the selected rows (``None``: every
        row of ``h``, already selected)."""
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        normed, _ = ops.add_norm(h, residual, self.norm.weight, self.norm.eps)
        logits = _linear(self.lm_head, normed, ops)
        if self.tensor_parallel is not None:
            logits = self.tensor_parallel.gather_vocab(logits)
        return logits.float()


# Legacy per-projection names in checkpoints -> (fused param, slice index).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_state_dict(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Copies HF-named weights (``model.layers.N.self_attn.q_proj.weight`` ...) into ``model``.

    Raises:
        ValueError: a weight is missing or has the wrong shape.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    splits = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights.items():
            target = name.removeprefix("model.")
            if target.startswith("lm_head") and cfg.tie_word_embeddings:
                continue
            if "rotary_emb" in target:
                continue
            parts = target.split(".")
            offset = 0
            if len(parts) >= 2 and parts[-2] in FUSED:
                fused, idx = FUSED[parts[-2]]
                sizes = splits[fused]
                offset = sum(sizes[:idx])
                parts[-2] = fused
                target = ".".join(parts)
                if target not in params:
                    raise ValueError(f"weights: unexpected tensor {name!r}")
                dest = params[target][offset : offset + sizes[idx]]
            else:
                if target not in params:
                    raise ValueError(f"weights: unexpected tensor {name!r}")
                dest = params[target]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
            seen.add(f"{target}@{offset}")
    expected = 0
    for pname in params:
        if pname.startswith("lm_head") and cfg.tie_word_embeddings:
            continue
        base = pname.split(".")[-2] if "." in pname else pname
        expected += len(splits.get(base, [0]))
    if len(seen) != expected:
        raise ValueError(f"weights: checkpoint covers {len(seen)} of {expected} tensors")
