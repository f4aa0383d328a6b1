#!/usr/bin/env bash
# Sourced on the lent H200 (no network): the carried vLLM 0.26.0 (+ onnxruntime, wetext, soundfile,
# nvidia-ml-py, psutil carried with EXTRA_WHEELS, see docs/perf/README.md), our vLLM plugin entry point
# without pip, and this checkout on PYTHONPATH.
[ -f /tmp/vllm_env.sh ] || { echo "vLLM is not installed here: transfer .carry1 (and .carry2) first" >&2; return 3; }
. /tmp/vllm_env.sh
# our vllm.general_plugins entry point, without pip: a dist-info beside the carried site-packages
d=/tmp/site/cosyvoice2_studio-0.1.0.dist-info
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: cosyvoice2-studio\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[vllm.general_plugins]\ncosyvoice2 = app.engine.vllm_plugin:register\n' > "$d/entry_points.txt"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export OUT=${OUT:-out}
mkdir -p "$OUT"
