"""``asymcache bench-engine``'s table: medians of alternating runs and the paired ratios' range
(the measurements themselves run transformers and are not part of the default suite)."""

from __future__ import annotations

import pytest

from eval.bench_engine import SpeedRow, SpeedSummary, print_table


def test_table_shows_medians_and_paired_ratio_ranges(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import cpu_linear

    forms = ("weight-left",) * (len(cpu_linear.ROW_BUCKETS) - 1) + ("library",)
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: forms)
    ours = SpeedSummary("asymcache", 16, (SpeedRow("asymcache", 16, 100.0, 10.0), SpeedRow("asymcache", 16, 130.0, 9.0),
                                          SpeedRow("asymcache", 16, 120.0, 12.0)))
    hf = SpeedSummary("transformers", 16, (SpeedRow("transformers", 16, 100.0, 10.0),
                                           SpeedRow("transformers", 16, 100.0, 10.0),
                                           SpeedRow("transformers", 16, 150.0, 10.0)))
    assert (ours.prefill_tok_s, ours.decode_tok_s) == (120.0, 10.0)
    print_table([ours, hf], 128, 64)
    lines = capsys.readouterr().out.splitlines()
    assert "median of 3 alternating runs" in lines[0]
    assert "CPU linear weight-left/library" in lines[0]  # the engine's forms, as its probe kept them
    row = next(line for line in lines if line.startswith("asymcache"))
    # medians 120 / 100 and 10 / 10; paired ratios 1.00, 1.30, 0.80 and 1.00, 0.90, 1.20
    assert row.split()[-4:] == ["1.20x", "1.00x", "0.80-1.30", "0.90-1.20"]
