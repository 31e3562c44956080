"""GGUF checkpoints (llama.cpp format), dequantized to torch at load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asymcache_core.loaders.gguf_file import GGUFFile

logger = logging.getLogger("asymcache_core.loaders")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: llama.cpp's ``general.architecture`` -> the HF architecture it converts to.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"model: {str(path)!r} is not a readable GGUF file ({exc})") from None


def open_gguf(path: Path) -> GGUFFile:
    """Parses a GGUF file once (metadata and tensor index; the payload stays memory-mapped)."""
    return _reader(path)


def gguf_hf_config(path: Path, reader: GGUFFile | None = None) -> dict[str, Any]:
    """Translates a llama, qwen2 or qwen3 GGUF's metadata into an HF ``config.json`` dict.

    Raises:
        ValueError: another architecture (``qwen3moe`` included).
    """
    reader = reader if reader is not None else _reader(path)
    arch = reader.field("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"architectures: GGUF architecture {arch!r} is not supported")
    p = f"{arch}."
    heads = int(reader.field(p + "attention.head_count"))
    hidden = int(reader.field(p + "embedding_length"))
    tokens = reader.field("tokenizer.ggml.tokens") or []
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(reader.field(p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(reader.field(p + "feed_forward_length")),
        "num_hidden_layers": int(reader.field(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(reader.field(p + "attention.head_count_kv", heads)),
        # NOTE: llama.cpp writes key_length where head_dim is not hidden / heads (Qwen3-4B:
        # 2560 / 32 heads, 128 a head); absent, the quotient.
        "head_dim": int(reader.field(p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(reader.field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(reader.field(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(reader.field(p + "context_length", 8192)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": reader.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.field("tokenizer.ggml.eos_token_id"),
    }


def _reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (interleaved rope -> HF's half-split layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(path: Path, cfg: dict[str, Any], reader: GGUFFile | None = None) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor into HF names and layouts (float32).

    Raises:
        ValueError: unknown tensor names or a corrupt payload.
    """
    from gguf.quants import dequantize

    reader = reader if reader is not None else _reader(path)
    # NOTE: only llama's q/k rows are permuted (llama.cpp's convert_hf_to_gguf permutes them in
    # LlamaModel for its interleaved rope); qwen2 and qwen3 run llama.cpp's NeoX rope on rows
    # in HF's order, as transformers reads them (modeling_gguf_pytorch_utils.TENSOR_PROCESSORS
    # reverses the permutation for "llama" alone).
    is_llama = cfg["architectures"][0] == "LlamaForCausalLM"
    out: dict[str, torch.Tensor] = {}
    label = f"converting {path.name}"
    for done, tensor in enumerate(reader.tensors, 1):
        # NOTE: one record per tensor; a progress display shows them at its own pace.
        logger.debug("tensor %s", tensor.name, extra={"progress": (label, done, len(reader.tensors))})
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            base = _LAYER_NAMES.get(parts[2])
            if base is None:
                continue
            name = f"model.layers.{parts[1]}.{base}.{parts[-1]}"
        else:
            base = _GLOBAL_NAMES.get(parts[0])
            if base is None:
                continue
            name = f"{base}.{parts[-1]}"
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"model: tensor {tensor.name!r} of {str(path)!r} is corrupt ({exc})") from None
        shape = tuple(reversed(tensor.shape))
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
        if is_llama and parts[0] == "blk" and parts[2] == "attn_q":
            weight = _reverse_permute(weight, cfg["num_attention_heads"])
        elif is_llama and parts[0] == "blk" and parts[2] == "attn_k":
            weight = _reverse_permute(weight, cfg["num_key_value_heads"])
        out[name] = weight
    return out


def gguf_tokenizer(path: Path) -> Any:
    """The HF fast tokenizer embedded in the GGUF (with its chat template).

    NOTE: ``PreTrainedTokenizerFast`` reads only the tokenizer's fields; ``AutoTokenizer`` would
    first parse the whole file again to find the model's config (seconds for a 49k vocabulary)
    and builds the same tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ValueError(f"model: cannot read the tokenizer of {str(path)!r} ({exc})") from None
