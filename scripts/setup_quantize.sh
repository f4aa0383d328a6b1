#!/usr/bin/env bash
# The AWQ quantization venv alone (.venv-quant; requirements-quantize.txt), which scripts/test.sh also makes.
# Separate from .venv because llm-compressor's compressed-tensors pin clashes with vLLM's. Idempotent.
# Use: bash scripts/setup_quantize.sh && .venv-quant/bin/python -m app.tools.quantize EXPORT_DIR OUT_DIR
cd "$(dirname "$0")/.."
. scripts/lib.sh
setup_quantize_venv
