"""The server's sampling defaults, as vLLM's ``--generation-config auto`` sets them.

A request that leaves ``temperature`` (``top_p``, ``top_k``, ``min_p``, the penalties) out gets
the model's ``generation_config.json`` value for it when the model has one, else vLLM's default
(:data:`VLLM_SAMPLING_DEFAULTS`: temperature 1, no truncation, no penalties); an operator's
``--override-generation-config`` JSON is laid over the model's. The model's ``max_new_tokens``
(or the override's) becomes the default ``max_tokens`` of a chat, as in vLLM.

NOTE: the servers' defaults only: the Python API (:class:`~asymcache_core.SamplingParams`,
``Engine.generate``, ``AgentRuntime`` / ``job.chat``) stays greedy by default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asymcache_core.config import json_object_text
from asymcache_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: vLLM's defaults of the sampling fields a request leaves out (its request models' own).
VLLM_SAMPLING_DEFAULTS: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
#: The keys vLLM reads of a generation config (``ModelConfig.get_diff_sampling_param``).
GENERATION_CONFIG_KEYS = (*VLLM_SAMPLING_DEFAULTS, "max_new_tokens")
#: transformers' ``GenerationConfig`` defaults: vLLM reads a model's file through
#: ``to_diff_dict()``, which leaves out the values equal to these (a file's ``top_k: 50`` is
#: HF's default, so vLLM keeps its own ``top_k: 0``).
_HF_GENERATION_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
}


def _checked_value(key: str, value: Any) -> Any:
    """``value`` as :class:`SamplingParams` takes it for ``key``.

    Raises:
        ValueError: a value the engine would reject (the text names ``key``).
    """
    if key == "max_new_tokens":
        return SamplingParams(max_tokens=value).max_tokens
    return getattr(SamplingParams(**{key: value}), key)


def check_generation_config(config: str | Mapping[str, Any] | None,
                            option: str = "override_generation_config") -> dict[str, Any]:
    """An ``--override-generation-config`` value, checked.

    Args:
        config: JSON text of an object, or the object (None: none).
        option: the option's name, for the error.

    Returns:
        The sampling defaults it states (``null`` values left out, as vLLM leaves them).

    Raises:
        ValueError: not JSON, not an object, an unknown key, or a value the engine would
            reject; one line naming ``option``.
    """
    if config is None:
        return {}
    if isinstance(config, str):
        config = json_object_text(option, config)
    if not isinstance(config, Mapping):
        raise ValueError(f"{option}: must be a JSON object such as '{{\"temperature\": 0}}', got {config!r}")
    checked: dict[str, Any] = {}
    for key, value in config.items():
        if key not in GENERATION_CONFIG_KEYS:
            raise ValueError(f"{option}: unknown key {key!r} (one of {', '.join(GENERATION_CONFIG_KEYS)})")
        if value is None:
            continue
        try:
            checked[key] = _checked_value(key, value)
        except ValueError as e:
            raise ValueError(f"{option}: {key}: {str(e).split(': ', 1)[-1]}") from None
    return checked


def model_generation_config(model: str | None) -> dict[str, Any]:
    """The sampling defaults of a model's ``generation_config.json`` (an HF folder's), as vLLM's
    ``--generation-config auto`` reads them.

    Args:
        model: the engine's model spec (a folder, a ``.gguf`` file, a packaged name, ...).

    Returns:
        The file's sampling values that differ from transformers' defaults (empty: no file, a
        model of another kind, an unreadable file). A value the engine would reject is left out,
        with a warning.
    """
    if not model:
        return {}
    path = Path(model) / "generation_config.json"
    try:
        if not path.is_file():
            return {}
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("model: ignoring %s (%s)", path, e)
        return {}
    if not isinstance(raw, Mapping):
        return {}
    defaults: dict[str, Any] = {}
    for key in GENERATION_CONFIG_KEYS:
        value = raw.get(key)
        if value is None or (key in _HF_GENERATION_DEFAULTS and value == _HF_GENERATION_DEFAULTS[key]):
            continue
        try:
            defaults[key] = _checked_value(key, value)
        except ValueError as e:
            logger.warning("model: ignoring %s's %s (%s)", path, key, e)
    return defaults


def sampling_defaults(model: str | None, override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The server's defaults: the model's generation config with ``override`` over it.

    Args:
        model: the engine's model spec.
        override: checked ``--override-generation-config`` values (:func:`check_generation_config`).

    Returns:
        Sampling field -> default (``max_new_tokens`` named ``max_tokens``, as vLLM names it);
        fields left out take :data:`VLLM_SAMPLING_DEFAULTS`.
    """
    merged = {**model_generation_config(model), **(override or {})}
    if "max_new_tokens" in merged:
        merged["max_tokens"] = merged.pop("max_new_tokens")
    if merged:
        logger.info("Default sampling parameters (vLLM's generation config): %s", merged)
    return merged


__all__ = [
    "GENERATION_CONFIG_KEYS",
    "VLLM_SAMPLING_DEFAULTS",
    "check_generation_config",
    "model_generation_config",
    "sampling_defaults",
]
