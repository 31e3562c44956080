"""The latency-model fit recovers a known curve; the profile command runs on the real engine."""

from __future__ import annotations

import json

import pytest
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
    # a decode reads its K and V in every layer: 8 x 20k keys of Llama-3.1-8B are 21 GB, ~5 ms
    kv_read = gpu.step_latency(8, 160_000, True, 160_000) - gpu.step_latency(8, 160_000, True)
    assert kv_read == pytest.approx(160_000 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 / 4e12)
    assert 0.003 < kv_read < 0.008


def _decode_points(truth: LatencyModel, kind: str, contexts: tuple[int, ...]) -> list[ProfilePoint]:
    points = []
    for ctx in contexts:
        for batch in (1, 4, 16):
            pairs, keys = batch * (ctx + 1.0), batch * (ctx + 1.0)
            latency = truth.step_latency(batch, pairs, kind == "graph", keys)
            points.append(ProfilePoint(kind, batch, ctx, batch, pairs, latency))
    return points


@pytest.mark.parametrize("kind", ["decode", "graph"])
def test_fit_recovers_the_decode_key_term(kind):
    """Decodes at two depths tell the per-key read from the per-token cost, whether they run
    eagerly (fitted with the chunks) or as graph replays (fitted beyond the chunks' curve)."""
    truth = LatencyModel(floor_s=0.02, per_token_s=0.0004, per_attn_s=2e-9, knee_tokens=128,
                         decode_floor_s=0.006 if kind == "graph" else None, per_decode_kv_s=3e-6)
    points = []
    for ctx in (0, 512, 2048):
        for tokens in (16, 64, 128, 256, 512, 1024):
            pairs = tokens * ctx + tokens * (tokens + 1) / 2
            points.append(ProfilePoint("chunk", tokens, ctx, 1, pairs, truth.step_latency(tokens, pairs)))
    model = fit(points + _decode_points(truth, kind, (512, 2048)), model="m", device="cpu")
    assert model.per_decode_kv_s == pytest.approx(3e-6, rel=1e-3)
    assert model.floor_s == pytest.approx(0.02, rel=1e-3)
    if kind == "graph":
        assert model.decode_floor_s == pytest.approx(0.006, rel=1e-3)
    assert model.fit_error is not None and model.fit_error < 1e-3
    # a one-token chunk samples like a decode: the fit prices its keys the same way
    one = ProfilePoint("chunk", 1, 2048, 1, 2049.0, truth.step_latency(1, 2049.0, False, 2049.0))
    assert fit(points + [one] + _decode_points(truth, kind, (512, 2048))).per_decode_kv_s == pytest.approx(
        3e-6, rel=1e-3)
    # chunks alone say nothing about decodes
    assert fit(points).per_decode_kv_s == 0.0


