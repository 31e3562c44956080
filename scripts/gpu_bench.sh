#!/usr/bin/env bash
# GPU benchmarks of eviction policies and chunking on a dummy-weight Llama-3.1-8B (run on the GPU machine).
# Usage: scripts/gpu_bench.sh OUT_DIR STAGE...
#   grid-chat | grid-swe     eviction policies side by side
#   grid-longchat            the same on long chat turns (median 4000 tokens, contexts up to 64k);
#                            LONGCHAT_KV_FRACTION=... sets its pool (default 0.3)
#   chunk-chat | chunk-swe   fixed budgets 256/512/2048/8192 vs adaptive, AsymCache eviction
#                            (CHUNK_POLICIES=... runs a subset)
# GRID_POLICIES=... runs a subset of the grid; BENCH_EXTRA="--step-log ..." adds bench options
# (BENCH_EXTRA="--repeats 3": chat TTFT varies ~20% between runs of one policy, measured on the H200).
# Each stage writes OUT_DIR/STAGE.log (the table) and OUT_DIR/STAGE.tar.gz (report.md and
# results.json); the profile is bench_traces/profile_h200_llama8b.json (`asymcache profile`) unless
# PROFILE=... names another (bench_traces/profile_h200_llama8b_live_decode_kv.json: fitted to live steps,
# with the decode-key term, so adaptive chunking meets its TPOT target more closely; or
# bench_traces/profile_h200_llama8b_live_async_2026_12_03.json, refitted to the step logs of
# seven H200 runs on three workloads with async scheduling, the GPU default: the load sweep's
# default; bench_traces/profile_h200_llama8b_live_2026_12_03.json is its synchronous twin).
set -uo pipefail
out=$1; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
profile=${PROFILE:-bench_traces/profile_h200_llama8b.json}
common=(--backend real --device cuda --model dummy:llama-3.1-8b --max-context 32768 --kv-fraction 0.3
        --time-scale 0.05 --no-lossless-check --tpot-slo-ms 40 --latency-profile "$profile")
chat=(--workload trace:bench_traces/gpu_chat.jsonl --jobs 20 --concurrency 10)
swe=(--workload trace:bench_traces/gpu_swe.jsonl --jobs 10 --concurrency 5)
# NOTE: later options override the common ones (typer keeps the last value).
longchat=(--workload trace:bench_traces/gpu_longchat.jsonl --jobs 20 --concurrency 10 --max-context 65536
          --kv-fraction "${LONGCHAT_KV_FRACTION:-0.3}")
grid=${GRID_POLICIES:-vllm-apc,lru,asymcache,continuum,asymcache+continuum}
chunks=${CHUNK_POLICIES:-asymcache/fixed:256,asymcache/fixed:512,asymcache/fixed:2048,asymcache/fixed:8192,asymcache/adaptive}
for stage in "$@"; do
  case $stage in
    grid-chat) args=("${chat[@]}" --policies "$grid" --max-batched-tokens 2048) ;;
    grid-swe) args=("${swe[@]}" --policies "$grid" --max-batched-tokens 2048) ;;
    grid-longchat) args=("${longchat[@]}" --policies "$grid" --max-batched-tokens 2048) ;;
    chunk-chat) args=("${chat[@]}" --policies "$chunks" --max-batched-tokens 8192) ;;
    chunk-swe) args=("${swe[@]}" --policies "$chunks" --max-batched-tokens 8192) ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m eval.cli bench "${common[@]}" "${args[@]}" ${BENCH_EXTRA:-} --out "/tmp/bench/$stage" 2>&1 | grep -v "━" | tee "$out/$stage.log"
  echo "$stage: $(( $(date +%s) - start )) s" | tee -a "$out/$stage.log"
  files=("$stage/report.md" "$stage/results.json")
  [ -d "/tmp/bench/$stage/steps" ] && files+=("$stage/steps")
  [ -d "/tmp/bench/$stage/requests" ] && files+=("$stage/requests")
  tar -czf "$out/$stage.tar.gz" -C /tmp/bench "${files[@]}"
done
