"""The ``http`` backend against a fake OpenAI-compatible server on localhost: failed streams
fail, TPOT is per token, queueing is unknown, and SLO goodput needs measured latencies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eval.bench import BenchConfig, load_workload, run_bench
from eval.results import SLO

#: seconds between the fake server's first chunk (one token) and its second (the rest)
GAP_S = 0.2


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    mode = "ok"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - the http.server spelling
        body = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send(self, obj: object) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.wfile.write(b"data: " + data + b"\n\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802 - the http.server spelling
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        k = req["max_tokens"]
        if self.mode == "error":
            self._send({"choices": [{"text": "a", "token_ids": [101]}]})
            self._send({"error": {"message": "boom: out of KV blocks", "code": 500}})
        elif self.mode == "ok":
            self._send({"choices": [{"text": "a", "token_ids": [101]}]})
            time.sleep(GAP_S)
            self._send({"choices": [{"text": "b" * (k - 1), "token_ids": list(range(102, 101 + k))}]})
            self._send({"choices": [], "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": k}})
        # mode "empty": the stream ends with no token at all
        self._send(b"[DONE]")


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"mode": "ok"})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def _config(url: str, tmp_path: Path, output_tokens: int = 6) -> BenchConfig:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"job_id": f"j{i}", "turns": [{"input_tokens": 8, "output_tokens": output_tokens}]}) + "\n"
        for i in range(2)
    ))
    return BenchConfig(workload=f"trace:{trace}", backend="http", url=url, jobs=2, concurrency=2, time_scale=0.0,
                       policies=("server",), out=tmp_path / "run", plots=False, check_lossless=False,
                       slo="ttft:60000,tpot:60000")


def test_tpot_is_per_token_and_queueing_is_unknown(server, tmp_path):
    from eval.http_backend import run_http
    from eval.variants import BenchVariant

    url, _ = server
    cfg = _config(url, tmp_path)
    outcome = run_http(cfg, load_workload(cfg), [BenchVariant.label("server")])["server"]
    assert len(outcome.records) == 2
    for r in outcome.records:
        assert len(r.output) == 6 and r.first_scheduled is None and r.ttft is not None
        # two chunks GAP_S apart carry 6 tokens: 5 gaps between tokens, not one between chunks
        assert r.tpot == pytest.approx(GAP_S / 5, rel=0.5)
    results, run_dir = run_bench(cfg)
    p = results.policies["server"]
    assert p.queue.count == 0 and p.job_time is None and p.ttft.count == 2
    assert p.tpot.mean is not None and p.tpot.mean < GAP_S / 2
    assert p.serving["request_goodput"] > 0  # measured latencies within the targets count
    row = next(line for line in (run_dir / "report.md").read_text().splitlines() if line.startswith("| Queueing mean"))
    assert "n/a" in row


@pytest.mark.parametrize(("mode", "needle"), [("error", "boom: out of KV blocks"), ("empty", "carried no token")])
def test_a_failed_stream_is_an_error_not_a_served_request(server, tmp_path, mode, needle):
    url, handler = server
    handler.mode = mode
    with pytest.raises(ValueError, match=needle) as info:
        run_bench(_config(url, tmp_path))
    assert str(info.value).startswith("url:") and "job 'j" in str(info.value)


def test_a_request_without_a_measured_latency_does_not_meet_the_slo():
    from eval.harness import RequestRecord, RunOutcome, serving_metrics

    slo = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    assert slo.request_ok(0.5, 0.05)
    assert not slo.request_ok(None, 0.05) and not slo.request_ok(0.5, None)
    assert not slo.request_ok(2.0, 0.05) and not slo.request_ok(0.5, 0.2)
    assert SLO(jct_s=10.0).request_ok(None, None)  # no request target: nothing to miss
    assert SLO(ttft_ms=1000.0).request_ok(0.5, None)  # no TPOT target: its absence does not matter

    def record(job: str, ttft: float | None, tpot: float | None, tokens: int) -> RequestRecord:
        return RequestRecord(job, 0, 0.0, 0.0, ttft, 1.0, 10, 0, [1] * tokens, ttft, tpot)

    records = [record("a", 0.5, 0.05, 4), record("b", 0.5, None, 1), record("c", None, None, 4),
               record("d", 0.5, None, 4)]
    serving, goodput = serving_metrics(RunOutcome("p", records, {j: 1.0 for j in "abcd"}, 1.0, {}), slo)
    # a and the one-token reply b are good; c (no TTFT) and d (no TPOT for 4 tokens) are not
    assert serving["request_goodput"] == pytest.approx(2.0) and goodput == pytest.approx(2 * 3600.0)

