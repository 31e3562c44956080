"""The top-p search's cuts against the sort's, with each row's passes, the tokens it copied out
and one row's trace of its passes (GPU; ``interp``: the same under Triton's interpreter, on the CPU).

``PYTHONPATH=$PWD python scripts/gpu_top_p_trace.py [interp]``

Both runs print the same lines where the compiled kernel does what the interpreted one does:
how the compiled kernel's lost assignment (Triton 3.6, an H100) was found, 2026-12-06.
"""

from __future__ import annotations

import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "interp":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import top_p as k  # noqa: E402

device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
gen = torch.Generator().manual_seed(0)
logits = torch.cat([(torch.randn(2, 49152, generator=gen) * s).to(torch.bfloat16) for s in (0.5, 3.0, 12.0)])
n = len(logits)
t = torch.full((n,), 0.7)
t[1::2] = 1.0
c = torch.full((n,), float("-inf"))
p = torch.full((n,), 0.95)
case = [x.to(device) for x in (logits, t, c, p)]


def keys_of(x: torch.Tensor) -> torch.Tensor:
    bits = x.float().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


for kw in [(False, 16, 2048), (True, 8, 1024)]:
    stats = torch.zeros(n, 260, dtype=torch.int32, device=device)
    scratch = (torch.full((n, k.FEW), -7, dtype=torch.int32, device=device),
               torch.full((n, k.FEW), -7.0, dtype=torch.float32, device=device))
    out = k.top_p_cut_triton(*case, *kw, stats, scratch)
    naive = k.top_p_cut_naive(*case)
    for i in range(n):
        n_few = int(stats[i, 2])
        stored = scratch[0][i, :n_few].cpu()
        e = scratch[1][i, :n_few].cpu()
        row_keys = keys_of(logits[i])
        lo_k, hi_k = int(stored.min()), int(stored.max())
        in_range = int(((row_keys >= lo_k) & (row_keys <= hi_k)).sum())
        top = logits[i].float().max()
        want_e = torch.exp2((torch.where(stored >= 0, stored, stored ^ 0x7FFFFFFF).view(torch.float32) - top) * (1.4426950408889634 / t[i]))
        print(kw, i, f"search {out[i].item():.6f} sort {naive[i].item():.6f}", "stats", stats[i, :4].tolist(),
              "sentinels", int((stored == -7).sum()), "unique", len(set(stored.tolist())), "in range", in_range,
              "e err", float((e - want_e).abs().max()), "e sum", float(e.sum()), flush=True)
        if i == 2:  # the trace of one row's passes
            for j in range(int(stats[i, 0])):
                tr = stats[i, 4 + 16 * j: 4 + 16 * j + 16].cpu()
                fl = tr[6:10].view(torch.float32).tolist()
                print("   pass", j, "lo hi", tr[0:2].tolist(), "-> ", tr[2:4].tolist(), "t1 t8", tr[4:6].tolist(),
                      "s1 s8 bound base", [f"{v:.6g}" for v in fl], "few n_few c1 c8", tr[10:14].tolist())
