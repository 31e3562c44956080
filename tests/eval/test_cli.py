"""The command line's engine options: derived from ``EngineConfig``'s fields, vLLM's names, the
older names as aliases, values checked by the config (one ``error:`` line, exit code 2)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from asymcache_core import EngineConfig
from asymcache_core.config import cli_flags
from eval.cli import app, clean_errors, engine_options

runner = CliRunner()


def test_every_flag_names_a_field_and_no_spelling_is_taken_twice():
    flags = cli_flags()
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(flags) <= names
    # what a serving preset or a bench suffix sets has no flag of its own
    assert not {"eviction_policy", "priority", "hole_reuse"} & set(flags)
    spellings = [s for flag in flags.values() for s in (flag.name, *flag.aliases)]
    assert len(spellings) == len(set(spellings))
    assert flags["max_model_len"].name == "--max-model-len" and "--max-context" in flags["max_model_len"].aliases
    assert flags["num_kv_blocks"].name == "--num-kv-blocks" and "--kv-blocks" in flags["num_kv_blocks"].aliases
    assert "--max-batched-tokens" in flags["max_num_batched_tokens"].aliases


def _probe() -> tuple[typer.Typer, list[dict[str, Any]]]:
    """A one-command app over every engine option that records what the command received."""
    seen: list[dict[str, Any]] = []
    probe = typer.Typer()

    @probe.command()
    @clean_errors
    @engine_options(defaults={"max_num_seqs": 8})
    def run(label: str = typer.Option("x"), *, engine_args: dict[str, Any]) -> None:
        EngineConfig(**engine_args)
        seen.append({"label": label, **engine_args})

    return probe, seen


def test_options_map_back_onto_the_config_fields():
    probe, seen = _probe()
    result = runner.invoke(probe, ["--label", "y"])
    assert result.exit_code == 0, result.output
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in cli_flags()}
    assert seen[-1] == {"label": "y", **defaults, "max_num_seqs": 8}  # the command's own default
    args = ["--max-model-len", "300", "--num-kv-blocks", "40", "--max-num-batched-tokens", "96",
            "--block-size", "32", "--dtype", "float32", "--enforce-eager", "--least-work-first",
            "--least-work-patience", "4", "--chunking", "fixed:64", "--seed", "7"]
    result = runner.invoke(probe, args)
    assert result.exit_code == 0, result.output
    got = seen[-1]
    assert (got["max_model_len"], got["num_kv_blocks"], got["max_num_batched_tokens"], got["block_size"]) == (
        300, 40, 96, 32)
    assert got["dtype"] == "float32" and got["enforce_eager"] is True and got["least_work_first"] is True
    assert (got["least_work_patience"], got["chunking"], got["seed"]) == (4.0, "fixed:64", 7)


@pytest.mark.parametrize(
    ("alias", "field", "value"),
    [("--max-context", "max_model_len", 256), ("--kv-blocks", "num_kv_blocks", 64),
     ("--num-gpu-blocks-override", "num_kv_blocks", 64), ("--max-batched-tokens", "max_num_batched_tokens", 128)],
)
def test_older_names_still_work(alias, field, value):
    probe, seen = _probe()
    result = runner.invoke(probe, [alias, str(value)])
    assert result.exit_code == 0, result.output
    assert seen[-1][field] == value


@pytest.mark.parametrize(
    ("args", "field"),
    [(["--max-model-len", "0"], "max_model_len"), (["--block-size", "24"], "block_size"),
     (["--dtype", "int8"], "dtype"), (["--device", "tpu"], "device"), (["--chunking", "fixed:0"], "chunking"),
     (["--least-work-patience", "2"], "least_work_patience"), (["--max-num-seqs", "0"], "max_num_seqs")],
)
def test_a_bad_value_is_one_error_line_naming_the_field(args, field):
    probe, seen = _probe()
    result = runner.invoke(probe, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:"), result.output
    assert not seen


def test_unknown_field_is_a_bug_at_import():
    with pytest.raises(TypeError, match="eviction_policy"):
        engine_options({"eviction_policy"})


@pytest.mark.parametrize(
    ("argv", "target"),
    [(["serve"], "run_serve"), (["chat"], "run_chat"), (["agent", "run", "a task"], "run_agent")],
)
def test_serve_chat_and_agent_take_the_engine_options(monkeypatch, argv, target):
    import agent_runtime.commands as commands

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(commands, target, lambda **kw: calls.append(kw))
    result = runner.invoke(app, [*argv, "--max-context", "512", "--kv-blocks", "64", "--max-num-seqs", "4",
                                 "--dtype", "float32", "--policy", "continuum"])
    assert result.exit_code == 0, result.output
    kw = calls[-1]
    assert (kw["max_model_len"], kw["num_kv_blocks"], kw["max_num_seqs"], kw["dtype"]) == (512, 64, 4, "float32")
    assert kw["policy"] == "continuum" and kw["model"] == "smollm2-135m"
    # everything handed on is an EngineConfig field, or the command's own argument
    own = {"serve": {"host", "port", "api_key", "policy", "max_request_body_bytes", "max_queue_len", "shutdown_timeout",
                     "replicas", "served_model_name", "override_generation_config", "generation_config", "chat_template",
                     "default_chat_template_kwargs",
                     "trust_request_chat_template", "tool_call_parser", "reasoning_parser", "responses_store_size",
                     "log_level", "access_log", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "max_logprobs", "response_role",
                     "enable_log_requests", "enable_force_include_usage", "disable_fastapi_docs", "allow_credentials"},
           "chat": {"policy"},
           "agent": {"task", "workdir", "max_turns", "policy", "tool_choice", "parallel_tool_calls"}}[argv[0]]
    assert set(kw) - own <= {f.name for f in dataclasses.fields(EngineConfig)}
    if argv[0] == "agent":
        assert kw["tool_choice"] == ["required"]  # the first turn forced into some tool call
        assert kw["parallel_tool_calls"] is False  # one call a turn unless --parallel-tool-calls
        assert runner.invoke(app, [*argv, "--parallel-tool-calls"]).exit_code == 0
        assert calls[-1]["parallel_tool_calls"] is True
    # a server keeps a window of its step log; the other commands keep every step
    assert kw.get("max_step_log") == (10_000 if argv[0] == "serve" else None)


def test_serve_defaults_and_bad_values(monkeypatch):
    import agent_runtime.commands as commands
    import agent_runtime.server as server

    calls: list[server.ServeOptions] = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    result = runner.invoke(app, ["serve"])
    assert result.exit_code == 0, result.output
    options = calls[-1]
    assert options.num_kv_blocks == 2048  # serve's own pool default
    assert "kv_memory_fraction" not in options.engine_settings
    assert set(options.engine_settings) <= set(commands.ENGINE_SETTINGS)
    assert (options.max_request_body_bytes, options.max_queue_len, options.shutdown_timeout) == (8 << 20, 256, 30.0)
    # a pool sized from device memory: the fixed default gives way, an explicit one still wins
    result = runner.invoke(app, ["serve", "--gpu-memory-utilization", "0.5", "--max-queue-len", "8"])
    assert result.exit_code == 0, result.output
    assert calls[-1].num_kv_blocks is None and calls[-1].engine_settings["gpu_memory_utilization"] == 0.5
    assert calls[-1].max_queue_len == 8
    result = runner.invoke(app, ["serve", "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "64"])
    assert result.exit_code == 0 and calls[-1].num_kv_blocks == 64
    calls[1:] = []
    for bad, field in ((["--max-num-seqs", "0"], "max_num_seqs"), (["--num-kv-blocks", "0"], "num_kv_blocks"),
                       (["--max-model-len", "-1"], "max_model_len")):
        result = runner.invoke(app, ["serve", *bad])
        assert result.exit_code == 2 and result.output.startswith(f"error: {field}:"), result.output
        assert result.output.strip().count("\n") == 0
    assert len(calls) == 1


def test_serve_runs_a_vllm_launch_line(monkeypatch):
    # `vllm serve MODEL` with the flags launch scripts carry: the model as an argument, uvicorn's
    # log settings passed on, the flags that name what this server always does accepted
    import types

    import agent_runtime.server as server
    import agent_runtime.server.app as server_app

    calls: list[server.ServeOptions] = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    line = ["serve", "dummy:tiny", "--enable-prefix-caching", "--enable-chunked-prefill", "--trust-remote-code",
            "--disable-log-requests", "--disable-log-stats", "--enable-auto-tool-choice", "--uvicorn-log-level",
            "warning", "--disable-uvicorn-access-log", "--max-model-len", "64"]
    result = runner.invoke(app, line)
    assert result.exit_code == 0, result.output
    options = calls[-1]
    assert (options.model, options.log_level, options.access_log, options.max_model_len) == ("dummy:tiny", "warning", False, 64)
    result = runner.invoke(app, ["serve", "--model", "dummy:tiny"])
    assert result.exit_code == 0 and (calls[-1].model, calls[-1].log_level, calls[-1].access_log) == ("dummy:tiny", "info", True)
    result = runner.invoke(app, ["serve", "dummy:tiny", "--model", "dummy:tiny"])
    assert result.exit_code == 0 and calls[-1].model == "dummy:tiny"
    count = len(calls)
    for bad, message in (
        (["dummy:tiny", "--model", "smollm2-135m"], "model: given twice, as MODEL ('dummy:tiny') and --model"),
        (["--no-enable-prefix-caching"], "enable_prefix_caching: cannot be turned off"),
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill: cannot be turned off"),
        (["--uvicorn-log-level", "loud"], "log_level: must be one of"),
    ):
        result = runner.invoke(app, ["serve", *bad])
        assert result.exit_code == 2 and result.output.startswith(f"error: {message}"), result.output
        assert result.output.strip().count("\n") == 0
    assert len(calls) == count
    # and uvicorn gets them
    ran: list[dict[str, Any]] = []
    monkeypatch.setattr(server_app.ServeOptions, "build_runtime", lambda self: types.SimpleNamespace(close_sync=lambda: None))
    monkeypatch.setattr(server_app.ServeOptions, "build_app", lambda self, source: "app")
    # NOTE: the start-up heap is out of the collector's view while uvicorn serves, and back after
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append({**kw, "frozen": gc.get_freeze_count()}))
    server_app.serve(options)
    assert ran[-1]["log_level"] == "warning" and ran[-1]["access_log"] is False
    assert ran[-1]["frozen"] > 1000 and gc.get_freeze_count() == 0


def test_serve_reads_a_vllm_config_file_and_the_key_from_the_environment(monkeypatch, tmp_path):
    import agent_runtime.server as server

    calls: list[server.ServeOptions] = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    config = tmp_path / "serve.yaml"
    config.write_text("model: dummy:tiny\nport: 8124\nmax-num-seqs: 8\n--enforce-eager: true\n"
                      "served_model_name: from-file\nkv-blocks: 64\nenable-prefix-caching: true\n")
    result = runner.invoke(app, ["serve", "--config", str(config), "--max-num-seqs", "4"])
    assert result.exit_code == 0, result.output
    options = calls[-1]
    assert (options.model, options.port, options.served_model_name, options.num_kv_blocks) == ("dummy:tiny", 8124, "from-file", 64)
    settings = options.engine_settings
    assert settings["max_num_seqs"] == 4 and settings["enforce_eager"] is True  # the command line wins
    result = runner.invoke(app, ["serve", "dummy:llama-3.1-8b", "--config", str(config)])
    assert result.exit_code == 0 and calls[-1].model == "dummy:llama-3.1-8b"  # MODEL wins over the file's
    # a pool size in the file counts as given: --gpu-memory-utilization does not replace it
    result = runner.invoke(app, ["serve", "--config", str(config), "--gpu-memory-utilization", "0.5"])
    assert result.exit_code == 0 and calls[-1].num_kv_blocks == 64
    count = len(calls)
    for text, message in (("bogus: 1\n", "'bogus' is not an option"), ("[1, 2]\n", "must hold a mapping"),
                          ("port: [\n", "cannot read"), ("max-num-seqs: 0\n", "max_num_seqs:"),
                          ("no-enable-prefix-caching: true\n", "'no-enable-prefix-caching' is not an option")):
        config.write_text(text)
        result = runner.invoke(app, ["serve", "--config", str(config)])
        assert result.exit_code == 2 and message in result.output, result.output
        assert result.output.startswith("error: ") and result.output.strip().count("\n") == 0, result.output
    result = runner.invoke(app, ["serve", "--config", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "cannot read" in result.output
    assert len(calls) == count
    # the API key from the environment (a key on the command line shows in the process list)
    for variable in ("ASYMCACHE_API_KEY", "VLLM_API_KEY"):
        result = runner.invoke(app, ["serve"], env={variable: "sekret"})
        assert result.exit_code == 0 and calls[-1].api_key == "sekret"
    result = runner.invoke(app, ["serve", "--api-key", "given"], env={"ASYMCACHE_API_KEY": "sekret"})
    assert result.exit_code == 0 and calls[-1].api_key == "given"


def test_bench_takes_every_engine_flag_but_those_its_policies_and_workload_set():
    """README: ``bench`` takes all the engine options but those its suffixes set, the pool's
    fraction and the serving ones (``--jump-forward`` was once missing)."""
    from asymcache_core.config import cli_flags
    from eval.bench import ENGINE_FIELDS

    set_by_suffixes = {"chunking", "admit_full_prompt", "least_work_first", "least_work_patience", "implicit_jobs"}
    serving_only = {"tensor_parallel_size", "kv_events_config", "max_step_log"}
    read_by_the_bench = {"num_kv_blocks", "max_model_len", "kv_memory_fraction"}
    missing = set(cli_flags()) - set(ENGINE_FIELDS) - set_by_suffixes - serving_only - read_by_the_bench
    assert not missing, f"bench lacks {sorted(missing)}"
    help_text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output
    assert "--no-jump-forward" in help_text and "the least and the greatest of the runs" in help_text


def test_bench_and_profile_show_vllm_names():
    bench = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert bench.exit_code == 0
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--num-kv-blocks", "--max-num-seqs", "--dtype"):
        assert flag in bench.output
    profile = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    assert "--block-size" in profile.output and "--max-model-len" not in profile.output


def test_serve_takes_vllms_template_and_name_options(monkeypatch, tmp_path):
    import agent_runtime.server as server

    calls: list[server.ServeOptions] = []
    monkeypatch.setattr(server, "serve", calls.append)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    result = runner.invoke(app, ["serve", "--served-model-name", "my-model", "--chat-template", str(template),
                                 "--default-chat-template-kwargs", '{"enable_thinking": false}',
                                 "--trust-request-chat-template", "--responses-store-size", "16"])
    assert result.exit_code == 0, result.output
    options = calls[-1]
    assert options.served_model_name == "my-model" and options.trust_request_chat_template is True
    assert options.responses_store_size == 16 and "responses_store_size" not in options.engine_settings
    assert options.chat_template == template.read_text() and options.default_chat_template_kwargs == {
        "enable_thinking": False}
    assert not {"chat_template", "served_model_name"} & set(options.engine_settings)
    for bad, field in ((["--default-chat-template-kwargs", "{nope"], "default_chat_template_kwargs"),
                       (["--default-chat-template-kwargs", "[1]"], "default_chat_template_kwargs"),
                       (["--default-chat-template-kwargs", '{"tools": []}'], "default_chat_template_kwargs.tools"),
                       (["--chat-template", str(tmp_path / "missing.jinja")], "chat_template"),
                       (["--served-model-name", " "], "served_model_name"),
                       (["--reasoning-parser", "granite"], "reasoning_parser"),
                       (["--tool-call-parser", "mistral"], "tool_call_parser"),
                       (["--responses-store-size", "-1"], "responses_store_size")):
        result = runner.invoke(app, ["serve", *bad])
        assert result.exit_code == 2 and result.output.startswith(f"error: {field}:"), result.output
        assert result.output.strip().count("\n") == 0
    assert len(calls) == 1


def test_serve_fails_before_the_model_loads_where_it_could_not_listen(tmp_path):
    """A port in use or a host that does not resolve once surfaced after the model load, as
    uvicorn's exit code 3 and a log line; a config file that is not UTF-8 as a traceback."""
    import socket

    from agent_runtime.commands import check_listen_address

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"^port: cannot listen on 127.0.0.1:{port}"):
            check_listen_address("127.0.0.1", port)
        result = runner.invoke(app, ["serve", "dummy:tiny", "--host", "127.0.0.1", "--port", str(port)])
        assert result.exit_code == 2 and result.output.startswith("error: port: "), result.output
    with pytest.raises(ValueError, match="^host: cannot resolve '999.1.1.1'"):
        check_listen_address("999.1.1.1", 8000)
    config = tmp_path / "binary.yaml"
    config.write_bytes(b"\x00\xff\xfe")
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2 and "cannot read" in result.output and "Traceback" not in result.output
