"""A tiny llama GGUF written on the fly: two layers, a byte-level BPE tokenizer, a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = 256 + extra
            extra += 1
    return [chr(spelled[b]) for b in range(256)]


#: The tiny tokenizer's vocabulary: the 256 bytes, two merges, the chat markers.
TOKENS = [*_byte_tokens(), "he", "ll", "<|im_start|>", "<|im_end|>"]


def gguf_writer(path: Path, arch: str, shape: dict[str, Any], pre: str = "default") -> Any:
    """A ``gguf.GGUFWriter`` at ``path`` holding the model's metadata (``shape``: ``context``,
    ``hidden``, ``inter``, ``layers``, ``heads``, ``kv``, ``eps``, ``rope_base``, and
    ``head_dim`` to write ``key_length``/``value_length``), the tiny byte-level BPE tokenizer
    (:data:`TOKENS`, tokenizer ``pre``) and the chat template; the tensors are the caller's."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["inter"])
    writer.add_block_count(shape["layers"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv"])
    if "head_dim" in shape:
        writer.add_key_length(shape["head_dim"])
        writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_merges(["h e", "l l"])
    writer.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])
    writer.add_bos_token_id(len(TOKENS) - 2)
    writer.add_eos_token_id(len(TOKENS) - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
    return writer


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A two-layer llama GGUF with a byte-level BPE tokenizer and a chat template."""
    tokens = TOKENS
    hidden, inter, layers, heads, kv = 32, 48, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf_writer(path, "llama", {"context": 128, "hidden": hidden, "inter": inter, "layers": layers,
                                         "heads": heads, "kv": kv, "eps": 1e-5, "rope_base": 10000.0})
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
    add("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
