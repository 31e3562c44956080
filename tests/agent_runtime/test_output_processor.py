"""OutputProcessor without an engine: parsing, the Continuum hand-off, recomputed history, metrics."""

from __future__ import annotations

from typing import Any

from agent_runtime.output_processor import OutputOptions, OutputProcessor
from asymcache_core.continuum.controller import PinDecision
from asymcache_core.request import RequestMetrics, RequestOutput

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'


class RecordingController:
    """Records the processor's calls; pins 3 blocks for 1.5 s on every tool call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_request_arrival(self, job_id: str, now: float) -> None:
        self.calls.append(("arrival", (job_id, now)))

    def on_tool_call(self, job_id: str, tools: list[str], context_tokens: int, **kw: Any) -> PinDecision:
        self.calls.append(("tool_call", (job_id, tools, context_tokens, kw)))
        return PinDecision(job_id, tools[0], 1.5, 3, None, 0.0, 1.0, context_tokens, 0.0)

    def on_job_finished(self, job_id: str, num_turns: int | None = None) -> None:
        self.calls.append(("finished", (job_id, num_turns)))


def _out(text: str, n_prompt: int, n_out: int, cached: int = 0, reason: str = "stop", **m: Any) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=1.5, finish_time=2.0,
                             cached_tokens=cached, token_times=[1.5, 2.0], **m)
    return RequestOutput("r", [], list(range(1000, 1000 + n_out)), text, True, reason, metrics, n_prompt)


def test_tool_call_turn_pins_and_counts_recomputed_history():
    ctl = RecordingController()
    proc = OutputProcessor(ctl, block_size=4)  # type: ignore[arg-type]
    proc.on_request_added("job", 1.0)
    proc.on_request_added(None, 1.0)  # no job: nothing to tell
    opts = OutputOptions(job_id="job", parse_format="hermes", pinning=True, ttl_rule="continuum")
    prompt = list(range(10))
    first = proc.finalize(opts, prompt, _out(CALL, 10, 6))
    assert [c.name for c in first.parsed.tool_calls] == ["read_file"]
    assert first.pin is not None and first.metrics.ttl_s == 1.5 and first.metrics.pinned_blocks == 3
    assert first.metrics.queue_s == 0.25 and first.metrics.recomputed_tokens == 0
    kinds = [k for k, _ in ctl.calls]
    # the queueing delay is the engine's to record, at admission: not reported a second time here
    assert kinds == ["arrival", "tool_call"]
    job, tools, context, kw = ctl.calls[-1][1]
    assert (job, tools, context) == ("job", ["read_file"], 16)
    assert kw == {"ended_at": 2.0, "pinning": True, "ttl_rule": "continuum"}

    # The next turn extends the first's 16 tokens (four full blocks); 4 were cached, so 12 were
    # recomputed (plus the preemption's recompute).
    second_prompt = [*prompt, *range(1000, 1006), 77, 78, 79]
    last = OutputOptions(job_id="job", is_last_step=True, parse_format="hermes")
    final = proc.finalize(last, second_prompt, _out("done", 19, 2, cached=4, preempted_tokens=2))
    assert final.metrics.recomputed_tokens == 12 + 2
    assert final.pin is None and ctl.calls[-1] == ("finished", ("job", None))
    # the last step forgot the job: a new job of the same id starts from nothing
    again = proc.finalize(OutputOptions(job_id="job"), second_prompt, _out("x", 19, 1))
    assert again.metrics.recomputed_tokens == 0


def test_pause_tool_aborts_and_requests_without_a_job():
    ctl = RecordingController()
    proc = OutputProcessor(ctl, block_size=4)  # type: ignore[arg-type]
    # a token-level client names the pause: pinned as after a tool call, nothing parsed
    ev = proc.finalize(OutputOptions(job_id="j", pause_tool="sleep"), [1, 2, 3], _out("text", 3, 2))
    assert ev.parsed is None and ev.pin is not None and ctl.calls[-1][1][1] == ["sleep"]
    # an aborted turn decides nothing
    n = len(ctl.calls)
    ev = proc.finalize(OutputOptions(job_id="j", parse_format="hermes"), [1, 2, 3], _out(CALL, 3, 2, reason="abort"))
    assert ev.pin is None and ctl.calls[n:] == []
    # without a job: recomputed = holes + suffix + preemption, no decision
    ev = proc.finalize(OutputOptions(parse_format="hermes"), [1], _out(CALL, 1, 2, hole_tokens=4,
                                                                       suffix_recomputed_tokens=1, preempted_tokens=2))
    assert ev.pin is None and ev.metrics.recomputed_tokens == 7 and ev.parsed.tool_calls
    # finish_job releases and forgets
    proc.finish_job("j", 2)
    assert ctl.calls[-1] == ("finished", ("j", 2))


def test_tracked_jobs_are_bounded():
    proc = OutputProcessor(RecordingController(), block_size=4, max_tracked_jobs=2)  # type: ignore[arg-type]
    for job in ("a", "b", "c"):
        proc.finalize(OutputOptions(job_id=job, pause_tool="t"), list(range(8)), _out("", 8, 0))
    # "a" was dropped: its next turn counts no recomputed history although nothing was cached
    ids = list(range(8)) + [5] * 8
    assert proc.finalize(OutputOptions(job_id="a"), ids, _out("", 16, 0)).metrics.recomputed_tokens == 0
    assert proc.finalize(OutputOptions(job_id="c"), ids, _out("", 16, 0)).metrics.recomputed_tokens == 8


def test_parallel_tool_calls_off_keeps_the_first_call_only():
    two = CALL + "\n" + CALL.replace("read_file", "list_files")
    ctl = RecordingController()
    proc = OutputProcessor(ctl, block_size=4)  # type: ignore[arg-type]
    both = proc.finalize(OutputOptions(parse_format="hermes"), [1, 2], _out(two, 2, 6))
    assert [c.name for c in both.parsed.tool_calls] == ["read_file", "list_files"]
    proc.on_request_added("job", 1.0)
    one = proc.finalize(OutputOptions(job_id="job", parse_format="hermes", max_tool_calls=1), [1, 2], _out(two, 2, 6))
    assert [c.name for c in one.parsed.tool_calls] == ["read_file"]
    assert ctl.calls[-1][0] == "tool_call" and ctl.calls[-1][1][1] == ["read_file"]  # the pause is the kept call's
