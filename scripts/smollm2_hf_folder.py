"""Write SmolLM2-135M-Instruct as an HF folder (safetensors, fp32) from the packaged GGUF, for
the stock-vLLM benchmarks (``scripts/vllm_http_bench.sh MODEL_DIR ...``). No download.

Usage: ``.venv-vllm/bin/python scripts/smollm2_hf_folder.py OUT_DIR`` (needs ``accelerate``,
which ``scripts/vllm_venv.sh`` installs: transformers dequantizes GGUF files through it).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out_dir: str) -> int:
    """Writes the folder; returns the exit status."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
    from tiny_model import smollm2_gguf

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    # NOTE: a model loaded from GGUF is marked quantized and refuses to be saved: copy its
    # (dequantized) weights into a plain one
    config.quantization_config = None
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    print(f"smollm2_hf_folder: wrote {out_dir}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: smollm2_hf_folder.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