def test_default_grids_time_decodes_at_two_depths_within_their_memory():
    from asymcache_core.profiler import ProfileGrid

    for device, cap in (("cpu", 16384), ("cuda", 262144)):
        grid = ProfileGrid.for_device(device)
        decodes = [(b, c) for kind, _, c, b in grid.points() if kind == "decode"]
        assert len({c for _, c in decodes}) >= 2
        assert max(b * c for b, c in decodes) <= cap
        assert grid.num_blocks_needed(16) >= max(b * -(-(c + 1) // 16) for b, c in decodes)


def test_profile_command_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["profile", "--quick", "--model", "dummy:tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["floor_s"] > 0 and data["fit_error"] is not None
    assert "knee" in result.output and "fit error" in result.output
    assert LatencyModel.from_json(out).model == "dummy:tiny"


def _live_steps(truth: LatencyModel, count: int = 60) -> list[dict]:
    """Step records as ``bench --step-log`` writes them, timed by ``truth``."""
    steps = []
    for i in range(count):
        decode_only = i % 3 != 0
        tokens = 4 + i % 4 if decode_only else 200 + 37 * i
        pairs = float(tokens * (300 + 11 * i))
        steps.append({
            "num_tokens": tokens, "attn_pairs": pairs, "decode_only": decode_only,
            "duration_s": truth.step_latency(tokens, pairs, decode_only),
        })
    return steps


def test_calibrate_shifts_the_floors_by_the_live_residuals():
    from dataclasses import replace

    from asymcache_core.profiler import calibrate

    profile = LatencyModel(floor_s=0.017, per_token_s=2e-5, per_attn_s=1.5e-9, knee_tokens=512, decode_floor_s=0.011)
    # the live engine pays 6 ms more per eager step and 1.5 ms more per graph step
    truth = replace(profile, floor_s=0.023, decode_floor_s=0.0125)
    live = calibrate(profile, _live_steps(truth), source="live.json")
    assert live.floor_s == pytest.approx(0.023) and live.decode_floor_s == pytest.approx(0.0125)
    assert live.per_token_s == profile.per_token_s and live.knee_tokens == profile.knee_tokens
    assert live.source == "live.json" and live.fit_error == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="steps"):
        calibrate(profile, [])
    with pytest.raises(ValueError, match="steps"):
        calibrate(profile, [{"num_tokens": 3}])


def test_calibrate_fits_the_host_gap_between_steps():
    """Two runs' logs concatenated: steps 0.3 ms apart, idle spells of a second (nothing to
    run) and the jump back between the runs are not the loop's host time; logs without
    ``start`` leave the gap as it was."""
    from dataclasses import replace

    from asymcache_core.profiler import calibrate

    profile = LatencyModel(floor_s=0.017, per_token_s=2e-5, per_attn_s=1.5e-9, knee_tokens=512, host_gap_s=0.001)
    steps = []
    for run in range(2):
        now = 50.0 * run
        for i, step in enumerate(_live_steps(profile)):
            steps.append({**step, "start": now})
            now += step["duration_s"] + (1.0 if i % 10 == 9 else 0.0003)
    live = calibrate(profile, steps)
    assert live.host_gap_s == pytest.approx(0.0003)
    assert live.floor_s == pytest.approx(profile.floor_s) and live.fit_error == pytest.approx(0.0, abs=1e-9)
    assert calibrate(replace(profile, host_gap_s=0.002), _live_steps(profile)).host_gap_s == 0.002
    with pytest.raises(ValueError, match="start"):
        calibrate(profile, [{**steps[0], "start": "soon"}, steps[1]])


@pytest.mark.parametrize("logged_keys", [True, False])
def test_calibrate_fits_the_decode_key_term(logged_keys):
    """A profile that prices a decode's keys at 0 against live steps that pay 30 ns a key (an
    H200 reading Llama-3.1-8B's KV): calibration recovers the term and the decode floor, from
    logs with ``decode_kv_tokens`` and from older logs (a decode-only step's pairs are its keys)."""
    from dataclasses import replace

    from asymcache_core.profiler import calibrate

    profile = LatencyModel(floor_s=0.017, per_token_s=2e-5, per_attn_s=1.5e-9, knee_tokens=512, decode_floor_s=0.011)
    truth = replace(profile, floor_s=0.020, decode_floor_s=0.007, per_decode_kv_s=3e-8)
    steps = []
    for i in range(90):
        decode_only = i % 3 != 0
        batch = 1 + i % 8
        keys = float(batch * (2000 + 997 * i))
        tokens = batch if decode_only else 2048 + batch
        pairs = keys if decode_only else keys + 2048 * (5000 + 13 * i)
        step = {"num_tokens": tokens, "attn_pairs": pairs, "decode_only": decode_only,
                "duration_s": truth.step_latency(tokens, pairs, decode_only, keys)}
        if logged_keys:
            step["decode_kv_tokens"] = keys
        elif not decode_only:
            # an older log cannot price the decodes of a mixed step: time it without them
            step["duration_s"] = truth.step_latency(tokens, pairs, False)
        steps.append(step)
    live = calibrate(profile, steps)
    assert live.per_decode_kv_s == pytest.approx(3e-8, rel=1e-6)
    assert live.decode_floor_s == pytest.approx(0.007, rel=1e-6)
    assert live.floor_s == pytest.approx(0.020, rel=1e-6)
    assert live.fit_error == pytest.approx(0.0, abs=1e-9)


def test_calibrate_command(tmp_path):
    from dataclasses import replace

    profile = LatencyModel(floor_s=0.010, per_token_s=1e-4, per_attn_s=1e-9, knee_tokens=64)
    base = tmp_path / "profile.json"
    profile.to_json(base)
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in _live_steps(replace(profile, floor_s=0.014))))
    out = tmp_path / "live.json"
    result = CliRunner().invoke(app, ["calibrate", str(log), "--latency-profile", str(base), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "floor 10.00 -> 14.00 ms" in result.output
    assert LatencyModel.from_json(out).floor_s == pytest.approx(0.014)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = CliRunner().invoke(app, ["calibrate", str(bad), "--latency-profile", str(base), "--out", str(out)])
    assert result.exit_code == 2 and result.output.startswith("error: steps:")
    # a NaN, infinite or negative step time was fitted into a profile of NaN floors, and a
    # profile with a NaN or negative floor loaded; a floor of another type was a TypeError
    steps = _live_steps(replace(profile, floor_s=0.014))
    for value in (float("nan"), float("inf"), -1.0):
        bad.write_text("".join(json.dumps({**s, "duration_s": value if i == 2 else s["duration_s"]}) + "\n"
                               for i, s in enumerate(steps)))
        result = CliRunner().invoke(app, ["calibrate", str(bad), "--latency-profile", str(base), "--out", str(out)])
        assert result.exit_code == 2 and result.output.startswith("error: steps: record 3's duration_s"), result.output
    for floor in ("NaN", "-1", '"x"'):
        broken = tmp_path / "broken.json"
        broken.write_text(base.read_text().replace('"floor_s": 0.01', f'"floor_s": {floor}'))
        with pytest.raises(ValueError, match="^latency_profile: .*floor_s must be a finite number >= 0"):
            LatencyModel.from_json(broken)
