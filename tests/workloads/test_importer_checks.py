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

