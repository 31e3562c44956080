"""A tiny llama GGUF written on the fly: two layers, a byte-level BPE tokenizer, a chat template."""

from __future__ import annotations

from pathlib import Path

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


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A two-layer llama GGUF with a byte-level BPE tokenizer and a chat template."""
    import gguf

    tokens = [*_byte_tokens(), "he", "ll", "<|im_start|>", "<|im_end|>"]
    hidden, inter, layers, heads, kv = 32, 48, 2, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["h e", "l l"])
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
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
