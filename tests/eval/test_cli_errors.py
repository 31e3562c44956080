"""Every command-line error is one ``error:`` line on stderr and exit code 2; ``--version``,
``-h``; flags that read naturally; the ``--policies`` help offers only what parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from eval.cli import app, clean_errors, one_line
from eval.results_io import save_results
from eval.variants import SUFFIX_SPELLINGS, BenchVariant
from tests.eval.sample_results import sample_results

runner = CliRunner()

#: What each command needs besides options (``None``: nothing).
REQUIRED = {
    "report": ["."],
    "calibrate": ["steps.jsonl", "--latency-profile", "profile.json"],
    "generate": ["hello"],
    "agent run": ["a task"],
}


def _commands() -> list[tuple[str, Any]]:
    """Every leaf command of the app, by its words (``agent run``)."""
    root = typer.main.get_command(app)
    found: list[tuple[str, Any]] = []

    def walk(prefix: list[str], group: Any) -> None:
        ctx = typer.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if hasattr(command, "list_commands"):
                walk([*prefix, name], command)
            else:
                found.append((" ".join([*prefix, name]), command))

    walk([], root)
    return found


COMMANDS = _commands()


def _bad_values(command: Any) -> list[list[str]]:
    """For each numeric option of ``command``, an argument list giving it a word."""
    bad = []
    for param in command.params:
        kind = getattr(param, "type_descriptor", None)
        annotation = getattr(kind, "annotation", None)
        if param.param_type_name == "option" and annotation in (int, float, int | None, float | None):
            bad.append([param.opts[0], "abc"])
    return bad


def _assert_one_error_line(result: Any, argv: list[str]) -> str:
    assert result.exit_code == 2, (argv, result.output)
    assert result.stdout == "", (argv, result.stdout)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, result.stderr)
    assert "Traceback" not in result.output and "╭" not in result.output
    return lines[0]


def test_the_walk_finds_every_command() -> None:
    names = {name for name, _ in COMMANDS}
    assert names == {"bench", "report", "profile", "calibrate", "bench-engine", "generate", "serve", "chat",
                     "agent run"}


@pytest.mark.parametrize(("name", "command"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_command_answers_bad_options_with_one_line(name: str, command: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    words = name.split()
    required = REQUIRED.get(name, [])
    cases: list[tuple[list[str], str]] = [([*required, "--no-such-option"], "error: No such option")]
    cases += [([*required, *bad], f"error: Invalid value for '{bad[0]}'") for bad in _bad_values(command)]
    if required and not required[0].startswith("--"):
        cases.append(([], "error: Missing argument"))
    if any(p.name == "block_size" for p in command.params):
        cases.append(([*required, "--block-size", "24"], "error: block_size:"))  # the config refuses it
    if any(p.name == "device" for p in command.params):
        cases.append(([*required, "--device", "tpu"], "error: device: 'tpu' is not a device; use cpu, cuda or cuda:N"))
    assert len(cases) >= 2
    for case, expected in cases:
        argv = [*words, *case]
        line = _assert_one_error_line(runner.invoke(app, argv), argv)
        assert line.startswith(expected), (argv, line)
    assert not list(tmp_path.iterdir())  # nothing written by a refused command


def test_unknown_command_is_one_line() -> None:
    _assert_one_error_line(runner.invoke(app, ["nosuch"]), ["nosuch"])


def test_version_and_short_help() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"asymcache \d+\.\d+\.\d+\S*\n", result.stdout), result.output
    for argv in (["-h"], ["bench", "-h"], ["agent", "run", "-h"]):
        short, long = runner.invoke(app, argv), runner.invoke(app, [*argv[:-1], "--help"])
        assert short.exit_code == 0 and short.stdout == long.stdout and "Usage" in short.stdout


@pytest.mark.parametrize(("name", "command"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_flags_read_naturally_in_the_help(name: str, command: Any) -> None:
    result = runner.invoke(app, [*name.split(), "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout and "--no-no-" not in result.stdout, result.stdout
    assert "-h" in result.stdout


def test_lossless_check_flag_pair() -> None:
    help_text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "250"}).stdout
    assert "--lossless-check" in help_text and "--no-lossless-check" in help_text


def test_policies_help_offers_only_what_parses() -> None:
    help_text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "400"}).stdout
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", help_text).split())
    offered = re.findall(r"(/[a-z][a-z:-]*[A-Z]*)", flat.split("--policies", 1)[1].split("--backend", 1)[0])
    assert {o.lstrip("/") for o in offered} == set(SUFFIX_SPELLINGS)
    assert {"adaptive", "fixed:N", "least-work:P", "adaptive:slack", "slo:MS"} <= set(SUFFIX_SPELLINGS)
    assert "fixed" not in SUFFIX_SPELLINGS  # /fixed alone is not offered: it needs its budget
    numbers = {"N": "256", "P": "4", "MS": "100"}
    for spelling in SUFFIX_SPELLINGS:
        suffix = re.sub(r"(N|P|MS)$", lambda m: numbers[m.group(1)], spelling)
        spec = f"asymcache/adaptive/{suffix}" if suffix.startswith("slo:") else f"asymcache/{suffix}"
        BenchVariant.parse(spec)
    with pytest.raises(ValueError, match="known: .*least-work:P, adaptive, adaptive:slack, fixed:N, slo:MS"):
        BenchVariant.parse("asymcache/fixed")
    # suffixes that undo each other were taken as "the last one wins"; a preset's own setting
    # may still be replaced (continuum/fcfs)
    with pytest.raises(ValueError, match="^policy: 'no-job-admission' contradicts another suffix"):
        BenchVariant.parse("asymcache/job-admission/no-job-admission")
    assert BenchVariant.parse("continuum/fcfs").engine_overrides["priority"] == "fcfs"


def test_report_takes_the_results_file_or_its_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_results(sample_results(), run)
    result = runner.invoke(app, ["report", str(run / "results.json")])
    assert result.exit_code == 0, result.output
    assert (run / "report.md").is_file() and (run / "report.html").is_file()
    other = run / "report.md"
    line = _assert_one_error_line(runner.invoke(app, ["report", str(other)]), ["report", str(other)])
    assert "is a file; give the run folder" in line
    missing = tmp_path / "missing"
    line = _assert_one_error_line(runner.invoke(app, ["report", str(missing)]), ["report"])
    assert "no folder" in line


def test_a_schema_error_lists_every_problem_on_its_line(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"a": 1}))
    line = _assert_one_error_line(runner.invoke(app, ["report", str(tmp_path)]), ["report"])
    assert "3 problem(s): " in line
    for problem in ("run: Field required", "policies: Field required", "a: Extra inputs are not permitted"):
        assert problem in line, line


def test_one_line_joins_lines_and_drops_bullets() -> None:
    assert one_line("x: 2 problem(s):\n  - a: bad\n  - b: worse\n") == "x: 2 problem(s): a: bad; b: worse"
    assert one_line("single") == "single"


@pytest.mark.parametrize("out", [None, "given"])
def test_a_failed_bench_leaves_no_empty_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   out: str | None) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--backend", "http", "--jobs", "1"]  # fails after the run folder is made: no --url
    if out is not None:
        argv += ["--out", str(tmp_path / "runs" / "mine")]
    line = _assert_one_error_line(runner.invoke(app, argv), argv)
    assert line == "error: url: --backend http needs --url"
    assert not (tmp_path / "runs").exists()
    # a runs/ folder that was there before stays, with what it held
    (tmp_path / "runs" / "old").mkdir(parents=True)
    _assert_one_error_line(runner.invoke(app, argv), argv)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["old"]


def test_running_out_of_memory_is_one_line_saying_so() -> None:
    probe = typer.Typer()

    @probe.command()
    @clean_errors
    def grow() -> None:
        raise MemoryError

    result = runner.invoke(probe, [])
    assert result.exit_code == 2 and result.stderr.startswith("error: out of memory: a size given")


def test_an_unexpected_exception_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = typer.Typer()

    @probe.command()
    @clean_errors
    def boom() -> None:
        raise RuntimeError("kaput\nsecond line")

    result = runner.invoke(probe, [])
    assert result.exit_code == 2
    assert result.stderr == "error: unexpected RuntimeError: kaput; second line (ASYMCACHE_DEBUG=1 shows the traceback)\n"
    monkeypatch.setenv("ASYMCACHE_DEBUG", "1")
    result = runner.invoke(probe, [])
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.parametrize(("args", "message"), [
    (["--concurrency", "1,,2"], "error: concurrency: expected comma-separated numbers, got '1,,2'"),
    (["--concurrency", ","], "error: concurrency: expected comma-separated numbers, got ','"),
    (["--seeds", ","], "error: seeds: expected comma-separated numbers, got ','"),
    (["--rate", "inf"], "error: rate: every number must be finite, got 'inf'"),
    (["--time-scale", "inf"], "error: time_scale: must be a number in [0, 1000], got inf"),
    (["--token-scale", "1e308"], "error: token_scale: must be a number in [0, 1000], got 1e+308"),
    (["--kv-fraction", "inf"], "error: kv_fraction: must be a share of the working set in (0, 1], got inf"),
    (["--kv-fraction", "0"], "error: kv_fraction: must be a share of the working set in (0, 1], got 0.0"),
    (["--kv-fraction", "1.5"], "error: kv_fraction: must be a share of the working set in (0, 1], got 1.5"),
    (["--model", "dummy:tiny", "--kv-fraction", "0.01"], "error: kv_fraction: 0.01 of the workload's working set of"),
    (["--seed", "-1"], "error: seed: must be an integer >= 0, got -1"),
    # an item of --seeds once failed as the point's seed, naming --seed
    (["--seeds", "1,-2"], "error: seeds: every seed must be an integer in [0, 2**64), got -2\n"),
    (["--seeds", f"3,{2**64}"], f"error: seeds: every seed must be an integer in [0, 2**64), got {2**64}\n"),
    (["--seed", "-1", "--seeds", "-1,2"], "error: seeds: every seed must be an integer in [0, 2**64), got -1\n"),
    (["--rate", "2,-1"], "error: rate: must be > 0, got -1\n"),
    (["--concurrency", "2,0"], "error: concurrency: must be >= 1, got 0\n"),
    # a repeated load point or seed once ran the same point twice
    (["--seeds", "1,2,1"], "error: seeds: 1 is listed twice, in '1,2,1'\n"),
    (["--concurrency", "8,16,08"], "error: concurrency: 08 is listed twice, in '8,16,08'\n"),
    (["--rate", "0.5,1,0.50"], "error: rate: 0.50 is listed twice, in '0.5,1,0.50'\n"),
    (["--jobs", str(10**23)], f"error: jobs: must be an integer in [1, 1,000,000], got {10**23}"),
    (["--repeats", str(10**20)], f"error: repeats: must be an integer in [1, 1,000], got {10**20}"),
    (["--policies", "asymcache,asymcache"], "error: policies: 'asymcache' is listed twice (use --repeats to run it again)"),
    (["--workload", "swe,,chat"], "error: workload: an empty item in 'swe,,chat'"),
    (["--model", "dummy:tiny", "--max-model-len", "100000"],
     "error: max_model_len: 100000 is past dummy:tiny's limit of 2048 tokens (its max_position_embeddings); "
     "give at most 2048 or leave it unset for the model's own\n"),
    (["--model", "dummy:tiny", "--num-kv-blocks", str(10**14)], "error: num_kv_blocks: 100,000,000,000,000 blocks need"),
])
def test_bench_sizes_and_lists_fail_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    """Once: empty list items dropped or an IndexError, infinities run to a late failure,
    sizes that hung or were killed for memory, a policy listed twice merged into one."""
    out = tmp_path / "run"
    argv = ["bench", "--backend", "sim", "--jobs", "4", "--no-plots", "--out", str(out), *args]
    line = _assert_one_error_line(runner.invoke(app, argv), argv)
    assert f"{line}\n".startswith(message), line
    assert not out.exists()


def test_a_sweep_reads_every_workload_before_its_first_point(tmp_path: Path) -> None:
    """A bad trace in the sweep's second workload once failed after the first had run,
    leaving its point's files and no sweep."""
    out = tmp_path / "sweep"
    argv = ["bench", "--backend", "sim", "--jobs", "2", "--no-plots", "--workload", "swe,trace:/nonexistent",
            "--out", str(out)]
    line = _assert_one_error_line(runner.invoke(app, argv), argv)
    assert line.startswith("error: workload: /nonexistent: cannot read trace"), line
    assert not out.exists()


