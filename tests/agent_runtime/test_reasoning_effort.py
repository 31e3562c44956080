"""OpenAI's reasoning effort (chat ``reasoning_effort``, Responses ``reasoning``, as Codex sends
it) reaches the chat template as its ``reasoning_effort`` variable, as vLLM passes it."""

from __future__ import annotations

import httpx
import openai

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import create_app
from tests.agent_runtime.live_server import MODEL, serving
from tests.conftest import make_engine

#: SmolLM2's turns after a system line that names the effort (gpt-oss's template does likewise).
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "{% if reasoning_effort == 'high' %}: think it through, step by step, before you answer{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_effort_is_the_templates_variable(smollm):
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=EFFORT_TEMPLATE)
    ask = [{"role": "user", "content": "hi"}]
    try:
        with serving(create_app(runtime, MODEL)) as base:
            oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

            def tokens(**kwargs: object) -> int:
                return len(httpx.post(f"{base}/tokenize", timeout=60,
                                      json={"model": MODEL, "messages": ask, **kwargs}).json()["tokens"])

            plain, low, high = tokens(), tokens(chat_template_kwargs={"reasoning_effort": "low"}), tokens(
                chat_template_kwargs={"reasoning_effort": "high"})
            chat = {effort: oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=1, reasoning_effort=effort)
                    for effort in ("low", "high")}
            # the request's own variable wins over the field
            overridden = oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=1, reasoning_effort="low",
                                                    extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
            none = oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=1)
            # Codex's body: an effort and a summary
            resp = oa.responses.create(model=MODEL, input=ask, max_output_tokens=1,
                                       reasoning={"effort": "high", "summary": "auto"})
            bad = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                             json={"model": MODEL, "messages": ask, "reasoning_effort": "extreme"})
    finally:
        runtime.close_sync()
        runtime.engine.close()
    assert plain < low < high
    assert chat["low"].usage.prompt_tokens == low and chat["high"].usage.prompt_tokens == high
    assert overridden.usage.prompt_tokens == high and none.usage.prompt_tokens == plain
    assert resp.usage.input_tokens == high
    assert resp.reasoning.effort == "high" and resp.reasoning.summary == "auto"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
