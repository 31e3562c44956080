"""The server's sampling defaults, as vLLM's ``--generation-config`` sets them.

A request that leaves ``temperature`` (``top_p``, ``top_k``, ``min_p``, the penalties) out gets
the generation config's value for it, else vLLM's default (:data:`VLLM_SAMPLING_DEFAULTS`:
temperature 1, no truncation, no penalties). Which generation config, as vLLM's
``--generation-config`` says (``ModelConfig.get_diff_sampling_param``):

- ``auto`` (the default): the model's ``generation_config.json``, where an HF folder has one;
  without one (or with one transformers cannot read), the generation fields its ``config.json``
  still carries (``min_p``, ``max_new_tokens``: transformers' ``from_model_config``, which drops
  the model config's ``temperature`` / ``top_p`` / ``top_k`` / ``repetition_penalty``); else none;
- ``vllm``: none (vLLM's defaults), the model's file ignored;
- a folder's path: the ``generation_config.json`` in that folder instead of the model's (or,
  without one, its ``config.json``'s fields, as with ``auto``).

Every value a file states is read, a value equal to transformers' old default (``top_k: 50``)
included: vLLM 0.32 reads the file with transformers 5, whose ``GenerationConfig`` defaults are
unset, so its ``to_diff_dict()`` keeps them all.

An operator's ``--override-generation-config`` JSON is laid over it (with ``vllm``, the
override alone). The config's ``max_new_tokens`` becomes the default ``max_tokens`` of a chat,
as in vLLM.

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
#: The keys of :data:`GENERATION_CONFIG_KEYS` a model's ``config.json`` still gives: transformers
#: 5 drops the model config's legacy generation parameters (``temperature``, ``top_p``,
#: ``top_k``, ``repetition_penalty``), and has no field for the penalties vLLM adds.
_MODEL_CONFIG_KEYS = ("min_p", "max_new_tokens")
#: The sub-configs whose generation fields ``GenerationConfig.from_model_config`` reads where
#: the top level has none (the first one present: a multimodal model's text decoder).
_DECODER_CONFIGS = ("decoder", "generator", "text_config")
#: An HF model folder's config.
MODEL_CONFIG_FILE = "config.json"


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


#: The ``--generation-config`` values that name no folder.
GENERATION_CONFIG_MODES = ("auto", "vllm")
#: The file a generation-config folder holds (an HF model folder's).
GENERATION_CONFIG_FILE = "generation_config.json"


def _sampling_values(raw: Mapping[str, Any], path: Path, strict: bool,
                     keys: tuple[str, ...] = GENERATION_CONFIG_KEYS) -> dict[str, Any]:
    """The sampling values a generation config file's object states (what vLLM reads through
    ``to_diff_dict()``: with transformers 5, every value that is not null).

    Args:
        raw: the file's object.
        path: the file (for messages).
        strict: a value the engine would reject raises (a file the operator named); else it is
            left out with a warning (the model's own file).
        keys: the keys read.

    Raises:
        ValueError: ``strict`` and a value the engine would reject (naming the option).
    """
    values: dict[str, Any] = {}
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        try:
            values[key] = _checked_value(key, value)
        except ValueError as e:
            if strict:
                raise ValueError(f"generation_config: {path}: {key}: {str(e).split(': ', 1)[-1]}") from None
            logger.warning("model: ignoring %s's %s (%s)", path, key, e)
    return values


def _read_object(path: Path) -> Mapping[str, Any] | None:
    """The JSON object in ``path`` (None: no file; an unreadable one, or one holding no object,
    with a warning)."""
    try:
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("model: ignoring %s (%s)", path, e)
        return None
    if not isinstance(raw, Mapping):
        logger.warning("model: ignoring %s (not a JSON object)", path)
        return None
    return raw


def _model_config_values(folder: Path) -> dict[str, Any]:
    """The generation fields of the ``config.json`` in ``folder``, as vLLM reads a model without
    a readable ``generation_config.json`` (``GenerationConfig.from_model_config``): only
    ``min_p`` and ``max_new_tokens`` survive transformers 5's model config, from its top level,
    else from its first decoder sub-config. Empty without the file."""
    raw = _read_object(folder / MODEL_CONFIG_FILE)
    if raw is None:
        return {}
    path = folder / MODEL_CONFIG_FILE
    values = _sampling_values(raw, path, strict=False, keys=_MODEL_CONFIG_KEYS)
    sub = next((raw[name] for name in _DECODER_CONFIGS if isinstance(raw.get(name), Mapping)), None)
    if sub is not None:
        # NOTE: a sub-config's value fills only what the top level leaves unset
        values = {**_sampling_values(sub, path, strict=False, keys=_MODEL_CONFIG_KEYS), **values}
    return values


def model_generation_config(model: str | None) -> dict[str, Any]:
    """The sampling defaults of a model's ``generation_config.json`` (an HF folder's), as vLLM's
    ``--generation-config auto`` reads them.

    Args:
        model: the engine's model spec (a folder, a ``.gguf`` file, a packaged name, ...).

    Returns:
        The file's sampling values. Without the file, or with one that cannot be read (a
        warning says so), the generation fields of the folder's ``config.json``, as vLLM falls
        back to them (:func:`_model_config_values`; empty: a model of another kind). A value
        the engine would reject is left out, with a warning.
    """
    if not model:
        return {}
    folder = Path(model)
    try:
        if not folder.is_dir():
            return {}
    except OSError:
        return {}
    raw = _read_object(folder / GENERATION_CONFIG_FILE)
    if raw is None:
        return _model_config_values(folder)
    return _sampling_values(raw, folder / GENERATION_CONFIG_FILE, strict=False)


def folder_generation_config(folder: str) -> dict[str, Any]:
    """The sampling defaults of the ``generation_config.json`` in ``folder`` (vLLM's
    ``--generation-config PATH``), read strictly: the operator named it.

    Args:
        folder: the folder's path.

    Returns:
        The file's sampling values (other keys, such as token ids, are ignored, as vLLM ignores
        them for sampling). A model folder without the file: its ``config.json``'s generation
        fields, as vLLM falls back to them.

    Raises:
        ValueError: not a folder, neither file in it, unreadable, not a JSON object, or a value
            the engine would reject; one line naming ``generation_config``.

    NOTE: vLLM falls back to ``config.json`` from a broken ``generation_config.json`` too; a
    file the operator named that cannot be read is an error here, not ignored.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"generation_config: {folder!r} is neither {' nor '.join(GENERATION_CONFIG_MODES)} nor a "
                         "folder (a folder holding a generation_config.json)")
    path = root / GENERATION_CONFIG_FILE
    if not path.is_file():
        if (root / MODEL_CONFIG_FILE).is_file():
            return _model_config_values(root)
        # NOTE: vLLM fails here too (transformers finds no config in the folder)
        raise ValueError(f"generation_config: no {GENERATION_CONFIG_FILE} in {folder!r} (nor a model's "
                         f"{MODEL_CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"generation_config: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        where = f" ({e.msg} at character {e.pos})" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"generation_config: {path} is not valid JSON{where}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"generation_config: {path} must hold a JSON object, got {type(raw).__name__}")
    return _sampling_values(raw, path, strict=True)


def check_generation_config_source(source: str | None) -> str:
    """A ``--generation-config`` value, checked (a folder's file is read, so that a bad one
    fails before the model loads).

    Args:
        source: ``auto``, ``vllm`` or a folder's path (None: ``auto``).

    Returns:
        The value (``auto`` for None).

    Raises:
        ValueError: not a string, or a folder :func:`folder_generation_config` refuses.
    """
    if source is None:
        return "auto"
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"generation_config: must be auto, vllm or a folder's path, got {source!r}")
    if source not in GENERATION_CONFIG_MODES:
        folder_generation_config(source)
    return source


