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
