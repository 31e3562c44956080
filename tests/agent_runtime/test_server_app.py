"""The server's options: one list, split from keyword arguments, checked on construction."""

from __future__ import annotations

import pytest

from agent_runtime.server import ServeOptions


def test_from_kwargs_splits_the_options_from_the_engine_settings():
    opts = ServeOptions.from_kwargs({"port": 9000, "policy": "asymcache", "device": "cpu", "max_num_seqs": 4})
    assert (opts.port, opts.policy, opts.host, opts.model) == (9000, "asymcache", "127.0.0.1", "smollm2-135m")
    assert dict(opts.engine_settings) == {"device": "cpu", "max_num_seqs": 4}
    assert dict(ServeOptions.from_kwargs({}).engine_settings) == {}


@pytest.mark.parametrize("kwargs,field", [
    ({"port": 70000}, "port"),
    ({"port": True}, "port"),
    ({"host": " "}, "host"),
    ({"api_key": ""}, "api_key"),
    ({"served_model_name": ""}, "served_model_name"),
    ({"log_level": "loud"}, "log_level"),
])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ServeOptions.from_kwargs(kwargs)


def test_every_operation_has_its_own_id_and_ping_answers_get_and_post():
    """vLLM registers ``GET /ping`` and ``POST /ping`` as two routes (``ping_ping_get``,
    ``ping_ping_post``); one route of both methods gave both one operation id (a FastAPI
    warning)."""
    import warnings

    from fastapi.testclient import TestClient

    from agent_runtime.server import create_app

    app = create_app(lambda: None, "m", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        paths = app.openapi()["paths"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert {m: op["operationId"] for m, op in paths["/ping"].items()} == {"get": "ping_ping_get",
                                                                          "post": "ping_ping_post"}
    # NOTE: no runtime attached (no lifespan): /ping answers as /health does, for either method
    client = TestClient(app)
    health = client.get("/health")
    for method in ("GET", "POST"):
        r = client.request(method, "/ping")
        assert (r.status_code, r.json()) == (health.status_code, health.json()), method
    assert client.put("/ping").status_code == 405
