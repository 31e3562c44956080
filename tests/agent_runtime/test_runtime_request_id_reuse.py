"""AgentRuntime: a caller-chosen request id reused right after an abort (a client retry) is
refused on the submit call, and the aborted request's stream still ends with its own abort."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent_runtime.runtime import AgentRuntime
from asymcache_core import Engine, SamplingParams

PROMPT = list(range(5, 40))


def test_resubmit_of_an_aborted_id_is_refused_until_its_abort_is_reported() -> None:
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def main() -> tuple[str, str, int, list[str]]:
        async with AgentRuntime(engine) as rt:
            # NOTE: the engine thread handles queued commands one after another before it
            # steps: held on this call, it then takes the submit, the abort and the retry
            # together, as a retry that reaches it before its next step would be.
            gate = threading.Event()
            held = rt.call_threadsafe(lambda e: gate.wait(30))
            first_task = asyncio.ensure_future(rt.submit(PROMPT, params, request_id="x"))
            await asyncio.sleep(0)  # the submit is queued (token ids: no encoding first)
            rt.abort_nowait("x")
            retry_task = asyncio.ensure_future(rt.submit(PROMPT, params, request_id="x"))
            await asyncio.sleep(0)
            gate.set()
            assert await asyncio.wrap_future(held)
            first = await first_task
            with pytest.raises(ValueError, match=r"^request_id: 'x' is already in use") as refused:
                await asyncio.wait_for(retry_task, 30)
            final = await asyncio.wait_for(first.result(), 30)
            # reported: the id is free again, and the retry runs as a request of its own
            again = await rt.submit(PROMPT, params, request_id="x")
            retried = await asyncio.wait_for(again.result(), 30)
            left = await rt.call(lambda e: sorted(e.requests))
            await rt.call(lambda e: e.check_integrity())
            return str(refused.value), final.output.finish_reason, len(retried.output.token_ids), left

    message, first_reason, retried_tokens, left = asyncio.run(main())
    assert "request_id" in message
    assert first_reason == "abort"
    assert retried_tokens == 8
    assert left == []


def test_a_failed_step_frees_its_requests_ids_at_once() -> None:
    """A step that raises fails the requests in flight on their streams; a client's retry under
    the same id, reaching the engine thread before its next step, runs (it was refused while the
    failed request's abort output waited for a step nobody reads)."""
    engine = Engine.simulated(model="dummy:tiny", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain_step = engine.step
    in_step, retry_queued = threading.Event(), threading.Event()
    failed: list[bool] = []

    def failing_once() -> list:
        if not failed and engine.requests:
            failed.append(True)
            # NOTE: the retry is queued while this step runs (not before: the engine thread
            # takes every queued command before it steps), so the engine thread takes it right
            # after failing the step, before any later step
            in_step.set()
            retry_queued.wait(30)
            raise RuntimeError("injected step failure")
        return plain_step()

    engine.step = failing_once  # type: ignore[method-assign]

    async def main() -> tuple[str, int, list[str]]:
        async with AgentRuntime(engine) as rt:
            first = await rt.submit(PROMPT, params, request_id="x")
            assert await asyncio.to_thread(in_step.wait, 30)
            retry_task = asyncio.ensure_future(rt.submit(PROMPT, params, request_id="x"))
            await asyncio.sleep(0)  # the retry is queued (token ids: no encoding first)
            retry_queued.set()
            with pytest.raises(RuntimeError) as failure:
                await asyncio.wait_for(first.result(), 30)
            retried = await asyncio.wait_for(retry_task, 30)
            out = await asyncio.wait_for(retried.result(), 30)
            left = await rt.call(lambda e: sorted(e.requests))
            await rt.call(lambda e: e.check_integrity())
            return str(failure.value), len(out.output.token_ids), left

    message, retried_tokens, left = asyncio.run(main())
    assert "engine step failed" in message and "injected step failure" in message
    assert retried_tokens == 8
    assert left == []
