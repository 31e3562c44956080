"""``asymcache serve`` takes vLLM 0.32's frontend flags (CORS, ``--root-path``, TLS, the docs
routes, ``--max-logprobs``, forced usage, request logging and ``--max-log-len``, ``--response-role``,
the client-certificate flags ``--ssl-ca-certs`` / ``--ssl-cert-reqs`` passed to uvicorn as vLLM's
``serve_http`` passes them) and accepts
``--kv-cache-dtype auto`` and ``--enable-prompt-tokens-details`` as what it always does; a value
it cannot honour is one line and exit code 2, before the model loads."""

from __future__ import annotations

import ssl
import types

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


@pytest.fixture()
def pem(tmp_path):
    """A readable file for each TLS flag (uvicorn, not these tests, would parse them)."""
    for name in ("key", "cert", "ca"):
        (tmp_path / f"{name}.pem").write_text(name)
    return {name: str(tmp_path / f"{name}.pem") for name in ("key", "cert", "ca")}


def test_client_certificate_flags_reach_uvicorn(served, monkeypatch, pem):
    import agent_runtime.server.app as server_app

    line = ["serve", "--ssl-keyfile", pem["key"], "--ssl-certfile", pem["cert"], "--ssl-ca-certs", pem["ca"],
            "--ssl-cert-reqs", "2", "--max-log-len", "100"]
    result = runner.invoke(app, line)
    assert result.exit_code == 0, result.output
    options = served[-1]
    assert (options.ssl_ca_certs, options.ssl_cert_reqs) == (pem["ca"], ssl.CERT_REQUIRED)
    assert options.frontend.max_log_len == 100
    ran: list[dict] = []
    monkeypatch.setattr(server_app.ServeOptions, "build_runtime", lambda self: types.SimpleNamespace(close_sync=lambda: None))
    monkeypatch.setattr(server_app.ServeOptions, "build_app", lambda self, source: "app")
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append(kw))
    server_app.serve(options)
    assert (ran[-1]["ssl_ca_certs"], ran[-1]["ssl_cert_reqs"]) == (pem["ca"], 2)
    # without them: vLLM's defaults (no CA file, ssl.CERT_NONE; every line of the body logged)
    assert runner.invoke(app, ["serve"]).exit_code == 0
    assert (served[-1].ssl_ca_certs, served[-1].ssl_cert_reqs, served[-1].frontend.max_log_len) == (None, 0, None)


@pytest.mark.parametrize("argv,message", [
    (["--ssl-cert-reqs", "3", "--tls"], "ssl_cert_reqs: must be one of 0, 1, 2"),
    (["--ssl-cert-reqs", "-1", "--tls"], "ssl_cert_reqs: must be one of 0, 1, 2"),
    (["--ssl-ca-certs", "/nonexistent/ca.pem", "--tls"], "ssl_ca_certs: cannot read '/nonexistent/ca.pem'"),
    (["--ssl-ca-certs", "CA"], "ssl_ca_certs: client certificates need TLS"),
    (["--ssl-cert-reqs", "1"], "ssl_cert_reqs: client certificates need TLS"),
    (["--replicas", "2", "--ssl-cert-reqs", "2", "--ssl-ca-certs", "CA", "--tls"], "replicas: CORS, --root-path"),
    (["--max-log-len", "-1"], "max_log_len: must be an integer >= 0"),
    (["--ssl-keyfile", "CA"], "ssl_keyfile: needs --ssl-certfile too"),
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
def test_a_value_that_cannot_be_honoured_is_one_line_and_exit_2(served, monkeypatch, pem, argv, message):
    # NOTE: Ray is not needed to refuse the flags that a replicated server cannot serve
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    tls = ["--ssl-keyfile", pem["key"], "--ssl-certfile", pem["cert"]]
    argv = [a for arg in argv for a in (tls if arg == "--tls" else [pem["ca"]] if arg == "CA" else [arg])]
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
                 "--enable-prompt-tokens-details",
                 "--ssl-ca-certs", "--ssl-cert-reqs", "--max-log-len"):
        assert flag in text, flag