@pytest.mark.parametrize("bad", [0, -3])
def test_bench_api_refuses_concurrency_below_one(tmp_path: Path, bad: int) -> None:
    from eval.bench import BenchConfig, BenchError, run_bench

    with pytest.raises(BenchError, match=r"^concurrency: must be an integer in \[1, "):
        run_bench(BenchConfig(backend="sim", jobs=2, concurrency=bad, out=tmp_path / "x"))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--backend", "sim", "--out"],
        ["profile", "--quick", "--out"],
        ["calibrate", "steps.jsonl", "--latency-profile", "profile.json", "--out"],
    ],
    ids=["bench", "profile", "calibrate"],
)
def test_an_output_path_that_cannot_be_written_fails_before_any_work(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asymcache_core

    monkeypatch.chdir(tmp_path)

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was built before the output path was checked")

    monkeypatch.setattr(asymcache_core, "Engine", no_engine)
    (tmp_path / "a_file").write_text("")
    for out, reason in (("/proc/nope/x.json", "No such file or directory"), ("a_file/x.json", "is a file")):
        line = _assert_one_error_line(runner.invoke(app, [*argv, out]), [*argv, out])
        assert line.startswith("error: out: ") and reason in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]  # the check leaves nothing behind


def test_checking_an_output_path_creates_nothing(tmp_path: Path) -> None:
    from eval.cli_app import check_output_path

    check_output_path("out", tmp_path / "new" / "deeper" / "x.json")
    check_output_path("out", tmp_path / "run" / "folder", folder=True)
    assert not list(tmp_path.iterdir())
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^out: .* is a file, not a folder"):
        check_output_path("out", tmp_path / "f", folder=True)
    with pytest.raises(ValueError, match=r"^out: .* is a folder; give a file path"):
        check_output_path("out", tmp_path)


