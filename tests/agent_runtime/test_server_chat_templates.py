"""vLLM's chat-template options over HTTP: ``chat_template_kwargs`` (and the body fields it may
carry), ``documents``, a request's own ``chat_template`` (a 400 unless the server trusts its
clients with ``--trust-request-chat-template``), a deployment's template and default variables,
on chat completions and ``/tokenize``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from agent_runtime.runtime import AgentRuntime
from agent_runtime.server import ServeOptions, create_app
from tests.agent_runtime.live_server import MODEL, serving
from tests.agent_runtime.test_chat_template_options import (
    CHAT,
    EMPTY_THINK,
    STRICT_TEMPLATE,
    THINKING_TEMPLATE,
)
from tests.conftest import make_engine


class Servers:
    """One runtime (the deployment's template, thinking off by default) behind two apps: one
    that refuses request templates (vLLM's default) and one that trusts them."""

    def __init__(self, runtime: AgentRuntime, strict: str, trusting: str) -> None:
        self.runtime, self.strict, self.trusting = runtime, strict, trusting

    def post(self, path: str, body: dict, trusting: bool = False) -> httpx.Response:
        base = self.trusting if trusting else self.strict
        return httpx.post(f"{base}{path}", json=body, timeout=120)

    def text(self, body: dict, trusting: bool = False) -> str:
        r = self.post("/tokenize", body, trusting)
        assert r.status_code == 200, r.text
        return self.runtime.engine.tokenizer.decode(r.json()["tokens"])

    def check(self) -> None:
        self.runtime.call_threadsafe(lambda e: e.check_integrity()).result(timeout=30)
        assert self.runtime.call_threadsafe(lambda e: e.has_unfinished()).result(timeout=30) is False


@pytest.fixture(scope="module")
def servers(smollm) -> Iterator[Servers]:
    runtime = AgentRuntime(make_engine(smollm, max_model_len=1024), chat_template=THINKING_TEMPLATE,
                           chat_template_kwargs={"enable_thinking": False})
    try:
        with serving(create_app(runtime, MODEL)) as strict, \
                serving(create_app(runtime, MODEL, trust_request_chat_template=True)) as trusting:
            yield Servers(runtime, strict, trusting)
    finally:
        runtime.close_sync()


def test_template_variables_and_documents_in_a_chat(servers):
    assert servers.text({"messages": CHAT}).endswith(EMPTY_THINK + "\n\n")  # the deployment's default
    thinking = servers.text({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.endswith("<|im_start|>assistant\n")
    docs = [{"title": "colours", "text": "Red is a colour."}]
    assert servers.text({"messages": CHAT, "documents": docs}).startswith("<|im_start|>system\n[colours] Red is")
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": True},
            "documents": docs}
    r = servers.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    prompt_ids = servers.post("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True},
                                            "documents": docs}).json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    servers.check()


def test_body_fields_carried_in_the_template_variables(servers):
    # vLLM reads these entries of chat_template_kwargs as the body's own fields, over them
    closed = servers.text({"messages": CHAT, "add_generation_prompt": False})
    assert servers.text({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}) == closed
    assert servers.text({"messages": CHAT, "add_generation_prompt": True,
                         "chat_template_kwargs": {"add_generation_prompt": False}}) == closed
    docs = [{"title": "t", "text": "x"}]
    assert servers.text({"messages": CHAT, "chat_template_kwargs": {"documents": docs}}) == \
        servers.text({"messages": CHAT, "documents": docs})


def test_request_templates_need_the_servers_trust(servers):
    model_template = servers.runtime.engine.tokenizer.chat_template
    for path, extra in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}), ("/tokenize", {})):
        for fields in ({"chat_template": model_template},
                       {"chat_template_kwargs": {"chat_template": model_template}}):
            r = servers.post(path, {"messages": CHAT, **extra, **fields})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
    own = servers.text({"messages": CHAT, "chat_template": model_template}, trusting=True)
    assert own.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    r = servers.post("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                              "chat_template": model_template}, trusting=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        servers.runtime.engine.tokenizer.encode(own, add_special_tokens=False))
    servers.check()


def test_bad_template_options_are_400s_naming_the_field(servers):
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    cases = [
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"not-a-name": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": "text"}, "documents"),
        ({"documents": [{"text": "a"}, 3]}, "documents[1]"),
        ({"chat_template": "{% if %}"}, "chat_template"),
    ]
    for fields, param in cases:
        for path, body in (("/v1/chat/completions", chat), ("/tokenize", {"messages": CHAT})):
            r = servers.post(path, {**body, **fields}, trusting=True)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    # a template that refuses the chat (its raise_exception) is the client's error, not a 500
    refused = {"messages": [{"role": "assistant", "content": "Hi"}, *CHAT], "chat_template": STRICT_TEMPLATE}
    for path, body in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}), ("/tokenize", {})):
        r = servers.post(path, {**body, **refused}, trusting=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "Conversations must start with a user message" in r.json()["error"]["message"]
    # a text completion is not rendered with a template: its fields there are a 400, not ignored
    r = servers.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                         "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    servers.check()


def test_serve_options_read_the_deployments_template(tmp_path):
    path = tmp_path / "chatml.jinja"
    path.write_text(THINKING_TEMPLATE, encoding="utf-8")
    options = ServeOptions(chat_template=str(path), default_chat_template_kwargs={"enable_thinking": False},
                           trust_request_chat_template=True)
    assert options.chat_template == THINKING_TEMPLATE
    inline = ServeOptions(chat_template=THINKING_TEMPLATE)
    assert inline.chat_template == THINKING_TEMPLATE and inline.trust_request_chat_template is False
    for bad, match in (({"chat_template": str(tmp_path / "missing.jinja")}, "^chat_template: cannot read"),
                       ({"chat_template": "{% for %}"}, "^chat_template: not a Jinja template"),
                       ({"default_chat_template_kwargs": {"messages": []}},
                        r"^default_chat_template_kwargs\.messages")):
        with pytest.raises(ValueError, match=match):
            ServeOptions(**bad)
    app = options.build_app(lambda: None)
    assert app.state.server.trust_request_chat_template is True
    assert ServeOptions().build_app(lambda: None).state.server.trust_request_chat_template is False
