#!/usr/bin/env bash
# Sourced on the lent H200 (no network): the carried vLLM 0.26.0 and this checkout on PYTHONPATH. Nothing
# of ours is installed: vLLM serves its own Qwen2ForCausalLM and imports our logits processor by name.
# The whole pipeline also needs onnxruntime, wetext, soundfile (+ cffi) and, for the panels,
# nvidia-ml-py and psutil; carry them with vLLM (two transfers), here:
#   EXTRA_WHEELS="onnxruntime==1.32.0 flatbuffers==25.12.19 kaldifst==1.8.3 wetext==0.0.7 inflect==7.6.0
#     typeguard==4.6.1 more_itertools==11.2.1 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
#     nvidia-ml-py==13.590.48 psutil==7.2.2" bash ../shared/device/prepare_vllm_wheels.sh
# (without cffi, soundfile fails to import and takes transformers' audio utils, and so vLLM, with it).
[ -f /tmp/vllm_env.sh ] || { echo "vLLM is not installed here: transfer .carry1 (and .carry2) first" >&2; return 3; }
. /tmp/vllm_env.sh
# no plugin: drop the entry-point dist-info an earlier version of this script wrote (a warm machine)
rm -rf /tmp/site/cosyvoice2_studio-0.1.0.dist-info
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export OUT=${OUT:-out}
mkdir -p "$OUT"
