"""The results.json schema: summaries, the save/load round trip, and what loading refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eval.results import Recompute, Results, Summary, summarize
from eval.results_io import load_results, save_results
from tests.eval.sample_results import sample_results


def test_summarize_known_data() -> None:
    s = summarize([float(v) for v in range(1, 101)])  # 1..100
    assert s.count == 100
    assert s.mean == pytest.approx(50.5)
    assert s.p50 == pytest.approx(50.5)
    assert s.p95 == pytest.approx(95.05)
    assert s.p99 == pytest.approx(99.01)
    single = summarize([2.5])
    assert (single.mean, single.p50, single.p95, single.p99, single.count) == (
        2.5,
        2.5,
        2.5,
        2.5,
        1,
    )


def test_summarize_empty_and_non_finite() -> None:
    empty = summarize([])
    assert empty.count == 0
    assert empty.mean is None and empty.p50 is None and empty.p95 is None and empty.p99 is None
    with pytest.raises(ValueError, match="NaN or infinite"):
        summarize([1.0, float("nan")])


def test_summary_rejects_inconsistent_count() -> None:
    with pytest.raises(ValueError, match="null"):
        Summary(mean=None, p50=None, p90=None, p95=None, p99=None, count=3)
    with pytest.raises(ValueError, match="total"):
        Recompute(hole=5, suffix=5, preempted=0, total=3)


def test_round_trip(tmp_path: Path) -> None:
    results = sample_results()
    path = save_results(results, tmp_path / "run")
    assert path == tmp_path / "run" / "results.json"
    loaded = load_results(path)
    assert loaded == results
    assert load_results(path.parent) == results  # a folder works too
    assert list(loaded.policies) == ["lru", "vllm-apc", "asymcache"]  # display order kept
    assert loaded.policies["asymcache"].series.blocks_in_use[0] == (
        0.0,
        results.policies["asymcache"].series.blocks_in_use[0][1],
    )
    schema = json.loads((path.parent / "results.schema.json").read_text())
    assert schema == Results.model_json_schema()
    assert {"schema_version", "run", "policies"} <= set(schema["properties"])


def test_save_refuses_non_finite(tmp_path: Path) -> None:
    results = sample_results()
    results.policies["lru"].series.jct.append(float("inf"))
    with pytest.raises(ValueError, match=r"series\.jct\[20\]"):
        save_results(results, tmp_path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "results.json"))) as err:
        load_results(tmp_path)
    assert "not found" in str(err.value)


def test_load_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text('{"schema_version": 1, "run": ')
    with pytest.raises(ValueError, match=re.escape(str(path))) as err:
        load_results(path)
    assert "not valid JSON" in str(err.value) and "line 1" in str(err.value)


def test_load_wrong_fields(tmp_path: Path) -> None:
    data = json.loads(sample_results().model_dump_json())
    data["run"]["backend"] = "quantum"
    del data["policies"]["lru"]["hit_rate"]
    data["policies"]["lru"]["hit_ratio"] = 0.4  # a typo must not pass silently
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_results(path)
    msg = str(err.value)
    assert str(path) in msg and "does not match the results schema" in msg
    assert "run.backend" in msg
    assert "policies.lru.hit_rate" in msg
    assert "policies.lru.hit_ratio" in msg


def test_load_wrong_version_and_top_level(tmp_path: Path) -> None:
    data = json.loads(sample_results().model_dump_json())
    data["schema_version"] = 99
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version 99"):
        load_results(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_results(path)
