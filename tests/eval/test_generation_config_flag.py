"""``asymcache serve --generation-config`` with vLLM 0.32's meaning (``ModelConfig.generation_config``
and ``get_diff_sampling_param``): ``auto`` (the default) reads the model's
``generation_config.json``, ``vllm`` ignores it (vLLM's defaults: temperature 1), a folder's
path reads the ``generation_config.json`` there instead; ``--override-generation-config`` is laid
over whichever (with ``vllm``, the override alone). A bad folder or file is one ``error:`` line,
exit code 2, before the model loads. Then the defaults the server applies to real requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import ServeOptions, create_app
from agent_runtime.server.generation_defaults import (
    check_generation_config_source,
    folder_generation_config,
    sampling_defaults,
)
from eval.cli import app
from tests.conftest import make_engine

runner = CliRunner()
USER = [{"role": "user", "content": "Write a short poem about the sea."}]


def _folder(path: Path, config: object) -> str:
    """A folder holding ``config`` as its generation_config.json (text as it is)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


# -- the command line -------------------------------------------------------------------------


def test_the_flag_reaches_the_server(served, tmp_path):
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert served[-1].generation_config == "auto"  # vLLM's default
    for value in ("vllm", "auto", _folder(tmp_path / "gen", {"temperature": 0.3})):
        result = runner.invoke(app, ["serve", "--generation-config", value])
        assert result.exit_code == 0, result.output
        assert served[-1].generation_config == value
        assert "generation_config" not in served[-1].engine_settings
    # with the override, as vLLM's launch line gives both
    result = runner.invoke(app, ["serve", "--generation-config", "vllm", "--override-generation-config",
                                 '{"temperature": 0}'])
    assert result.exit_code == 0, result.output
    assert (served[-1].generation_config, served[-1].override_generation_config) == ("vllm", {"temperature": 0.0})


def test_the_flag_from_a_config_file(served, tmp_path):
    """vLLM's ``--config`` YAML names it as the command line does."""
    folder = _folder(tmp_path / "gen", {"top_p": 0.5})
    config = tmp_path / "serve.yaml"
    config.write_text(f"generation-config: {folder}\n")
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert served[-1].generation_config == folder


@pytest.mark.parametrize("make,needle", [
    (lambda tmp: str(tmp / "missing"), "is neither auto nor vllm nor a folder"),
    (lambda tmp: _folder(tmp / "f", {}) + "/generation_config.json", "is neither auto nor vllm nor a folder"),
    (lambda tmp: str(tmp), "no generation_config.json in"),
    (lambda tmp: _folder(tmp / "f", "{temperature: 0"), "is not valid JSON"),
    (lambda tmp: _folder(tmp / "f", "[0.7]"), "must hold a JSON object"),
    (lambda tmp: _folder(tmp / "f", {"temperature": -1}), "temperature"),
    (lambda tmp: _folder(tmp / "f", {"max_new_tokens": 0}), "max_new_tokens"),
    (lambda tmp: "", "must be auto, vllm or a folder's path"),
])
def test_a_bad_value_is_one_line_and_exit_2(served, tmp_path, make, needle):
    result = runner.invoke(app, ["serve", "--generation-config", make(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: generation_config:") and needle in result.output, result.output
    assert result.output.strip().count("\n") == 0
    assert not served  # refused before the server (and the model) start


def test_the_python_api_checks_it_too(tmp_path):
    with pytest.raises(ValueError, match="^generation_config: no generation_config.json"):
        ServeOptions(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="^generation_config: .* is neither"):
        create_app(lambda: None, "m", generation_config=str(tmp_path / "missing"))
    assert ServeOptions().generation_config == "auto" and check_generation_config_source(None) == "auto"


# -- the defaults, as vLLM's get_diff_sampling_param gives them --------------------------------


def test_the_three_sources_and_the_override(tmp_path):
    model = _folder(tmp_path / "model", {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "eos_token_id": 2})
    other = _folder(tmp_path / "other", {"temperature": 0.2, "top_k": 50, "min_p": 0.05, "bos_token_id": 1})
    # auto: the model's file
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert sampling_defaults(model, {"temperature": 0.0}) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 64}
    # vllm: the model's file ignored; the override alone
    assert sampling_defaults(model, None, "vllm") == {}
    assert sampling_defaults(model, {"top_k": 5}, "vllm") == {"top_k": 5}
    # a folder: its file instead of the model's (top_k 50 too: transformers 5 has no default to
    # leave it out as), override over it
    assert folder_generation_config(other) == {"temperature": 0.2, "top_k": 50, "min_p": 0.05}
    assert sampling_defaults(model, None, other) == {"temperature": 0.2, "top_k": 50, "min_p": 0.05}
    assert sampling_defaults(model, {"temperature": 1.0, "max_new_tokens": 9}, other) == {
        "temperature": 1.0, "top_k": 50, "min_p": 0.05, "max_tokens": 9}
    # a model without a generation config (a packaged GGUF): auto is vLLM's defaults too
    assert sampling_defaults("smollm2-135m") == {} == sampling_defaults("smollm2-135m", None, "vllm")


# -- what the server applies --------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(smollm):
    rt = AgentRuntime(make_engine(smollm, max_model_len=256, num_kv_blocks=64))
    yield rt
    rt.close_sync()


def _distinct_replies(client: TestClient, **extra: object) -> int:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "n": 4, "max_tokens": 10,
                                                  "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return len({c["message"]["content"] for c in r.json()["choices"]})


def test_the_server_applies_a_folders_defaults(runtime, tmp_path):
    greedy = _folder(tmp_path / "greedy", {"temperature": 0.0, "max_new_tokens": 6})
    with TestClient(create_app(runtime, "m", generation_config=greedy)) as client:
        assert client.app.state.server.sampling_defaults == {"temperature": 0.0, "max_tokens": 6}
        assert _distinct_replies(client) == 1  # the folder's temperature 0: greedy
        assert _distinct_replies(client, temperature=1.0) > 1  # the request's own value wins
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 6  # its max_new_tokens: a chat's default max_tokens
    # the override over the folder's
    with TestClient(create_app(runtime, "m", generation_config=greedy,
                               override_generation_config={"temperature": 1.0})) as client:
        assert client.app.state.server.sampling_defaults == {"temperature": 1.0, "max_tokens": 6}
        assert _distinct_replies(client) > 1


def test_the_server_with_vllm_takes_the_override_alone(runtime):
    with TestClient(create_app(runtime, "m", generation_config="vllm")) as client:
        assert client.app.state.server.sampling_defaults == {}
        assert _distinct_replies(client) > 1  # vLLM's temperature 1
    with TestClient(create_app(runtime, "m", generation_config="vllm",
                               override_generation_config={"temperature": 0})) as client:
        assert _distinct_replies(client) == 1
