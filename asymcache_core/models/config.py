"""Model configuration read from an HF ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: Architectures with a per-head RMSNorm on q and on k before the rotary embedding (vLLM 0.32's
#: ``model_executor/models/qwen3.py`` ``Qwen3Attention``: ``q_norm``/``k_norm`` over head_dim).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder.

    Attributes mirror HF's names; ``attention_bias`` is True for Qwen2 (biases on q/k/v);
    ``qk_norm`` is True for Qwen3 (a per-head RMSNorm of ``head_dim`` on q and on k, derived
    from the architecture). ``head_dim`` need not be ``hidden_size / num_attention_heads``
    (Qwen3-4B: 2560 / 32 heads, head_dim 128).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds the config from a ``config.json`` dict.

        Raises:
            ValueError: unsupported architecture or missing fields.
        """
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures: unsupported {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling") or None
            rope_theta = cfg.get("rope_theta")
            params = cfg.get("rope_parameters")
            if isinstance(params, dict):  # transformers 5 folds rope settings into one dict
                rope_theta = rope_theta or params.get("rope_theta")
                if params.get("rope_type", "default") != "default" and rope_scaling is None:
                    rope_scaling = params
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                raw=dict(cfg),
            )
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]}: missing from the model config") from None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
