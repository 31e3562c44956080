"""``asymcache serve``'s client-certificate flags (vLLM 0.32's ``--ssl-ca-certs`` and
``--ssl-cert-reqs``, passed to uvicorn as vLLM's ``serve_http`` passes them) and
``--max-log-len``; a value that cannot be honoured is one line and exit code 2, before the
model loads."""

from __future__ import annotations

import ssl
import types

import pytest
from typer.testing import CliRunner

from eval.cli import app

runner = CliRunner()


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
    for flag in ("--ssl-ca-certs", "--ssl-cert-reqs", "--max-log-len"):
        assert flag in text, flag
