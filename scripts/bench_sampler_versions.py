"""Host rows (a logits processor on every row) through an earlier sampler and this one, side by side.

``git show b32a002:asymcache_core/sampler.py > /tmp/old_sampler.py``
``PYTHONPATH=$PWD python scripts/bench_sampler_versions.py --old /tmp/old_sampler.py [--rows 1,8,32]``

Llama-3 vocabulary (128,256); on CUDA when there is one. Median ms of ``Sampler.sample`` over 12
calls after 3, for temperature 0.7 alone, with top-k 50 and top-p 0.95, and with top-p 0.95.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from asymcache_core.sampler import Sampler
from asymcache_core.sampling_params import SamplingParams
from scripts.bench_sampling import unchanged

SETTINGS = (dict(temperature=0.7), dict(temperature=0.7, top_p=0.95, top_k=50), dict(temperature=0.7, top_p=0.95))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="an earlier asymcache_core/sampler.py")
    ap.add_argument("--rows", default="1,8,32")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("old_sampler", args.old)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    for n in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(n, 128_256, device=device) * 3
        ids, outs = [f"r{i}" for i in range(n)], [[1, 2]] * n
        for kw in SETTINGS:
            params = [SamplingParams(seed=i, logits_processors=(unchanged,), **kw) for i in range(n)]
            row = []
            for sampler in (old.Sampler(0), Sampler(0)):
                times = []
                for _ in range(15):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    sampler.sample(logits, ids, params, outs)
                    times.append(time.perf_counter() - t)
                row.append(statistics.median(times[3:]) * 1e3)
            print(n, kw, f"host rows before {row[0]:.2f} ms, now {row[1]:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
