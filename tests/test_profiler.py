"""The latency-model fit recovers a known curve; the profile command runs on the real engine."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from asymcache_core.latency_model import LatencyModel
from asymcache_core.profiler import ProfilePoint, fit
from eval.cli import app


def test_fit_recovers_a_synthetic_curve():
    truth = LatencyModel(floor_s=0.02, per_token_s=0.0004, per_attn_s=2e-9, knee_tokens=128)
    points = []
    for ctx in (0, 512, 2048):
        for tokens in (1, 16, 64, 128, 256, 512, 1024):
            pairs = tokens * ctx + tokens * (tokens + 1) / 2
            points.append(ProfilePoint("chunk", tokens, ctx, 1, pairs, truth.step_latency(tokens, pairs)))
    model = fit(points, model="m", device="cpu")
    assert model.knee_tokens == 128
    assert abs(model.floor_s - 0.02) < 1e-4
    assert abs(model.per_token_s - 0.0004) < 1e-6
    assert model.fit_error is not None and model.fit_error < 1e-3


def test_analytic_default_is_sane():
    from asymcache_core.loaders import resolve_hf_config
    from asymcache_core.models import ModelConfig

    cfg = ModelConfig.from_hf(resolve_hf_config("dummy:llama-3.1-8b")[0])
    gpu = LatencyModel.analytic(cfg, "cuda", 2)
    # an 8B model on a GPU: a decode step is bound by reading 16 GB of weights (~4 ms) and the
    # knee sits in the hundreds of tokens
    assert 0.003 < gpu.floor_s < 0.01
    assert 50 < gpu.knee_tokens < 1000
    assert gpu.block_rebuild_latency(100, 16, 0) > gpu.block_rebuild_latency(1, 16, 0)


def test_profile_command_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["profile", "--quick", "--model", "dummy:tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["floor_s"] > 0 and data["fit_error"] is not None
    assert "knee" in result.output and "fit error" in result.output
    assert LatencyModel.from_json(out).model == "dummy:tiny"
