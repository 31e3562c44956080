"""A client that names no job (most agent frameworks) gets one: the runtime hands the job the
engine gave a turn to Continuum (its tool pause is pinned under it), the next turn of the
conversation rejoins it, and a reply without a tool call ends it (real SmolLM2)."""

from __future__ import annotations

import asyncio

from agent_runtime.presets import resolve_preset
from agent_runtime.runtime import AgentRuntime
from asymcache_core.implicit_jobs import JOB_PREFIX
from asymcache_core.sampling_params import SamplingParams
from tests.agent_runtime.test_server import TOOLS
from tests.conftest import make_engine

READ = {"type": "function", "function": {"name": "read_file"}}


def test_an_agent_loop_without_job_ids_is_one_job(smollm):
    preset = resolve_preset("asymcache+continuum")
    runtime = AgentRuntime(make_engine(smollm, max_model_len=2048, **preset.engine_overrides), policy=preset)

    async def loop() -> None:
        messages = [{"role": "user", "content": "What is in notes.txt?"}]
        first = await runtime.chat(messages, tools=TOOLS, tool_choice=READ, max_tokens=48)
        assert first.parsed.tool_calls
        job = runtime.controller.decisions[-1].job_id
        assert job.startswith(JOB_PREFIX) and first.pin is not None
        call = first.message["tool_calls"][0]
        messages += [first.message, {"role": "tool", "tool_call_id": call["id"], "content": "Buy milk."}]
        second = await runtime.chat(messages, tools=TOOLS, tool_choice=READ, max_tokens=48)
        assert runtime.controller.decisions[-1].job_id == job  # the same conversation's job
        assert second.metrics.cached_tokens >= first.metrics.prompt_tokens // 16 * 16
        gate = await runtime.call(lambda e: set(e.job_admission.jobs))
        assert job in gate
        call = second.message["tool_calls"][0]
        messages += [second.message, {"role": "tool", "tool_call_id": call["id"], "content": "Call Bob."}]
        answer = await runtime.chat(messages, tools=TOOLS, tool_choice="none", max_tokens=8)
        assert not answer.parsed.tool_calls and answer.pin is None
        # the answer ended the job: the gate no longer reserves its context, nothing is pinned
        assert await runtime.call(lambda e: (job in e.job_admission.jobs, e.pins.is_pinned(job))) == (False, False)
        # another conversation is another job
        await runtime.chat([{"role": "user", "content": "List the files."}], tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "list_files"}}, max_tokens=32)
        assert runtime.controller.decisions[-1].job_id not in (job, None)
        stats = await runtime.call(lambda e: e.stats())
        assert (stats.implicit_jobs_matched_total, stats.implicit_jobs_started_total) == (2, 2)
        # several choices of one chat: the client goes on with one at most, so none gets a job
        streams, _ = await runtime.start_chat_choices(
            [{"role": "user", "content": "Read todo.md."}], [SamplingParams(max_tokens=4, seed=s) for s in (1, 2)])
        for stream in streams:
            async for _event in stream:
                pass
        after = await runtime.call(lambda e: e.stats())
        assert (after.implicit_jobs_matched_total, after.implicit_jobs_started_total) == (2, 2)
        await runtime.call(lambda e: e.check_integrity())

    try:
        asyncio.run(loop())
    finally:
        runtime.close_sync()
        runtime.engine.close()


def test_chat_completions_without_job_ids_join_their_conversation(smollm):
    import httpx
    import openai

    from agent_runtime.server import create_app
    from tests.agent_runtime.test_server import MODEL, serving

    preset = resolve_preset("asymcache+continuum")
    runtime = AgentRuntime(make_engine(smollm, max_model_len=2048, **preset.engine_overrides), policy=preset)
    try:
        with serving(create_app(runtime, MODEL)) as base:
            oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            messages = [{"role": "user", "content": "What is in notes.txt?"}]
            first = oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=READ,
                                               max_tokens=48)
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "Buy milk."}]
            # streamed, as most frameworks do
            chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                                                     tool_choice=READ, max_tokens=48))
            assert chunks
            metrics = httpx.get(f"{base}/metrics", timeout=60).text
    finally:
        runtime.close_sync()
        runtime.engine.close()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("asymcache_implicit_jobs_")}
    assert values["asymcache_implicit_jobs_matched_total"] == 1
    assert values["asymcache_implicit_jobs_started_total"] == 1
