"""Host-side MSA metadata: the padded block tables and the step metadata built from lists."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.metadata import build_msa_metadata, pad_block_tables

_tables = st.lists(st.lists(st.integers(-1, 2**31 - 1), max_size=40), max_size=6)


@given(tables=_tables, extra_width=st.integers(0, 5))
def test_pad_block_tables_is_the_zero_padded_nested_list(tables: list[list[int]], extra_width: int) -> None:
    width = max((len(t) for t in tables), default=0) + extra_width
    out = pad_block_tables(tables, width)
    assert out.dtype == torch.int32 and out.shape == (len(tables), width)
    assert out.tolist() == [t + [0] * (width - len(t)) for t in tables]


def test_build_msa_metadata_pads_tables_to_sixteen_block_rows() -> None:
    tables = [[3, 1, 4], list(range(20))]
    meta = build_msa_metadata(tables, [(0, 0, 2, 1), (1, 2, 1, 19)], [5, 6, 7], block_size=16)
    assert meta.block_tables.shape == (2, 32) and meta.block_tables.dtype == torch.int32
    assert meta.block_tables[0, :4].tolist() == [3, 1, 4, 0]
    assert meta.block_tables[1].tolist() == list(range(20)) + [0] * 12
    # a step without sequences still gets a one-row table
    assert build_msa_metadata([], [], [], block_size=16).block_tables.shape == (1, 16)
