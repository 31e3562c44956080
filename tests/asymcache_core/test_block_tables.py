"""Persistent block table rows: the padded table equals the lists', built from what changed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.block_tables import BlockTableRows
from asymcache_core.engine import Engine
from asymcache_core.request import HOLE, Request
from asymcache_core.sampling_params import SamplingParams
from kernels.metadata import pad_block_tables, table_width


def _req(rid: str, ids: list[int]) -> Request:
    request = Request(rid, [1] * 4, SamplingParams(max_tokens=1), 0.0)
    request.block_ids = ids
    return request


def test_a_decode_step_converts_only_the_entries_it_added():
    rows = BlockTableRows()
    a, b = _req("a", list(range(1000))), _req("b", list(range(500, 800)))
    first = rows.build([a, b], 1008)
    assert rows.entries_written == 1300
    assert np.array_equal(first, pad_block_tables([a.block_ids, b.block_ids], 1008).numpy())
    a.block_ids.append(7)  # a's next block; b unchanged
    second = rows.build([a, b], 1008)
    assert rows.entries_written == 1301
    assert second[0, 1000] == 7 and second[0, 1001:].sum() == 0
    assert np.array_equal(second, pad_block_tables([a.block_ids, b.block_ids], 1008).numpy())


def test_an_entry_changed_in_place_is_rewritten_from_its_mark():
    rows = BlockTableRows()
    a = _req("a", [3, HOLE, HOLE, 9])
    rows.build([a], 16)
    a.block_ids[1] = 42  # a hole gets its fresh block, as the cache manager marks it
    a.table_dirty_from = 1
    assert rows.build([a], 16)[0, :4].tolist() == [3, 42, HOLE, 9]
    assert rows.entries_written == 4 + 3


def test_a_change_in_place_without_its_mark_fails_the_integrity_check():
    rows = BlockTableRows()
    a = _req("a", [3, 4, 5])
    rows.build([a], 16)
    rows.check_integrity([a])
    a.block_ids[0] = 8  # unmarked
    with pytest.raises(AssertionError, match="table_dirty_from"):
        rows.check_integrity([a])


def test_a_new_list_rebuilds_the_row():
    rows = BlockTableRows()
    a = _req("a", [3, 4, 5, 6])
    rows.build([a], 16)
    a.block_ids = [7, 8]  # preempted and admitted again: a new list, shorter, no mark
    assert rows.build([a], 16)[0, :4].tolist() == [7, 8, 0, 0]


def test_rows_no_step_uses_are_dropped():
    rows = BlockTableRows(max_idle_steps=4)
    a, b = _req("a", [1]), _req("b", [2])
    rows.build([a, b], 16)
    for _ in range(6):  # steps 2-7: at step 4, a was idle 3 steps
        rows.build([b], 16)
    assert set(rows.rows) == {"a", "b"}
    rows.build([b], 16)  # step 8: idle 7 steps, scanned
    assert set(rows.rows) == {"b"}
    with pytest.raises(ValueError, match="max_idle_steps"):
        BlockTableRows(max_idle_steps=0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_match_the_lists_under_random_edits(data):
    rows = BlockTableRows(max_idle_steps=3)
    requests = [_req(f"r{i}", []) for i in range(4)]
    for _ in range(data.draw(st.integers(1, 12))):
        for request in requests:
            ids = request.block_ids
            op = data.draw(st.sampled_from(["append", "set", "new", "keep"]))
            if op == "append":
                ids.extend(data.draw(st.lists(st.integers(-1, 999), max_size=40)))
            elif op == "set" and ids:
                i = data.draw(st.integers(0, len(ids) - 1))
                ids[i] = data.draw(st.integers(-1, 999))
                request.table_dirty_from = min(request.table_dirty_from, i)
            elif op == "new":
                request.block_ids = data.draw(st.lists(st.integers(-1, 999), max_size=80))
        step = data.draw(st.lists(st.sampled_from(requests), min_size=1, max_size=4, unique_by=lambda r: r.request_id))
        tables = [r.block_ids for r in step]
        built = rows.build(step, table_width(tables))
        assert np.array_equal(built, pad_block_tables(tables, table_width(tables)).numpy())
        rows.check_integrity(requests)


def test_the_engine_keeps_rows_between_steps():
    # a real (CPU) forward pass per step: after the prompt's step, each decode step converts
    # only the entries its sequences added, and the outputs equal an engine of one sequence
    engine = Engine(model="dummy:tiny", num_kv_blocks=64, block_size=4, device="cpu", dtype="float32")
    prompts = [[5 + i] * 37 for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    rows = engine.runner.block_table_rows
    entries = sum(len(range(0, 37 + 12, 4)) for _ in prompts)
    assert 0 < rows.entries_written <= entries + 3 * 3  # each table written about once
    for prompt, out in zip(prompts, outs, strict=True):
        alone = Engine(model="dummy:tiny", num_kv_blocks=64, block_size=4, device="cpu", dtype="float32")
        assert alone.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids == out.token_ids
    engine.check_integrity()
