"""The converted-GGUF cache: where it lives, what it keys on, and that a bad entry is rebuilt."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import asymcache_core.loaders as loaders
from asymcache_core import Engine, EngineConfig, SamplingParams
from asymcache_core.loaders import load_model
from asymcache_core.loaders.cache import CACHE_ENV, GGUFCache, cache_dir
from tests.tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")
@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _reference(path: Path) -> dict[str, torch.Tensor]:
    """The model's parameters converted straight from the file, bypassing the cache."""
    from asymcache_core.loaders.gguf_loader import gguf_hf_config, gguf_state_dict, open_gguf
    from asymcache_core.models import ModelConfig, build_model, load_hf_state_dict

    reader = open_gguf(path)
    hf_cfg = gguf_hf_config(path, reader)
    model = build_model(ModelConfig.from_hf(hf_cfg), 128)
    load_hf_state_dict(model, gguf_state_dict(path, hf_cfg, reader))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_params(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name].to(tensor.dtype), tensor), name


def _forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object, **__: object) -> None:
        raise AssertionError("the GGUF was read again although the cache is valid")

    monkeypatch.setattr(loaders, "open_gguf", boom)
    monkeypatch.setattr(loaders, "gguf_tokenizer", boom)


def test_cache_dir_prefers_env_then_xdg_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "asymcache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "asymcache"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


