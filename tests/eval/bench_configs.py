"""Small bench configurations the harness tests share."""

from __future__ import annotations

from eval.bench import BenchConfig


def small(backend: str, policies: tuple[str, ...], out, **kw) -> BenchConfig:
    base = dict(
        workload="chat", jobs=6, concurrency=2, token_scale=0.5, time_scale=0.02, num_kv_blocks=20,
        max_model_len=320, seed=3, out=out, policies=policies, backend=backend, check_lossless=False,
    )
    base.update(kw)
    return BenchConfig(**base)
