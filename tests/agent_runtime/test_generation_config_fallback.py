"""``--generation-config auto`` (and a folder's path) for a model folder without a readable
``generation_config.json``, as vLLM 0.32 reads it (``transformers_utils.config.
try_get_generation_config``: ``GenerationConfig.from_pretrained``, else ``from_model_config`` of
the folder's ``config.json``), and a file's values read as transformers 5's ``to_diff_dict()``
gives them (nothing left out for equalling an old default). No model here: the functions alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent_runtime.server.generation_defaults import (
    folder_generation_config,
    model_generation_config,
    sampling_defaults,
)

#: A model config carrying legacy generation fields: transformers 5 drops temperature, top_p,
#: top_k and repetition_penalty from it; min_p and max_new_tokens survive (as vLLM reads them).
LEGACY = {"model_type": "llama", "hidden_size": 64, "temperature": 0.3, "top_p": 0.8, "top_k": 7,
          "repetition_penalty": 1.2, "presence_penalty": 0.5, "min_p": 0.1, "max_new_tokens": 33}


def _folder(path: Path, config: object | None = None, generation: object | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (("config.json", config), ("generation_config.json", generation)):
        if value is not None:
            (path / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_auto_without_a_generation_config_reads_the_model_configs_fields(tmp_path):
    model = _folder(tmp_path / "m", LEGACY)
    assert model_generation_config(model) == {"min_p": 0.1, "max_new_tokens": 33}
    assert sampling_defaults(model) == {"min_p": 0.1, "max_tokens": 33}
    # a model config without them: vLLM's defaults, no error
    plain = _folder(tmp_path / "plain", {"model_type": "llama", "hidden_size": 64})
    assert model_generation_config(plain) == {} == sampling_defaults(plain)
    # neither file (or no folder at all): vLLM's defaults
    assert model_generation_config(_folder(tmp_path / "empty")) == {}
    assert model_generation_config(str(tmp_path / "model.gguf")) == {}


def test_a_decoders_fields_fill_what_the_top_level_leaves_unset(tmp_path):
    model = _folder(tmp_path / "m", {"model_type": "llava", "min_p": 0.2,
                                     "text_config": {"min_p": 0.3, "max_new_tokens": 44, "temperature": 0.5}})
    assert model_generation_config(model) == {"min_p": 0.2, "max_new_tokens": 44}


def test_an_unreadable_generation_config_falls_back_to_the_model_config(tmp_path, caplog):
    for broken in ("{not json", "[0.7]"):
        model = _folder(tmp_path / "m", LEGACY, broken)
        with caplog.at_level(logging.WARNING, logger="agent_runtime.server.generation_defaults"):
            assert model_generation_config(model) == {"min_p": 0.1, "max_new_tokens": 33}
        assert "ignoring" in caplog.text and "generation_config.json" in caplog.text
        caplog.clear()


def test_every_value_a_file_states_is_read(tmp_path):
    # NOTE: transformers 4 left out top_k 50, temperature 1, top_p 1 and repetition_penalty 1;
    # transformers 5 (vLLM 0.32's) has no defaults for them
    stated = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
    assert model_generation_config(_folder(tmp_path / "m", LEGACY, stated)) == stated


def test_a_folders_model_config_stands_in_for_its_missing_file(tmp_path):
    assert folder_generation_config(_folder(tmp_path / "other", LEGACY)) == {"min_p": 0.1, "max_new_tokens": 33}
    with pytest.raises(ValueError, match=r"^generation_config: no generation_config.json in .* \(nor a model's "
                                         r"config.json\)$"):
        folder_generation_config(_folder(tmp_path / "empty"))
    # a file the operator named that cannot be read stays an error
    with pytest.raises(ValueError, match="is not valid JSON"):
        folder_generation_config(_folder(tmp_path / "bad", LEGACY, "{nope"))


def test_the_override_is_logged_as_vllm_warns(tmp_path, caplog):
    model = _folder(tmp_path / "m", generation={"temperature": 0.6})
    with caplog.at_level(logging.INFO, logger="agent_runtime.server.generation_defaults"):
        sampling_defaults(model)
        sampling_defaults(model, {"top_k": 5}, "vllm")
    levels = [(r.levelno, "--generation-config vllm" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, False)]
