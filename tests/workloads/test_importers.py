"""Tests of the trace importers: ShareGPT (and its streaming JSON reader), BFCL, Mooncake and
Bailian block traces, and ``load_trace``'s specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads import (
    TraceError,
    generate,
    import_bailian,
    import_bfcl,
    import_mooncake,
    import_sharegpt,
    job_token_stream,
    load_trace,
)
from workloads.importers import JsonStream


def _sharegpt_conv(i: int, turns: int) -> dict[str, object]:
    msgs = []
    for k in range(turns):
        msgs.append({"from": "human", "value": f"question {i}.{k} " + "x" * (8 * (k + 1))})
        msgs.append({"from": "gpt", "value": "answer " + "y" * (40 + k)})
    return {"id": f"c{i}", "conversations": msgs}


def test_sharegpt_truncated_array(tmp_path: Path) -> None:
    convs = [_sharegpt_conv(i, 1 + i % 3) for i in range(6)]
    convs.insert(2, {"id": "gpt-only", "conversations": [{"from": "gpt", "value": "hello"}]})
    text = json.dumps(convs, indent=2)
    cut = text.index('"c5"') + 30  # inside the last conversation
    path = tmp_path / "sg.json"
    path.write_text(text[:cut])
    # Small chunks force elements to straddle chunk boundaries.
    for chunk in (16, 97, 1 << 20):
        items = list(JsonStream(path, chunk_chars=chunk))
        assert len(items) == 6
    t = import_sharegpt(path, think_time_mean_s=5.0)
    assert t.params["truncated"] is True and t.params["skipped"] == 1
    assert [j.metadata["id"] for j in t.jobs] == ["c0", "c1", "c2", "c3", "c4"]
    assert [j.num_turns for j in t.jobs] == [1, 2, 3, 1, 2]
    first = t.jobs[0].turns[0]
    assert first.input_tokens == -(-len("question 0.0 " + "x" * 8) // 4)
    assert t.jobs[2].turns[0].think_time_s > 0 and t.jobs[2].turns[-1].think_time_s == 0
    # Pluggable tokenizer.
    words = import_sharegpt(path, tokenizer=lambda s: len(s.split()), keep_text=True)
    assert words.jobs[0].turns[0].input_tokens == 3
    assert words.jobs[0].turns[0].input_text is not None
    assert len(load_trace(f"sharegpt:{path}", num_jobs=2)) == 2


@settings(max_examples=60, deadline=None)
@given(
    elems=st.lists(
        st.dictionaries(st.text(max_size=4), st.text(max_size=12) | st.integers(), max_size=3),
        max_size=6,
    ),
    cut_frac=st.floats(0.0, 1.0),
    chunk=st.integers(16, 64),
)
def test_json_stream_recovers_complete_elements(
    tmp_path_factory: pytest.TempPathFactory,
    elems: list[dict[str, object]],
    cut_frac: float,
    chunk: int,
) -> None:
    parts = [json.dumps(e) for e in elems]
    text, ends = "[", []
    for i, part in enumerate(parts):
        text += (",\n" if i else "") + part
        ends.append(len(text))
    text += "]"
    cut = max(1, round(cut_frac * len(text)))
    path = tmp_path_factory.mktemp("js") / "a.json"
    path.write_text(text[:cut])
    stream = JsonStream(path, chunk_chars=chunk)
    got = [obj for _, obj in stream]
    assert got == elems[: sum(1 for e in ends if e <= cut)]
    assert stream.truncated == (cut < len(text))


def test_sharegpt_complete_and_malformed(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([_sharegpt_conv(i, 2) for i in range(3)]))
    t = import_sharegpt(path)
    assert len(t) == 3 and t.params["truncated"] is False
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"id": 1, "conversations": []},\n{"id": 2, oops},\n{"id": 3}\n]')
    with pytest.raises(TraceError, match=r"bad\.json:3"):
        import_sharegpt(bad)
    jsonl = tmp_path / "sg.jsonl"
    jsonl.write_text("\n".join(json.dumps(_sharegpt_conv(i, 1)) for i in range(4)))
    assert len(import_sharegpt(jsonl)) == 4
    with jsonl.open("a") as f:
        f.write('\n{"id": "cut", "conversa')
    cut = import_sharegpt(jsonl)
    assert len(cut) == 4 and cut.params["truncated"] is True
    with jsonl.open("a") as f:
        f.write("\n" + json.dumps(_sharegpt_conv(9, 1)) + "\n")
    with pytest.raises(TraceError, match=r"sg\.jsonl:5"):
        import_sharegpt(jsonl)
    with pytest.raises(TraceError, match="no such file"):
        import_sharegpt(tmp_path / "nope.json")
    # NOTE: a file whose only record is not JSON is no cut download: it once held "no jobs"
    not_json = tmp_path / "not.json"
    not_json.write_text("not json {\n")
    with pytest.raises(TraceError, match=r"not\.json:1: invalid JSON"):
        import_sharegpt(not_json)


def test_bfcl_import(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "possible_answer").mkdir(parents=True)
    (data / "multi_turn_func_doc").mkdir()
    (data / "multi_turn_func_doc" / "math_api.json").write_text("d" * 400)
    entries = [
        {
            "id": "mt_0",
            "question": [
                [{"role": "user", "content": "add 1 and 2 then log it"}],
                [{"role": "user", "content": "now the square root"}],
                [],
            ],
            "involved_classes": ["MathAPI"],
        },
        {
            "id": "mt_1",
            "question": [[{"role": "user", "content": "hi"}]],
            "involved_classes": ["MathAPI", "Unknown"],
            "ground_truth": [["mean(numbers=[1])"]],
        },
    ]
    answers = [
        {"id": "mt_0", "ground_truth": [["add(a=1,b=2)", "log(x=3)"], ["square_root(9)"], []]}
    ]
    qpath = data / "BFCL_multi_turn_x.json"
    qpath.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    (data / "possible_answer" / qpath.name).write_text(json.dumps(answers[0]) + "\n")
    t = import_bfcl(qpath, seed=1)
    j0, j1 = t.jobs
    assert [tu.tool for tu in j0.turns] == ["add", "log", None, "square_root", None, None]
    assert j0.turns[2].think_time_s > 0 and j0.turns[-1].think_time_s == 0
    assert all(0.01 <= tu.tool_duration_s <= 0.3 for tu in j0.turns if tu.tool)
    assert j0.shared_prefix_id == "bfcl:MathAPI" and j0.shared_prefix_tokens == 100
    assert j1.shared_prefix_tokens == 100 + 700  # doc file missing -> default
    assert [tu.tool for tu in j1.turns] == ["mean", None]
    assert import_bfcl(qpath, seed=1) == t
    assert load_trace(f"bfcl:{qpath}", seed=1) == t
    bad = data / "bad.json"
    bad.write_text(json.dumps(entries[1]) + "\n" + '{"id": "z"}\n')
    with pytest.raises(TraceError, match=r"bad\.json:2.*question"):
        import_bfcl(bad)
    # a class named by a string was split into its letters; a path of an object a KeyError,
    # reported through load_trace as "bad options"
    for field, value in (("involved_classes", "MathAPI"), ("path", {"a": 1}), ("path", 5)):
        bad.write_text(json.dumps({**entries[1], field: value}) + "\n")
        with pytest.raises(TraceError, match=rf"bad\.json:1: '{field}' must be a list"):
            load_trace(f"bfcl:{bad}")
    with pytest.raises(ValueError, match="^bad options for bfcl importer"):
        load_trace(f"bfcl:{qpath}", bogus=1)


def test_mooncake_import(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]},
        {"timestamp": 2500, "input_length": 100, "output_length": 0, "hash_ids": [7]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = import_mooncake(path)
    assert [j.arrival_s for j in t.jobs] == [0.0, 1.0, 2.5]
    assert t.arrival.kind == "trace"
    a, b = t.jobs[1], t.jobs[0]  # file lines 1 and 2
    assert a.block_hash_size == 512 and a.turns[0].input_tokens == 1100
    assert t.jobs[2].turns[0].output_tokens == 1  # at least one token
    sa, sb = job_token_stream(a, 32000)[0], job_token_stream(b, 32000)[0]
    assert sa[:512] == sb[:512] and sa[512:600] != sb[512:600]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + '{"timestamp": 5, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2.*input_length"):
        import_mooncake(bad)
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps(rows[0]) + "\n" + '{"timestamp": 5, "inp')
    with pytest.raises(TraceError, match=r"cut\.jsonl:2"):
        load_trace(f"mooncake:{cut}")
    # counts that are not integers: once an OverflowError (1e400), or cut (5.9) or True read as 1
    for value in ("1e400", "5.9", "true"):
        bad.write_text(json.dumps(rows[0]) + "\n" + f'{{"timestamp": 5, "input_length": {value}, "output_length": 3}}\n')
        with pytest.raises(TraceError, match=r"bad\.jsonl:2: field 'input_length' is not an integer"):
            import_mooncake(bad)
    bad.write_text(json.dumps({**rows[0], "hash_ids": [1.7, 2]}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: hash_ids must be integers"):
        import_mooncake(bad)
    # one JSON array on one line: its records once shared a job id (their line's)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows))
    assert [j.job_id for j in import_mooncake(array).jobs] == ["mooncake-2", "mooncake-1", "mooncake-3"]
    deep = tmp_path / "deep.jsonl"
    for text, where in (('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ":1"),  # a line of JSONL
                        ("[" * 100_000 + "]" * 100_000 + "\n", "")):  # a JSON array
        deep.write_text(text)
        with pytest.raises(TraceError, match=rf"deep\.jsonl{where}: JSON nested too deeply"):
            import_mooncake(deep)


def test_bailian_import(tmp_path: Path) -> None:
    rows = [
        {
            "chat_id": 1,
            "parent_chat_id": -1,
            "timestamp": 10.0,
            "input_length": 100,
            "output_length": 30,
            "type": "text",
            "turn": 1,
            "hash_ids": [5, 6, 7, 8, 9, 10, 11],
        },
        {
            "chat_id": 2,
            "parent_chat_id": -1,
            "timestamp": 11.0,
            "input_length": 40,
            "output_length": 10,
            "type": "text",
            "turn": 1,
            "hash_ids": [5, 6, 70],
        },
        {
            "chat_id": 3,
            "parent_chat_id": 1,
            "timestamp": 25.0,
            "input_length": 180,
            "output_length": 20,
            "type": "search",
            "turn": 2,
            "hash_ids": [],
        },
        {
            "chat_id": 4,
            "parent_chat_id": 3,
            "timestamp": 40.0,
            "input_length": 190,
            "output_length": 5,
            "type": "text",
            "turn": 3,
            "hash_ids": [],
        },
        {
            "chat_id": 5,
            "parent_chat_id": 999,
            "timestamp": 12.0,
            "input_length": 50,
            "output_length": 5,
            "type": "text",
            "turn": 4,
            "hash_ids": [5],
        },
    ]
    path = tmp_path / "bl.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = import_bailian(path)
    assert [j.job_id for j in t.jobs] == ["bailian-1", "bailian-2", "bailian-5"]
    assert [j.arrival_s for j in t.jobs] == [0.0, 1.0, 2.0]
    chain = t.jobs[0]
    assert [tu.input_tokens for tu in chain.turns] == [100, 50, 1]
    assert [tu.think_time_s for tu in chain.turns] == [15.0, 15.0, 0.0]
    assert chain.metadata["types"] == ["text", "search", "text"]
    s1, s2 = job_token_stream(t.jobs[0], 1000)[0], job_token_stream(t.jobs[1], 1000)[0]
    assert s1[:32] == s2[:32] and s1[32:40] != s2[32:40]
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(TraceError, match=r"dup\.jsonl:2.*duplicate"):
        import_bailian(dup)
    # a parent named as 1.0 is chat 1 (it started a chain of its own)
    floats = tmp_path / "floats.jsonl"
    floats.write_text("\n".join(json.dumps({**r, "parent_chat_id": float(r["parent_chat_id"])} if r["parent_chat_id"] != -1 else r)
                                for r in rows) + "\n")
    assert [len(j.turns) for j in import_bailian(floats).jobs] == [len(j.turns) for j in t.jobs]
    # records whose parent links loop reach no root: they were dropped unseen
    loop = tmp_path / "loop.jsonl"
    loop.write_text("\n".join(json.dumps(r) for r in [rows[0], {**rows[1], "chat_id": 7, "parent_chat_id": 8},
                                                       {**rows[2], "chat_id": 8, "parent_chat_id": 7}]) + "\n")
    with pytest.raises(TraceError, match=r"loop\.jsonl:2: chat_id '7' is in a cycle of parent_chat_id links"):
        import_bailian(loop)


def test_load_trace_specs(tmp_path: Path) -> None:
    t = load_trace("toolloop", num_jobs=5, seed=2, token_scale=0.1)
    assert t == generate("toolloop", 5, 2, token_scale=0.1)
    with pytest.raises(ValueError, match="nosuch"):
        load_trace("nosuch")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace("parquet:/x")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(f"bailian:{tmp_path / 'none.jsonl'}")
    with pytest.raises(ValueError, match="bad options"):
        load_trace(f"mooncake:{tmp_path / 'x'}", nonsense=1)
