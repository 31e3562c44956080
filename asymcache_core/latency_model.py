"""Step-latency model: what a forward step costs on this device and model.

``latency(T, A, K) = floor + per_token * max(0, T - knee) + per_attn * A + per_decode_kv * K``

(with ``decode_floor`` in place of ``floor`` for a decode-only step, when the engine replays
those as CUDA graphs and they cost far less than an eager step)

- ``T``: tokens computed in the step (prefill, hole and decode tokens alike);
- ``A``: attention work, the sum over segments of ``q_len * context`` (query x key pairs);
- ``K``: keys the step's decodes read, the sum of their contexts. A prefill query shares each
  key it loads with the other queries of its tile, so its pairs are compute-bound and ``A``
  prices them; a decode has one query per sequence and reads its whole KV for it, a memory
  bound that ``per_attn`` (fitted on prefill pairs) underprices ~15x on an H200;
- ``floor``: what any step costs (launches, reading the weights once);
- ``knee``: the token count up to which the step stays at its floor: below it the device is
  under-used and extra tokens ride almost free; above it every token costs ``per_token``.

A profile (``asymcache profile``) fits these numbers from the engine's own steps; without one the
analytic default derives them from the model's FLOPs and bytes and the device's nominal peaks.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from asymcache_core.models.config import ModelConfig

# Nominal peaks of the analytic default: (FLOP/s, bytes/s, per-step overhead s).
_DEVICE_PEAKS = {
    "cpu": (1.2e11, 1.5e10, 4.0e-3),
    "cuda": (7.0e14, 4.0e12, 2.0e-3),
}
# Nominal host <-> device copy bandwidth (bytes/s) when a profile has none.
_COPY_BYTES_PER_S = {"cpu": 5.0e9, "cuda": 4.0e10}


def segment_attn_pairs(num_tokens: int, start: int) -> float:
    """Query-key pairs of ``num_tokens`` consecutive positions from ``start``: each query
    attends over ``start`` earlier keys plus a causal triangle of its own segment (the ``A``
    a segment adds to a step)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) / 2


