"""A client that names no job (most agent frameworks) gets one: the runtime hands the job the
engine gave a turn to Continuum (its tool pause is pinned under it), the next turn of the
conversation rejoins it, and a reply without a tool call ends it (real SmolLM2)."""

from __future__ import annotations

import asyncio

import pytest

from agent_runtime.presets import resolve_preset
from agent_runtime.rendered_turns import RenderedTurns, previous_turn_chat
from agent_runtime.runtime import AgentRuntime
from asymcache_core.implicit_jobs import JOB_PREFIX
from asymcache_core.sampling_params import SamplingParams
from tests.agent_runtime.live_server import TOOLS
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
    from tests.agent_runtime.live_server import MODEL, serving

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


#: DeepSeek-R1's way with SmolLM2's turns: the reply opens with a thinking block the prompt
#: starts, and earlier replies are rendered without theirs.
DROPS_THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ (m.content or '').split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_a_template_that_drops_earlier_thinking_keeps_the_conversation_one_job(smollm):
    preset = resolve_preset("asymcache+continuum")
    runtime = AgentRuntime(make_engine(smollm, max_model_len=2048, **preset.engine_overrides), policy=preset,
                           chat_template=DROPS_THINKING_TEMPLATE, reasoning_parser="deepseek_r1")

    async def turn(messages: list[dict]) -> tuple[str, dict, list[int]]:
        stream, _ = await runtime.start_chat(messages, params=SamplingParams(max_tokens=12, ignore_eos=True))
        async for _event in stream:
            pass
        final = stream.final
        assert final is not None and stream.job_id is not None
        # the client sends the answer back, not the thinking (the whole reply here)
        message = {"role": "assistant", "content": "", "reasoning_content": final.output.text}
        return stream.job_id, message, stream.prompt_token_ids

    async def conversation() -> None:
        ask = [{"role": "user", "content": "Why is the sky blue? Explain it to a child in a few words."}]
        first_job, first, first_prompt = await turn(ask)
        assert first_job.startswith(JOB_PREFIX)
        follow = [*ask, first, {"role": "user", "content": "And why is it red at sunset?"}]
        second_job, _, second_prompt = await turn(follow)
        # the reply's thinking is gone from the second prompt: its tokens continue the first
        # prompt only up to the generation prompt's <think>, so no key of the engine matched
        rendered_reply = runtime.engine.tokenizer.encode("<think>\n", add_special_tokens=False)
        assert first_prompt[-len(rendered_reply):] == rendered_reply
        assert second_prompt[:len(first_prompt)] != first_prompt
        assert second_job == first_job  # but the rendered chat before the reply did
        # a second continuation of the first turn (a fork) is a job of its own
        fork_job, _, _ = await turn([*ask, first, {"role": "user", "content": "Now in French."}])
        assert fork_job not in (first_job, None)
        stats = await runtime.call(lambda e: e.stats())
        assert (stats.implicit_jobs_matched_total, stats.implicit_jobs_started_total) == (1, 2)
        await runtime.call(lambda e: e.check_integrity())

    try:
        asyncio.run(conversation())
    finally:
        runtime.close_sync()
        runtime.engine.close()


def test_rendered_turns_are_taken_once_and_bounded():
    turns = RenderedTurns(max_turns=2)
    turns.remember("prompt a", "implicit-0")
    turns.remember([1, 2, 3], "implicit-1")
    assert turns.take("prompt a") == "implicit-0" and turns.take("prompt a") is None
    turns.remember("prompt b", "implicit-2")
    turns.remember("prompt c", "implicit-3")  # the oldest goes
    assert len(turns) == 2 and turns.take([1, 2, 3]) is None and turns.take("prompt b") == "implicit-2"
    with pytest.raises(ValueError, match="^rendered turns: max_turns"):
        RenderedTurns(0)
    # a cache salt is a namespace: a turn is continued only under its own salt
    turns.remember("prompt d", "implicit-4", "tenant-a")
    assert turns.take("prompt d") is None and turns.take("prompt d", "tenant-b") is None
    assert turns.take("prompt d", "tenant-a") == "implicit-4"
    user, reply, tool = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                         {"role": "tool", "content": "y"})
    assert previous_turn_chat([user, reply, tool, reply, tool]) == [user, reply, tool]
    assert previous_turn_chat([user]) is None and previous_turn_chat([reply, user]) is None
