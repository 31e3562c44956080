#!/usr/bin/env bash
# One device call: part of the `agents` bench suite in the simulator on the GPU host's CPUs (in
# the background), and one GPU confirmation run of the real engine in the foreground.
#   bash scripts/gpu_agents_suite.sh WORKLOADS UTILIZATIONS WORKERS CONFIRM_POLICIES
# e.g. bash scripts/gpu_agents_suite.sh swe 0.9,0.4 13 asymcache+continuum,vllm-apc/unbounded
# Writes under $OUT: suite-u<U>/ (sweep folders, resumable), confirm/ (bench folder), logs.
set -uo pipefail
WORKLOADS=$1; UTILS=$2; WORKERS=$3; CONFIRM=$4; BUDGET=${BUDGET:-560}
export PYTHONUNBUFFERED=1
(
  for u in ${UTILS//,/ }; do
    timeout $((BUDGET - 20)) python3 -m eval.cli bench --suite agents --workload "$WORKLOADS" \
      --gpu-memory-utilization "$u" --workers "$WORKERS" --out "$OUT/suite-u$u" \
      >"$OUT/suite-u$u.log" 2>&1
  done
) &
SIM=$!
if [ "$CONFIRM" != none ]; then
  timeout $((BUDGET - 40)) python3 -m eval.cli bench --backend real --device cuda --model dummy:llama-3.1-8b \
    --workload swe --seed 21 --jobs 32 --concurrency 16 --time-scale 0.1 --token-scale 1.0 --max-model-len 131072 \
    --max-num-batched-tokens 8192 --max-num-seqs 256 --num-kv-blocks 3000 --no-lossless-check \
    --latency-profile bench_traces/profile_h200_llama8b_live_async_2026_12_03.json --policies "$CONFIRM" \
    --out "$OUT/confirm" >"$OUT/confirm.log" 2>&1
  echo "confirm rc $?"
  tail -8 "$OUT/confirm.log"
fi
wait $SIM
for f in "$OUT"/suite-u*.log; do echo "== $f"; tail -25 "$f"; done
# NOTE: one archive: the device returns a bounded number of files.
(cd "$OUT" && tar czf results.tgz --exclude='*.png' --exclude='*.html' --exclude='results.schema.json' \
  confirm suite-u* 2>/dev/null; rm -rf confirm suite-u*; ls -la)
