#!/usr/bin/env bash
# One device call: the SWE points of the `agents` suite at a binding pool (utilization 0.4) with
# host KV tiers of the given sizes, in the simulator on the GPU host's CPUs (in the background),
# and the tier's bandwidth and overlap tables on the GPU in the foreground.
#   bash scripts/gpu_host_tier_suite.sh "64 256" WORKERS_PER_TIER
# Writes under $OUT: tier<GB>/ (sweep folders, resumable), logs, results.tgz.
set -uo pipefail
TIERS=$1; WORKERS=$2; BUDGET=${BUDGET:-570}
export PYTHONUNBUFFERED=1
PIDS=()
for gb in $TIERS; do
  timeout $((BUDGET - 25)) python3 -m eval.cli bench --suite agents --workload swe --gpu-memory-utilization 0.4 \
    --cpu-offload-gb "$gb" --policies vllm-apc/reserve-prompt,asymcache+continuum/reserve-prompt \
    --slo jct:160.4 --workers "$WORKERS" --out "$OUT/tier$gb" >"$OUT/tier$gb.log" 2>&1 &
  PIDS+=($!)
done
timeout 150 python3 scripts/gpu_host_tier.py --skip-exactness --json "$OUT/host_tier_overlap.json" >"$OUT/host_tier_overlap.log" 2>&1
echo "overlap rc $?"; cat "$OUT/host_tier_overlap.log" | grep "|"
for pid in "${PIDS[@]}"; do wait "$pid"; done
for f in "$OUT"/tier*.log; do echo "== $f"; tail -12 "$f"; done
(cd "$OUT" && tar czf results.tgz --exclude='*.png' --exclude='*.html' --exclude='results.schema.json' tier* 2>/dev/null; rm -rf tier*/; ls -la)
