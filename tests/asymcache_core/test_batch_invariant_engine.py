"""The engine's batch-invariant mode with the real SmolLM2 (CPU, float32).

Each token's logits must be the same bits whatever else shares its step, however its prompt
was chunked, and whether its history was cached or rebuilt as a hole under a tight pool.
"""

from __future__ import annotations

import pytest
import torch

from asymcache_core import SamplingParams
from tests.conftest import StepClock, load_script, make_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _script():
    """``scripts/gpu_batch_invariant.py``: its logit recorder, and the GPU checks beside the cost figures."""
    return load_script("gpu_batch_invariant")


record_logits = _script().record_logits


def run_all(engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[torch.Tensor]]:
    """Adds every prompt at once and steps to the end; logits per prompt name."""
    log = record_logits(engine)
    ids = {name: engine.add_request(prompt, params) for name, prompt in prompts.items()}
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return {name: log[rid] for name, rid in ids.items()}


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"logits differ at output token {step}: max |diff| {float((x - y).abs().max()):.3g}"


@pytest.fixture(scope="module")
def prompts(chat_prompts) -> dict[str, list[int]]:
    target = chat_prompts[2]
    others = {f"o{i}": (chat_prompts[i % 2] + list(range(400 + 37 * i, 400 + 37 * i + 11 * i)))[: 20 + 23 * i] for i in range(7)}
    return {"target": target, **others}


def test_logits_equal_alone_and_in_a_batch_of_eight(smollm, prompts):
    alone = run_all(make_engine(smollm, batch_invariant=True), {"target": prompts["target"]})
    batched = run_all(make_engine(smollm, batch_invariant=True), prompts)
    assert_bitwise(alone["target"], batched["target"])


def test_logits_equal_however_the_prompt_is_chunked(smollm, prompts):
    whole = run_all(make_engine(smollm, batch_invariant=True), {"target": prompts["target"]})
    for budget in (16, 37):
        chunked = run_all(
            make_engine(smollm, batch_invariant=True, max_num_batched_tokens=budget), {"target": prompts["target"]}
        )
        assert_bitwise(whole["target"], chunked["target"])


def test_library_kernels_are_not_batch_invariant_here(smollm, prompts):
    """Why the mode exists: by default the same request's logits change with its batch."""
    alone = run_all(make_engine(smollm), {"target": prompts["target"]})
    batched = run_all(make_engine(smollm), prompts)
    assert any(not torch.equal(x, y) for x, y in zip(alone["target"], batched["target"], strict=True))


def test_logits_equal_cached_or_rebuilt_under_a_tight_pool(smollm):
    """The multi-session script of the lossless tests, its first three sessions over three
    turns: histories evicted from the middle and rebuilt as holes (asymcache, 9 blocks for a
    working set of ~18) give the same bits as histories kept whole in a roomy pool."""
    from tests.asymcache_core.test_holes_and_policies import run_script, short_turns

    logs = []
    engines = [
        make_engine(smollm, batch_invariant=True),
        make_engine(smollm, clock=StepClock(), batch_invariant=True, num_kv_blocks=9, eviction_policy="asymcache"),
    ]
    for engine in engines:
        log = record_logits(engine)
        # NOTE: the whole script (6 sessions, 12 blocks) takes twice as long on the batch-invariant
        # CPU path; three sessions with 3-token answers on 9 blocks still evict from the middle
        # of histories (every logit row of every step is compared)
        run_script(engine, sessions=3, turns=3, params=short_turns)
        logs.append(log)
    assert engines[1].counters.hole_tokens > 0
    roomy, tight = logs
    # request ids come from a per-engine counter: the same script gives the same ids
    assert roomy.keys() == tight.keys()
    for rid in roomy:
        assert_bitwise(roomy[rid], tight[rid])


def test_batch_invariant_config_is_validated():
    from asymcache_core.config import EngineConfig

    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, attention_backend="naive")
    # the default resolves to a bool: off on the CPU (float32 steps are exact without it)
    assert EngineConfig().batch_invariant is False
    assert EngineConfig(batch_invariant=True).batch_invariant is True


def test_cli_batch_invariant_flag_is_tri_state():
    """``--batch-invariant`` / ``--no-batch-invariant`` set it; neither leaves the engine's default."""
    from eval.cli import engine_options

    seen: list[object] = []

    @engine_options({"batch_invariant"})
    def command(engine_args: dict[str, object]) -> None:
        seen.append(engine_args["batch_invariant"])

    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(command)
    for args, expected in (([], None), (["--batch-invariant"], True), (["--no-batch-invariant"], False)):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert seen.pop() is expected


@pytest.mark.gpu
def test_batch_invariant_is_the_default_on_cuda():
    from asymcache_core.config import EngineConfig

    assert EngineConfig(device="cuda").batch_invariant is True
    assert EngineConfig(device="cuda", batch_invariant=False).batch_invariant is False
    assert EngineConfig(device="cuda", attention_backend="naive").batch_invariant is False
    assert EngineConfig(device="cuda", dtype="float16").batch_invariant is True
    assert EngineConfig(device="cuda", dtype="float32").batch_invariant is False


@pytest.fixture(scope="module")
def llama8b():
    from asymcache_core.loaders import load_model

    return load_model("dummy:llama-3.1-8b", torch.device("cuda"), torch.bfloat16, seed=0)


@pytest.mark.gpu
def test_gpu_logits_equal_alone_and_in_a_batch_of_64(llama8b):
    equal, total, diff = _script().alone_vs_batch(llama8b, "dummy:llama-3.1-8b", invariant=True)
    assert equal == total and diff == 0.0


@pytest.mark.gpu
def test_gpu_every_policy_equals_an_unbounded_pool_at_two_chunk_budgets(llama8b):
    script = _script()
    rows = script.policy_grid(llama8b, "dummy:llama-3.1-8b", {"batch-invariant": True})
    assert {row["budget"] for row in rows} == {8192, 512}
    assert {row["policy"] for row in rows} == {"lru", "vllm-apc", "pensieve", "asymcache"}
    assert all(row["tokens_equal"] == 1.0 for row in rows), rows
    assert any(row["holes"] > 0 for row in rows)


def test_the_cpu_engine_checks_its_linear_shapes_at_start(monkeypatch, tmp_path):
    # the product each weight shape runs is settled before the first step, and kept
    from asymcache_core import Engine
    from kernels import cpu_linear

    monkeypatch.setenv("ASYMCACHE_CACHE_DIR", str(tmp_path))
    cpu_linear.onednn_rows_invariant.cache_clear()
    checked: list[tuple[int, int]] = []
    monkeypatch.setattr(cpu_linear, "onednn_rows_agree", lambda n, k: checked.append((n, k)) or False)
    try:
        engine = Engine(model="dummy:tiny", dtype="float32", num_kv_blocks=32, batch_invariant=True)
        shapes = {tuple(m.weight.shape) for m in engine.loaded.model.modules() if isinstance(m, torch.nn.Linear)}
        assert set(checked) == shapes and len(checked) == len(shapes) > 0
        (out,) = engine.generate([[5, 6, 7, 8]], GREEDY)  # every shape failed: the padded calls, no new check
        assert len(out.token_ids) == GREEDY.max_tokens and len(checked) == len(shapes)
        cpu_linear.onednn_rows_invariant.cache_clear()
        Engine(model="dummy:tiny", dtype="float32", num_kv_blocks=32, batch_invariant=True)
        assert len(checked) == len(shapes)  # another process on this machine reads them back
    finally:
        cpu_linear.onednn_rows_invariant.cache_clear()
