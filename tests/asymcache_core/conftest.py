"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@pytest.fixture(scope="session")
def unbounded(smollm) -> list[list[int]]:
    """The greedy outputs of the multi-session script (``test_holes_and_policies.run_script``)
    on a pool that never evicts: what every policy, pool and tier must reproduce."""
    from tests.asymcache_core.test_holes_and_policies import run_script
    from tests.conftest import StepClock, make_engine

    return run_script(make_engine(smollm, clock=StepClock()))


@pytest.fixture(scope="session")
def short_unbounded(smollm) -> list[list[int]]:
    """:func:`unbounded` for the script with 3-token answers (``params=short_turns``), the one
    the tests of ``test_holes_and_policies`` and ``test_host_tier`` run."""
    from tests.asymcache_core.test_holes_and_policies import run_script, short_turns
    from tests.conftest import StepClock, make_engine

    return run_script(make_engine(smollm, clock=StepClock()), params=short_turns)


@dataclass
class TightRun:
    """One run of the multi-session script on the tight pool: its outputs and the engine after it."""

    outputs: list[list[int]]
    engine: Any


@pytest.fixture(scope="session")
def tight_run(smollm) -> Callable[..., TightRun]:
    """The multi-session script on a 12-block pool (its working set is ~33 blocks; overrides
    may name another size) under a policy and engine overrides, run once per setting for the
    whole session (``short``: with 3-token answers, compared with :func:`short_unbounded`).

    NOTE: several tests check different properties (outputs, counters, integrity) of the same
    deterministic run; they read the engine and never step it again.
    """
    from tests.asymcache_core.test_holes_and_policies import run_script, short_turns
    from tests.conftest import StepClock, make_engine

    runs: dict[tuple[str, bool, tuple[tuple[str, Any], ...]], TightRun] = {}

    def get(policy: str, short: bool = False, **overrides: Any) -> TightRun:
        key = (policy, short, tuple(sorted(overrides.items())))
        if key not in runs:
            engine = make_engine(smollm, clock=StepClock(), eviction_policy=policy, **{"num_kv_blocks": 12, **overrides})
            runs[key] = TightRun(run_script(engine, params=short_turns if short else None), engine)
        return runs[key]

    return get
