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
