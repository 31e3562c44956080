"""``asymcache serve``'s vLLM options for the server's defaults: ``--override-generation-config``
(checked before the model loads: one line naming it, exit code 2) and ``--served-model-name``
with several names, as vLLM's launch line gives them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eval.cli import app
from eval.cli_app import expand_multi_value_flags

runner = CliRunner()


def test_override_generation_config_reaches_the_server(served):
    result = runner.invoke(app, ["serve", "--override-generation-config", '{"temperature": 0, "top_p": 0.9}'])
    assert result.exit_code == 0, result.output
    options = served[-1]
    assert options.override_generation_config == {"temperature": 0.0, "top_p": 0.9}
    assert "override_generation_config" not in options.engine_settings
    assert runner.invoke(app, ["serve"]).exit_code == 0 and served[-1].override_generation_config is None


@pytest.mark.parametrize("value,needle", [
    ("{temperature: 0}", "not valid JSON"),
    ('"greedy"', "must be a JSON object"),
    ('{"temp": 0}', "unknown key 'temp'"),
    ('{"temperature": -0.5}', "temperature"),
    ('{"top_k": "all"}', "top_k"),
    ('{"max_new_tokens": 0}', "max_new_tokens"),
])
def test_a_bad_override_generation_config_is_one_line_and_exit_2(served, value, needle):
    result = runner.invoke(app, ["serve", "--override-generation-config", value])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: override_generation_config:") and needle in result.output
    assert result.output.strip().count("\n") == 0
    assert not served  # refused before the server (and the model) start


def test_served_model_name_takes_several_names_as_vllm_does(served):
    result = runner.invoke(app, ["serve", "--served-model-name", "a", "b", "--port", "8001"])
    assert result.exit_code == 0, result.output
    assert served[-1].served_model_name == ("a", "b") and served[-1].port == 8001
    result = runner.invoke(app, ["serve", "--served-model-name", "a", "--served-model-name", "c"])
    assert result.exit_code == 0 and served[-1].served_model_name == ("a", "c")
    result = runner.invoke(app, ["serve", "--served-model-name", "one"])
    assert result.exit_code == 0 and served[-1].served_model_name == "one"
    result = runner.invoke(app, ["serve", "--served-model-name"])
    assert result.exit_code == 2 and result.output.startswith("error: ")


def test_several_values_after_one_flag_are_expanded():
    assert expand_multi_value_flags(["serve", "--served-model-name", "a", "b", "--port", "1"]) == [
        "serve", "--served-model-name", "a", "--served-model-name", "b", "--port", "1"]
    assert expand_multi_value_flags(["serve", "--served-model-name"]) == ["serve", "--served-model-name"]
    assert expand_multi_value_flags(["serve", "--served-model-name=a", "x"]) == ["serve", "--served-model-name=a", "x"]
    assert expand_multi_value_flags(["serve", "--served-model-name", "--port", "1"]) == [
        "serve", "--served-model-name", "--port", "1"]
