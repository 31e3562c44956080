"""AgentRuntime on the real SmolLM2: the tool loop end to end, Continuum pins on a virtual clock,
aborts, bad input, and the CLI command functions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Literal

import pytest

from agent_runtime.commands import run_agent, run_chat, run_serve
from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from agent_runtime.tools import Tool, ToolRegistry
from asymcache_core import SamplingParams
from tests.asymcache_core.continuum.test_continuum import FakeClock
from tests.conftest import make_engine


def _project(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("The secret word is banana.\n")
    (tmp_path / "todo.md").write_text("- ship it\n")
    return tmp_path


def _file_tools(root: Path) -> ToolRegistry:
    """Two small tools over ``root`` with tight schemas (short prompts, short calls)."""

    def list_files() -> str:
        """List the files of the project."""
        return "\n".join(sorted(p.name for p in root.iterdir()))

    def read_file(path: Literal["notes.txt", "todo.md"]) -> str:
        """Read one file of the project.

        Args:
            path: the file name.
        """
        return (root / path).read_text()

    reg = ToolRegistry()
    reg.register_all([list_files, read_file])
    return reg


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


async def _integrity(runtime: AgentRuntime) -> None:
    await runtime.call(lambda e: e.check_integrity())


def test_job_run_tool_loop_end_to_end(smollm, tmp_path):
    root = _project(tmp_path)
    engine = make_engine(smollm, **resolve_preset("continuum").engine_overrides)
    printed: list[int] = []

    async def main():
        runtime = AgentRuntime(engine, policy="continuum")
        try:
            job = runtime.job(tools=_file_tools(root))
            result = await job.run(
                "What is the secret word in my notes?",
                max_turns=3,
                # The 135M model does not call tools unprompted: force the first two turns.
                tool_choice=[_named("list_files"), "required"],
                max_tokens=40,
                on_turn=lambda rec: printed.append(rec.index),
            )
            pinned = await runtime.call(lambda e: e.pins.num_pinned_blocks)
            await _integrity(runtime)
            return result, pinned
        finally:
            await runtime.close()

    result, pinned = asyncio.run(main())
    assert printed == [0, 1, 2]
    t0, t1, t2 = result.turns
    assert [c.name for c in t0.turn.parsed.tool_calls] == ["list_files"]
    assert "notes.txt" in t0.tool_calls[0].result.content and not t0.tool_calls[0].result.is_error
    assert t0.turn.finish_reason == "tool_calls" and t0.turn.message["tool_calls"]
    assert t1.turn.parsed.tool_calls and t1.tool_calls and not t1.tool_calls[0].result.is_error
    # the last allowed turn is sent as the last step; with no tool call it is the answer
    assert t2.turn.parsed.tool_calls == [] or result.finish_reason == "max_turns"
    roles = [m["role"] for m in result.messages]
    assert roles[:2] == ["user", "assistant"] and roles.count("tool") == 2
    # the second turn reuses the whole first turn (prompt + generated call) from the cache
    m0, m1 = t0.turn.metrics, t1.turn.metrics
    assert m1.cached_tokens >= (m0.prompt_tokens + m0.completion_tokens - 16) // 16 * 16
    assert m1.recomputed_tokens == 0
    assert m0.ttft is not None and m0.ttft > 0 and m0.tpot is not None and m0.queue_s is not None
    jm = result.metrics
    assert jm.num_turns == 3 and jm.num_tool_calls == 2
    assert jm.jct_s == pytest.approx(jm.last_departure - jm.first_arrival)
    assert jm.jct_s >= sum((r.turn.metrics.finish_time - r.turn.metrics.arrival_time) for r in result.turns)
    assert jm.cached_tokens == sum(r.turn.metrics.cached_tokens for r in result.turns)
    assert pinned == 0  # the job is over: nothing stays pinned


def test_virtual_clock_tool_pause_pin_jct_and_abandoned_job(smollm, expensive_reload_profile):
    clock = FakeClock(100.0)
    engine = make_engine(
        smollm, clock=clock, latency_profile=expensive_reload_profile,
        **resolve_preset("continuum").engine_overrides,
    )

    def slow_tool() -> str:
        """Take three (virtual) seconds."""
        clock.advance(3.0)
        return "done"

    def ping() -> str:
        """Ping."""
        return "pong"

    async def main():
        runtime = AgentRuntime(engine, policy="continuum", clock=clock)
        try:
            # Known-short pings: pinning for their 0.5 s beats reloading the context.
            for _ in range(3):
                runtime.controller.durations.record("ping", 0.5)
            job = runtime.job(tools=[slow_tool, ping])
            result = await job.run(
                "Run the slow tool.", max_turns=2, tool_choice=[_named("slow_tool"), "none"], max_tokens=30,
            )
            learned = runtime.controller.durations.samples("slow_tool")

            abandoned = runtime.job(tools=[ping])
            turn = await abandoned.chat(
                [{"role": "user", "content": "ping"}], tool_choice=_named("ping"), max_tokens=30,
            )
            before = await runtime.call(lambda e: e.pins.num_pinned_blocks)
            clock.advance(turn.pin.ttl_s + 0.01)  # the job never comes back
            deadline = time.monotonic() + 10
            after = before
            while after and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the idle engine thread expires pins on its own
                after = await runtime.call(lambda e: e.pins.num_pinned_blocks)
            expired = await runtime.call(lambda e: e.pins.num_expired)
            await _integrity(runtime)
            return result, learned, turn, before, after, expired
        finally:
            await runtime.close()

    result, learned, turn, before, after, expired = asyncio.run(main())
    t0, t1 = result.turns
    assert t0.tool_calls[0].result.content == "done"
    assert t0.tool_s == pytest.approx(3.0)
    # end of the LLM call -> arrival of the next request, on the virtual clock
    assert learned == [pytest.approx(3.0)]
    assert t1.turn.metrics.arrival_time - t0.turn.metrics.finish_time == pytest.approx(3.0)
    assert result.metrics.jct_s == pytest.approx(3.0)  # the steps take no virtual time
    assert result.metrics.tool_s == pytest.approx(3.0)
    assert turn.pin is not None and turn.pin.ttl_s == pytest.approx(0.5)
    assert turn.metrics.pinned_blocks == before > 0
    assert after == 0 and expired == 1


def test_abort_mid_stream_frees_blocks(smollm):
    engine = make_engine(smollm)

    async def main():
        runtime = AgentRuntime(engine)
        try:
            stream = await runtime.submit(list(range(200, 260)), SamplingParams(max_tokens=400, ignore_eos=True))
            seen = 0
            async for _event in stream:
                seen += 1
                if seen == 2:
                    stream.abort()
            state = await runtime.call(
                lambda e: (e.has_unfinished(), sum(b.ref_cnt for b in e.pool.blocks))
            )
            await _integrity(runtime)
            return stream.final, state
        finally:
            await runtime.close()

    final, state = asyncio.run(main())
    assert final.output.finish_reason == "abort" and len(final.output.token_ids) < 400
    assert state == (False, 0)


def test_bad_input_raises_value_error_naming_the_field(smollm):
    engine = make_engine(smollm, max_model_len=256)
    user = [{"role": "user", "content": "hi"}]
    tools = [Tool.from_function(lambda: "x", name="noop", description="Nothing.").openai_schema()]

    async def main():
        runtime = AgentRuntime(engine)
        errors = {}
        cases = {
            "tool_choice": dict(messages=user, tools=tools, tool_choice="sometimes"),
            "tool_choice_required": dict(messages=user, tool_choice="required"),
            "tool_choice.function.name": dict(messages=user, tools=tools, tool_choice=_named("missing")),
            "tools[0].function.name": dict(messages=user, tools=[{"type": "function", "function": {"name": ""}}]),
            "messages": dict(messages=[]),
            "messages[0].role": dict(messages=[{"role": "robot", "content": "x"}]),
            "prompt": dict(messages=[{"role": "user", "content": "word " * 400}]),
            "max_tokens": dict(messages=user, max_tokens=0),
            "logprobs": dict(messages=user, logprobs=99),
            # once taken as given: "no" ended the job, an unknown rule ran as continuum
            "is_last_step": dict(messages=user, is_last_step="no"),
            "pinning": dict(messages=user, pinning="x"),
            "ttl_rule": dict(messages=user, ttl_rule="x"),
            "job_id": dict(messages=user, job_id=["j"]),
        }
        try:
            for key, kw in cases.items():
                with pytest.raises(ValueError) as info:
                    await runtime.chat(**kw)
                errors[key] = str(info.value)
            job = runtime.job()
            with pytest.raises(ValueError, match="^tools: Job.run needs executable tools"):
                await job.run("task")
            with pytest.raises(ValueError, match="^task:"):
                await runtime.job(tools=tools).run("  ", tools=[Tool.from_function(lambda: "x", name="noop")])
            noop = [Tool.from_function(lambda: "x", name="noop")]
            # once TypeErrors, some only after a turn had run; max_turns=True ran one turn
            for kwargs, field in (({"tool_choice": 5}, "tool_choice"), ({"on_turn": 5}, "on_turn"),
                                  ({"max_turns": True}, "max_turns"), ({"system_prompt": 5}, "system_prompt")):
                with pytest.raises(ValueError, match=f"^{field}: "):
                    await runtime.job(tools=noop).run("task", **kwargs)
            with pytest.raises(ValueError, match="^tools: a ToolRegistry"):
                runtime.job(tools=5)
            with pytest.raises(ValueError, match="^policy:"):
                runtime.job(policy="bogus")
            with pytest.raises(ValueError, match="^num_turns:"):
                await runtime.finish_job("j", num_turns="x")
            with pytest.raises(ValueError, match="^job_id:"):
                await runtime.finish_job([])
            with pytest.raises(ValueError, match="^engine: an asymcache_core.Engine"):
                AgentRuntime(5)
            with pytest.raises(TypeError, match="bogus"):
                await runtime.start_chat_choices(user, [SamplingParams()], bogus=1)
            with pytest.raises(ValueError, match="^request_id:"):
                await runtime.start_chat_choices(user, [SamplingParams()] * 2, request_id="one")
            # still serving after all that
            turn = await runtime.chat(user, max_tokens=2, logprobs=1)
            await _integrity(runtime)
            return errors, turn
        finally:
            await runtime.close()

    errors, turn = asyncio.run(main())
    for key, message in errors.items():
        assert message.startswith(key.removesuffix("_required") + ":"), (key, message)
    assert "max_model_len" in errors["prompt"]
    assert turn.metrics.completion_tokens >= 1
    assert turn.logprobs is not None and [e.token_id for e in turn.logprobs] == turn.token_ids
    assert all(len(e.top) == 1 for e in turn.logprobs)


def test_runtime_rejects_policy_engine_mismatch(smollm):
    engine = make_engine(smollm, eviction_policy="vllm-apc")  # fcfs
    with pytest.raises(ValueError, match="^policy: 'continuum' needs priority='program'"):
        AgentRuntime(engine, policy="continuum")
    # without a policy the runtime takes the preset the engine is built for
    for eng, want in ((make_engine(smollm), "asymcache"), (engine, "vllm-apc"),  # Engine()'s default first
                      (make_engine(smollm, eviction_policy="vllm-apc", priority="program"), "continuum"),
                      (make_engine(smollm, priority="adaptive"), "asymcache+continuum")):
        runtime = AgentRuntime(eng)
        assert runtime.policy.name == want
        runtime.close_sync()
    with pytest.raises(ValueError, match="^policy: no preset has eviction_policy='asymcache' and priority='program'"):
        AgentRuntime(make_engine(smollm, priority="program"))
    # a setting the policy sets otherwise was silently replaced by the policy's
    with pytest.raises(ValueError, match="^eviction_policy: the policy 'asymcache\\+continuum' sets it to 'asymcache'"):
        AgentRuntime.from_model("smollm2-135m", "asymcache+continuum", loaded=smollm, eviction_policy="lru")


def test_commands(smollm, tmp_path, capsys):
    root = _project(tmp_path)
    with pytest.raises(ValueError, match="^workdir:"):
        run_agent("task", tmp_path / "missing")
    with pytest.raises(ValueError, match="^task:"):
        run_agent("", root)
    with pytest.raises(ValueError, match="^max_turns:"):
        run_agent("task", root, max_turns=0)
    with pytest.raises(ValueError, match="^policy:"):
        run_agent("task", root, policy="bogus")
    with pytest.raises(ValueError, match="^tools:"):
        run_agent("task", root, tools=["rm"])
    with pytest.raises(ValueError, match="^tool_choice: 'rm' is not"):
        run_agent("task", root, tool_choice=["required", "rm"])
    with pytest.raises(ValueError, match="^port:"):
        run_serve(port=70000)
    with pytest.raises(ValueError, match="^num_kv_blocks:"):
        run_serve(num_kv_blocks=0)
    with pytest.raises(ValueError, match="^least_work_first:"):
        run_serve(least_work_first="yes")
    # every engine setting is checked before the model loads, by the name the CLI shows
    for bad, field in (({"chunking": "bogus"}, "chunking"), ({"device": "tpu"}, "device"),
                       ({"tpot_slo_ms": 0.0}, "tpot_slo_ms"), ({"dtype": "int8"}, "dtype"),
                       ({"ttft_slo_ms": -1.0}, "ttft_slo_ms"), ({"ttft_slo_ms": float("nan")}, "ttft_slo_ms"),
                       ({"latency_profile": str(tmp_path / "none.json")}, "latency_profile"),
                       ({"max_num_seqs": 0}, "max_num_seqs"), ({"kv_fraction": 0.5}, "kv_fraction")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            run_serve(**bad)

    lines: list[str] = []
    result = run_agent(
        "Which files are there?", root, max_turns=1, tools=["list_files"], max_tokens=40,
        loaded=smollm, num_kv_blocks=128, print_fn=lines.append, policy="asymcache+continuum",
    )
    assert result.metrics.num_turns == 1 and result.finish_reason == "max_turns"
    assert result.turns[0].turn.parsed.tool_calls[0].name == "list_files"
    assert lines[0].startswith("[turn 1]") and any(line.startswith("[done: max_turns]") for line in lines)
    # a named tool per turn forces that call (constrained decoding), whatever the model prefers
    result = run_agent(
        "Which files are there?", root, max_turns=2, tool_choice=["list_files", "read_file"], max_tokens=40,
        loaded=smollm, num_kv_blocks=128, print_fn=lines.append, policy="asymcache+continuum",
    )
    assert [t.turn.parsed.tool_calls[0].name for t in result.turns] == ["list_files", "read_file"]
    # the loop takes one action a turn by default; with parallel calls a forced turn may make
    # several, and all of them run
    one = run_agent("List the files and read notes.", root, max_turns=1, tool_choice=["required"], max_tokens=120,
                    loaded=smollm, num_kv_blocks=128, print_fn=lines.append, policy="asymcache+continuum")
    assert len(one.turns[0].turn.parsed.tool_calls) == 1
    many = run_agent("List the files and read notes.", root, max_turns=2, tool_choice=["required"], max_tokens=80,
                     loaded=smollm, num_kv_blocks=128, print_fn=lines.append, policy="asymcache+continuum",
                     parallel_tool_calls=True)
    calls = many.turns[0].turn.parsed.tool_calls
    assert len(calls) >= 1 and len(many.turns[0].tool_calls) == len(calls)
    with pytest.raises(ValueError, match="^parallel_tool_calls:"):
        run_agent("task", root, parallel_tool_calls="yes")

    inputs = iter(["Hello!", "", "/exit", "never read"])
    out: list[str] = []
    replies = run_chat(input_fn=lambda _prompt: next(inputs), print_fn=out.append, max_tokens=3, loaded=smollm,
                       num_kv_blocks=64)
    assert replies == 1 and out[0].startswith("assistant> ")


def test_serve_passes_least_work_first_to_the_engine(monkeypatch, smollm):
    # `asymcache serve --least-work-first` builds its runtime's engine with the flag
    from typer.testing import CliRunner

    import agent_runtime.server as server
    from eval.cli import app

    built: list[AgentRuntime] = []

    def fake_serve(options):
        assert (options.max_request_body_bytes, options.max_queue_len, options.shutdown_timeout) == (8 << 20, 256, 30.0)
        built.append(AgentRuntime.from_model(options.model, options.policy, loaded=smollm,
                                             num_kv_blocks=options.num_kv_blocks, **options.engine_settings))

    monkeypatch.setattr(server, "serve", fake_serve)
    # NOTE: no real port is probed: the test serves nothing
    monkeypatch.setattr("agent_runtime.commands.check_listen_address", lambda host, port: None)
    for args, want in (([], False), (["--least-work-first"], True)):
        result = CliRunner().invoke(app, ["serve", "--kv-blocks", "64", *args])
        assert result.exit_code == 0, result.output
        assert built[-1].engine.config.least_work_first is want
    result = CliRunner().invoke(app, ["serve", "--kv-blocks", "64", "--least-work-first", "--least-work-patience", "8"])
    assert result.exit_code == 0, result.output
    assert built[-1].engine.config.least_work_patience == 8.0
    assert built[-1].engine.scheduler.least_work_patience == 8.0
    # the whole system on the command line: adaptive chunking, its profile, vLLM's admission rule
    profile = Path(__file__).resolve().parents[2] / "bench_traces" / "profile_h200_llama8b_live.json"
    result = CliRunner().invoke(app, [
        "serve", "--kv-blocks", "64", "--policy", "asymcache", "--chunking", "adaptive", "--tpot-slo-ms", "28",
        "--max-num-batched-tokens", "8192", "--max-num-seqs", "16", "--latency-profile", str(profile),
        "--admit-full-prompt", "--enforce-eager", "--dtype", "float32",
    ])
    assert result.exit_code == 0, result.output
    config = built[-1].engine.config
    assert (config.chunking, config.tpot_slo_ms, config.max_num_batched_tokens, config.max_num_seqs) == (
        "adaptive", 28.0, 8192, 16)
    assert config.latency_profile == str(profile) and config.admit_full_prompt and config.enforce_eager
    assert built[-1].engine.latency.source != "analytic"  # the profile was loaded
    assert config.eviction_policy == "asymcache" and config.dtype == "float32"
    # a bad setting: one line naming it, exit code 2, and no model load
    before = len(built)
    for args, field in ((["--chunking", "fixed:0"], "chunking"), (["--device", "tpu"], "device"),
                        (["--latency-profile", "missing.json"], "latency_profile"),
                        (["--least-work-patience", "8"], "least_work_patience")):
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 2 and result.output.strip().count("\n") == 0, result.output
        assert field in result.output
    assert len(built) == before
