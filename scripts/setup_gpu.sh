#!/usr/bin/env bash
# One setup command for a networked CUDA 13 GPU box: a venv in .venv with vllm 0.26.0 + torch 2.11.0
# (requirements.txt, the same file a Hugging Face Space installs) and the dev tools. The project is
# not installed: run from this checkout. Idempotent. (The offline H200 gets vLLM as wheels instead:
# see docs/gpu_runs.md and bench/gpu/run.sh.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.12}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q -U pip
python -m pip install -q -r requirements.txt -r requirements-dev.txt
python -m pip uninstall -q -y cosyvoice2-studio 2>/dev/null || true  # an earlier setup's editable install
python - <<'PY'
import torch, vllm
print("setup ok: torch", torch.__version__, "cuda", torch.cuda.is_available(), "vllm", vllm.__version__)
PY
