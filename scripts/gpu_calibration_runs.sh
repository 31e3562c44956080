#!/usr/bin/env bash
# One device call: real-engine runs of the simulator's confirmation rows, with step logs, for
# refitting the live latency profile (`asymcache calibrate`) on several workloads and checking
# the simulator against every row. Each row is `asymcache bench --backend real` on dummy
# Llama-3.1-8B bf16 at vLLM's settings (8,192-token steps, whole-prompt admission in the
# seed-23 rows), as in BENCHMARKS.md ("The simulator against the H200 on a binding pool" and
# "The default on chat, tool loops and BFCL where the pool binds").
#   bash scripts/gpu_calibration_runs.sh STAGE
# STAGE: swe (seed 21, 3,000 blocks: continuum and asymcache+continuum, ~6 min) or
# others (seed 23: chat on 900 blocks, BFCL on 800, tool loop on 1,200, three policies each,
# ~8 min) or ceiling (seed 21: the unbounded pool, and asymcache+continuum with a 64 GB host tier,
# ~5 min) or tier (seed 23: BFCL on 800 blocks and the tool loop on 1,200, each with a host
# tier four times the device pool, `vllm-apc` (an LRU tier) and `asymcache+continuum`, ~6 min) or
# anonymous-swe (SWE seed 21 on 3,000 blocks) or anonymous-bfcl (BFCL on 800): the default with job
# ids and without (~5 and ~3 min).
# PROFILE=... sets the engines' profile (default: the load sweep's). Needs the pydantic
# wheels of .whl/ carried (the bench CLI imports pydantic).
# Writes $OUT/results.tgz: every run's results.json, report.md, steps/ and requests/ (the
# device returns a bounded number of files, so one archive), and the logs.
set -uo pipefail
STAGE=$1
export PYTHONUNBUFFERED=1
PROFILE=${PROFILE:-bench_traces/profile_h200_llama8b_live_async_2026_12_03.json}
COMMON=(--backend real --device cuda --model dummy:llama-3.1-8b --time-scale 0.1 --token-scale 1.0
  --max-model-len 131072 --max-num-batched-tokens 8192 --max-num-seqs 256 --no-lossless-check
  --latency-profile "$PROFILE" --step-log)
run() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m eval.cli bench "${COMMON[@]}" "$@" --out "$OUT/$name" >"$OUT/$name.log" 2>&1
  echo "== $name rc $?"
  grep -A8 "JCT mean" "$OUT/$name.log" | grep "│" || tail -3 "$OUT/$name.log"
}
case "$STAGE" in
  swe)
    for policy in continuum asymcache+continuum; do
      run "swe21-${policy//+/-}" 260 --workload swe --seed 21 --jobs 32 --concurrency 16 \
        --num-kv-blocks 3000 --policies "$policy"
    done
    ;;
  ceiling)
    run swe21-unbounded 200 --workload swe --seed 21 --jobs 32 --concurrency 16 --num-kv-blocks 3000 \
      --policies vllm-apc/unbounded
    run swe21-tier64-asymcache-continuum 230 --workload swe --seed 21 --jobs 32 --concurrency 16 \
      --num-kv-blocks 3000 --cpu-offload-gb 64 --policies asymcache+continuum
    ;;
  others)
    P=vllm-apc/reserve-prompt,continuum/reserve-prompt,asymcache+continuum/reserve-prompt
    run chat900 250 --workload chat --seed 23 --jobs 96 --concurrency 48 --num-kv-blocks 900 --policies "$P"
    run bfcl800 180 --workload bfcl:bench_traces/bfcl_multi_turn_sample.jsonl --seed 23 --jobs 96 \
      --concurrency 48 --num-kv-blocks 800 --policies "$P"
    run tool1200 120 --workload toolloop --seed 23 --jobs 96 --concurrency 48 --num-kv-blocks 1200 --policies "$P"
    ;;
  anonymous-swe)
    # clients without job ids (the engine gives their requests jobs) against the same clients with them
    run swe21-anonymous 540 --workload swe --seed 21 --jobs 32 --concurrency 16 --num-kv-blocks 3000 \
      --policies asymcache+continuum,asymcache+continuum/anonymous
    ;;
  anonymous-bfcl)
    P=asymcache+continuum/reserve-prompt,asymcache+continuum/reserve-prompt/anonymous
    run bfcl800-anonymous 300 --workload bfcl:bench_traces/bfcl_multi_turn_sample.jsonl --seed 23 --jobs 96 \
      --concurrency 48 --num-kv-blocks 800 --policies "$P"
    ;;
  tier)
    P=vllm-apc/reserve-prompt,asymcache+continuum/reserve-prompt
    run bfcl800-host3200 300 --workload bfcl:bench_traces/bfcl_multi_turn_sample.jsonl --seed 23 --jobs 96 \
      --concurrency 48 --num-kv-blocks 800 --num-host-kv-blocks 3200 --policies "$P"
    run tool1200-host4800 200 --workload toolloop --seed 23 --jobs 96 --concurrency 48 --num-kv-blocks 1200 \
      --num-host-kv-blocks 4800 --policies "$P"
    ;;
  *)
    echo "STAGE: swe, others, ceiling, tier, anonymous-swe or anonymous-bfcl, got $STAGE" >&2
    exit 2
    ;;
esac
(cd "$OUT" && tar czf results.tgz --exclude='*.png' --exclude='*.html' --exclude='results.schema.json' \
  -- */ *.log 2>/dev/null; find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +; ls -la)
