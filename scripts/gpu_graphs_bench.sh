#!/usr/bin/env bash
# On the lent H200: the flow estimator's CUDA graphs (engine.flow_cuda_graphs), eager vs graphs on the
# `full` model's flow (scripts/gpu_flow_graphs.py), then the whole-pipeline sweep with graphs on.
#   run(carry=[".carry1"]); run(carry=[".carry2"], command="bash .carry2/install_vllm.sh && bash scripts/gpu_graphs_bench.sh")
# Knobs (env): as scripts/gpu_serve_bench.sh (TAG, CONC, RPS, VOICE, SETS), SWEEP (0 = the flow check only).
set -uo pipefail
. scripts/gpu_env.sh || exit 3
. scripts/gpu_install_extra.sh || exit 3  # soundfile needs cffi
[ -f /tmp/full/llm.pt ] || python3 -m app.tools.make_model /tmp/full --size full --force > "$OUT/make_full.json" 2>&1 \
  || { tail -20 "$OUT/make_full.json"; exit 4; }
timeout 240 python3 scripts/gpu_flow_graphs.py /tmp/full "$OUT/flow_graphs.json" 2>&1 | grep -v Warning | tail -12
[ "${SWEEP:-1}" = 1 ] || exit 0
TAG=${TAG:-graphs} PREFLIGHT=0 SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-420} SETS="engine.flow_cuda_graphs=true ${SETS:-}" bash scripts/gpu_serve_bench.sh
