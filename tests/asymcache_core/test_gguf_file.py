"""The GGUF parser (``asymcache_core.loaders.gguf_file``) against ``gguf.GGUFReader``, the
format's reference reader: the same metadata and tensors, and a clear error for a bad file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymcache_core.loaders.gguf_file import GGUFFile
from tests.tiny_gguf import write_tiny_gguf

gguf = pytest.importorskip("gguf")


def _assert_same_as_reference(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's header pseudo-fields
    assert list(ours.fields) == keys
    for key in keys:
        expected = ref.fields[key].contents()
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == int(theirs.tensor_type) and mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
    return ours


def test_the_packaged_model_parses_as_the_reference_reader_parses_it():
    from asymcache_core.loaders import packaged_smollm2_path

    parsed = _assert_same_as_reference(packaged_smollm2_path())
    # a 49k vocabulary, its merges, and quantized and float tensors
    assert len(parsed.field("tokenizer.ggml.tokens")) == 49152 and len(parsed.field("tokenizer.ggml.merges")) > 40000
    assert {t.tensor_type for t in parsed.tensors} >= {0, 3}  # F32 norms, Q4_1 matrices
    assert parsed.field("no.such.key", "absent") == "absent"


def test_every_value_type_and_tensor_type_round_trips(tmp_path):
    from gguf.quants import quantize

    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strs", ["a", "", "ü"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    parsed = _assert_same_as_reference(path)
    assert parsed.field("t.u64") == 2**63 + 5 and parsed.field("t.bools") == [True, False, True]
    assert parsed.field("t.str") == "héllo ✓" and parsed.field("t.strs") == ["a", "", "ü"]
    assert [t.shape for t in parsed.tensors] == [(5, 3), (2, 4), (6,), (64, 2)]


def _cut(source: Path, dest: Path, size: int) -> Path:
    dest.write_bytes(source.read_bytes()[:size])
    return dest


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda src, dst: dst.write_bytes(b""), "bad magic|empty"),
        (lambda src, dst: dst.write_bytes(b"GGML" + src.read_bytes()[4:]), "bad magic"),
        (lambda src, dst: _cut(src, dst, 10), "header is cut short"),
        (lambda src, dst: dst.write_bytes(b"GGUF" + struct.pack(">I", 3) + src.read_bytes()[8:]), "big-endian"),
        (lambda src, dst: _cut(src, dst, 700), "metadata is corrupt or cut short"),
        (lambda src, dst: _cut(src, dst, src.stat().st_size - 40), "runs past the end of the file"),
    ],
    ids=["empty", "magic", "header", "byte-order", "metadata", "payload"],
)
def test_a_damaged_file_is_a_value_error_naming_it(tmp_path, damage, message):
    from asymcache_core.loaders import load_model

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    bad = tmp_path / "bad.gguf"
    if bad.exists():
        bad.unlink()
    damage(source, bad)
    with pytest.raises(ValueError, match=message):
        GGUFFile(bad)
    with pytest.raises(ValueError, match=rf"^model: '{bad}' is not a readable GGUF file \("):
        load_model(str(bad), torch.device("cpu"), torch.float32, seed=0)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_cut_or_flipped_file_parses_or_is_a_value_error(tmp_path_factory, data):
    # whatever the damage: the same parse, another one, or a ValueError (never another exception)
    folder = tmp_path_factory.mktemp("fuzz")
    source = write_tiny_gguf(folder / "tiny.gguf").read_bytes()
    damaged = bytearray(source)
    if data.draw(st.booleans(), label="cut"):
        damaged = damaged[: data.draw(st.integers(0, len(source) - 1), label="size")]
    else:
        # the header and index, where a flipped byte changes what is parsed
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, min(len(source), 3000) - 1), label="at")
            damaged[at] ^= data.draw(st.integers(1, 255), label="mask")
    path = folder / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    try:
        parsed = GGUFFile(path)
    except ValueError:
        return
    # parsed: every tensor's payload lies inside the file (a cut past the last one is harmless)
    assert sum(t.data.nbytes for t in parsed.tensors) <= len(damaged)
