"""Model implementations chosen from ``config.json``'s ``architectures``."""

from __future__ import annotations

from asymcache_core.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from asymcache_core.models.llama import LlamaForCausalLM, load_hf_state_dict
from asymcache_core.parallel import TensorParallelGroup


def build_model(
    cfg: ModelConfig, max_len: int, tensor_parallel: TensorParallelGroup | None = None
) -> LlamaForCausalLM:
    """Instantiates the module for ``cfg.architecture`` (all supported ones are Llama-shaped),
    whole or one rank's share of it."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures: unsupported {cfg.architecture!r}")
    return LlamaForCausalLM(cfg, max_len, tensor_parallel)


__all__ = ["ModelConfig", "LlamaForCausalLM", "build_model", "load_hf_state_dict"]
