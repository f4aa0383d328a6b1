#!/usr/bin/env bash
# One setup command for a networked CUDA 13 GPU box: a venv in .venv with vllm 0.26.0 + torch 2.11.0
# (requirements-gpu.txt) and the dev tools, and this project installed in editable mode so vLLM's
# engine processes find the CosyVoice2 model plugin. Idempotent. (The offline H200 gets vLLM as
# wheels instead: see ../shared/device/README.md, then run the last two steps below.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.12}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q -r requirements-gpu.txt -r requirements-dev.txt
# the `vllm.general_plugins` entry point (pyproject.toml) exists only once the project is installed
python -c "import setuptools" 2>/dev/null || python -m pip install -q "setuptools>=70.1,<81"
python -m pip install -q --no-deps --no-build-isolation -e .
python - <<'PY'
from importlib.metadata import entry_points
import torch, vllm
assert "cosyvoice2" in {e.name for e in entry_points(group="vllm.general_plugins")}, "plugin entry point missing"
print("setup ok: torch", torch.__version__, "cuda", torch.cuda.is_available(), "vllm", vllm.__version__)
PY