def test_a_max_model_len_past_the_models_is_one_line_naming_it() -> None:
    argv = ["generate", "hello", "--model", "dummy:tiny", "--max-model-len", "1000000000"]
    line = _assert_one_error_line(runner.invoke(app, argv), argv)
    assert re.match(r"error: max_model_len: 1000000000 is past dummy:tiny's limit of \d+ tokens", line), line


def test_bench_and_generate_say_a_max_model_len_past_the_models_in_the_apis_words(tmp_path: Path) -> None:
    """The bench once said it in words of its own ("... is past dummy:tiny's 2048 positions")."""
    from asymcache_core import Engine

    with pytest.raises(ValueError) as api:
        Engine.simulated(model="dummy:tiny", num_kv_blocks=8, max_model_len=100000)
    lines = []
    for argv in (["bench", "--backend", "sim", "--model", "dummy:tiny", "--out", str(tmp_path / "run")],
                 ["generate", "hello", "--model", "dummy:tiny"]):
        argv += ["--max-model-len", "100000"]
        lines.append(_assert_one_error_line(runner.invoke(app, argv), argv))
    assert lines == [f"error: {api.value}"] * 2 and lines[0].startswith("error: max_model_len: 100000 "), lines
    assert not (tmp_path / "run").exists()


def test_a_sharegpt_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    """It was once read as a file of no conversations ("holds no jobs")."""
    bad = tmp_path / "bad.json"
    bad.write_text("not json {\n")
    argv = ["bench", "--backend", "sim", "--model", "dummy:tiny", "--workload", f"sharegpt:{bad}"]
    argv += ["--out", str(tmp_path / "run")]
    line = _assert_one_error_line(runner.invoke(app, argv), argv)
    assert line == f"error: workload: {bad}:1: invalid JSON: Expecting value", line


def test_generate_refuses_an_empty_prompt_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asymcache_core

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded for an empty prompt")

    monkeypatch.setattr(asymcache_core, "Engine", no_engine)
    for prompt in ("", "  \n"):
        argv = ["generate", prompt]
        line = _assert_one_error_line(runner.invoke(app, argv), argv)
        assert line == "error: prompt: must be a non-empty message", line