@dataclass(frozen=True)
class LatencyModel:
    """A fitted or analytic step-latency model.

    Attributes:
        floor_s: latency of a step at or below the knee.
        per_token_s: marginal latency of a token above the knee.
        per_attn_s: latency per query-key pair.
        knee_tokens: tokens a step can take at its floor.
        source: ``analytic`` or the profile path.
        model: the model the numbers belong to.
        device: the device type.
        fit_error: mean relative error of the fit on its samples (profiles only).
        decode_floor_s: floor of a decode-only step when it differs from ``floor_s`` (CUDA
            graph replays); ``None``: the same.
        per_decode_kv_s: latency per key a decode reads (``K``), beyond ``per_attn_s``;
            0 in profiles written before this term existed.
        device_memory_bytes: the profiled device's memory, so that a simulated engine can size
            its pool the way the device would (``gpu_memory_utilization``); ``None``: unknown.
        h2d_bytes_per_s: measured copy bandwidth from the host KV tier to the device (pinned
            memory, whole blocks); ``None``: the device type's nominal figure.
        d2h_bytes_per_s: the same, device to host.
        copy_slowdown: how many times slower a step runs while host-tier copies are in flight
            (they share the device's memory bandwidth and the launching host thread); 1.0:
            copies are free for compute. Measured, not fitted: ``scripts/gpu_host_tier.py``'s
            decode step beside copies (1.54 on the H200, batch 32 at 4k context).
        host_gap_s: host time a live serving loop spends between two steps (outputs handed
            back and detokenized, requests taken in), which no step's duration holds; the
            simulator charges it after every step. 0 in profiles written before this term.
    """

    floor_s: float
    per_token_s: float
    per_attn_s: float
    knee_tokens: int
    source: str = "analytic"
    model: str = ""
    device: str = "cpu"
    fit_error: float | None = None
    decode_floor_s: float | None = None
    per_decode_kv_s: float = 0.0
    device_memory_bytes: int | None = None
    h2d_bytes_per_s: float | None = None
    d2h_bytes_per_s: float | None = None
    copy_slowdown: float = 1.0
    host_gap_s: float = 0.0

    def copy_bandwidth(self, to_device: bool) -> float:
        """Bytes per second of a KV block copy between the host tier and the device: the
        profile's measured figure, else the device type's nominal one (PCIe 5 x16 with pinned
        memory on CUDA, a memcpy on the CPU)."""
        measured = self.h2d_bytes_per_s if to_device else self.d2h_bytes_per_s
        if measured is not None:
            return measured
        return _COPY_BYTES_PER_S.get(self.device, _COPY_BYTES_PER_S["cpu"])

    def step_latency(
        self, num_tokens: int, attn_pairs: float, decode_only: bool = False, decode_kv_tokens: float = 0.0
    ) -> float:
        """Predicted latency of a step with ``num_tokens`` tokens and ``attn_pairs`` pairs.

        Args:
            num_tokens: tokens computed in the step.
            attn_pairs: query-key pairs of the step.
            decode_only: every token is a decode (one per sequence): ``decode_floor_s`` applies.
            decode_kv_tokens: keys read by the step's decodes (``K``; their pairs are also in
                ``attn_pairs``).
        """
        floor = self.floor_s
        if decode_only and self.decode_floor_s is not None:
            floor = self.decode_floor_s
        return (
            floor
            + self.per_token_s * max(0, num_tokens - self.knee_tokens)
            + self.per_attn_s * attn_pairs
            + self.per_decode_kv_s * decode_kv_tokens
        )

    def marginal_latency(self, base_tokens: int, extra_tokens: int, extra_attn_pairs: float) -> float:
        """What adding ``extra_tokens`` to a step that already has ``base_tokens`` costs."""
        over_before = max(0, base_tokens - self.knee_tokens)
        over_after = max(0, base_tokens + extra_tokens - self.knee_tokens)
        return self.per_token_s * (over_after - over_before) + self.per_attn_s * extra_attn_pairs

    def prefill_latency(self, num_tokens: int, context_end: int) -> float:
        """Compute time of prefilling the ``num_tokens`` positions that end at ``context_end``:
        their per-token cost plus their attention pairs (floors left out: the steps they join
        are paid for anyway). The scheduler's estimate of a request's own work."""
        n = max(0, min(num_tokens, context_end))
        return self.per_token_s * n + self.per_attn_s * segment_attn_pairs(n, context_end - n)

    def block_rebuild_latency(self, position: int, block_size: int, base_tokens: int) -> float:
        """Marginal latency of recomputing the block at logical index ``position``.

        Its ``block_size`` tokens attend over ``position * block_size`` earlier tokens plus a
        causal half of the block; they join a step that already carries ``base_tokens``.
        """
        fixed, slope = self.block_rebuild_line(block_size, base_tokens)
        return fixed + slope * position

    def block_rebuild_line(self, block_size: int, base_tokens: int) -> tuple[float, float]:
        """``(fixed, slope)`` with ``block_rebuild_latency(p) = fixed + slope * p``: one pair per
        session lets eviction price every block of it without calling the model per block."""
        fixed = self.marginal_latency(base_tokens, block_size, segment_attn_pairs(block_size, 0))
        return fixed, self.per_attn_s * block_size * block_size

    def max_tokens_within(self, target_s: float, attn_per_token: float) -> int:
        """Largest token count whose step stays under ``target_s`` (attention per token given)."""
        if self.step_latency(self.knee_tokens, attn_per_token * self.knee_tokens) >= target_s:
            # Below the knee only attention grows with tokens.
            if self.per_attn_s * attn_per_token <= 0:
                return self.knee_tokens
            room = target_s - self.floor_s
            return max(0, int(room / (self.per_attn_s * attn_per_token)))
        per = self.per_token_s + self.per_attn_s * attn_per_token
        room = target_s - self.floor_s + self.per_token_s * self.knee_tokens
        return max(self.knee_tokens, int(room / per)) if per > 0 else 1 << 30

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> LatencyModel:
        """Loads a profile.

        Raises:
            ValueError: unreadable file or missing fields.
        """
        try:
            data = json.loads(Path(path).read_text())
            model = cls(**{k: data[k] for k in data if k in cls.__dataclass_fields__})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"latency_profile: cannot read {str(path)!r} ({exc})") from None
        # NOTE: a profile's times price every simulated step: a NaN or a negative floor would
        # fail a run in its middle (the clock cannot move by NaN) or run it backwards
        for name in ("floor_s", "per_token_s", "per_attn_s", "decode_floor_s", "per_decode_kv_s", "host_gap_s",
                     "copy_slowdown", "h2d_bytes_per_s", "d2h_bytes_per_s"):
            value = getattr(model, name)
            if value is None and name in ("decode_floor_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
                value < 0 and name != "per_decode_kv_s"
            ):
                raise ValueError(f"latency_profile: {str(path)!r}: {name} must be a finite number >= 0, got {value!r}")
        if isinstance(model.knee_tokens, bool) or not isinstance(model.knee_tokens, int) or model.knee_tokens < 0:
            raise ValueError(f"latency_profile: {str(path)!r}: knee_tokens must be an integer >= 0, "
                             f"got {model.knee_tokens!r}")
        return model

    @classmethod
    def analytic(cls, cfg: ModelConfig, device_type: str, dtype_bytes: int, name: str = "") -> LatencyModel:
        """Default from FLOPs and bytes: floor = weight read + overhead; knee where compute
        time equals the floor; attention at 4 * layers * heads * head_dim FLOPs per pair; a
        decode's key at the bytes of its K and V in every layer."""
        flops, bandwidth, overhead = _DEVICE_PEAKS.get(device_type, _DEVICE_PEAKS["cpu"])
        weight_read = cfg.num_params * dtype_bytes / bandwidth
        per_token = 2.0 * cfg.num_params / flops
        floor = overhead + weight_read
        knee = max(1, int(weight_read / per_token))
        per_attn = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim / flops
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
        return cls(floor, per_token, per_attn, knee, "analytic", name, device_type,
                   per_decode_kv_s=kv_bytes / bandwidth)


@dataclass
class LatencyFeedback:
    """Online correction of the latency model from the engine's measured steps.

    A profile times forward passes in isolation; a live step also pays scheduling, input
    preparation and sampling, and mixes shapes the profile never ran. The running gap between
    measured and predicted step time (an exponential moving average, one per step kind: CUDA
    graph decode steps and eager mixed steps) is added to later predictions.

    Attributes:
        alpha: weight of the newest step in the averages.
        decode_residual_s: measured minus predicted, decode-only steps.
        mixed_residual_s: measured minus predicted, other steps.
    """

    alpha: float = 0.05
    decode_residual_s: float = 0.0
    mixed_residual_s: float = 0.0

    def observe(self, predicted_s: float, measured_s: float, decode_only: bool) -> None:
        """Folds one step's measured time into the residual of its kind."""
        gap = measured_s - predicted_s
        if decode_only:
            self.decode_residual_s += self.alpha * (gap - self.decode_residual_s)
        else:
            self.mixed_residual_s += self.alpha * (gap - self.mixed_residual_s)

    def residual(self, decode_only: bool) -> float:
        return self.decode_residual_s if decode_only else self.mixed_residual_s
