"""``asymcache serve`` takes vLLM 0.32's frontend flags (CORS, ``--root-path``, TLS, the docs
routes, ``--max-logprobs``, forced usage, request logging, ``--response-role``) and accepts
``--kv-cache-dtype auto`` and ``--enable-prompt-tokens-details`` as what it always does; a value
it cannot honour is one line and exit code 2, before the model loads."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from agent_runtime.server.frontend import FrontendOptions
from eval.cli import app

runner = CliRunner()


def test_a_vllm_frontend_launch_line_reaches_the_server(served, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    line = ["serve", "dummy:tiny", "--allowed-origins", '["https://ui.example"]', "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", '["Authorization"]', "--allow-credentials", "--root-path", "/api",
            "--disable-fastapi-docs", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--max-logprobs", "5",
            "--enable-force-include-usage", "--enable-log-requests", "--response-role", "bot",
            "--kv-cache-dtype", "auto", "--enable-prompt-tokens-details"]
    result = runner.invoke(app, line)
    assert result.exit_code == 0, result.output
    options = served[-1]
    assert options.frontend == FrontendOptions(
        allowed_origins=("https://ui.example",), allowed_methods=("GET", "POST"), allowed_headers=("Authorization",),
        allow_credentials=True, root_path="/api", disable_fastapi_docs=True, max_logprobs=5,
        enable_force_include_usage=True, enable_log_requests=True, response_role="bot")
    assert (options.ssl_keyfile, options.ssl_certfile) == (str(key), str(cert))
    assert not {"kv_cache_dtype", "enable_prompt_tokens_details"} & set(options.engine_settings)
    # without them: vLLM's defaults
    result = runner.invoke(app, ["serve"])
    assert result.exit_code == 0 and served[-1].frontend == FrontendOptions()
    assert (served[-1].ssl_keyfile, served[-1].ssl_certfile) == (None, None)


def test_tls_files_reach_uvicorn(served, monkeypatch, tmp_path):
    import types

    import agent_runtime.server.app as server_app

    key = tmp_path / "key.pem"
    key.write_text("k")
    assert runner.invoke(app, ["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(key)]).exit_code == 0
    ran: list[dict] = []
    monkeypatch.setattr(server_app.ServeOptions, "build_runtime", lambda self: types.SimpleNamespace(close_sync=lambda: None))
    monkeypatch.setattr(server_app.ServeOptions, "build_app", lambda self, source: "app")
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append(kw))
    server_app.serve(served[-1])
    assert ran[-1]["ssl_keyfile"] == ran[-1]["ssl_certfile"] == str(key)


@pytest.mark.parametrize("argv,message", [
    (["--allowed-origins", "*"], "allowed_origins: not valid JSON"),
    (["--allowed-methods", '"GET"'], "allowed_methods: must be a JSON list of strings"),
    (["--allowed-headers", "[1]"], "allowed_headers: must be a list of strings"),
    (["--root-path", "api"], "root_path: must be a path starting with '/'"),
    (["--max-logprobs", "21"], "max_logprobs: must be an integer in [0, 20]"),
    (["--max-logprobs", "-1"], "max_logprobs: must be an integer in [0, 20]"),
    (["--response-role", " "], "response_role: must be a non-empty role name"),
    (["--ssl-keyfile", "/nonexistent/key.pem"], "ssl_keyfile: cannot read '/nonexistent/key.pem'"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype: only 'auto' is served"),
    (["--no-enable-prompt-tokens-details"], "enable_prompt_tokens_details: cannot be turned off"),
    (["--enable-log-requests", "--disable-log-requests"], "enable_log_requests: given with --disable-log-requests"),
    (["--replicas", "2", "--root-path", "/api"], "replicas: CORS, --root-path"),
])
def test_a_value_that_cannot_be_honoured_is_one_line_and_exit_2(served, monkeypatch, argv, message):
    # NOTE: Ray is not needed to refuse the flags that a replicated server cannot serve
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    result = runner.invoke(app, ["serve", *argv])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {message}"), result.output
    assert result.output.strip().count("\n") == 0
    assert not served


def test_the_help_names_each_flag():
    text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "300"}).output
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials", "--root-path",
                 "--max-logprobs", "--enable-force-include-usage", "--enable-log-requests", "--ssl-keyfile",
                 "--ssl-certfile", "--disable-fastapi-docs", "--response-role", "--kv-cache-dtype",
                 "--enable-prompt-tokens-details"):
        assert flag in text, flag
