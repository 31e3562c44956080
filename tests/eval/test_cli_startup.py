"""Start-up of the commands a newcomer runs first: ``generate`` streams its answer, ``serve``
logs one line saying what it loaded."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asymcache_core import Engine, SamplingParams
from asymcache_core.memory_budget import GIB
from eval.cli import StartupLine, app, startup_line, stream_answer
from tests.tiny_gguf import write_tiny_gguf

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_stream_answer_writes_the_text_as_it_grows(tiny: Path) -> None:
    engine = Engine(str(tiny), num_kv_blocks=32)
    prompt = "hello"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = engine.generate([prompt], params)[0].text
    pieces: list[str] = []
    steps_before: list[int] = []

    def write(piece: str) -> None:
        pieces.append(piece)
        steps_before.append(len(engine.step_log))

    answer = stream_answer(engine, prompt, params, write)
    assert answer == expected == "".join(pieces)
    assert all(pieces)
    assert len(pieces) >= 2 and steps_before == sorted(steps_before) and steps_before[0] < steps_before[-1]


def test_generate_prints_the_streamed_answer(tiny: Path) -> None:
    engine = Engine(str(tiny), num_kv_blocks=256)
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    expected = engine.generate([text], SamplingParams(max_tokens=5, temperature=0))[0].text
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny), "--max-tokens", "5"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"


def test_the_engine_reports_what_it_loaded(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asymcache_core.engine"):
        engine = Engine(str(tiny), num_kv_blocks=48, block_size=16)
    (record,) = [r for r in caplog.records if hasattr(r, "engine_ready")]
    ready = record.engine_ready
    per_token = engine.model_config.kv_bytes_per_token(4)
    assert ready == {
        "model": str(tiny), "dtype": "float32", "device": "cpu", "eviction_policy": "asymcache",
        "kv_blocks": 48, "kv_gib": pytest.approx(48 * 16 * per_token / GIB),
    }


def test_startup_line_names_model_dtype_device_policy_and_pool() -> None:
    ready = {"model": "smollm2-135m", "dtype": "float32", "device": "cpu", "eviction_policy": "asymcache",
             "kv_blocks": 2048, "kv_gib": 1.40625}
    assert startup_line(ready, "asymcache+continuum", 1.234) == (
        "serve: model smollm2-135m, dtype float32, device cpu, policy asymcache+continuum (eviction asymcache), "
        "pool 2048 blocks (1.41 GiB); loaded in 1.2 s"
    )


def test_startup_line_is_written_once_and_the_handler_detaches(capsys: pytest.CaptureFixture[str]) -> None:
    ready = {"model": "m", "dtype": "bfloat16", "device": "cuda:0", "eviction_policy": "lru",
             "kv_blocks": 8, "kv_gib": 0.5}
    engine_log = logging.getLogger("asymcache_core.engine")
    ticks = iter([10.0, 12.5, 99.0])
    with StartupLine.listening("vllm-apc", clock=lambda: next(ticks)) as handler:
        assert handler in engine_log.handlers and engine_log.level == logging.INFO
        engine_log.info("unrelated")
        engine_log.info("engine ready", extra={"engine_ready": ready})
        engine_log.info("engine ready", extra={"engine_ready": ready})
    assert handler not in engine_log.handlers and engine_log.level == logging.NOTSET
    assert capsys.readouterr().err.splitlines() == [startup_line(ready, "vllm-apc", 2.5)]


def test_serve_logs_one_startup_line(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    served: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    result = runner.invoke(app, ["serve", "--model", str(tiny), "--num-kv-blocks", "64", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert served and served[0]["port"] == 8123
    lines = [line for line in result.stderr.splitlines() if line.startswith("serve:")]
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(
        rf"serve: model {re.escape(str(tiny))}, dtype float32, device cpu, policy asymcache\+continuum "
        r"\(eviction asymcache\), pool 64 blocks \(\d+\.\d\d GiB\); loaded in \d+\.\d s",
        lines[0],
    ), lines[0]
