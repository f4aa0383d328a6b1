#!/usr/bin/env bash
# One setup command for the AWQ quantization venv (.venv-quant; requirements-quantize.txt). Idempotent.
# Separate from .venv because llm-compressor's compressed-tensors pin clashes with vLLM's.
# Use: bash scripts/setup_quantize.sh && .venv-quant/bin/python -m app.tools.quantize EXPORT_DIR OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv-quant/bin/python ] || "$PY" -m venv .venv-quant
Q=.venv-quant/bin/python
"$Q" -m pip install -q -U pip
"$Q" -m pip install -q -r requirements-quantize.txt
# Nothing here needs them; if a dependency ever pulls PyPI's CUDA builds they break torch+cpu imports.
"$Q" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$Q" -c "import torch, llmcompressor, compressed_tensors as ct; \
print('quantize venv ok: torch', torch.__version__, 'llmcompressor', llmcompressor.__version__, 'ct', ct.__version__)"
