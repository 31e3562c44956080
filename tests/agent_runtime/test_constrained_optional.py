"""Without the ``constrained`` extra (xgrammar hidden from the import system, in a fresh
interpreter): the runtime and the server load and serve unconstrained requests; a request that
needs constrained decoding (a forced tool call, a JSON ``response_format``, vLLM's
``structured_outputs``) fails with a ValueError
naming the extra, a 400 from the server naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    sys.modules["xgrammar"] = None  # what an environment without the extra looks like
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("xgrammar is still importable")

    import agent_runtime
    from agent_runtime import AgentRuntime, GrammarCache, create_app
    from fastapi.testclient import TestClient

    TOOL = {"type": "function", "function": {"name": "list_files", "description": "List files.",
            "parameters": {"type": "object", "properties": {}}}}
    MSGS = [{"role": "user", "content": "Hi"}]
    report = {}

    runtime = AgentRuntime.from_model("smollm2-135m", num_kv_blocks=64, max_model_len=512)

    async def direct():
        turn = await runtime.chat(MSGS, tools=[TOOL], tool_choice="auto", max_tokens=3)
        report["auto_ok"] = 1 <= len(turn.token_ids) <= 3
        for choice in ("required", {"type": "function", "function": {"name": "list_files"}}):
            try:
                await runtime.chat(MSGS, tools=[TOOL], tool_choice=choice, max_tokens=3)
            except ValueError as exc:
                report.setdefault("errors", []).append(str(exc))

    asyncio.run(direct())
    try:
        GrammarCache().json_schema_grammar(runtime.engine.tokenizer, {"type": "object"})
    except ValueError as exc:
        report["json_error"] = str(exc)

    with TestClient(create_app(runtime, "smollm2-135m")) as client:
        body = {"model": "smollm2-135m", "messages": MSGS, "tools": [TOOL], "max_tokens": 3}
        ok = client.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
        bad = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
        report["server"] = [ok.status_code, bad.status_code, bad.json()]
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        report["formats"] = [
            [r.status_code, r.json()] for r in (
                client.post("/v1/chat/completions", json={**body, "response_format": f})
                for f in ({"type": "json_object"}, fmt, {"type": "text"}))
        ]
        # vLLM's structured outputs: checked for shape, then the extra is named (no grammar)
        report["structured"] = [
            [r.status_code, r.json()] for r in (
                client.post("/v1/chat/completions", json={**body, "structured_outputs": so})
                for so in ({"regex": "[0-9]+"}, {"choice": ["a", "b"]}, {"choice": []}))
        ]
    runtime.close_sync()
    report["xgrammar_loaded"] = sys.modules.get("xgrammar") is not None
    print("REPORT " + json.dumps(report))
    """
)


def test_no_xgrammar_serves_unconstrained_and_names_the_extra() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    hint = "pip install 'asymcache[constrained]'"
    assert report["auto_ok"] is True
    assert len(report["errors"]) == 2
    for message in report["errors"]:
        assert message.startswith("tool_choice: constrained decoding needs xgrammar") and hint in message
    assert report["json_error"].startswith("response_format: ") and hint in report["json_error"]
    ok_status, bad_status, bad_body = report["server"]
    assert ok_status == 200
    assert bad_status == 400
    assert hint in bad_body["error"]["message"] and bad_body["error"]["param"] == "tool_choice"
    (obj_status, obj_body), (schema_status, schema_body), (text_status, _) = report["formats"]
    assert obj_status == schema_status == 400 and text_status == 200
    for body in (obj_body, schema_body):
        assert body["error"]["param"] == "response_format" and hint in body["error"]["message"]
    (regex_status, regex_body), (choice_status, choice_body), (empty_status, empty_body) = report["structured"]
    assert regex_status == choice_status == empty_status == 400
    for body in (regex_body, choice_body):
        assert body["error"]["param"] == "structured_outputs" and hint in body["error"]["message"]
    assert empty_body["error"]["param"] == "structured_outputs.choice"
    assert report["xgrammar_loaded"] is False
