"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def unbounded(smollm) -> list[list[int]]:
    """The greedy outputs of the multi-session script (``test_holes_and_policies.run_script``)
    on a pool that never evicts: what every policy, pool and tier must reproduce."""
    from tests.asymcache_core.test_holes_and_policies import run_script
    from tests.conftest import make_engine

    return run_script(make_engine(smollm, num_kv_blocks=2048))
