"""Importers and ``load_trace`` refuse sizes and files they would misread: negative counts
(read as slices), BFCL ids given twice, and (block traces) a missing timestamp, a branching
chat, hash ids that do not cover the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workloads import TraceError
from workloads.importers import (
    import_bailian,
    import_bfcl,
    import_mooncake,
    import_sharegpt,
    load_trace,
)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "hi " * 9}, {"from": "gpt", "value": "yo"},
                                               {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"}]}
             for i in range(3)]
    return {
        "trace": _jsonl(tmp_path / "t.jsonl", [{"job_id": f"j{i}", "turns": [{"input_tokens": 5, "output_tokens": 2}]}
                                               for i in range(3)]),
        "sharegpt": _jsonl(tmp_path / "s.jsonl", convs),
        "mooncake": _jsonl(tmp_path / "m.jsonl", [{"timestamp": i, "input_length": 600, "output_length": 3,
                                                   "hash_ids": [i, 10 + i]} for i in range(3)]),
        "bailian": _jsonl(tmp_path / "b.jsonl", [{"chat_id": i, "parent_chat_id": -1, "timestamp": i,
                                                  "input_length": 20, "output_length": 3, "hash_ids": [i, 9]}
                                                 for i in range(3)]),
        "bfcl": _jsonl(tmp_path / "q.jsonl", [{"id": f"q{i}", "question": [[{"role": "user", "content": "hi"}]]}
                                              for i in range(3)]),
    }


@pytest.mark.parametrize("kind", ["swe", "trace", "sharegpt", "mooncake", "bailian", "bfcl"])
def test_load_trace_refuses_a_negative_num_jobs(files, kind):
    spec = kind if kind == "swe" else f"{kind}:{files[kind]}"
    assert len(load_trace(spec, num_jobs=2).jobs) == 2  # the limit itself works
    with pytest.raises(ValueError, match=r"^num_jobs: must be an integer >= 0"):
        load_trace(spec, num_jobs=-1)


@pytest.mark.parametrize(("call", "field"), [
    (lambda f: import_sharegpt(f["sharegpt"], max_jobs=-1), "max_jobs"),
    (lambda f: import_sharegpt(f["sharegpt"], max_turns=-1), "max_turns"),
    (lambda f: import_sharegpt(f["sharegpt"], max_turns=0), "max_turns"),
    (lambda f: import_sharegpt(f["sharegpt"], min_turns=-2), "min_turns"),
    (lambda f: import_sharegpt(f["sharegpt"], max_jobs=1.5), "max_jobs"),
    (lambda f: import_mooncake(f["mooncake"], max_jobs=-1), "max_jobs"),
    (lambda f: import_mooncake(f["mooncake"], block_size=0), "block_size"),
    (lambda f: import_mooncake(f["mooncake"], timestamp_unit="h"), "timestamp_unit"),
    (lambda f: import_bailian(f["bailian"], max_jobs=-1), "max_jobs"),
    (lambda f: import_bailian(f["bailian"], block_size=-16), "block_size"),
    (lambda f: import_bfcl(f["bfcl"], max_jobs=-1), "max_jobs"),
])
def test_importers_refuse_bad_sizes_naming_the_option(files, call, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        call(files)


def test_importer_limits_still_apply(files):
    assert len(import_sharegpt(files["sharegpt"], max_turns=1).jobs[0].turns) == 1
    assert len(import_sharegpt(files["sharegpt"], max_jobs=0).jobs) == 0
    assert len(import_mooncake(files["mooncake"], max_jobs=1).jobs) == 1


def test_bfcl_duplicate_ids_are_one_line_naming_the_file(tmp_path):
    path = _jsonl(tmp_path / "dup.jsonl", [
        {"id": "x", "question": [[{"role": "user", "content": "hi"}]]},
        {"id": "y", "question": [[{"role": "user", "content": "hey"}]]},
        {"id": "x", "question": [[{"role": "user", "content": "hello"}]]},
    ])
    with pytest.raises(TraceError) as info:
        import_bfcl(path)
    message = str(info.value)
    assert "\n" not in message and message == f"{path}:3: duplicate id 'x' (first on line 1)"



@pytest.mark.parametrize("importer", [import_mooncake, import_bailian])
def test_a_missing_timestamp_names_its_line(tmp_path, importer):
    rows = [{"chat_id": i, "parent_chat_id": -1, "timestamp": 5 + i, "input_length": 600, "output_length": 3,
             "hash_ids": [i, 9]} for i in range(3)]
    del rows[1]["timestamp"]
    path = _jsonl(tmp_path / "ts.jsonl", rows)
    with pytest.raises(TraceError, match=r"ts\.jsonl:2: missing field 'timestamp'"):
        importer(path)
    rows[1]["timestamp"] = 6
    arrivals = [j.arrival_s for j in importer(_jsonl(path, rows)).jobs]
    assert arrivals[0] == 0.0 and 0 < arrivals[1] < arrivals[2]  # the second keeps its place


def test_bailian_branching_chat_is_refused_naming_both_requests(tmp_path):
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 100, "output_length": 10},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 5, "input_length": 130, "output_length": 10},
        {"chat_id": 3, "parent_chat_id": 2, "timestamp": 9, "input_length": 160, "output_length": 10},
        {"chat_id": 4, "parent_chat_id": 1, "timestamp": 7, "input_length": 125, "output_length": 10},
    ]
    linear = import_bailian(_jsonl(tmp_path / "ok.jsonl", rows[:3]))
    # each turn's new tokens count against its parent: 130 - (100 + 10), 160 - (130 + 10)
    assert [t.input_tokens for t in linear.jobs[0].turns] == [100, 20, 20]
    path = _jsonl(tmp_path / "branch.jsonl", rows)
    with pytest.raises(TraceError) as info:
        import_bailian(path)
    assert str(info.value) == (
        f"{path}:4: chat_id '4' branches from chat_id '1', which chat_id '2' (line 2) already continues; "
        "branching conversations are not supported"
    )


def test_mooncake_hash_ids_must_cover_the_prompt(tmp_path):
    ok = [{"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 3]},  # 3 blocks of 512
          {"timestamp": 1, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2, 3]},  # one over: tolerated
          {"timestamp": 2, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2]},  # one under: tolerated
          {"timestamp": 3, "input_length": 700, "output_length": 2}]  # no hash ids: nothing to check
    assert len(import_mooncake(_jsonl(tmp_path / "ok.jsonl", ok)).jobs) == 4
    bad = [*ok, {"timestamp": 4, "input_length": 5000, "output_length": 2, "hash_ids": [1, 2]}]
    with pytest.raises(TraceError, match=r"bad\.jsonl:5: hash_ids holds 2 blocks but input_length 5000 is 10 blocks"):
        import_mooncake(_jsonl(tmp_path / "bad.jsonl", bad))
    # the same record is right for 2,500-token blocks
    assert len(import_mooncake(_jsonl(tmp_path / "big.jsonl", bad[-1:]), block_size=2500).jobs) == 1
