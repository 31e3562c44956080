#!/usr/bin/env bash
# GPU benchmarks of issues #4 and #5 on a dummy-weight Llama-3.1-8B (run on the GPU machine).
# Usage: scripts/gpu_bench.sh STAGE OUT_DIR   (STAGE: grid-chat | grid-swe | chunking)
set -uo pipefail
stage=$1; out=$2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
common=(--backend real --device cuda --model dummy:llama-3.1-8b --max-context 32768 --kv-fraction 0.3
        --time-scale 0.05 --no-lossless-check --tpot-slo-ms 40 --max-batched-tokens 2048)
profile=bench_traces/profile_h200_llama8b.json
[ -f "$profile" ] || python -m eval.cli profile --model dummy:llama-3.1-8b --device cuda --out "$profile" 2>&1 | tail -1
case $stage in
  grid-chat)
    python -m eval.cli bench "${common[@]}" --workload trace:bench_traces/gpu_chat.jsonl --jobs 20 --concurrency 10 \
      --latency-profile "$profile" --policies vllm-apc,lru,pensieve,asymcache,continuum,asymcache+continuum,asymcache/adaptive \
      --out "$out/chat" 2>&1 | grep -v "━" ;;
  grid-swe)
    python -m eval.cli bench "${common[@]}" --workload trace:bench_traces/gpu_swe.jsonl --jobs 10 --concurrency 5 \
      --latency-profile "$profile" --policies vllm-apc,continuum,asymcache,asymcache+continuum \
      --out "$out/swe" 2>&1 | grep -v "━" ;;
  chunking)
    python -m eval.cli bench "${common[@]}" --workload trace:bench_traces/gpu_chat.jsonl --jobs 20 --concurrency 10 \
      --latency-profile "$profile" \
      --policies asymcache/fixed:256,asymcache/fixed:512,asymcache/fixed:2048,asymcache/fixed:8192,asymcache/adaptive \
      --max-batched-tokens 8192 --out "$out/chunking" 2>&1 | grep -v "━" ;;
esac