def test_second_load_reads_the_cache_only(cache: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _reference(tiny)
    first = load_model(str(tiny), CPU, torch.float32, seed=0)
    _assert_params(first.model, expected)
    entry = GGUFCache(tiny).entry
    assert entry.parent.parent == cache
    assert (entry / "meta" / "manifest.json").is_file()
    assert (entry / "weights-float32" / "manifest.json").is_file()
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]  # no temporary folders left

    _forbid_conversion(monkeypatch)
    second = load_model(str(tiny), CPU, torch.float32, seed=0)
    _assert_params(second.model, expected)
    assert second.model.lm_head.weight is second.model.embed_tokens.weight  # still tied
    text = "hello <|im_start|> wörld"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        first.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (second.tokenizer.eos_token, second.tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    # the cached model computes what the converted one does
    prompt = [256, 257, 111, 32, 120]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [
        Engine(str(tiny), loaded=loaded, num_kv_blocks=16).generate([prompt], greedy)[0].token_ids
        for loaded in (first, second)
    ]
    assert outs[0] == outs[1]


def test_the_config_alone_is_read_without_the_tokenizer(cache: Path, tiny: Path) -> None:
    # a cold cache converts (config and tokenizer); a warm one gives the config from its file
    cold = loaders.resolve_hf_config(str(tiny))
    assert cold[1] == "gguf" and cold[0]["vocab_size"] > 0 and GGUFCache(tiny).config() == cold[0]

    def no_tokenizer(*_: object) -> None:
        raise AssertionError("the tokenizer was loaded for a config")

    with pytest.MonkeyPatch.context() as mp:
        _forbid_conversion(mp)
        mp.setattr("asymcache_core.loaders.cache.load_tokenizer", no_tokenizer)
        assert loaders.resolve_hf_config(str(tiny)) == cold
    # a damaged config is dropped and converted again
    (GGUFCache(tiny).entry / "meta" / "config.json").write_text("{not json")
    assert loaders.resolve_hf_config(str(tiny)) == cold
    assert GGUFCache(tiny).config() == cold[0]


def test_each_dtype_has_its_own_weights(cache: Path, tiny: Path) -> None:
    expected = _reference(tiny)
    load_model(str(tiny), CPU, torch.float32, seed=0)
    bf16 = load_model(str(tiny), CPU, torch.bfloat16, seed=0)
    again = load_model(str(tiny), CPU, torch.bfloat16, seed=0)
    entry = GGUFCache(tiny).entry
    assert {p.name for p in entry.iterdir()} == {"meta", "weights-float32", "weights-bfloat16"}
    for loaded in (bf16, again):
        assert next(loaded.model.parameters()).dtype == torch.bfloat16
        _assert_params(loaded.model, {k: v.to(torch.bfloat16) for k, v in expected.items()})


def test_a_changed_source_is_converted_again(cache: Path, tiny: Path) -> None:
    load_model(str(tiny), CPU, torch.float32, seed=0)
    old_entry = GGUFCache(tiny).entry
    write_tiny_gguf(tiny, seed=1)
    os.utime(tiny, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    reloaded = load_model(str(tiny), CPU, torch.float32, seed=0)
    _assert_params(reloaded.model, _reference(tiny))
    new_entry = GGUFCache(tiny).entry
    assert new_entry != old_entry
    assert not old_entry.exists()  # the stale entry of the same file is removed


def _truncate_weights(entry: Path) -> None:
    weights = entry / "weights-float32" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _flip_a_weight_byte(entry: Path) -> None:
    weights = entry / "weights-float32" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # same size, a payload byte changed
    weights.write_bytes(bytes(data))


def _drop_manifest(entry: Path) -> None:
    (entry / "meta" / "manifest.json").unlink()


def _garble_manifest(entry: Path) -> None:
    (entry / "weights-float32" / "manifest.json").write_text("{not json")


def _garble_tokenizer_consistently(entry: Path) -> None:
    """A tokenizer file the manifest agrees with but that does not parse."""
    meta = entry / "meta"
    (meta / "tokenizer" / "tokenizer.json").write_text("{}")
    manifest = json.loads((meta / "manifest.json").read_text())
    import zlib

    manifest["files"]["tokenizer/tokenizer.json"] = {"size": 2, "crc32": zlib.crc32(b"{}")}
    (meta / "manifest.json").write_text(json.dumps(manifest))


def _wrong_shapes_consistently(entry: Path) -> None:
    """Weights the manifest agrees with but that belong to another model."""
    from safetensors.torch import save_file

    part = entry / "weights-float32"
    save_file({"embed_tokens.weight": torch.zeros(3, 3)}, str(part / "weights.safetensors"))
    import zlib

    data = (part / "weights.safetensors").read_bytes()
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"] = {"size": len(data), "crc32": zlib.crc32(data)}
    (part / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage",
    [_truncate_weights, _flip_a_weight_byte, _drop_manifest, _garble_manifest,
     _garble_tokenizer_consistently, _wrong_shapes_consistently],
)
def test_a_damaged_entry_is_detected_and_rebuilt(
    cache: Path, tiny: Path, damage, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _reference(tiny)
    first = load_model(str(tiny), CPU, torch.float32, seed=0)
    entry = GGUFCache(tiny).entry
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="asymcache_core.loaders"):
        rebuilt = load_model(str(tiny), CPU, torch.float32, seed=0)
    assert "rebuilding" in caplog.text
    _assert_params(rebuilt.model, expected)
    assert rebuilt.tokenizer.encode("hello") == first.tokenizer.encode("hello")
    # the rebuilt entry is whole again: a third load converts nothing
    meta, weights = GGUFCache(tiny).meta(), GGUFCache(tiny).weights(torch.float32)
    assert meta is not None and weights is not None


def test_a_leftover_temporary_folder_is_ignored(cache: Path, tiny: Path) -> None:
    entry = GGUFCache(tiny).entry
    (entry / ".weights-float32-crashed").mkdir(parents=True)
    (entry / ".weights-float32-crashed" / "weights.safetensors").write_bytes(b"partial")
    loaded = load_model(str(tiny), CPU, torch.float32, seed=0)
    _assert_params(loaded.model, _reference(tiny))
    assert GGUFCache(tiny).weights(torch.float32) is not None


def test_an_unwritable_cache_still_loads(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    with caplog.at_level(logging.WARNING, logger="asymcache_core.loaders"):
        loaded = load_model(str(tiny), CPU, torch.float32, seed=0)
    _assert_params(loaded.model, _reference(tiny))
    assert "cannot write" in caplog.text


def test_the_packaged_tokenizer_survives_the_cache(tmp_path: Path) -> None:
    from asymcache_core.loaders import packaged_smollm2_path
    from asymcache_core.loaders.gguf_loader import gguf_tokenizer

    path = packaged_smollm2_path()
    original = gguf_tokenizer(path)
    cache = GGUFCache(path, root=tmp_path)
    cache.store_meta({"vocab_size": 1}, original)
    meta = cache.meta()
    assert meta is not None
    restored = meta[1]
    assert restored.backend_tokenizer.to_str() == original.backend_tokenizer.to_str()
    assert restored.chat_template == original.chat_template
    assert restored.special_tokens_map == original.special_tokens_map
    assert (restored.eos_token_id, restored.bos_token_id) == (original.eos_token_id, original.bos_token_id)
    text = "<|im_start|>user\nWhat is 2+2? Ünïcode  spaces\n\n<|im_end|>"
    assert restored.encode(text) == original.encode(text)


def test_engine_takes_the_model_as_first_argument(cache: Path, tiny: Path) -> None:
    engine = Engine(str(tiny), num_kv_blocks=16, block_size=8)
    assert engine.config.model == str(tiny)
    assert (engine.num_blocks, engine.config.block_size) == (16, 8)
    out = engine.generate([[256, 257]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    via_config = Engine(EngineConfig(model=str(tiny), num_kv_blocks=16), block_size=8)
    assert via_config.config == engine.config


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((42,), {}, "^config: expected an EngineConfig or a model name, not int"),
        ((Path("x.gguf"),), {}, "^config: .*not PosixPath"),
        (("smollm2-135m",), {"model": "dummy:tiny"}, "^model: given both"),
    ],
)
def test_engine_rejects_other_first_arguments(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(*args, **kwargs)
