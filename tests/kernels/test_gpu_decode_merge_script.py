"""``scripts/gpu_decode_merge.py``: the plans its GPU table compares.

The table times one graph decode plan three ways; this checks, on the CPU, that the three are
what their names say (a merge in the walk's launch or in a kernel of its own, with or without
the output's zero fill) and that the engine's ``before`` plans, graph and eager, lose the fused
merge only inside the script's context.
"""

from __future__ import annotations

import torch

from kernels import msa_config, msa_plan
from scripts.gpu_decode_merge import before_plans, variant_plan


def _graph_plan() -> msa_plan.MSAPlan:
    # a batch of 3 in a graph of 4 on an H200's 132 SMs: the chunks are spread over programs
    tiles = torch.tensor([(0, 0, 1, 2047), (1, 1, 1, 99), (2, 2, 1, 5000), (3, 3, 0, 0)], dtype=torch.int32)
    return msa_plan.decode_graph_plan(tiles, 32, 8, 131072, head_dim=128, invariant=True)


def test_the_three_variants_are_what_they_say(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(msa_config, "_num_sms", lambda device: 132)
    plan = _graph_plan()
    assert plan.num_splits > 1 and plan.merge_counts is not None and plan.merge_counts.numel() == 4 * 8
    assert plan.pad_rows and plan.covered_rows == 4  # no zero fill
    before = variant_plan(plan, "before")
    assert before.merge_counts is None and not before.pad_rows and before.covered_rows == 0
    pad = variant_plan(plan, "pad rows")
    assert pad.merge_counts is None and pad.pad_rows and pad.covered_rows == 4
    assert variant_plan(plan, "in the launch") is plan


def test_before_plans_patch_graph_and_eager_plans_only_inside(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(msa_config, "_num_sms", lambda device: 132)
    with before_plans():
        graph = _graph_plan()
        assert graph.merge_counts is None and graph.covered_rows == 0
        assert msa_plan._merge_counts(32, 4, torch.device("cpu")) is None
    assert _graph_plan().merge_counts is not None
    assert msa_plan._merge_counts(32, 4, torch.device("cpu")) is not None