def generation_config(source: str, model: str | None) -> dict[str, Any]:
    """The sampling defaults of the generation config ``source`` names.

    Args:
        source: ``auto`` (the model's file), ``vllm`` (none) or a folder's path.
        model: the engine's model spec (read with ``auto``).

    Returns:
        The config's sampling values (``max_new_tokens`` by that name).

    Raises:
        ValueError: a folder :func:`folder_generation_config` refuses.
    """
    if source == "vllm":
        return {}
    if source == "auto":
        return model_generation_config(model)
    return folder_generation_config(source)


def sampling_defaults(model: str | None, override: Mapping[str, Any] | None = None,
                      source: str = "auto") -> dict[str, Any]:
    """The server's defaults: the generation config ``source`` names, with ``override`` over it
    (vLLM's ``get_diff_sampling_param``).

    Args:
        model: the engine's model spec.
        override: checked ``--override-generation-config`` values (:func:`check_generation_config`).
        source: ``--generation-config``: ``auto``, ``vllm`` or a folder's path.

    Returns:
        Sampling field -> default (``max_new_tokens`` named ``max_tokens``, as vLLM names it);
        fields left out take :data:`VLLM_SAMPLING_DEFAULTS`.

    Raises:
        ValueError: a folder :func:`folder_generation_config` refuses.
    """
    merged = {**generation_config(source, model), **(override or {})}
    if "max_new_tokens" in merged:
        merged["max_tokens"] = merged.pop("max_new_tokens")
    if merged and source != "vllm":
        # NOTE: a warning, as vLLM's: replies sample otherwise than vLLM's defaults say
        origin = "the model's generation config" if source == "auto" else source
        logger.warning("Default sampling parameters overridden by %s (overrides applied): %s; serve with "
                       "--generation-config vllm for vLLM's own", origin, merged)
    elif merged:
        logger.info("Default sampling parameters (vLLM's, overrides applied): %s", merged)
    return merged


__all__ = [
    "GENERATION_CONFIG_KEYS",
    "GENERATION_CONFIG_MODES",
    "VLLM_SAMPLING_DEFAULTS",
    "check_generation_config",
    "check_generation_config_source",
    "folder_generation_config",
    "generation_config",
    "model_generation_config",
    "sampling_defaults",
]
